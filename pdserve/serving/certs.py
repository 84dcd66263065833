"""`pdserve certs DIR --host ...`: a private CA and one member certificate for a cluster's
mutual TLS (both server and client use), for nodes without an existing PKI.

    DIR/ca.pem       the CA certificate: every member's --tls-ca, and an SDK client's `tls`
    DIR/ca-key.pem   the CA's key: keep it off the serving nodes once certificates are made
    DIR/member.pem   the member certificate, SANs = every --host (IP addresses and names)
                     and 127.0.0.1
    DIR/member-key.pem

Keys are EC P-256, written 0600. Needs the `cryptography` package (`pip install
'pdserve[tls]'`); imported only here.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

FILES = ("ca.pem", "ca-key.pem", "member.pem", "member-key.pem")


def _crypto():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise ValueError(
            "certs: needs the cryptography package (pip install cryptography)"
        ) from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _san(host: str):
    x509 = _crypto()[0]
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_certs(out: str | Path, hosts: list[str], days: int = 365) -> dict[str, Path]:
    """Writes FILES under `out` -> {name: path}. Refuses to overwrite an existing CA."""
    x509, hashes, serialization, ec, eku, name_oid = _crypto()
    # the router's OpenAI front door reaches its own gRPC port on 127.0.0.1 whatever --host
    # says, so every member certificate names it too
    hosts = list(dict.fromkeys([*hosts, "127.0.0.1"]))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in FILES}
    if paths["ca.pem"].exists():
        raise ValueError(f"certs: {paths['ca.pem']} exists; choose an empty directory")
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def name(cn: str):
        return x509.Name([x509.NameAttribute(name_oid.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("pdserve cluster CA"))
        .issuer_name(name("pdserve cluster CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    member = (
        x509.CertificateBuilder()
        .subject_name(name("pdserve member"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([eku.SERVER_AUTH, eku.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    private = dict(
        encoding=pem,
        format=serialization.PrivateFormat.PKCS8,
        encryption_algorithm=serialization.NoEncryption(),
    )
    _write(paths["ca.pem"], ca.public_bytes(pem), 0o644)
    _write(paths["ca-key.pem"], ca_key.private_bytes(**private), 0o600)
    _write(paths["member.pem"], member.public_bytes(pem), 0o644)
    _write(paths["member-key.pem"], key.private_bytes(**private), 0o600)
    return paths


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
