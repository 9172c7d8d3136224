"""The relay: requests the admission connection does not answer itself, handed to a stock uvicorn server.

The admission connection answers admission reviews and probes itself. Every other request (/preview, the
docs, static files, unknown paths, admission requests it will not answer, such as chunked ones) it relays:
the head, re-serialised by `forwarded_head`, then the body bytes exactly as they came, go over a Unix socket
connection of their own to `HumanApi`, a stock `uvicorn.Server` serving the ASGI application, and the answer's
bytes come back unchanged. Nothing here parses an answer.

Rules:
- One request per upstream connection. The forwarded head says `connection: close`, so uvicorn ends its
  answer by closing the connection: the end of the connection is the end of the answer.
- uvicorn is used through its public API only (`Config`, `Server`, `serve`, `started`, `should_exit`,
  `handle_exit`).
- Request bytes waiting for the upstream connection, or in its transport's write buffer, are bounded by
  the Downstream: past HIGH_WATER of them `relay_backlog(True)` asks it to stop reading its client, and
  `relay_backlog(False)` says when they have drained.
- The relay sets no deadline of its own: the admission connection's deadlines end a relay with `abort()`.
"""

from __future__ import annotations

import asyncio
import enum
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any, Protocol, cast

import uvicorn

HIGH_WATER = 64 * 1024  # request bytes queued or unsent upstream before the client's reading stops
SOCKET_NAME = "human.sock"
STARTUP_SECONDS = 10.0
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"upgrade", b"te"})
FRAMING = frozenset({b"content-length", b"transfer-encoding"})
_UNSAFE = re.compile(rb"[\r\n\0]")

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


def forwarded_head(
    method: bytes, target: bytes, version: str, headers: list[tuple[bytes, bytes]], *, upgrade: bool
) -> bytes:
    """The request head as uvicorn is to read it: the request line and the headers as given, but for the
    hop-by-hop ones (HOP_BY_HOP and the names a Connection header lists), then `connection: close`.

    The framing headers (Content-Length, Transfer-Encoding) and Host are kept even when a Connection header
    lists them: the body is relayed as it came, framed by them. With `upgrade` (a request that asked for a
    protocol upgrade, whose body is never read) the framing headers are dropped too, so uvicorn answers a
    request without a body. ValueError for a version other than 1.0 or 1.1, or CR, LF or NUL in any field.
    """
    if version not in ("1.0", "1.1"):
        raise ValueError(f"HTTP version {version!r} is not relayed")
    if any(_UNSAFE.search(part) for part in (method, target, *(part for pair in headers for part in pair))):
        raise ValueError("CR, LF or NUL in a request head field")
    dropped = _dropped(headers, upgrade=upgrade)
    lines = [b"%s %s HTTP/%s\r\n" % (method, target, version.encode())]
    lines.extend(b"%s: %s\r\n" % (name, value) for name, value in headers if name.lower() not in dropped)
    lines.append(b"connection: close\r\n\r\n")
    return b"".join(lines)


def _dropped(headers: list[tuple[bytes, bytes]], *, upgrade: bool) -> frozenset[bytes]:
    """The lower-case names of the headers forwarded_head leaves out."""
    listed = {
        token.strip().lower() for name, value in headers if name.lower() == b"connection" for token in value.split(b",")
    }
    return HOP_BY_HOP | (listed - FRAMING - {b"host"}) | (FRAMING if upgrade else frozenset())


class Downstream(Protocol):
    """The admission connection whose request is relayed. The relay calls it from event loop callbacks:
    `relayed` any number of times, then `relay_ended` once; `relay_backlog` at any point before that (and
    from within `Relay.body`). Nothing after `relay_ended` or after `Relay.abort()`."""

    def relayed(self, data: bytes) -> None:
        """Answer bytes for the client, in order."""

    def relay_ended(self, answered: bool) -> None:
        """The upstream connection is gone. `answered` is False when not one answer byte came (uvicorn
        refused or closed the connection: it is stopping or stopped), and the client is to be answered 503.
        When True, the answer relayed said `connection: close`: the client's connection closes once it is
        written."""

    def relay_backlog(self, full: bool) -> None:
        """True: more than HIGH_WATER request bytes wait to go upstream; read no more of the client.
        False: they went; read again."""


class State(enum.Enum):
    CONNECTING = "connecting"  # the upstream connection is being made: request bytes queue
    OPEN = "open"  # request bytes go upstream as they come; answer bytes come back
    ENDED = "ended"  # relay_ended was called, or abort(): nothing moves either way any more


