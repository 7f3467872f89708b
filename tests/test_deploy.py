"""Deployment over gRPC: certificates, node keys, the flwr connection, process records, and a real
SuperLink with two SuperNodes on loopback, with TLS and node authentication.

The slow tests share one deployment (module fixture) and run in file order: nodes that must be refused,
two rounds of weight-aligned merging, then the faults: the SuperLink stopped after round 2 and that run
resumed with ``resume=true`` (rounds 3 and 4), with a SuperNode stopped mid-round 3 and restarted. Every
process they start is stopped by its recorded PID in a ``finally``. Measured figures are logged
(``-o log_cli=true --log-cli-level=INFO`` shows them).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import stat
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.cli.supernode.register import try_load_public_key

from deploy import cli
from deploy.certs import certificate_names, make_certificates
from deploy.cluster import (
    Cluster,
    ClusterSpec,
    down,
    node_argv,
    restart,
    run,
    start_node,
    up,
    wait_joined,
    wait_until,
)
from deploy.connection import write_connection
from deploy.keys import make_node_key
from deploy.processes import Process, launch, stop
from glmc.data.fashion_mnist import find_fashion_mnist
from glmc.errors import ConfigError, DeployError
from glmc.io.checkpoint import load_checkpoint, state_digest
from harness.engine import (
    descendants,
    flwr_env,
    flwr_json,
    free_port,
    listening_pid,
    run_status,
    running,
    toml_value,
)

log = logging.getLogger(__name__)

needs_data = pytest.mark.skipif(find_fashion_mnist() is None, reason="Fashion-MNIST is not installed (make data)")

# Small and quick: 10 local steps, an IID split (the Dirichlet split costs each ClientApp seconds), 100 test images.
RUN = {"model": "vit-tiny", "aggregation": "weight", "local-steps": 10, "eval-limit": 100, "partitioner": "iid"}


# Certificates, keys, connection, overrides, process records: no flwr process needed.

def test_server_certificate_is_signed_by_the_ca_for_loopback_and_given_hosts(tmp_path: Path) -> None:
    paths = make_certificates(tmp_path, ["superlink.example", "10.1.2.3"])
    ca = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
    ca_key = ca.public_key()
    assert isinstance(ca_key, ec.EllipticCurvePublicKey)
    ca_key.verify(server.signature, server.tbs_certificate_bytes, ec.ECDSA(hashes.SHA384()))  # raises if forged
    assert server.issuer == ca.subject
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert set(certificate_names(paths.server_cert)) == {"localhost", "127.0.0.1", "::1", "superlink.example",
                                                         "10.1.2.3"}
    for secret in (paths.ca_key, paths.server_key):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="--force"):
        make_certificates(tmp_path)


def test_node_keys_are_openssh_p384_that_flwr_accepts(tmp_path: Path) -> None:
    key = make_node_key(tmp_path, "node-0")
    private = serialization.load_ssh_private_key(key.private.read_bytes(), None)
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    public = serialization.load_ssh_public_key(key.public.read_bytes())
    assert public == private.public_key()
    assert try_load_public_key(key.public)  # what `flwr supernode register` itself runs on the file
    assert stat.S_IMODE(key.private.stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="--force"):
        make_node_key(tmp_path, "node-0")


def test_connection_is_added_next_to_the_existing_ones(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    write_connection(tmp_path, "lab", "10.1.2.3:9093", tmp_path / "ca.crt")
    write_connection(tmp_path, "loop", "127.0.0.1:9093", None)
    config = tomllib.loads((tmp_path / "config.toml").read_text())["superlink"]
    assert config["default"] == "local" and config["local"] == {"address": ":local:"}
    assert config["lab"] == {"address": "10.1.2.3:9093", "root-certificates": str((tmp_path / "ca.crt").resolve())}
    assert config["loop"] == {"address": "127.0.0.1:9093", "insecure": True}


def test_run_config_overrides_are_toml_values() -> None:
    assert cli.parse_overrides(["num-server-rounds=2 aggregation='weight'", 'run-name="a b" resume=true']) == {
        "num-server-rounds": 2, "aggregation": "weight", "run-name": "a b", "resume": True}
    with pytest.raises(ConfigError, match="invalid format"):
        cli.parse_overrides(["rounds=two"])


def test_spec_checks_and_node_config() -> None:
    spec = ClusterSpec(name="t", nodes=3, tiers=(1.0, 0.5))
    assert [spec.node_config(i) for i in (0, 1)] == ["partition-id=0 num-partitions=3 width-tier=1",
                                                     "partition-id=1 num-partitions=3 width-tier=0.5"]
    assert [spec.node_port(i) for i in range(3)] == [9094, 9095, 9096]
    assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ConfigError, match="needs TLS"):
        ClusterSpec(auth=True, insecure=True)
    with pytest.raises(ConfigError, match="node ports"):
        ClusterSpec(nodes=2, node_ports=(1,))
    for ports in ({"fleet_port": 0}, {"fleet_port": 70000}, {"node_ports": (9094, 9093)}):
        with pytest.raises(ConfigError, match=r"distinct, in 1\.\.65535"):
            ClusterSpec(nodes=2, **ports)  # type: ignore[arg-type]


@pytest.mark.parametrize(("argv", "expect"), [
    (["certs", "--out", "{tmp}/c", "--host", ""], "a certificate host must be"),
    (["keys", "--out", "{tmp}/k", "../escape"], "a key name must be"),
    (["certs", "--out", "/proc/no-such-dir"], "No such file or directory: /proc/no-such-dir"),
    (["up", "--nodes", "1", "--fleet-port", "0", "--output-dir", "{tmp}"], "distinct, in 1..65535"),
])
def test_bad_input_is_one_line_and_writes_nothing(argv: list[str], expect: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([a.format(tmp=tmp_path) for a in argv]) == 2  # these once passed, or ended in a traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("deploy: error: ") and expect in err[0], err
    assert not any(tmp_path.iterdir())


def test_up_refuses_ports_in_use_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        spec = ClusterSpec(name="busy", nodes=0, fleet_port=port, control_port=free_port(), output_dir=tmp_path)
        with pytest.raises(ConfigError, match=f"ports in use on 127.0.0.1: {port};"):
            up(spec)
    assert not (tmp_path / "busy" / "cluster.json").exists()


def test_stop_ends_the_recorded_process_and_its_children_and_nothing_else(tmp_path: Path) -> None:
    script = "import subprocess, time; subprocess.Popen(['sleep', '120']); time.sleep(120)"
    parent = launch("parent", [sys.executable, "-c", script], tmp_path / "p.log", dict(os.environ), tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not descendants(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        [child] = descendants(parent.pid)
        impostor = Process("parent", parent.pid, parent.start_time + 1, parent.log, 0, parent.argv)
        assert not impostor.alive() and not stop(impostor)  # a reused PID is never signalled
        assert parent.alive()
        assert stop(parent, grace=5)
        assert not parent.alive() and not running(child)
    finally:
        stop(parent, grace=1)


def test_a_deployed_round_is_reported_in_one_line_with_what_was_dropped() -> None:
    from deploy.follow import round_line
    from server.records import RoundRecord

    first = RoundRecord(3, replies=2, valid=1, central_accuracy=0.5123, dropped=["node 7: NaN or Inf values"])
    assert round_line(first.to_dict()) == ("round 3: accuracy 51.2%, 1/2 valid replies; dropped node 7: NaN or Inf "
                                           "values")
    kept = RoundRecord(4, replies=1, valid=0, failure="only 1 of the 2 nodes the round needs connected")
    assert round_line(kept.to_dict()).endswith("0/1 valid replies, global model kept: only 1 of the 2 nodes the "
                                               "round needs connected")


# A real deployment on loopback: TLS, node authentication, two SuperNodes with width tiers 1 and 0.5.

@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if find_fashion_mnist() is None:
        pytest.skip("Fashion-MNIST is not installed (make data)")
    root = tmp_path_factory.mktemp("deploy")
    spec = ClusterSpec(name="loop", nodes=2, tiers=(1.0, 0.5), fleet_port=free_port(), control_port=free_port(),
                       node_ports=(free_port(), free_port()), auth=True, output_dir=root)
    start = time.monotonic()
    started = up(spec)
    log.info("up: SuperLink + 2 SuperNodes with TLS and node authentication in %.1f s", time.monotonic() - start)
    try:
        yield started
    finally:
        down(started)
        assert not any(p.alive() for p in started.processes)


@pytest.mark.slow
def test_nodes_without_the_ca_or_a_registered_key_cannot_join(cluster: Cluster, tmp_path: Path) -> None:
    spec = cluster.spec
    rogue = make_node_key(tmp_path, "rogue")
    unregistered = start_node(spec, 2, key=rogue, port=free_port(), wait=False)
    argv = node_argv(spec, 3, key=rogue, port=free_port())  # TLS fails before the key is looked at
    flag = argv.index("--root-certificates")
    del argv[flag:flag + 2]  # no CA: the node can only trust the system's roots, which never signed our SuperLink
    no_ca = launch("node-3", argv, tmp_path / "no-ca.log", flwr_env(tmp_path / "home"), tmp_path)
    with pytest.raises(DeployError, match=r"node-2 exited before it could join.*\[code: 2004\] Failed to activate"):
        wait_joined(unregistered)  # stops it whatever happens
    with pytest.raises(DeployError, match=r"node-3 exited before it could join.*CERTIFICATE_VERIFY_FAILED"):
        wait_joined(no_ca)
    for refused in (unregistered, no_ca):
        assert "Exit Code: 305" in refused.log_text()
    assert statuses(cluster) == ["online", "online"]  # only the two registered nodes


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output dir of the deployed runs: the fault test resumes the run of the two-round test."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def tls_run(cluster: Cluster, runs: Path) -> tuple[int, str]:
    """Two rounds of weight-aligned merging over gRPC with TLS, through ``python -m deploy run`` (its exit status and
    what it printed), run once for the module: the test that checks them and the fault test, which resumes this
    run, each work alone as well as in order."""
    config = RUN | {"num-server-rounds": 2, "output-dir": str(runs), "run-name": "tls"}
    start = time.monotonic()
    # A process of its own, as a user runs it: pytest's live logging (log_cli) would reset a redirected sys.stdout.
    done = subprocess.run([sys.executable, "-m", "deploy", "run", "--name", cluster.spec.name, "--output-dir",
                           str(cluster.spec.output_dir), "--run-config",
                           " ".join(f"{k}={toml_value(v)}" for k, v in config.items())],
                          capture_output=True, text=True, timeout=1800)
    log.info("2 rounds over gRPC with TLS: %.1f s", time.monotonic() - start)
    return done.returncode, done.stdout if done.returncode == 0 else done.stdout + done.stderr


@pytest.mark.slow
def test_two_rounds_over_grpc_with_tls(cluster: Cluster, runs: Path, tls_run: tuple[int, str]) -> None:
    spec = cluster.spec
    superlink = cluster.process("superlink")
    assert listening_pid(spec.fleet_port) == superlink.pid
    assert f"Starting Fleet API (gRPC-rere) on 127.0.0.1:{spec.fleet_port}" in superlink.log_text()
    assert tls_peer_certificate(spec.fleet_port, spec.certs.ca_cert) == spec.certs.server_cert.read_bytes()
    for node in ("node-0", "node-1"):
        argv = cluster.process(node).argv
        assert "--grpc-rere" in argv and "--root-certificates" in argv and "--insecure" not in argv

    status, printed = tls_run
    assert status == 0, printed
    lines = printed.splitlines()  # round by round as the run goes, then where its outputs are
    assert lines[1].startswith("round 0: accuracy") and lines[2].startswith("round 1: accuracy"), printed
    assert ", 2/2 valid replies" in lines[3] and "finished:completed" in lines[-1], printed
    assert f"metrics: {runs / 'tls' / 'metrics.json'}" in lines and f"plot: {runs / 'tls' / 'accuracy.png'}" in lines
    records = json.loads((runs / "tls" / "metrics.json").read_text())["records"]
    assert [r["round"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["aggregated"] and r["replies"] == 2 and r["valid"] == 2 and not r["dropped"], r
        assert 0.0 <= r["central_accuracy"] <= 1.0 and r["align_seconds"] > 0
    assert records[2]["central_loss"] < records[0]["central_loss"]
    for node in ("node-0", "node-1"):
        assert "Receiving: train message" in cluster.process(node).log_text()


@pytest.mark.slow
def test_resume_after_a_superlink_restart_survives_a_stopped_node_and_a_nan_reply(cluster: Cluster, runs: Path,
                                                                                  tls_run: tuple[int, str]) -> None:
    """The SuperLink is stopped after round 2 and started again; ``resume=true`` continues from the round-2
    checkpoint bit for bit. In round 3 a SuperNode is stopped mid-round: the round finishes with the reply
    that arrived (min-train-nodes=1). The node, restarted once round 3 is recorded, is back in round 4 (which
    waits for 2 connected nodes), where its reply is NaN (the ``fault-partition`` test hook) and is dropped with
    the reason while the valid one is merged."""
    checkpoint = runs / "tls" / "checkpoints" / "round-002.safetensors"
    assert tls_run[0] == 0 and checkpoint.is_file(), f"the run it resumes: {tls_run[1]}"
    stopped = time.monotonic()
    restart(cluster, "superlink")
    wait_for(lambda: statuses(cluster) == ["online", "online"], cluster, "both nodes to reconnect", interval=2)
    log.info("SuperLink restarted; both SuperNodes back after %.1f s", time.monotonic() - stopped)

    node = cluster.process("node-1")
    seen = len(node.log_text())  # the earlier run left its instructions in this log
    # min-available-nodes=2: round 4 waits until the restarted node has joined, so it cannot race the round start.
    config = RUN | {"num-server-rounds": 4, "resume": True, "min-train-nodes": 1, "min-available-nodes": 2,
                    "round-timeout": 300.0, "fault-partition": 1, "output-dir": str(runs), "run-name": "tls"}
    start = time.monotonic()
    started = run(cluster, config, wait=False)
    assert started.run_id, started.details
    wait_for(lambda: "Receiving: train message" in node.log_text()[seen:], cluster, "node-1's round-3 instruction")
    killed = time.monotonic()
    assert stop(node)
    offline = seconds_until_offline(cluster, node_id(node), killed)
    # The SuperLink answers a lost instruction with "Node Unavailable" only if its node is offline when the
    # ServerApp polls (every 3 s): a node back sooner would leave round 3 waiting for round-timeout.
    wait_for(lambda: rounds_recorded(runs / "tls") > 3, cluster, "round 3 recorded without node-1")
    restarted = restart(cluster, "node-1")
    log.info("SIGTERM mid-round: node offline after %.1f s; restarted and joined after %.1f s", offline,
             time.monotonic() - killed)
    last = runs / "tls" / "checkpoints" / "round-004.safetensors"
    wait_for(last.is_file, cluster, "the round-4 checkpoint")
    wait_for(lambda: run_status(started.run_id, cluster.env, superlink=cluster.spec.name).status.startswith(
        "finished"), cluster, "the resumed run to finish", interval=2)
    result = run_status(started.run_id, cluster.env, superlink=cluster.spec.name, start=start)
    assert result.ok, f"{result.status}: {result.details}"
    log.info("resumed rounds 3 and 4 in %.1f s", result.seconds)

    saved, _ = load_checkpoint(checkpoint)
    server_log = (runs / "tls" / "server.log").read_text()
    assert f"global model after round 2: sha256 {state_digest(saved)}" in server_log
    records = json.loads((runs / "tls" / "metrics.json").read_text())["records"]
    assert [r["round"] for r in records] == [0, 1, 2, 3, 4]
    assert records[3]["aggregated"] and records[3]["replies"] == 2 and records[3]["valid"] == 1
    assert "Node Unavailable" in records[3]["dropped"][0]
    assert records[4]["replies"] == 2, "the restarted node missed round 4"
    assert "Receiving: train message" in restarted.log_text()
    assert records[4]["aggregated"] and records[4]["valid"] == 1 and "NaN or Inf" in records[4]["dropped"][0]
    final, _ = load_checkpoint(last)
    assert all(v.isfinite().all() for v in final.values())


@pytest.mark.slow
def test_insecure_deployment_warns_and_down_stops_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    where = ["--name", "plain", "--output-dir", str(tmp_path)]
    try:
        with caplog.at_level(logging.WARNING):
            assert cli.main(["up", *where, "--nodes", "0", "--insecure", "--fleet-port", str(free_port()),
                             "--control-port", str(free_port())]) == 0
        assert any("TLS is OFF" in r.getMessage() for r in caplog.records)
        assert "INSECURE" in capsys.readouterr().out
        assert cli.main(["status", *where]) == 0
        assert "--insecure" in Cluster.load("plain", tmp_path).process("superlink").argv
    finally:
        assert cli.main(["down", *where]) == 0
    assert "stopped: superlink" in capsys.readouterr().out
    assert cli.main(["status", *where]) == 1


def tls_peer_certificate(port: int, ca: Path) -> bytes:
    """The PEM certificate a TLS client that trusts only ``ca`` sees on 127.0.0.1:``port`` (HTTP/2, as gRPC)."""
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return ssl.DER_cert_to_PEM_cert(der).encode()


def node_id(node: Process) -> str:
    """The id the SuperLink gave ``node``, from its log."""
    line = next(line for line in node.log_text().splitlines() if "SuperNode ID:" in line)
    return line.rsplit(":", 1)[1].strip()


def statuses(cluster: Cluster, node: str | None = None) -> list[str]:
    """The sorted statuses `flwr supernode ls` gives every node, or only ``node``."""
    nodes = flwr_json(["supernode", "ls", cluster.spec.name], cluster.env, 60).get("nodes", [])
    return sorted(n["status"] for n in nodes if node in (None, n["node-id"]))


def rounds_recorded(run_dir: Path) -> int:
    """How many rounds (round 0 included) the run's metrics.json holds; 0 before it is written."""
    path = run_dir / "metrics.json"
    return len(json.loads(path.read_text())["records"]) if path.is_file() else 0


