"""A local deployment: one SuperLink and N SuperNodes on loopback, talking over the gRPC Fleet API with TLS.

:func:`up` makes what is missing (CA and server certificate, node keys: authentication is on unless turned off),
starts the SuperLink, writes the `flwr` CLI's connection, registers the node keys, starts the
SuperNodes (each with its own partition and width tier in ``--node-config``), and records every PID.
:func:`down` stops exactly the recorded processes. The same layout serves one machine or the
loopback test; README "Deploy over gRPC" gives the commands for several machines.

Layout of ``outputs/deploy/<name>/``::

    cluster.json      the spec and the PID, start time and log of every process `up` started
    certs/            ca.crt, ca.key, server.pem, server.key (deploy.certs)
    keys/             node-<i>, node-<i>.pub with node authentication (deploy.keys)
    superlink/        the SuperLink's FLWR_HOME and state.db (registered keys and runs survive a restart)
    node-<i>/         SuperNode i's FLWR_HOME (installed app bundles)
    flwr-home/        the `flwr` CLI's FLWR_HOME: config.toml names the connection <name>
    logs/             superlink.log, node-<i>.log
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.certs import CertPaths, make_certificates
from deploy.connection import write_connection
from deploy.files import require_plain_name
from deploy.keys import NodeKey, make_node_key
from deploy.processes import Process, launch, stop
from glmc.errors import ConfigError, DeployError
from harness.engine import BIN, PROJECT, RunResult, flwr_env, flwr_json, listening_pid, run_app

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
READY_TIMEOUT = 90.0  # seconds for a process to listen or join (imports are slow on a loaded machine)
INSECURE_WARNING = ("--insecure: TLS is OFF. Model weights, node identities and the control API travel in plain "
                    "text, and node authentication is impossible. Use it on a trusted loopback only.")
NO_AUTH_WARNING = ("--no-auth: node authentication is OFF. Anyone who holds the CA certificate can join as a "
                   "SuperNode, receive the global model and send replies into the aggregation.")
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # flwr colours its log levels
JOINED = "SuperNode ID:"  # what a SuperNode logs once the SuperLink has accepted it


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. Node ``i`` gets partition ``i`` of ``nodes`` and width tier ``tiers[i mod len]``."""

    name: str = "local"
    nodes: int = 2
    tiers: tuple[float, ...] = (1.0,)
    fleet_port: int = 9092  # Fleet API (gRPC-rere): SuperNodes connect here
    control_port: int = 9093  # HTTP API: the `flwr` CLI (control) and the ServerApp's SuperExec (runtime)
    node_ports: tuple[int, ...] = ()  # each SuperNode's own runtime API port; default 9094, 9095, ...
    auth: bool = True  # node authentication: only SuperNodes with a registered key may join (off: warned)
    insecure: bool = False
    output_dir: Path = Path("outputs/deploy")

    def __post_init__(self) -> None:
        require_plain_name("deployment name", self.name)
        if self.nodes < 0 or not self.tiers or not all(0 < t <= 1 for t in self.tiers):
            raise ConfigError(f"need nodes >= 0 and tiers in (0, 1], got {self.nodes} and {self.tiers}")
        if self.node_ports and len(self.node_ports) != self.nodes:
            raise ConfigError(f"{self.nodes} nodes need {self.nodes} node ports, got {list(self.node_ports)}")
        if self.auth and self.insecure:
            raise ConfigError("node authentication needs TLS: drop --insecure or --auth")
        ports = [self.fleet_port, self.control_port, *(self.node_port(i) for i in range(self.nodes))]
        if not all(0 < port < 65536 for port in ports) or len(set(ports)) != len(ports):
            raise ConfigError(f"fleet, control and node ports must be distinct, in 1..65535, got {ports}")

    @property
    def root(self) -> Path:
        return self.output_dir / self.name

    @property
    def certs(self) -> CertPaths:
        return CertPaths(self.root / "certs")

    @property
    def cli_home(self) -> Path:
        return self.root / "flwr-home"

    def tier(self, index: int) -> float:
        return self.tiers[index % len(self.tiers)]

    def node_port(self, index: int) -> int:
        return self.node_ports[index] if self.node_ports else self.control_port + 1 + index

    def node_key(self, index: int) -> NodeKey:
        return NodeKey(self.root / "keys" / f"node-{index}")

    def node_config(self, index: int) -> str:
        """``--node-config`` of node ``index``: the keys client.app reads."""
        return f"partition-id={index} num-partitions={self.nodes} width-tier={self.tier(index):g}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"output_dir": str(self.output_dir)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterSpec:
        return cls(**(dict(data) | {"tiers": tuple(data["tiers"]), "node_ports": tuple(data["node_ports"]),
                                    "output_dir": Path(data["output_dir"])}))


