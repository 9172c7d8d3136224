"""The puller's failures: one pull that failed (transient or not), and a pull abandoned at SIGTERM."""

from __future__ import annotations

import re

ERROR_LIMIT = 300  # characters of a runtime's error kept in the puller's line
_PERMANENT = (
    "not found",
    "manifest unknown",
    "unauthorized",
    "authentication required",
    "denied",
    "forbidden",
    "invalid reference",
    "failed to parse image reference",
    "repository name must be",
    "no basic auth credentials",
    "x509: certificate",
    "certificate signed by unknown authority",
    "executable file not found",
    "no such file or directory",
)


# HTTP 401/403 as a word, never as digits of a port or an address (127.0.0.1:40135 is not a 401).
_REFUSED_STATUS = re.compile(r"(?<![\w.:])40[13](?![\w.:])")


class PullError(Exception):
    """A failed call; `permanent` when retrying cannot help (not found, unauthorized, invalid, no client)."""

    def __init__(self, message: str, permanent: bool | None = None) -> None:
        text = " ".join(message.split())
        if len(text) > ERROR_LIMIT:
            # Go wraps errors as "doing X: doing Y: cause": keep the start (what failed) and the end (why).
            head = ERROR_LIMIT // 3
            text = text[:head] + " … " + text[-(ERROR_LIMIT - head - 3) :]
        super().__init__(text)
        self.message = text
        lowered = text.lower()
        if permanent is None:
            permanent = any(p in lowered for p in _PERMANENT) or _REFUSED_STATUS.search(lowered) is not None
        self.permanent = permanent


class Cancelled(Exception):
    """The puller is stopping (SIGTERM): the call was abandoned."""
