"""What the Secret and the caBundle should hold next: issue, renew and rotate without a window in which
the served certificate and the caBundle disagree. Pure: bytes and times in, bytes out.

- The serving certificate is renewed at two thirds of its lifetime, or when it no longer covers the
  Service's names or was not signed by the current CA. The CA stays, so the caBundle does not change.
- The CA is rotated in two steps. At two thirds of its lifetime a new CA joins the bundle (old + new)
  while the old one still signs. Only once the webhook configuration carries the new CA is a serving
  certificate issued from it. Until then every served certificate verifies against the published bundle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.authority import KeyPair, generate_ca, issue_serving

CA_KEY, CA_CERT, NEXT_KEY, NEXT_CERT = "ca.key", "ca.crt", "next-ca.key", "next-ca.crt"
TLS_KEY, TLS_CERT, BUNDLE = "tls.key", "tls.crt", "ca-bundle.crt"


def _pair(cert_pem: bytes | None, key_pem: bytes | None) -> KeyPair | None:
    if not cert_pem or not key_pem:
        return None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError:
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        return None
    return KeyPair(key, cert)


def _aged(cert: x509.Certificate, now: datetime) -> bool:
    """Past two thirds of its lifetime (or expired)."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return now >= start + (end - start) * 2 / 3


def _covers(cert: x509.Certificate, names: Sequence[str]) -> bool:
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return set(names) <= set(sans.get_values_for_type(x509.DNSName))


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def pem_bundle(certs: Sequence[x509.Certificate]) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def load_bundle(pem: bytes | None) -> list[x509.Certificate]:
    if not pem:
        return []
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError:
        return []


@dataclass(frozen=True)
class State:
    data: dict[str, bytes]  # the Secret's data
    bundle: bytes  # what the webhook configuration's caBundle must hold
    changed: bool  # the Secret must be written
    note: str


def _current_ca(data: dict[str, bytes], name: str, now: datetime, *, ca_days: int, notes: list[str]) -> KeyPair:
    """The CA that signs, a new one (and the Secret's data started over) when there is none or it expired."""
    ca = _pair(data.get(CA_CERT), data.get(CA_KEY))
    if ca is not None and ca.cert.not_valid_after_utc > now:
        return ca
    ca = generate_ca(f"{name} webhook CA", days=ca_days, now=now)
    data.clear()
    data.update({CA_KEY: ca.key_pem, CA_CERT: ca.cert_pem})
    notes.append("new CA")
    return ca


def _rotate(
    data: dict[str, bytes],
    ca: KeyPair,
    bundle: list[x509.Certificate],
    *,
    published: bytes | None,
    name: str,
    now: datetime,
    ca_days: int,
    notes: list[str],
) -> KeyPair:
    """The CA that signs after this step: an aged CA gets a next one, which joins the bundle; the next CA
    is promoted once the API server trusts it."""
    following = _pair(data.get(NEXT_CERT), data.get(NEXT_KEY))
    if following is None and _aged(ca.cert, now):
        following = generate_ca(f"{name} webhook CA", days=ca_days, now=now)
        data[NEXT_KEY], data[NEXT_CERT] = following.key_pem, following.cert_pem
        bundle.append(following.cert)
        notes.append("next CA joins the bundle")
    elif following is not None and following.cert in load_bundle(published):
        # The API server trusts the next CA now: it may sign.
        ca = following
        data[CA_KEY], data[CA_CERT] = ca.key_pem, ca.cert_pem
        del data[NEXT_KEY], data[NEXT_CERT]
        notes.append("next CA promoted")
    return ca


def _serve(
    data: dict[str, bytes], ca: KeyPair, names: Sequence[str], *, now: datetime, days: int, notes: list[str]
) -> None:
    """A new serving certificate when there is none, it aged, misses a name or another CA signed it."""
    leaf = _pair(data.get(TLS_CERT), data.get(TLS_KEY))
    if leaf is None or _aged(leaf.cert, now) or not _covers(leaf.cert, names) or not _signed_by(leaf.cert, ca.cert):
        leaf = issue_serving(ca, list(names), days=days, now=now)
        data[TLS_KEY], data[TLS_CERT] = leaf.key_pem, leaf.cert_pem
        notes.append("new serving certificate")


def next_state(
    secret: Mapping[str, bytes] | None,
    published: bytes | None,
    names: Sequence[str],
    *,
    now: datetime,
    days: int,
) -> State:
    """`secret`: the Secret's data now (None: no Secret); `published`: the caBundle in the webhook
    configuration now; `names`: the DNS names the serving certificate must cover."""
    ca_days = max(days * 10, 5 * 365)
    data = dict(secret or {})
    notes: list[str] = []
    ca = _current_ca(data, names[0], now, ca_days=ca_days, notes=notes)
    bundle = [c for c in load_bundle(data.get(BUNDLE)) if c.not_valid_after_utc > now] or [ca.cert]
    if ca.cert not in bundle:
        bundle.insert(0, ca.cert)
    ca = _rotate(data, ca, bundle, published=published, name=names[0], now=now, ca_days=ca_days, notes=notes)
    _serve(data, ca, names, now=now, days=days, notes=notes)
    bundle_pem = pem_bundle(bundle)
    data[BUNDLE] = bundle_pem
    changed = dict(secret or {}) != data
    return State(data, bundle_pem, changed, ", ".join(notes) or "nothing to do")


def expiry(pem: bytes) -> datetime | None:
    """When the first certificate of a PEM bundle expires; None for no readable certificate."""
    certs = load_bundle(pem)
    return min((c.not_valid_after_utc for c in certs), default=None)
