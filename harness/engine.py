"""Run the Flower apps through the real simulation engine (`flwr run . --stream`) from Python, safely.

`flwr run` exits 0 even when the ServerApp fails, and leaves a detached local SuperLink behind.
So :func:`run_simulation` reads the run id from ``--format json``,
asks ``flwr ls --run-id ID --format json`` for the final status, and always stops the SuperLink it
started, by the PID listening on its own port. Each call gets its own ``FLWR_HOME`` and free ports
(``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``, ``FLWR_LOCAL_CONTROL_API_PORT``), so concurrent runs, tests
and other users of the default port 39091 never meet. :func:`run_app` is the same `flwr run` against
any SuperLink connection; :mod:`deploy` uses it, and the process helpers, for deployments over gRPC.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmc.data import data_root

log = logging.getLogger(__name__)

PROJECT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # flwr and flower-superlink live next to this interpreter


@functools.cache
def app_dir() -> Path:
    """The folder `flwr run` bundles: a copy of the files git would commit (tracked and untracked, not ignored), made
    once per process. Flower walks every file under the app's folder before it filters them, the .venv's 55k
    included (about 13 of a simulation cell's 65 s on 2 cores); the copy gives it the same app to bundle, less any
    git-excluded scratch. Outside a git checkout, the project folder itself."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=PROJECT,
                                capture_output=True, check=False)
    except OSError:  # no git on this machine
        return PROJECT
    if listed.returncode != 0:
        return PROJECT
    root = Path(tempfile.mkdtemp(prefix="glmc-app-")) / "glmc-fl"
    atexit.register(shutil.rmtree, root.parent, ignore_errors=True)
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (PROJECT / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(PROJECT / name, root / name)
    return root


@dataclass(frozen=True)
class RunResult:
    """How a `flwr run` ended: its id, final status (``finished:completed`` on success) and wall time."""

    run_id: str | None
    status: str
    details: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flwr_env(flwr_home: Path, http_port: int | None = None, control_port: int | None = None) -> dict[str, str]:
    """The environment every flwr command of this project runs with.

    ``http_port`` and ``control_port`` move the local SuperLink that `flwr run` starts for a simulation;
    a deployment (:mod:`deploy`) starts its own SuperLink and leaves them out.
    """
    ports = {} if http_port is None or control_port is None else {
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port), "FLWR_LOCAL_CONTROL_API_PORT": str(control_port)}
    return os.environ | ports | {
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLWR_HOME": str(flwr_home),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "GLMC_DATA": str(data_root().resolve()),  # the apps run from an installed copy of the project
        "HF_HUB_OFFLINE": "1",
    }


def toml_value(value: Any) -> str:
    """A Python value as a TOML literal for a run-config override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a basic TOML string: double quotes, JSON escapes


def listening_pid(port: int) -> int | None:
    """The PID listening on 127.0.0.1:``port`` (``ss -Hltnp``), or None."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, check=False).stdout
    for token in out.replace(",", " ").split():
        if token.startswith("pid="):
            return int(token[4:])
    return None


