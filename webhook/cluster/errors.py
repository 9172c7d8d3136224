"""What the cluster layer raises."""

from __future__ import annotations

import json
import re
import ssl
from typing import Any


class ClusterAccessError(RuntimeError):
    """No way to reach the cluster where one is required (no service account, no kubeconfig, bad credentials)."""


class EnsureError(RuntimeError):
    """The certificate and caBundle could not be brought in step (no webhook configuration, endless conflicts)."""


class Gone(Exception):
    """The resourceVersion we hold has been compacted away: relist."""


class WatchError(Exception):
    """The API server ended a watch with an error event other than `410 Gone`."""


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")


def plainly(exc: BaseException) -> str:
    """An error of the cluster layer in plain words, without its class name: what the API server answered,
    or why it could not be reached."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import MaxRetryError

    if isinstance(exc, ApiException):
        message = _status_message(exc.body) or exc.reason or ""
        return f"the API server answered {exc.status}" + (f": {message}" if message else "")
    if isinstance(exc, MaxRetryError):
        pool = exc.pool
        where = f"{pool.host}:{pool.port}" if pool is not None else "the API server"
        return f"cannot reach {where}: {_unreachable(exc)}"
    if isinstance(exc, OSError):  # ssl.SSLError among them
        return _unreachable(exc) or _cause(exc)
    return str(exc) or "unexpected error"


def failure(exc: BaseException) -> str | None:
    """Why a request to the API server failed, in plain words and without the server's address (the caller
    names it): its answer as status, reason and message (`403 Forbidden: nodes is forbidden: ...`), or why
    it could not be reached or read (`connection refused`, `timed out`, `TLS verification failed: ...`).
    None when the exception is neither: a fault of ours, not of the cluster or the way to it."""
    from kubernetes.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        message = _status_message(exc.body)
        said = f"{exc.status} {exc.reason}" if exc.reason else f"{exc.status}"
        return said + (f": {message}" if message and message != exc.reason else "")
    if isinstance(exc, WatchError):
        return f"the API server ended the watch: {exc}"
    if isinstance(exc, json.JSONDecodeError):  # orjson's error is one
        return f"an answer that is not JSON ({exc})"
    return _unreachable(exc)


def described(exc: BaseException) -> tuple[str, bool]:
    """What to say of a failure in the cluster layer, and whether it is a fault of ours (worth its traceback):
    the plain reason `failure` gives, the message of our own errors, or else the class and the message."""
    if isinstance(exc, (ClusterAccessError, EnsureError)):
        return str(exc), False
    why = failure(exc)
    if why is not None:
        return why, False
    return f"unexpected {type(exc).__name__}: {exc}", True


def _unreachable(exc: BaseException) -> str | None:
    """Why the API server could not be reached, or its answer read to the end; None for anything else."""
    from urllib3.exceptions import HTTPError, MaxRetryError, ProtocolError

    if isinstance(exc, MaxRetryError):
        return _cause(exc.reason)
    if isinstance(exc, ssl.SSLError):
        return _tls(exc)
    if isinstance(exc, ProtocolError):  # urllib3's: its arguments hold the OSError, if there was one
        cause = next((arg for arg in exc.args if isinstance(arg, OSError)), None)
        return _cause(cause) if cause is not None else "the connection broke off in the middle of an answer"
    if isinstance(exc, (HTTPError, OSError)):
        return _cause(exc)
    return None


def _tls(exc: ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS verification failed: {exc.verify_message}"
    reason = getattr(exc, "reason", None) or exc.strerror or "handshake"
    return "TLS failed: " + str(reason).lower().replace("_", " ")


def _cause(exc: BaseException | None) -> str:
    text = str(exc or "")
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
        return "TLS verification failed (" + text.rsplit("certificate verify failed", 1)[-1].strip(" :)'\"") + ")"
    found = _ERRNO.search(text)
    if found:
        return found.group(1).strip().lower()
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    if "timed out" in text.lower():
        return "timed out"
    return text or "unexpected error"


def _status_message(body: Any) -> str | None:
    try:
        status = json.loads(body) if body else None
    except (TypeError, ValueError):
        return None
    message = status.get("message") if isinstance(status, dict) else None
    return message if isinstance(message, str) else None
