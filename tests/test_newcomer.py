"""A newcomer's first hour, scripted on tiny sizes through the real `flwr run`: Quickstart 1 on a text model from a
fresh FLWR_HOME with nothing exported beyond the README's variables, which leaves no process behind; and the
run-config mistakes that `flwr run` refuses in one line, with a non-zero status, before it starts anything. (A
``--json`` naming an input is refused with the input unchanged: tests/test_outputs.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest

from glmc.data.paths import data_root
from harness.engine import BIN, app_dir, flwr_env, free_port, listening_pid, stop_tree

FEDERATION = "num-supernodes=2 client-resources-num-cpus=1"


def _shakespeare_unexported() -> bool:
    """Whether the Shakespeare corpus is found with no GLMC_DATA: the apps' own lookup from Flower's copy."""
    with mock.patch.dict(os.environ):
        os.environ.pop("GLMC_DATA", None)
        return any((data_root() / "shakespeare").glob("*_gut.txt"))


@pytest.fixture
def newcomer(tmp_path: Path):
    """The README's environment on a fresh FLWR_HOME (own ports, so that no other SuperLink is met) and nothing
    else: no GLMC_DATA. Afterwards, whatever still listens on the ports is stopped, and the test has failed."""
    http, control = free_port(), free_port()
    env = flwr_env(tmp_path / "flwr-home", http, control)
    env.pop("GLMC_DATA")
    yield env, http
    left = [pid for port in (http, control) if (pid := listening_pid(port)) is not None]
    for pid in left:
        stop_tree(pid)
    assert not left, f"processes left listening on the run's ports: {left}"


def _flwr_run(env: dict[str, str], run_config: str) -> subprocess.CompletedProcess[str]:
    """`flwr run . --stream` as Quickstart 1 types it, from a checkout's files (``app_dir``: no .data, no .venv)."""
    return subprocess.run([str(BIN / "flwr"), "run", ".", "--stream", "--federation-config", FEDERATION,
                           "--run-config", run_config], cwd=app_dir(), env=env, capture_output=True, text=True,
                          timeout=600, check=False)


def _run_processes(env: dict[str, str], port: int) -> list[str]:
    """The command lines of the processes that serve this FLWR_HOME's runs: SuperLink, SuperExec, simulation."""
    marks = (env["FLWR_HOME"].encode(), f"127.0.0.1:{port}".encode())
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if any(mark in cmdline for mark in marks) and int(entry.name) != os.getpid():
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


def test_a_copy_of_the_code_finds_the_data_of_the_checkout_it_was_installed_from(tmp_path, monkeypatch):
    """What Flower's copy of the app sees (no .data beside the code): the editable install's checkout's .data; a
    copy with its own .data, and GLMC_DATA, come first."""
    import glmc
    from glmc.data.paths import editable_source

    installed = editable_source()
    if installed is None or not (installed / ".data").is_dir():
        pytest.skip("the project is not installed in editable mode from a checkout with .data (make setup)")
    monkeypatch.delenv("GLMC_DATA", raising=False)
    monkeypatch.setattr(glmc, "__file__", str(tmp_path / "copy" / "glmc" / "__init__.py"))
    assert data_root() == installed / ".data"
    (tmp_path / "copy" / ".data").mkdir(parents=True)
    assert data_root() == tmp_path / "copy" / ".data"
    monkeypatch.setenv("GLMC_DATA", str(tmp_path / "mine"))
    assert data_root() == tmp_path / "mine"


@pytest.mark.parametrize(("overrides", "expect"), [
    ("aggregation='wieght'", ["aggregation must be one of", "'weight'", "got 'wieght'"]),
    ("agregation='weight'", ["unknown run-config key 'agregation'", "did you mean 'aggregation'"]),
    ("dataset='shakespeare' partitioner='dirichlet'", ["partitioner 'dirichlet' does not split shakespeare",
                                                       "role, play"]),
    ("model='llama-tiny' dataset='shakespeare' width-tiers='1,0.25'", ["width-tiers '1,0.25'", "KV heads"]),
])
def test_a_bad_run_config_is_refused_in_one_line_before_anything_starts(overrides, expect, newcomer):
    env, port = newcomer
    result = _flwr_run(env, overrides)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("flwr run: error: "), result.stderr
    assert all(part in errors[0] for part in expect), errors[0]
    assert not (Path(env["FLWR_HOME"]) / "local-superlink").exists()  # no SuperLink was ever started
    assert not _run_processes(env, port)


@pytest.mark.slow
@pytest.mark.skipif(not _shakespeare_unexported(), reason="no Shakespeare corpus in .data (make data)")
def test_quickstart_1_on_shakespeare_finds_its_data_and_leaves_nothing_running(newcomer, tmp_path):
    """A GPT-2 on Shakespeare's speaking roles (the text's default partitioner), run by Flower from its own copy of
    the app under FLWR_HOME/apps/, where no .data lies beside the code."""
    env, port = newcomer
    out = tmp_path / "outputs"
    result = _flwr_run(env, f"model='gpt2-tiny' dataset='shakespeare' aggregation='weight' num-server-rounds=1 "
                            f"local-steps=2 eval-limit=100 output-dir='{out}' run-name='first'")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "run finished" in result.stdout + result.stderr, (result.stdout + result.stderr)[-3000:]
    metrics = json.loads((out / "first" / "metrics.json").read_text())
    assert metrics["split"]["scheme"] == "role"
    (last,) = [r for r in metrics["records"] if r["round"] == 1]
    assert last["aggregated"] and last["valid"] == 2 and 0 < last["central_accuracy"] <= 1
    deadline = time.monotonic() + 60  # the simulation process ends a few seconds after its SuperLink
    while (left := _run_processes(env, port)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
