"""Test PKI for the FL transport: one CA per run, a server certificate and one certificate per client.

The server trusts only certificates its CA signed and takes a client's id from the certificate's subject
common name (``client-<id>``), never from a message. Built with ``cryptography``'s x509 API (ECDSA P-256).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from crosstrain.checkpoint.atomic import atomic_path, atomic_write
from crosstrain.errors import ConfigError

CLIENT_PREFIX = "client-"
SERVER_NAME = "crosstrain-fl-server"
VALID_DAYS = 30


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "crosstrain fl"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, issuer_key: ec.EllipticCurvePrivateKey,
           *, ca: bool = False, server: bool = False,
           valid: tuple[datetime.datetime, datetime.datetime] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = valid or (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS))
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    atomic_write(folder / f"{stem}.crt", cert.public_bytes(serialization.Encoding.PEM))
    with atomic_path(folder / f"{stem}.key") as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # private keys: owner only
        with os.fdopen(fd, "wb") as fh:
            fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def generate(folder: str | os.PathLike[str], clients: int) -> Path:
    """Write ``ca.crt/.key``, ``server.crt/.key`` (SAN localhost, 127.0.0.1) and ``client-<i>.crt/.key`` for
    ``i`` in ``0..clients-1`` into ``folder``; an existing CA there is refused rather than overwritten."""
    if clients < 1:
        raise ConfigError(f"--clients={clients} must be >= 1")
    out = Path(folder)
    if (out / "ca.crt").exists():
        raise ConfigError(f"{out} already holds a CA (ca.crt); pass an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("crosstrain fl CA")
    ca = _issue("crosstrain fl CA", ca_key, ca_name, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    _write(out, "server", _issue(SERVER_NAME, server_key, ca_name, ca_key, server=True), server_key)
    for i in range(clients):
        key = ec.generate_private_key(ec.SECP256R1())
        _write(out, f"{CLIENT_PREFIX}{i}", _issue(f"{CLIENT_PREFIX}{i}", key, ca_name, ca_key), key)
    _write(out, "ca", ca, ca_key)  # last: a folder with ca.crt is complete
    return out


@dataclass(frozen=True)
class Identity:
    """PEM bytes a TLS endpoint needs: the CA to trust, and its own certificate chain and key."""

    ca: bytes
    cert: bytes
    key: bytes


def load(folder: str | os.PathLike[str], stem: str) -> Identity:
    """The identity ``stem`` (``server`` or ``client-<i>``) from a `crosstrain fl certs` folder."""
    out = Path(folder)
    paths = [out / "ca.crt", out / f"{stem}.crt", out / f"{stem}.key"]
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"{path} does not exist; create the certificates with `crosstrain fl certs {out} "
                              "--clients N` and set fl.certs to that folder")
    ca, cert, key = (p.read_bytes() for p in paths)
    identity = Identity(ca, cert, key)
    check(identity, paths[1])
    return identity


def check(identity: Identity, where: Path) -> None:
    """ConfigError in one line unless ``identity``'s certificate is signed by its CA, valid now and matches its key:
    the TLS handshake would fail on any of these with only an opaque ``UNAVAILABLE`` to show for it."""
    try:
        ca = x509.load_pem_x509_certificate(identity.ca)
        cert = x509.load_pem_x509_certificate(identity.cert)
        key = serialization.load_pem_private_key(identity.key, password=None)
    except ValueError as exc:
        raise ConfigError(f"{where.parent}: a certificate or key there is not PEM ({exc}); recreate it with "
                          "`crosstrain fl certs`") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ConfigError(f"{where} is not signed by {where.parent / 'ca.crt'} (another CA issued it); use the "
                          "certificate the run's CA issued for this client, or that CA's ca.crt") from None
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if now < start:
        raise ConfigError(f"{where} is not valid yet (from {start:%Y-%m-%d %H:%M} UTC; now {now:%Y-%m-%d %H:%M}); "
                          "check this machine's clock or issue a new certificate")
    if now > end:
        raise ConfigError(f"{where} expired on {end:%Y-%m-%d %H:%M} UTC; issue a new one with `crosstrain fl certs`")
    if key.public_key().public_numbers() != cert.public_key().public_numbers():  # type: ignore[union-attr]
        raise ConfigError(f"{where} does not match its key {where.with_suffix('.key')}; pass the pair issued "
                          "together")


def client_id(common_name: str) -> int | None:
    """The client id a certificate's common name ``client-<id>`` names, or None for any other subject."""
    if not common_name.startswith(CLIENT_PREFIX) or not common_name[len(CLIENT_PREFIX):].isdigit():
        return None
    return int(common_name[len(CLIENT_PREFIX):])