def stop_pid(pid: int, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; only this one PID (see :func:`stop_tree` for what it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not running(pid):
                return
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)


def stop_tree(pid: int, grace: float = 10.0, first: signal.Signals = signal.SIGTERM) -> None:
    """End ``pid`` (``first``, then SIGKILL after ``grace``), then whatever it had started that still runs.

    The descendants are found before ``pid`` is signalled: a SuperLink stopped mid-run leaves its simulation
    process and that process's Ray workers running otherwise (they are re-parented to init).
    """
    family = [(child, start_time(child)) for child in descendants(pid)]
    if first == signal.SIGTERM:
        stop_pid(pid, grace)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, first)
    for child, started in family:
        if running(child) and start_time(child) == started:
            stop_pid(child, grace)


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot, or None if there is no such process."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields else None


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` in the process tree (children first), from the parent links in /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := proc_stat(int(entry.name))):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so `finally` blocks stop the SuperLink this process started."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process: a zombie (exited, not yet reaped) is not; our own is reaped here."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after "(comm)": [state, ppid, ...] (Linux); None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


@contextlib.contextmanager
def local_superlink_env(flwr_home: Path | None = None) -> Iterator[dict[str, str]]:
    """An isolated flwr environment; on exit, stops the local SuperLink that `flwr run` left on its port."""
    with contextlib.ExitStack() as stack:
        home = flwr_home or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flwr-home-")))
        http_port, control_port = free_port(), free_port()
        try:
            yield flwr_env(home, http_port, control_port)
        finally:
            pid = listening_pid(http_port)
            if pid is not None:
                log.info("stopping the local SuperLink (pid %d, port %d) and what it started", pid, http_port)
                stop_tree(pid)


def free_local_superlink(env: Mapping[str, str]) -> bool:
    """Stop a local SuperLink that holds ``env``'s port (one that started after `flwr run` gave up waiting on it,
    under heavy load); True if there was one, so that the run can be tried again."""
    port = env.get("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT")
    pid = listening_pid(int(port)) if port else None
    if pid is None:
        return False
    log.warning("the run did not start; stopping the local SuperLink on port %s (pid %d) and trying again", port, pid)
    stop_tree(pid)
    return True


def flwr_json(args: list[str], env: Mapping[str, str], timeout: float) -> dict[str, Any]:
    """Run one flwr CLI command with ``--format json``; its JSON answer (success false on no answer)."""
    proc = subprocess.run([str(BIN / "flwr"), *args, "--format", "json"], cwd=PROJECT, env=dict(env),
                          capture_output=True, text=True, timeout=timeout, check=False)
    start = proc.stdout.find("{")
    try:
        return json.loads(proc.stdout[start:]) if start >= 0 else {"success": False, "error": proc.stderr[-500:]}
    except json.JSONDecodeError:
        return {"success": False, "error": (proc.stdout + proc.stderr)[-500:]}


def run_simulation(run_config: Mapping[str, Any], num_supernodes: int, *, cpus_per_client: int = 1,
                   gpus_per_client: float = 0.0, timeout: float = 7200,
                   env: Mapping[str, str] | None = None) -> RunResult:
    """`flwr run . --stream` on the local simulation engine with these run-config overrides.

    ``gpus_per_client``: Flower's ``client-resources-num-gpus`` (a fraction lets several clients share one GPU;
    0 keeps every client on the CPU). ``env``: an environment from :func:`local_superlink_env` to share one
    SuperLink across runs; without it, the run gets its own, stopped before this returns.
    """
    if env is None:
        with local_superlink_env() as own:
            return run_simulation(run_config, num_supernodes, cpus_per_client=cpus_per_client,
                                  gpus_per_client=gpus_per_client, timeout=timeout, env=own)
    federation = f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client}"
    if gpus_per_client:
        federation += f" client-resources-num-gpus={gpus_per_client}"
    return run_app(run_config, env, ["--federation-config", federation], timeout=timeout)


def run_app(run_config: Mapping[str, Any], env: Mapping[str, str], options: Sequence[str] = (), *,
            superlink: str | None = None, wait: bool = True, timeout: float = 7200) -> RunResult:
    """`flwr run . [superlink] --stream` with these run-config overrides; the run's final status from `flwr ls`.

    ``superlink``: the name of a SuperLink connection in ``$FLWR_HOME/config.toml`` (a deployment);
    default, the local simulation SuperLink. ``options``: more `flwr run` flags. Without ``wait``
    (no ``--stream``), it returns as soon as the run is submitted, with its status then.
    """
    start = time.monotonic()
    target = [superlink] if superlink else []
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as overrides:
        overrides.write("".join(f"{k} = {toml_value(v)}\n" for k, v in run_config.items()))
        overrides.flush()
        command = ["run", str(app_dir()), *target, *(["--stream"] if wait else []), *options,
                   "--run-config", overrides.name]
        started = flwr_json(command, env, timeout)
        if not started.get("run-id") and superlink is None and free_local_superlink(env):
            started = flwr_json(command, env, timeout)
    run_id = started.get("run-id")
    if not run_id:
        error = started.get("error") or started.get("error-message") or started
        return RunResult(None, "not-started", str(error), time.monotonic() - start)
    result = run_status(str(run_id), env, superlink=superlink, start=start)
    log.info("run %s: %s in %.0f s %s", run_id, result.status, result.seconds, "" if result.ok else result.details)
    return result


def run_status(run_id: str, env: Mapping[str, str], *, superlink: str | None = None,
               start: float | None = None) -> RunResult:
    """What `flwr ls --run-id` says of run ``run_id`` now; ``seconds`` counts from ``start`` (monotonic), if given."""
    target = [superlink] if superlink else []
    runs = flwr_json(["ls", *target, "--run-id", run_id], env, 120).get("runs") or [{}]
    return RunResult(run_id, runs[0].get("status", "unknown"), runs[0].get("status-details", ""),
                     0.0 if start is None else time.monotonic() - start)
