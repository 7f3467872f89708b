"""`flwr run` of this app refuses a bad run config before it submits the run, with one line naming the key and its
choices and exit status 2; and a `flwr run --stream` leaves no SuperLink behind.

Alone, flwr 1.39 checks only that an override names a key of ``pyproject.toml``, and answers a misspelled one with
"[code: 15] Invalid run configuration."; a bad value passes, starts a SuperLink and a simulation, fails in the
ServerApp, and `flwr run` exits 0. But `flwr run` first imports this package in its own process (its component check
looks ``server.app`` up, which imports ``server``), before it starts a SuperLink or sends anything. There,
:func:`check_submission` (called by ``server/__init__.py``) reads the command's parsed arguments from click and checks
the app's defaults with the run's overrides as the apps will (:func:`federation.preflight.check_run_config`).
Anywhere else, the apps' own processes and tests included, it does nothing.

For a simulation, `flwr run` starts a local SuperLink as its own child and detaches it: it would outlive the run,
and every later `flwr run` would reuse it (by its port, whatever its FLWR_HOME), with the environment of the shell
that started it. With
``--stream`` the run has ended when `flwr run` exits, so the SuperLink that this command started is stopped then
(:func:`stop_own_superlink`). Without ``--stream`` the run goes on in it, and it stays (docs/federated.md says how to
stop it); a SuperLink that was already running is no child of this command and is left alone."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import click

SUPERLINK = b"flower-superlink"  # the program `flwr run` starts for a local simulation
STOP_SECONDS = 20.0  # how long a stopped SuperLink gets to end its SuperExec before it is killed


def check_submission() -> None:
    """In `flwr run` of this app: exit 2 with one line on stderr unless the run config would pass the apps' checks."""
    params = flwr_run_params()
    if params is None:
        return
    if params.get("stream"):
        atexit.register(stop_own_superlink)
    import typer
    from flwr.common.config import parse_config_args

    from federation.preflight import check_run_config
    from glmc.errors import GlmcError

    try:
        check_run_config(app_defaults(Path(params["app"])) | parse_config_args(params["run_config_overrides"]))
    except GlmcError as err:
        print(f"flwr run: error: {err}", file=sys.stderr)  # sys.stderr now: flwr's --format json captures it
        raise typer.Exit(code=2) from None


def flwr_run_params() -> dict[str, Any] | None:
    """The parsed arguments of the `flwr run` command this process runs, for an app on disk; None elsewhere."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or ctx.find_root().info_name != "flwr" or ctx.command.name != "run":
        return None
    return None if str(ctx.params.get("app", "")).startswith("@") else ctx.params


def app_defaults(app: Path) -> dict[str, Any]:
    """The run config an app declares in its ``pyproject.toml``: every key, with its default."""
    config = tomllib.loads((app.expanduser() / "pyproject.toml").read_text())
    return dict(config["tool"]["flwr"]["app"]["config"])


def stop_own_superlink() -> None:
    """Stop (SIGTERM, then SIGKILL after STOP_SECONDS) every SuperLink that is a child of this process: the one this
    `flwr run` started, whose SuperExec ends with it."""
    for pid in _children():
        try:
            if SUPERLINK not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_SECONDS
            while os.waitpid(pid, os.WNOHANG)[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        except (OSError, ChildProcessError):  # it ended by itself meanwhile
            continue


def _children() -> list[int]:
    """This process's children (Linux's /proc; none found elsewhere)."""
    me = os.getpid()
    try:
        return [int(pid) for pid in Path(f"/proc/{me}/task/{me}/children").read_text().split()]
    except OSError:
        return []
