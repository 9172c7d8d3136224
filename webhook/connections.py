"""HTTP connections under uvicorn, with the limits an admission webhook needs.

uvicorn's httptools protocol, plus three things it lacks:
- a bound on open connections (`server.maxConnections`): one over the bound is closed as soon as its TLS
  handshake completes, before it can hold a request's worth of memory;
- a time limit before the first request (`server.idleTimeoutSeconds`): uvicorn arms its keep-alive timer
  only after a response, so a connection that never sends anything was held forever;
- draining: once the server shuts down, every answer says `Connection: close`, and a connection with no
  request in flight gets a short grace to deliver one it may already have sent, instead of the immediate
  close that made clients lose the request they had just written on an idle keep-alive connection.
It also keeps the request target as sent when it is not origin-form (`POST https://host/mutate`), so the
router can refuse it: the API server only ever sends origin-form targets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

CLOSE_GRACE_SECONDS = 0.5  # how long an idle connection may still deliver a request once shutdown starts


class Limits:
    """Shared by every connection of one server; the server flips `draining`."""

    def __init__(
        self,
        max_connections: int,
        idle_timeout: float,
        on_refused: Callable[[], None] = lambda: None,
        name: str = "server.maxConnections",
    ) -> None:
        self.max_connections = max_connections
        self.name = name
        self.on_refused = on_refused
        self.idle_timeout = idle_timeout
        self.draining = False
        self.refused = 0
        self._last_warning = 0.0

    def refuse(self, open_connections: int) -> None:
        self.refused += 1
        self.on_refused()
        now = time.monotonic()
        if now - self._last_warning > 10:  # one line per 10 s, however hard a client pushes
            self._last_warning = now
            log.warning(
                "connection closed: %d open, over %s (%d); %d refused so far",
                open_connections,
                self.name,
                self.max_connections,
                self.refused,
            )

    def readiness(self) -> str | None:
        return "shutting down: draining connections" if self.draining else None


def protocol_class(limits: Limits) -> type[HttpToolsProtocol]:
    class Protocol(_LimitedProtocol):
        pass

    Protocol.limits = limits
    return Protocol


class _LimitedProtocol(HttpToolsProtocol):
    limits: Limits

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.limits.refuse(len(self.connections))
            transport.close()
            return
        # Until the first request arrives, the keep-alive timer is the time-to-first-request limit.
        self.timeout_keep_alive_task = self.loop.call_later(self.limits.idle_timeout, self.timeout_keep_alive_handler)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if not self.url.startswith(b"/"):
            # Absolute-form or asterisk-form: keep the target as sent, so no route matches it.
            self.scope["raw_path"] = self.url
        if self.limits.draining and self.cycle is not None:
            self.cycle.keep_alive = False

    def shutdown(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            # Idle: a request may be on the wire already. Serve it (with Connection: close) if it comes soon.
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(CLOSE_GRACE_SECONDS, self.timeout_keep_alive_handler)
        else:
            self.cycle.keep_alive = False
