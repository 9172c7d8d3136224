"""The server's TLS context, reloaded in place when the certificate files change on disk.

Kubernetes updates a mounted Secret by swapping a symlink, so a change shows as a new inode, size or
mtime of the file the path resolves to. A new pair is loaded into a scratch context first: a half-written
or mismatched pair is refused (and logged) while the old one keeps serving. Loading into the live
context only affects handshakes that start afterwards; connections in flight keep their session.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509

log = logging.getLogger(__name__)

_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


def file_stamp(*paths: str | None) -> tuple[tuple[int, int, int], ...]:
    stamps = []
    for path in paths:
        if path is None:
            continue
        try:
            st = os.stat(path)
        except OSError:
            stamps.append((-1, -1, -1))
        else:
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


@dataclass(frozen=True)
class TLSFiles:
    cert: str
    key: str
    client_ca: str | None = None
    min_version: str = "1.2"


def _configure(context: ssl.SSLContext, files: TLSFiles) -> None:
    context.load_cert_chain(files.cert, files.key)
    if files.client_ca:
        context.load_verify_locations(cafile=files.client_ca)


def new_context(files: TLSFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _VERSIONS[files.min_version]
    context.set_alpn_protocols(["http/1.1"])  # HTTP/1.1 only (spec 2)
    if files.client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
    _configure(context, files)
    return context


def not_after(cert_path: str) -> datetime:
    pem = Path(cert_path).read_bytes()
    return x509.load_pem_x509_certificate(pem).not_valid_after_utc


class ReloadingTLS:
    """One live SSLContext; `reload_if_changed` swaps its certificate when the files change."""

    def __init__(self, files: TLSFiles) -> None:
        self.files = files
        self._stamp = file_stamp(files.cert, files.key, files.client_ca)
        self.context = new_context(files)
        self.expires = not_after(files.cert)

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
            new_context(self.files)  # validate the new pair before touching the live context
            expires = not_after(self.files.cert)
            _configure(self.context, self.files)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.error("new certificate in %s refused, still serving the previous one: %s", self.files.cert, exc)
            return False
        self.expires = expires
        log.info("certificate reloaded from %s (expires %s)", self.files.cert, expires.isoformat())
        return True
