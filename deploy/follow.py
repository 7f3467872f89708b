"""A deployed run reported as it goes: one line per round as the ServerApp writes it (accuracy, valid replies, what
was dropped), then where the run's metrics, checkpoints and plot are. The ServerApp writes them on the SuperLink's
host, which for ``python -m deploy up`` is this one."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from glmc.errors import DeployError
from harness.engine import RunResult, run_status

POLL_SECONDS = 2.0


def round_line(record: Mapping[str, Any]) -> str:
    """One round of metrics.json in words."""
    accuracy = record.get("central_accuracy")
    line = f"round {record['round']}: " + (f"accuracy {100 * accuracy:.1f}%" if accuracy is not None else "no accuracy")
    if record["round"] == 0:
        return line + " (the initial model)"
    line += f", {record.get('valid', 0)}/{record.get('replies', 0)} valid replies"
    if record.get("failure"):
        line += f", global model kept: {record['failure']}"
    return line + "".join(f"; dropped {d}" for d in record.get("dropped", []))


def _records(directory: Path) -> list[dict[str, Any]]:
    try:
        return json.loads((directory / "metrics.json").read_text())["records"]
    except (OSError, ValueError, KeyError):  # not written yet (it is replaced atomically, never half written)
        return []


def follow(run_id: str, directory: Path, env: Mapping[str, str], superlink: str, say: Callable[[str], None],
           start: float, poll: float = POLL_SECONDS, timeout: float = 7200) -> RunResult:
    """Print each new round of ``directory``'s metrics until run ``run_id`` has finished (at most ``timeout``
    seconds after ``start``); its final status, then the paths of its outputs."""
    shown = 0
    while True:
        if time.monotonic() - start > timeout:
            raise DeployError(f"run {run_id} did not finish within {timeout:.0f} s; its rounds so far: {directory}")
        status = run_status(run_id, env, superlink=superlink, start=start)
        records = _records(directory)
        for record in records[shown:]:
            say(round_line(record))
        shown = len(records)
        if status.status.startswith("finished"):
            break
        time.sleep(poll)
    say(f"metrics: {directory / 'metrics.json'}")
    say(f"checkpoints: {directory / 'checkpoints'}")
    say(f"plot: {directory / 'accuracy.png'}")
    return status