@dataclass
class Cluster:
    """A started deployment: its spec and the processes it started (saved to ``cluster.json``)."""

    spec: ClusterSpec
    processes: list[Process] = dataclasses.field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment for `flwr` CLI commands against this deployment."""
        return flwr_env(self.spec.cli_home.resolve())

    def process(self, role: str) -> Process:
        return next(p for p in self.processes if p.role == role)

    def save(self) -> None:
        body = {"spec": self.spec.to_dict(), "processes": [p.to_dict() for p in self.processes]}
        (self.spec.root / "cluster.json").write_text(json.dumps(body, indent=1))

    @classmethod
    def load(cls, name: str, output_dir: Path = ClusterSpec.output_dir) -> Cluster:
        path = output_dir / name / "cluster.json"
        if not path.is_file():
            raise ConfigError(f"no deployment {name!r} under {output_dir} (start one with `python -m deploy up`)")
        body = json.loads(path.read_text())
        return cls(ClusterSpec.from_dict(body["spec"]), [Process.from_dict(p) for p in body["processes"]])


def up(spec: ClusterSpec) -> Cluster:
    """Start the SuperLink and the SuperNodes of ``spec``; on any failure, stop what started and raise."""
    if (spec.root / "cluster.json").is_file() and any(p.alive() for p in Cluster.load(spec.name,
                                                                                       spec.output_dir).processes):
        raise ConfigError(f"deployment {spec.name!r} is running; stop it first (`python -m deploy down`)")
    ports = [spec.fleet_port, spec.control_port, *(spec.node_port(i) for i in range(spec.nodes))]
    if busy := [str(port) for port in ports if port_in_use(port)]:
        raise ConfigError(f"ports in use on {LOOPBACK}: {', '.join(busy)}; choose others with --fleet-port, "
                          f"--control-port, --node-port")
    if spec.insecure:
        log.warning(INSECURE_WARNING)
    elif not spec.auth:
        log.warning(NO_AUTH_WARNING)
    if not spec.insecure and not spec.certs.exist():
        make_certificates(spec.certs.root)
    cluster = Cluster(spec)
    try:
        cluster.processes.append(start_superlink(spec))
        cluster.save()
        write_connection(spec.cli_home, spec.name, f"{LOOPBACK}:{spec.control_port}",
                         None if spec.insecure else spec.certs.ca_cert)
        with ThreadPoolExecutor() as pool:  # each `flwr` call takes seconds, mostly its imports
            list(pool.map(lambda index: register_key(cluster, index), range(spec.nodes if spec.auth else 0)))
        nodes = [start_node(spec, index, wait=False) for index in range(spec.nodes)]
        cluster.processes += nodes
        cluster.save()
        for node in nodes:
            wait_joined(node)
    except BaseException:
        down(cluster)
        raise
    return cluster


def port_in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port`` (whoever owns it; ``ss`` shows only our own PIDs)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket in TIME_WAIT does not count
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return True
    return False


def down(cluster: Cluster) -> list[str]:
    """Stop every recorded process, the SuperNodes (together) before the SuperLink; the roles of those that
    were still running."""
    nodes = [p for p in cluster.processes if p.role != "superlink"]
    with ThreadPoolExecutor() as pool:
        stopped = [p.role for p, ended in zip(nodes, pool.map(stop, nodes), strict=True) if ended]
    stopped += [p.role for p in cluster.processes if p.role == "superlink" and stop(p)]
    if (cluster.spec.root / "cluster.json").is_file():
        cluster.save()  # keeps the log paths; every recorded PID is now gone
    return stopped


def start_superlink(spec: ClusterSpec) -> Process:
    """flower-superlink with the Fleet API over gRPC-rere on ``fleet_port`` and the HTTP API on ``control_port``."""
    home = spec.root / "superlink"
    home.mkdir(parents=True, exist_ok=True)
    argv = [str(BIN / "flower-superlink"), *superlink_tls_args(spec),
            "--fleet-api-type", "grpc-rere", "--fleet-api-address", f"{LOOPBACK}:{spec.fleet_port}",
            "--host", LOOPBACK, "--port", str(spec.control_port),
            "--isolation", "subprocess", "--database", str((home / "state.db").resolve()),
            *(["--enable-supernode-auth"] if spec.auth else [])]
    process = launch("superlink", argv, spec.root / "logs" / "superlink.log", flwr_env(home.resolve()), home)
    return ready_or_stopped(process, lambda: all(listening_pid(port) == process.pid
                                                 for port in (spec.fleet_port, spec.control_port)),
                            "listen on its ports")


def superlink_tls_args(spec: ClusterSpec) -> list[str]:
    if spec.insecure:
        return ["--insecure"]
    certs = spec.certs
    return ["--ssl-ca-certfile", str(certs.ca_cert.resolve()), "--ssl-certfile", str(certs.server_cert.resolve()),
            "--ssl-keyfile", str(certs.server_key.resolve())]


def start_node(spec: ClusterSpec, index: int, *, key: NodeKey | None = None, port: int | None = None,
               wait: bool = True) -> Process:
    """flower-supernode ``index``; with ``wait``, returns once the SuperLink accepted it (see :func:`node_argv`)."""
    home = spec.root / f"node-{index}"
    home.mkdir(parents=True, exist_ok=True)
    process = launch(f"node-{index}", node_argv(spec, index, key=key, port=port),
                     spec.root / "logs" / f"node-{index}.log", flwr_env(home.resolve()), home)
    return wait_joined(process) if wait else process


def node_argv(spec: ClusterSpec, index: int, *, key: NodeKey | None = None, port: int | None = None) -> list[str]:
    """The flower-supernode command of node ``index``: Fleet API over gRPC-rere, the deployment's CA, its
    partition and width tier, and with authentication its own key. ``key`` and ``port`` replace the node's
    own (the fault tests start nodes that must be refused)."""
    key = key or (spec.node_key(index) if spec.auth else None)
    return [str(BIN / "flower-supernode"), "--superlink", f"{LOOPBACK}:{spec.fleet_port}", "--grpc-rere",
            *(["--insecure"] if spec.insecure else ["--root-certificates", str(spec.certs.ca_cert.resolve())]),
            *(["--auth-supernode-private-key", str(key.private.resolve())] if key else []),
            "--node-config", spec.node_config(index), "--host", LOOPBACK,
            "--port", str(port or spec.node_port(index)), "--isolation", "subprocess"]


def wait_joined(node: Process) -> Process:
    """``node`` once the SuperLink has accepted it; a DeployError saying why if it exits first (then it is
    stopped, with whatever it started)."""
    return ready_or_stopped(node, lambda: JOINED in node.log_text(), "join the SuperLink")


def restart(cluster: Cluster, role: str) -> Process:
    """Stop the process of ``role`` ("superlink" or "node-<i>") if it still runs, start it again, record it."""
    old = cluster.process(role)
    stop(old)
    spec = cluster.spec
    new = start_superlink(spec) if role == "superlink" else start_node(spec, int(role.removeprefix("node-")))
    cluster.processes[cluster.processes.index(old)] = new
    cluster.save()
    return new


def register_key(cluster: Cluster, index: int) -> None:
    """Make node ``index``'s key pair if it has none, and register its public key at the SuperLink."""
    key = cluster.spec.node_key(index)
    if not key.private.is_file():
        make_node_key(key.private.parent, key.private.name)
    answer = flwr_json(["supernode", "register", str(key.public.resolve()), cluster.spec.name], cluster.env, 120)
    error = str(answer.get("error-message", ""))
    if not answer.get("success") and "already in use" not in error:  # registered by an earlier `up`: fine
        raise DeployError(f"registering {key.public} failed: {error or answer}")


