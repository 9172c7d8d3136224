"""What the server, its configuration and its inputs raise; each message names what is wrong, for a 4xx
answer or a one-line exit, never a traceback. (The other layers: webhook/mutation/errors.py,
webhook/cluster/errors.py, webhook/pull/errors.py.)"""

from __future__ import annotations


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key, the value and what is allowed."""


class DocumentError(ValueError):
    """The bytes are not a document we accept; the message says what is wrong and where."""


class RequestError(Exception):
    """A request that is not a usable AdmissionReview (or Pod, for /preview): answered with a 4xx."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class PreviewFailed(Exception):
    """A preview's worker could not answer (timed out, stopped): answered with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class InvalidReference(ValueError):
    """Not an image reference the runtimes would accept; the message says why."""


class ClientGone(Exception):
    """The client went away before its answer: nothing to send."""
