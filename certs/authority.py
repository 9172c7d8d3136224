"""Generate a CA and a serving certificate for the webhook Service.

ECDSA P-256 keys: accepted by every supported API server and Go's TLS stack, and a thousand times faster
to generate than RSA-4096, which matters when replicas create certificates at start-up.
"""

from __future__ import annotations

import base64
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Certificates start a little in the past: API servers whose clocks run behind must still accept them.
CLOCK_SKEW = timedelta(minutes=5)


@dataclass(frozen=True)
class KeyPair:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def service_dns_names(service: str, namespace: str) -> list[str]:
    """The names the API server may use to reach a Service (it uses <svc>.<ns>.svc)."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])


def generate_ca(common_name: str = "copilot-webhook-ca", days: int = 3650, now: datetime | None = None) -> KeyPair:
    now = now or datetime.now(UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + timedelta(days=days))
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(key, cert)


def issue_serving(
    ca: KeyPair,
    dns_names: Sequence[str],
    ips: Sequence[str] = (),
    *,
    days: int = 365,
    now: datetime | None = None,
    usage: x509.ObjectIdentifier = ExtendedKeyUsageOID.SERVER_AUTH,
) -> KeyPair:
    """A leaf certificate signed by `ca`; `usage` CLIENT_AUTH makes one to present to a server."""
    if not dns_names and not ips:
        raise ValueError("a certificate needs at least one DNS name or IP address")
    now = now or datetime.now(UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    not_after = min(now + timedelta(days=days), ca.cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(dns_names[2] if len(dns_names) > 2 else (list(dns_names) or list(ips))[0]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return KeyPair(key, cert)


def ca_bundle(ca: KeyPair) -> str:
    """The value for a webhook configuration's clientConfig.caBundle."""
    return base64.b64encode(ca.cert_pem).decode("ascii")


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    # Write beside the target and rename: a server watching the file never reads half of it.
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_files(out: str | Path, ca: KeyPair, serving: KeyPair) -> dict[str, Path]:
    """ca.crt, tls.crt (leaf), tls.key (0600). The CA key is not written: nothing here signs again."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"ca.crt": out / "ca.crt", "tls.crt": out / "tls.crt", "tls.key": out / "tls.key"}
    write_atomic(paths["ca.crt"], ca.cert_pem, 0o644)
    write_atomic(paths["tls.key"], serving.key_pem, 0o600)
    write_atomic(paths["tls.crt"], serving.cert_pem, 0o644)
    return paths


def generate_files(
    out: str | Path,
    service: str,
    namespace: str,
    *,
    dns: Sequence[str] = (),
    ips: Sequence[str] = (),
    days: int = 365,
) -> tuple[dict[str, Path], str]:
    ca = generate_ca(f"{service}.{namespace} webhook CA", days=max(days, 1) * 2)
    serving = issue_serving(ca, [*service_dns_names(service, namespace), *dns], ips, days=days)
    return write_files(out, ca, serving), ca_bundle(ca)
