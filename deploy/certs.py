"""A local certificate authority and the SuperLink's server certificate, made with `cryptography`.

The SuperLink serves TLS on every API (Fleet gRPC, and the HTTP API that the ``flwr`` CLI and the
ServerApp's SuperExec use) with ``server.pem``/``server.key``; SuperNodes and the ``flwr`` CLI check it
against ``ca.crt``. The server certificate names every address a client dials: always localhost,
127.0.0.1 and ::1 (the SuperLink's own SuperExec dials its loopback address), plus the host names and
IP addresses of a multi-machine deployment.

Files written to the output folder::

    ca.crt       the CA certificate: copy to every SuperNode host and to the host running `flwr`
    ca.key       the CA's private key: keep it off the network (it signs server certificates)
    server.pem   the SuperLink's certificate, signed by the CA
    server.key   its private key: only on the SuperLink host
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from deploy.files import write_file
from glmc.errors import ConfigError

LOOPBACK = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 365


@dataclass(frozen=True)
class CertPaths:
    """Where the CA and the server certificate of one deployment live."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "server.key"

    def exist(self) -> bool:
        return all(p.is_file() for p in (self.ca_cert, self.server_cert, self.server_key))


def make_certificates(out: Path, hosts: Sequence[str] = (), *, force: bool = False) -> CertPaths:
    """Write a fresh CA and a server certificate for loopback plus ``hosts`` into ``out``.

    An existing set is kept unless ``force``: replacing the CA would lock out every node that holds the
    old ``ca.crt``.
    """
    if not all(host.strip() for host in hosts):
        raise ConfigError(f"a certificate host must be a DNS name or IP address, got {list(hosts)}")
    paths = CertPaths(out)
    if paths.exist() and not force:
        raise ConfigError(f"{out} already holds certificates; pass --force to replace them")
    out.mkdir(parents=True, exist_ok=True)
    ca_key, server_key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_cert = _ca_certificate(ca_key)
    server_cert = _server_certificate(server_key, ca_cert, ca_key, _subject_alt_names([*LOOPBACK, *hosts]))
    write_file(paths.ca_key, _private_pem(ca_key), secret=True)
    write_file(paths.server_key, _private_pem(server_key), secret=True)
    write_file(paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    write_file(paths.server_cert, server_cert.public_bytes(serialization.Encoding.PEM))
    return paths


def certificate_names(path: Path) -> list[str]:
    """The DNS names and IP addresses a certificate is valid for (its subjectAltName)."""
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [*san.get_values_for_type(x509.DNSName), *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))]


def _ca_certificate(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "glmc-fl deployment CA")])
    return (_builder(name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(cert_sign=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA384()))


def _server_certificate(key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
                        ca_key: ec.EllipticCurvePrivateKey, names: x509.SubjectAlternativeName) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "glmc-fl superlink")])
    return (_builder(subject, ca_cert.subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(names, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA384()))


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew between hosts
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS)))


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign,
                         crl_sign=cert_sign, encipher_only=False, decipher_only=False)


def _subject_alt_names(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    """Each host as an IP address entry when it parses as one, else as a DNS name; duplicates once."""
    entries: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
