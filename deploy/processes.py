"""The processes a deployment starts: launched detached with a log file, recorded by PID and start time,
and stopped by exactly those records.

A PID alone can be reused once its process is gone, so every record also keeps the process's start
time (``/proc/PID/stat``, field 22); :func:`stop` signals a PID only while both still match. The
SuperLink and every SuperNode start helpers of their own (a SuperExec, then one ServerApp or ClientApp
process per task), which follow their parent's exit; :func:`stop` also ends any of them still alive,
found as descendants of the recorded PID before it is signalled. Nothing is ever matched by name.
Linux only (``/proc``), like ``ss`` in :mod:`harness.engine`.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.engine import running, start_time, stop_tree

TERM_GRACE = 10.0  # seconds between SIGTERM and SIGKILL


@dataclass(frozen=True)
class Process:
    """One started process: its role ("superlink", "node-0", ...), PID, start time and log file."""

    role: str
    pid: int
    start_time: int  # clock ticks since boot, from /proc/PID/stat
    log: Path
    log_offset: int  # where this process's output starts in ``log`` (a restarted node appends to the same file)
    argv: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"log": str(self.log), "argv": list(self.argv)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Process:
        return cls(data["role"], int(data["pid"]), int(data["start_time"]), Path(data["log"]),
                   int(data["log_offset"]), tuple(data["argv"]))

    def alive(self) -> bool:
        """Whether this very process (not a later one that reused its PID) still runs."""
        return running(self.pid) and start_time(self.pid) == self.start_time

    def log_text(self) -> str:
        """What this process has written to its log so far."""
        if not self.log.is_file():
            return ""
        with self.log.open("rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")


def launch(role: str, argv: Sequence[str], log: Path, env: Mapping[str, str], cwd: Path) -> Process:
    """Start ``argv`` in its own session (it outlives the command that started it), output appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        offset = out.tell()
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(env), cwd=cwd, start_new_session=True)
    return Process(role, proc.pid, start_time(proc.pid) or 0, log, offset, tuple(argv))


def stop(process: Process, sig: signal.Signals = signal.SIGTERM, grace: float = TERM_GRACE) -> bool:
    """End ``process`` and whatever it started that is still running; False if it had already gone.

    ``sig`` is the first signal (SIGTERM lets a SuperNode say goodbye, so the SuperLink marks it offline
    at once; SIGKILL simulates a crash). SIGKILL follows after ``grace`` seconds.
    """
    if not process.alive():
        return False
    stop_tree(process.pid, grace, sig)
    return True
