"""SuperNode authentication keys: ECDSA P-384 key pairs in OpenSSH format, made with `cryptography`.

With ``flower-superlink --enable-supernode-auth`` the SuperLink admits only SuperNodes whose public key
was registered (``flwr supernode register KEY.pub <connection>``); each SuperNode signs its requests
with its private key (``flower-supernode --auth-supernode-private-key KEY``). flwr accepts EC keys on
NIST curves only, in the format ``ssh-keygen -t ecdsa -b 384`` writes; this module writes the same
without needing ssh-keygen.

Files written for node ``NAME``::

    NAME       the private key: only on that SuperNode's host
    NAME.pub   the public key: registered at the SuperLink through the `flwr` CLI
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from deploy.files import require_plain_name, write_file
from glmc.errors import ConfigError


@dataclass(frozen=True)
class NodeKey:
    """The key pair of one SuperNode."""

    private: Path

    @property
    def public(self) -> Path:
        return self.private.with_name(self.private.name + ".pub")


def make_node_key(out: Path, name: str, *, force: bool = False) -> NodeKey:
    """Write ``out/name`` (private, mode 0600) and ``out/name.pub``; an existing pair is kept unless ``force``."""
    require_plain_name("a key name", name)
    key = NodeKey(out / name)
    if key.private.exists() and not force:
        raise ConfigError(f"{key.private} exists; pass --force to replace it")
    out.mkdir(parents=True, exist_ok=True)
    private = ec.generate_private_key(ec.SECP384R1())
    write_file(key.private, private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                  serialization.NoEncryption()), secret=True)
    public = private.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    write_file(key.public, public + f" glmc-fl-{name}\n".encode())
    return key
