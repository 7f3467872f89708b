"""The `flwr` CLI's connection to a deployed SuperLink: a ``[superlink.<name>]`` table in ``$FLWR_HOME/config.toml``.

``flwr run . <name>``, ``flwr ls <name>`` and ``flwr supernode register KEY <name>`` reach the SuperLink's
control API (its ``--port``, 9093 here) through this table. It never goes into pyproject.toml: `flwr run`
rewrites a ``[tool.flwr.federations]`` section there.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from deploy.files import write_file


def default_flwr_home() -> Path:
    """Where `flwr` itself looks: ``$FLWR_HOME``, else ``~/.flwr``."""
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")


def connection_table(address: str, root_certificates: Path | None) -> dict[str, Any]:
    """The table for one SuperLink: TLS checked against ``root_certificates``, or plain text when it is None."""
    if root_certificates is None:
        return {"address": address, "insecure": True}
    return {"address": address, "root-certificates": str(root_certificates.resolve())}


def write_connection(flwr_home: Path, name: str, address: str, root_certificates: Path | None) -> Path:
    """Add or replace connection ``name`` in ``flwr_home/config.toml``, keeping every other connection.

    A new file also makes ``name`` the default connection.
    """
    path = flwr_home / "config.toml"
    config = tomllib.loads(path.read_text()) if path.is_file() else {}
    superlink = config.setdefault("superlink", {})
    superlink.setdefault("default", name)
    superlink[name] = connection_table(address, root_certificates)
    flwr_home.mkdir(parents=True, exist_ok=True)
    write_file(path, tomli_w.dumps(config).encode())
    return path