def run(cluster: Cluster, run_config: Mapping[str, Any], *, wait: bool = True, timeout: float = 7200) -> RunResult:
    """`flwr run . <name> --stream` with ``run_config`` overrides; the run's final status from `flwr ls`.

    The ServerApp writes to ``outputs/`` of this project unless ``output-dir`` says otherwise, and the
    run's ``width-tiers`` default to the deployment's tiers, so every node's reply fits the schema.
    Without ``wait`` it returns once the run is submitted.
    """
    return run_app(deployed_config(cluster, run_config), cluster.env, superlink=cluster.spec.name, wait=wait,
                   timeout=timeout)


def deployed_config(cluster: Cluster, run_config: Mapping[str, Any]) -> dict[str, Any]:
    """``run_config`` with the deployment's defaults: this project's ``outputs/`` and the deployment's tiers."""
    return {"output-dir": str((PROJECT / "outputs").resolve()),
            "width-tiers": ",".join(f"{t:g}" for t in cluster.spec.tiers)} | dict(run_config)


def wait_until(ready: Callable[[], bool], process: Process, what: str, timeout: float = READY_TIMEOUT,
               interval: float = 0.3) -> None:
    """Poll ``ready()`` every ``interval`` seconds until it holds; a DeployError quoting the log if ``process``
    exits or time runs out."""
    deadline = time.monotonic() + timeout
    while not ready():
        if not process.alive():
            raise DeployError(f"{process.role} exited before it could {what}: {failure_reason(process.log_text())}")
        if time.monotonic() > deadline:
            raise DeployError(f"{process.role} did not {what} within {timeout:.0f} s; see {process.log}")
        time.sleep(interval)


