"""What bounds the connections of one listener: their number, their timers, and the drain.

A connection owes its client's next bytes by a time (the idle timeout between requests, the deadline
within a head or a body) or, while it does not read, owes nothing and waits on its client to read its
answers. One watchdog per listener checks every running timer each TICK_SECONDS, rather than a timer
handle per request: a request that arrives whole in one read, as the API server sends it, starts none.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

TICK_SECONDS = 0.1  # how often running timers are checked
WARN_EVERY_SECONDS = 10.0  # one log line per kind of refusal per this many seconds, however hard a client pushes


class Timed(Protocol):
    """A connection with a timer: told when it runs out."""

    def expired(self) -> None: ...


class Timers:
    """Connections that owe something by a time; `expired` is called once the time passes."""

    def __init__(self) -> None:
        self._due: dict[Timed, float] = {}
        self._armed = False

    def start(self, conn: Timed, seconds: float, *, restart: bool = True) -> None:
        """Due in `seconds`; with restart False, a timer already running keeps its time."""
        if not restart and conn in self._due:
            return
        self._due[conn] = time.monotonic() + seconds
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_later(TICK_SECONDS, self._check)

    def stop(self, conn: Timed) -> None:
        self._due.pop(conn, None)

    def __contains__(self, conn: object) -> bool:
        return conn in self._due

    def _check(self) -> None:
        now = time.monotonic()
        for conn in [c for c, due in self._due.items() if due <= now]:
            del self._due[conn]
            conn.expired()
        if self._due:
            asyncio.get_running_loop().call_later(TICK_SECONDS, self._check)
        else:
            self._armed = False


class Limits:
    """Shared by the connections of one listener; the process flips `draining` at its first signal and
    `stopping` once the drain ends."""

    def __init__(
        self,
        max_connections: int,
        idle_timeout: float,
        *,
        deadline: float,
        name: str = "server.maxConnections",
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout  # server.idleTimeoutSeconds: before a first request and between requests
        self.deadline = deadline  # server.deadlineSeconds: for a head, from its first byte
        self.name = name
        self.on_refused = on_refused
        self.draining = False  # every answer says Connection: close
        self.stopping = False  # idle connections get a short grace, then close
        self.refused = 0
        self.timers = Timers()
        self._warned: dict[str, float] = {}

    def refuse(self, open_connections: int) -> None:
        """A connection over the bound, closed as its handshake completes."""
        self.refused += 1
        self.on_refused()
        self.warn(
            "connection",
            "connection closed: %d open, over %s (%d); %d refused so far",
            open_connections,
            self.name,
            self.max_connections,
            self.refused,
        )

    def warn(self, kind: str, message: str, *args: object) -> None:
        """One line per kind per WARN_EVERY_SECONDS."""
        now = time.monotonic()
        if now - self._warned.get(kind, -WARN_EVERY_SECONDS) > WARN_EVERY_SECONDS:
            self._warned[kind] = now
            log.warning(message, *args)

    def readiness(self) -> str | None:
        return "shutting down: draining connections" if self.draining else None
