"""``python -m deploy``: certificates, node keys, the `flwr` connection, and a local SuperLink + SuperNodes.

    python -m deploy certs --out DIR [--host NAME_OR_IP ...]         CA + SuperLink certificate
    python -m deploy keys --out DIR NAME [NAME ...]                  SuperNode authentication keys
    python -m deploy connection --name N --address HOST:9093 --ca ca.crt [--flwr-home DIR]
    python -m deploy up --name N --nodes 2 [--tiers 1,0.5] [--no-auth] [--insecure] [ports]
    python -m deploy run --name N [--run-config 'num-server-rounds=2 aggregation="weight"']
    python -m deploy status --name N
    python -m deploy down --name N

Errors are one line, ``deploy: error: ...``, with exit status 2; a run that did not finish exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from flwr.common.config import parse_config_args

from deploy.certs import certificate_names, make_certificates
from deploy.cluster import INSECURE_WARNING, Cluster, ClusterSpec, deployed_config, describe, down, run, up
from deploy.connection import default_flwr_home, write_connection
from deploy.follow import follow
from deploy.keys import make_node_key
from federation.preflight import check_run_config
from glmc.core.options import parse_floats
from glmc.errors import ConfigError, GlmcError

log = logging.getLogger("deploy")


def cmd_certs(args: argparse.Namespace) -> int:
    paths = make_certificates(args.out, args.host, force=args.force)
    print(f"wrote {paths.ca_cert}, {paths.ca_key}, {paths.server_cert}, {paths.server_key}")
    print(f"server certificate valid for: {', '.join(certificate_names(paths.server_cert))}")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    for name in args.names:
        key = make_node_key(args.out, name, force=args.force)
        print(f"wrote {key.private} (private: only on its SuperNode) and {key.public} (register it)")
    return 0


def cmd_connection(args: argparse.Namespace) -> int:
    if args.insecure:
        log.warning(INSECURE_WARNING)
    path = write_connection(args.flwr_home, args.name, args.address, None if args.insecure else args.ca)
    print(f"connection {args.name!r} → {args.address} in {path}; now: flwr run . {args.name} --stream")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    spec = ClusterSpec(name=args.name, nodes=args.nodes, tiers=parse_floats("--tiers", args.tiers),
                       fleet_port=args.fleet_port, control_port=args.control_port,
                       node_ports=tuple(args.node_port or ()), auth=not (args.no_auth or args.insecure),
                       insecure=args.insecure, output_dir=args.output_dir)
    cluster = up(spec)
    print(describe(cluster))
    print(f"run the apps: python -m deploy run --name {spec.name}  (or FLWR_HOME={spec.cli_home.resolve()} "
          f"flwr run . {spec.name} --stream)")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    stopped = down(Cluster.load(args.name, args.output_dir))
    print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    cluster = Cluster.load(args.name, args.output_dir)
    print(describe(cluster))
    return 0 if all(p.alive() for p in cluster.processes) else 1


def cmd_run(args: argparse.Namespace) -> int:
    """Submit the run, report each round as the ServerApp writes it, then its status and where its outputs are."""
    cluster = Cluster.load(args.name, args.output_dir)
    config = deployed_config(cluster, parse_overrides(args.run_config))
    settings = check_run_config(config)  # a bad key or value fails here, before the run is submitted
    start = time.monotonic()
    started = run(cluster, config, wait=False)
    if started.run_id is None:
        print(f"run not started: {started.details}")
        return 1
    print(f"run {started.run_id} submitted", flush=True)
    result = follow(started.run_id, settings.run_dir(int(started.run_id)), cluster.env, cluster.spec.name,
                    lambda line: print(line, flush=True), start)
    print(f"run {result.run_id}: {result.status} in {result.seconds:.0f} s {'' if result.ok else result.details}")
    return 0 if result.ok else 1


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``'k1=v1 k2="s"'`` strings, read by flwr's own `--run-config` parser (TOML values)."""
    try:
        return parse_config_args(list(items))
    except click.ClickException as err:
        raise ConfigError(f"run-config overrides {list(items)}: {err.message}") from err


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deploy", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("certs", help="a local CA and the SuperLink's server certificate")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--host", action="append", default=[],
                   help="a DNS name or IP address SuperNodes and the flwr CLI dial (repeat); loopback is always in")
    p.add_argument("--force", action="store_true", help="replace existing certificates (every node needs the new CA)")

    p = sub.add_parser("keys", help="ECDSA P-384 OpenSSH key pairs for SuperNode authentication")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("names", nargs="+")
    p.add_argument("--force", action="store_true")

    p = sub.add_parser("connection", help="write [superlink.NAME] into FLWR_HOME/config.toml for the flwr CLI")
    p.add_argument("--name", required=True)
    p.add_argument("--address", required=True, help="the SuperLink's control API, HOST:9093")
    tls = p.add_mutually_exclusive_group(required=True)
    tls.add_argument("--ca", type=Path, help="the deployment's ca.crt")
    tls.add_argument("--insecure", action="store_true", help="no TLS (prints a warning)")
    p.add_argument("--flwr-home", type=Path, default=default_flwr_home())

    p = sub.add_parser("up", help="start a SuperLink and N SuperNodes on loopback (TLS unless --insecure)")
    _name(p)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--tiers", default="1", help="width tiers mapped over the nodes, e.g. 1,0.5")
    p.add_argument("--fleet-port", type=int, default=ClusterSpec.fleet_port)
    p.add_argument("--control-port", type=int, default=ClusterSpec.control_port)
    p.add_argument("--node-port", type=int, action="append",
                   help="each SuperNode's runtime API port, once per node (default: control port + 1 + i)")
    p.add_argument("--no-auth", action="store_true",
                   help="no node authentication (prints a warning); by default every node gets a registered key")
    p.add_argument("--insecure", action="store_true", help="no TLS and so no node authentication (prints a warning)")

    for command, text in (("down", "stop exactly the processes `up` started"),
                          ("status", "which recorded processes run; exit 1 if one does not")):
        _name(sub.add_parser(command, help=text))

    p = sub.add_parser("run", help="flwr run . NAME, each round reported as it ends, then the run's status (flwr ls) "
                       "and where its outputs are")
    _name(p)
    p.add_argument("--run-config", action="append", default=[], help="'key=value ...' overrides (TOML values)")
    return parser


def _name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default=ClusterSpec.name)
    parser.add_argument("--output-dir", type=Path, default=ClusterSpec.output_dir)


COMMANDS = {"certs": cmd_certs, "keys": cmd_keys, "connection": cmd_connection, "up": cmd_up, "down": cmd_down,
            "status": cmd_status, "run": cmd_run}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m deploy``; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("deploy").setLevel(logging.INFO)
    try:
        return COMMANDS[args.command](args)
    except GlmcError as err:
        print(f"deploy: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # an unwritable --out or --output-dir, a port the system refuses
        print(f"deploy: error: {err.strerror or err}{f': {err.filename}' if err.filename else ''}", file=sys.stderr)
        return 2