def ready_or_stopped(process: Process, ready: Callable[[], bool], what: str) -> Process:
    """``process`` once ``ready()``; if it never gets there, it is stopped (no unrecorded process is left)."""
    try:
        wait_until(ready, process, what)
    except BaseException:
        stop(process)
        raise
    return process


def failure_reason(log_text: str, lines: int = 4) -> str:
    """The lines of a flwr log that say why it stopped: its ERROR lines and what follows them."""
    text = [line.strip() for line in log_text.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(text) if "ERROR" in line), max(0, len(text) - lines))
    return " | ".join(ANSI_COLOUR.sub("", line) for line in text[start:start + lines])


def describe(cluster: Cluster) -> str:
    """A human summary: the ports, and each process with its PID, state and log."""
    spec = cluster.spec
    rows = [f"  {p.role:<10} pid {p.pid:<8} {'running' if p.alive() else 'stopped':<8} {p.log}"
            for p in cluster.processes]
    return "\n".join([
        f"deployment {spec.name!r} ({'INSECURE' if spec.insecure else 'TLS'}"
        f"{', node authentication' if spec.auth else ''}): Fleet API (gRPC) {LOOPBACK}:{spec.fleet_port}, "
        f"control API {LOOPBACK}:{spec.control_port}", *rows])
