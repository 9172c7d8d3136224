"""The server's TLS context, reloaded in place when the certificate files change on disk.

Kubernetes updates a mounted Secret by swapping a symlink, so a change shows as a new inode, size or
mtime of the file the path resolves to. A new pair is loaded into a fresh context: a half-written or
mismatched pair is refused (and logged) while the old one keeps serving. Only handshakes that start
afterwards use the new context; connections in flight keep their session.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509

from webhook.stamps import file_stamp

log = logging.getLogger(__name__)

_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


@dataclass(frozen=True)
class TLSFiles:
    cert: str
    key: str
    client_ca: str | None = None
    min_version: str = "1.2"


def new_context(files: TLSFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _VERSIONS[files.min_version]
    context.set_alpn_protocols(["http/1.1"])  # HTTP/1.1 only
    if files.client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(files.cert, files.key)
    if files.client_ca:
        context.load_verify_locations(cafile=files.client_ca)
    return context


def not_after(cert_path: str) -> datetime:
    pem = Path(cert_path).read_bytes()
    return x509.load_pem_x509_certificate(pem).not_valid_after_utc


class ReloadingTLS:
    """The listener's SSLContext, whose handshakes are handed to the newest context built from the files.

    A reload builds a fresh context from the files alone (`load_verify_locations` on a live context only
    adds, so a client CA removed from the file would stay trusted) and the listener's context hands every
    new handshake to it from its SNI callback, which OpenSSL calls for every ClientHello, with or without a
    server name. Verification then uses the new context's trust store; connections in flight keep theirs.
    """

    def __init__(self, files: TLSFiles) -> None:
        self.files = files
        self._stamp = file_stamp(files.cert, files.key, files.client_ca)
        self.context = new_context(files)
        self._live = self.context
        self.context.sni_callback = self._hand_over
        self.expires = not_after(files.cert)

    def _hand_over(self, connection: ssl.SSLObject, _server_name: str | None, context: ssl.SSLContext) -> None:
        live = self._live
        if live is not context:
            connection.context = live

    def readiness(self, now: datetime | None = None) -> str | None:
        """Not ready while the served certificate has expired: the API server would refuse every handshake."""
        now = now or datetime.now(UTC)
        if self.expires <= now:
            return f"the served certificate {self.files.cert} expired at {self.expires.isoformat()}"
        return None

    def reload_if_changed(self) -> bool | None:
        """True: reloaded; False: changed but refused (old pair still served); None: unchanged."""
        stamp = file_stamp(self.files.cert, self.files.key, self.files.client_ca)
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            fresh = new_context(self.files)
            expires = not_after(self.files.cert)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.error("new certificate in %s refused, still serving the previous one: %s", self.files.cert, exc)
            return False
        self._live = fresh
        self.expires = expires
        log.info("certificate reloaded from %s (expires %s)", self.files.cert, expires.isoformat())
        return True