def seconds_until_offline(cluster: Cluster, node: str, since: float) -> float:
    """Poll `flwr supernode ls` until ``node`` is offline; seconds since ``since``."""
    wait_for(lambda: statuses(cluster, node) == ["offline"], cluster, f"node {node} to be marked offline", interval=1)
    return time.monotonic() - since


def wait_for(ready: Callable[[], bool], cluster: Cluster, what: str, interval: float = 0.3) -> None:
    """Poll ``ready()`` for up to 5 minutes; fails at once, quoting its log, if the SuperLink exits meanwhile.
    Checks that run the `flwr` CLI take a CPU-second each: poll those every 2 s, not to starve the run."""
    wait_until(ready, cluster.process("superlink"), f"see {what}", timeout=300, interval=interval)


@pytest.mark.slow
def test_node_authentication_is_on_by_default_and_no_auth_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for name, flags in (("default", []), ("open", ["--no-auth"])):
        where = ["--name", name, "--output-dir", str(tmp_path)]
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING):
                assert cli.main(["up", *where, "--nodes", "0", *flags, "--fleet-port", str(free_port()),
                                 "--control-port", str(free_port())]) == 0
            argv = Cluster.load(name, tmp_path).process("superlink").argv
            warned = any("node authentication is OFF" in r.getMessage() for r in caplog.records)
            assert ("--enable-supernode-auth" in argv) == (not flags) and warned == bool(flags), name
            assert ("node authentication" in capsys.readouterr().out) == (not flags)
        finally:
            assert cli.main(["down", *where]) == 0
