"""Reading a request's body: under a size limit and a deadline kept by one watchdog, with the headers that
describe it. Shared by every endpoint that reads a body, each with its own limit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from webhook.errors import ClientGone, RequestError

Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]


class BodyDeadlines:
    """Deadlines for reading request bodies, kept by one watchdog instead of a timer per request, so that no
    request starts and stops a libuv timer of its own (`asyncio.timeout` around every read). The watchdog
    wakes every 0.1 s while any body is being read and cancels the reads that are late, so the deadline
    holds to within a tenth of a second."""

    TICK = 0.1

    def __init__(self) -> None:
        self._due: dict[asyncio.Task[Any], float] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        self._armed = False

    def start(self, task: asyncio.Task[Any], seconds: float) -> None:
        self._due[task] = time.monotonic() + seconds
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_later(self.TICK, self._check)

    def expired(self, task: asyncio.Task[Any]) -> bool:
        return task in self._expired

    def done(self, task: asyncio.Task[Any]) -> None:
        del self._due[task]
        if self._expired and task in self._expired:
            self._expired.discard(task)
            task.uncancel()

    def _check(self) -> None:
        now = time.monotonic()
        for task, due in list(self._due.items()):
            if due <= now and task not in self._expired:
                self._expired.add(task)
                task.cancel()
        if self._due:
            asyncio.get_running_loop().call_later(self.TICK, self._check)
        else:
            self._armed = False


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def media_type(scope: Scope) -> str:
    raw = header(scope, b"content-type") or ""
    return raw.split(";", 1)[0].strip().lower()


async def read_body(
    scope: Scope, receive: Receive, deadlines: BodyDeadlines, *, limit: int, limit_name: str, seconds: float
) -> bytes:
    """The whole body: RequestError 413 over `limit` (named `limit_name`), 408 when it has not arrived
    within `seconds`; ClientGone when the client left."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"body of {declared} bytes is over {limit_name} ({limit})")
    # The API server gives up at timeoutSeconds, so we stop waiting at server.deadlineSeconds and say
    # so; the deadline covers the whole body, its first byte included (BodyDeadlines).
    chunks: list[bytes] = []
    size = 0
    task: asyncio.Task[Any] = asyncio.current_task()  # type: ignore[assignment]
    deadlines.start(task, seconds)
    try:
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"body is over {limit_name} ({limit})")
            chunks.append(chunk)
            more = message.get("more_body", False)
    except asyncio.CancelledError:
        if not deadlines.expired(task):
            raise
        raise RequestError(408, f"body not received within server.deadlineSeconds ({seconds:g} s)") from None
    finally:
        deadlines.done(task)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