class Relay(asyncio.Protocol):
    """One relayed request. `body`, `pause`, `resume` and `abort` are the admission connection's side; the
    asyncio.Protocol methods are the upstream connection's. Made by `HumanApi.relay`."""

    def __init__(self, client: Downstream, head: bytes, path: str) -> None:
        self.state = State.CONNECTING
        self._client = client
        self._queue = [head]
        self._queued = len(head)
        self._transport: asyncio.Transport | None = None
        self._paused = False  # the client reads no answer bytes for now
        self._write_paused = False  # the upstream transport's write buffer is over its high mark
        self._backlogged = False  # what the client was last told
        self._answered = False
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_task(self._connect(loop, path))

    async def _connect(self, loop: asyncio.AbstractEventLoop, path: str) -> None:
        try:
            await loop.create_unix_connection(lambda: self, path)
        except OSError:  # no socket (stopped), or refused (stopping)
            self._end()

    # The admission connection's side.

    def body(self, data: bytes) -> None:
        """Request body bytes as they were on the wire (chunk framing included), in order. Dropped once
        the relay ended: uvicorn may answer, and close, before it has read a body."""
        if self.state is State.OPEN:
            assert self._transport is not None
            if not self._transport.is_closing():
                self._transport.write(data)
        elif self.state is State.CONNECTING:
            self._queue.append(data)
            self._queued += len(data)
            self._update_backlog()

    def pause(self) -> None:
        """The client reads no more answer bytes for now: neither does the relay from uvicorn."""
        self._paused = True
        self._apply_reading()

    def resume(self) -> None:
        self._paused = False
        self._apply_reading()

    def abort(self) -> None:
        """The client is gone: the upstream connection is closed at once (uvicorn's application sees
        http.disconnect). The Downstream is called no more."""
        self.state = State.ENDED
        self._queue, self._queued = [], 0
        self._connecting.cancel()
        if self._transport is not None:
            self._transport.abort()

    # The upstream connection's side.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)  # uvloop's is one in all but its class
        if self.state is State.ENDED:  # aborted while connecting
            stream.abort()
            return
        self.state, self._transport = State.OPEN, stream
        stream.set_write_buffer_limits(high=HIGH_WATER)
        self._apply_reading()
        stream.write(b"".join(self._queue))
        self._queue, self._queued = [], 0
        self._update_backlog()

    def data_received(self, data: bytes) -> None:
        if self.state is State.OPEN:
            self._answered = True
            self._client.relayed(data)

    def eof_received(self) -> bool | None:
        self._end()
        return None  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_backlog()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_backlog()

    def _apply_reading(self) -> None:
        if self.state is not State.OPEN:
            return  # connection_made applies it
        assert self._transport is not None
        if self._paused:
            self._transport.pause_reading()
        else:
            self._transport.resume_reading()

    def _update_backlog(self) -> None:
        full = self._write_paused or self._queued > HIGH_WATER
        if full != self._backlogged and self.state is not State.ENDED:
            self._backlogged = full
            self._client.relay_backlog(full)

    def _end(self) -> None:
        if self.state is State.ENDED:
            return
        self.state = State.ENDED
        self._queue, self._queued = [], 0
        self._client.relay_ended(self._answered)


class HumanServer(uvicorn.Server):
    """uvicorn's server, whose signals are the process's, not its own.

    While `serve()` runs in the main thread, uvicorn sets SIGINT and SIGTERM handlers to `handle_exit` and
    puts the previous ones back when it returns. Here `handle_exit` only calls `on_signal` (the process's
    drain; it runs in a signal handler, between two bytecodes of the main thread), and never uvicorn's own:
    a signal neither stops this server (`stop()` does, once the process has drained) nor is raised again
    when `serve()` returns.
    """

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_signal(sig)


class HumanApi:
    """A stock uvicorn server for the requests the admission connection relays, on a Unix socket in a
    private directory (mode 0700) made in $TMPDIR, else /tmp, and nowhere else. Start once, stop once."""

    def __init__(self, app: ASGIApp, *, on_signal: Callable[[int], None], timeout_graceful_shutdown: int = 10) -> None:
        config = uvicorn.Config(
            app,
            http="httptools",
            ws="none",
            lifespan="off",
            access_log=False,
            server_header=False,
            proxy_headers=False,
            log_config=None,
            timeout_graceful_shutdown=timeout_graceful_shutdown,
        )
        self.server = HumanServer(config, on_signal)
        self.directory: str | None = None
        self.socket_path: str | None = None
        self._serving: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Make the directory and socket and start serving. RuntimeError, naming TMPDIR, when there is
        no writable directory for the socket; RuntimeError when uvicorn ends, or has not started within
        STARTUP_SECONDS."""
        sock = self._bind()
        self._serving = asyncio.create_task(self.server.serve(sockets=[sock]))
        try:
            await self._started(self._serving)
        except BaseException:
            self._serving.cancel()
            await asyncio.gather(self._serving, return_exceptions=True)
            self._serving = None
            self._remove()
            raise

    async def stop(self) -> None:
        """Stop accepting and finish the requests in flight (uvicorn cancels those still running after
        `timeout_graceful_shutdown`), then remove the socket and its directory."""
        serving, self._serving = self._serving, None
        if serving is not None:
            self.server.should_exit = True
            await serving
        self._remove()

    def relay(self, client: Downstream, head: bytes) -> Relay:
        """Relay one request, whose head is `head` (forwarded_head's) and whose body the caller passes to
        `Relay.body`. Once stopped, each relay ends unanswered."""
        if self.socket_path is None:
            raise RuntimeError("HumanApi.relay before start")
        return Relay(client, head, self.socket_path)

    def _bind(self) -> socket.socket:
        base = os.environ.get("TMPDIR") or "/tmp"  # noqa: S108 # a private directory in it, mode 0700
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.directory = tempfile.mkdtemp(prefix="copilot-webhook-", dir=base)
            path = os.path.join(self.directory, SOCKET_NAME)
            sock.bind(path)
        except OSError as exc:
            sock.close()
            self._remove()
            raise RuntimeError(
                f"no Unix socket for the relay in TMPDIR={base}: {exc}; "
                "TMPDIR (or /tmp when unset) must be a short path to a writable directory"
            ) from exc
        self.socket_path = path
        return sock

    async def _started(self, serving: asyncio.Task[None]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_SECONDS
        while not self.server.started:
            if serving.done():
                serving.result()  # raises what ended it, if anything did
                raise RuntimeError("uvicorn's server ended before it started")
            if loop.time() > deadline:
                raise RuntimeError(f"uvicorn's server did not start within {STARTUP_SECONDS} s")
            await asyncio.sleep(0.01)

    def _remove(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
