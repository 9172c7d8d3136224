"""HTTP connections under uvicorn, with the limits an admission webhook needs.

uvicorn's httptools protocol, plus what it lacks:
- a bound on open connections (`server.maxConnections`): one over the bound is closed as soon as its TLS
  handshake completes, before it can hold a request's worth of memory;
- a time limit before the first request (`server.idleTimeoutSeconds`, as between requests): uvicorn arms
  its keep-alive timer only after a response, so a connection that never sends anything was held forever.
  It must outlast the API server's own (90 s): a POST it writes on a connection we are closing is lost
  (Go does not retry one), and it dials connections it may park unused in its idle pool;
- a deadline for the head (`server.deadlineSeconds` from its first byte, answered 408): the first byte
  stops the idle timer and the body's deadline starts after the head, so headers trickled a byte at a
  time held a connection forever. A body still arriving after its answer was sent (a page that reads
  none) meets the same deadline, then the connection is closed;
- bounds on the head (431 past MAX_HEAD_BYTES or MAX_HEADER_FIELDS): httptools takes any number of
  headers of any size, and 4 MB of tiny ones cost 97 MB of memory; trailers after a chunked body meet the
  same bounds (httptools joins a field's pieces by concatenation, and an endless one blocked the loop);
- one request at a time: the parser takes a read FEED_BYTES at a time and stops once a request is complete
  and its answer is being made, or the next one has begun behind it; what follows waits unparsed, and
  unread, until the answer is written. A connection answers at most TURN_ANSWERS requests directly per
  turn of the event loop; the rest waits for its next turn, after every other connection's.
  httptools parses all it is given, and one connection of pipelined GETs queued thousands of requests
  per read (10 MB of them took the RSS from 76 to 606 MB). A request that breaks (400, 408, 431) behind
  answers still being made is refused after them; one whose answer went already (a body nobody reads) is
  not answered twice;
- no protocol upgrades: no endpoint speaks websocket, so a request asking for one is answered as plain
  HTTP (a server may ignore Upgrade) and its connection closed after the answer, without a log line; the
  parser ends such a request at its head, so a body it declares is not read (an empty body's answer);
- draining: once the server shuts down, every answer says `Connection: close`, and a connection with no
  request in flight gets a short grace to deliver one it may already have sent, instead of the immediate
  close that made clients lose the request they had just written on an idle keep-alive connection.
- direct answers: a POST to an admission path shaped as the API server sends it (Content-Length within
  server.maxBodyBytes, JSON, no Expect or Transfer-Encoding, nothing pipelined ahead of it still being
  answered) is answered by the connection inside the read that completes its body, by `Direct` (the
  application's own code), without an ASGI cycle; its body meets the same deadline. A client that does
  not read its answers is not read from until it does, whoever wrote them (pause_writing,
  on_response_complete), and owes no request bytes meanwhile, but is cut off when it reads less than
  MIN_READ_PROGRESS of them in STALL_SECONDS; after every read the client owes the rest of a head or
  body within the deadline, or, with nothing in progress, a next request within the idle timeout (empty
  lines included); requests pipelined behind an answer that closed the connection are dropped.
- a budget for answers not read yet, all connections together (UNREAD_BUDGET): the kernel grows a socket's
  send queue to 4 MB, so a client that read none of a 1.5 MB page held all of it in our memory without ever
  pausing our writes, for as long as it kept the connection (the idle timeout); 200 of them held 280 MB.
  Past the budget, the connections whose clients went longest without reading are cut off (`Unread`).
It also writes each response's head together with its body's first bytes: uvicorn writes them apart, so
a small answer cost two TLS records and two sends where one does (a third of the CPU of a /mutate went to
those writes). It also keeps the request target as sent when it is not origin-form (`POST https://host/mutate`), so the
router can refuse it: the API server only ever sends origin-form targets.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger(__name__)

CLOSE_GRACE_SECONDS = 0.5  # how long an idle connection may still deliver a request once shutdown starts
# The API server sends a few hundred bytes of headers; a browser on /docs a few KB. nginx's default
# buffers hold 32 KB, Apache takes 100 fields.
MAX_HEAD_BYTES = 32 * 1024  # the request line and headers
MAX_HEADER_FIELDS = 100
# After a 408 or 431 the connection still reads (and drops) for this long before it closes, so a client
# still writing reads the answer rather than a reset.
LINGER_SECONDS = 0.5
_TICK = 0.1  # how often the deadlines are checked, while any is running
# A client that does not read its answers is cut off unless it read this much of them every STALL_SECONDS:
# not the idle timeout, which outlasts the API server's 90 s; unread answers are memory held.
MIN_READ_PROGRESS = 16 * 1024
STALL_SECONDS = 5.0
# The parser takes a read this much at a time, so it can stop between requests: httptools parses whatever it
# is given, and a 256 KB read of tiny pipelined requests queued thousands of them (a few KB each) at once.
FEED_BYTES = 4096
# Requests a connection has answered directly in one turn (checked between FEED_BYTES pieces: a piece
# started is parsed whole); the rest of what it sent waits for its next turn, after every other
# connection's. Each read was parsed whole, and libuv reads a socket up to 32 times a turn: a hundred
# clients pipelining reviews held the event loop for seconds per turn, and a new connection (the API
# server's) waited 36 s for its handshake.
TURN_ANSWERS = 4
# Answers written and not read yet, all connections of the process together: the transports' buffers and
# the sockets' send queues. Past it, the connections whose clients went longest without reading are cut off,
# down to UNREAD_AFTER_CUT. Admission answers are a few KB and read at once; a browser opening /docs reads 1.7 MB.
UNREAD_BUDGET = 16 * 1024 * 1024
UNREAD_AFTER_CUT = 12 * 1024 * 1024
MEASURE_STEP = 1024 * 1024  # after a measure within the budget, how much more is counted before the next
# struct tcp_info (linux/tcp.h): the u64 tcpi_bytes_acked at offset 120, since Linux 4.1.
_BYTES_ACKED = struct.Struct("=120xQ")
_TCP_INFO_SIZE = 256
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close resets, and drops what was not sent


class Direct(Protocol):
    """Requests the connection answers itself (WebhookApp: admission), within the read that completes them."""

    def body_limit(self) -> int: ...
    def body_seconds(self) -> float: ...
    def answer(self, endpoint: str, body: bytes, started: float, write: Callable[[int, bytes], None]) -> None: ...
    def finished(self, endpoint: str, result: str, started: float | None) -> None: ...


def _admission_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The body's length when the headers are an admission request's (one Content-Length, JSON, no
    Transfer-Encoding or Expect); None for anything else, which the application answers."""
    length = content_type = None
    for name, value in headers:
        if name == b"content-length":
            if length is not None:
                return None
            length = value
        elif name == b"content-type" and content_type is None:  # the first, as the application reads it
            content_type = value
        elif name in (b"transfer-encoding", b"expect"):
            return None
    if length is None or not length.isdigit():
        return None
    if content_type is None or content_type.split(b";", 1)[0].strip().lower() != b"application/json":
        return None
    return int(length)


class _Pending:
    """A direct request whose head arrived: its body so far."""

    __slots__ = ("chunks", "endpoint", "keep_alive", "started")

    def __init__(self, endpoint: str, keep_alive: bool, started: float) -> None:
        self.endpoint, self.keep_alive, self.started = endpoint, keep_alive, started
        self.chunks: list[bytes] = []


class HeadTooLarge(Exception):
    """Raised from a parser callback, to stop httptools at once."""


class Limits:
    """Shared by every connection of one server; the server flips `draining`."""

    def __init__(
        self,
        max_connections: int,
        idle_timeout: float,
        on_refused: Callable[[], None] = lambda: None,
        *,
        name: str = "server.maxConnections",
        deadline: float = 2.0,
        unread: Unread | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.name = name
        self.on_refused = on_refused
        self.idle_timeout = idle_timeout
        self.deadline = deadline  # server.deadlineSeconds: for a head, from its first byte
        self.draining = False
        self.refused = 0
        self.late = Deadlines()
        # Connections whose client reads none of the answers written to it (pause_writing), until it does.
        self.stalled = Deadlines(stalled=True)
        # Shared by the process's servers: the memory it bounds is the process's.
        self.unread = unread if unread is not None else Unread()
        self._warned: dict[str, float] = {}

    def refuse(self, open_connections: int) -> None:
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
        """One line per kind per 10 s, however hard a client pushes."""
        now = time.monotonic()
        if now - self._warned.get(kind, 0.0) > 10:
            self._warned[kind] = now
            log.warning(message, *args)

    def readiness(self) -> str | None:
        return "shutting down: draining connections" if self.draining else None


class Unread:
    """Bytes of answers the clients may not have read yet, within UNREAD_BUDGET. Counted as they are written
    (what a client leaves unread grows only as we write), and measured connection by connection only once
    the count passes the budget: the transport's buffer, the socket's send queue (SIOCOUTQ), and the bytes
    the client acknowledged (TCP_INFO). Past the budget, the first cut are the clients seen reading longest
    ago (the largest first among equals). A client is seen reading when it holds less than
    MIN_READ_PROGRESS, or has acknowledged MIN_READ_PROGRESS more (or all it held) since it was last seen
    reading: the API server reads each answer at once, yet the last one stays in our send queue until its
    next request carries the acknowledgement, and was taken for a client that reads nothing. After a
    measure within the budget the next waits for MEASURE_STEP more: clients holding just under the budget
    made every write measure every connection (about 10 µs each)."""

    def __init__(self, budget: int = UNREAD_BUDGET, after_cut: int = UNREAD_AFTER_CUT) -> None:
        self.budget, self.after_cut = budget, after_cut
        self.total = 0
        self.cut = 0
        self._next = budget  # the count past which to measure
        self._owing: dict[_LimitedProtocol, None] = {}  # connections counted since they last measured 0

    def wrote(self, conn: _LimitedProtocol, size: int) -> None:
        if not size:
            return
        if not conn._unread:
            self._owing[conn] = None
            conn._read_at = time.monotonic()  # it had read all there was
            conn._seen = None
        conn._unread += size
        self.total += size
        if self.total > self._next:
            self._measure()

    def forget(self, conn: _LimitedProtocol) -> None:
        if conn._unread:  # counted: it is owing
            del self._owing[conn]
            self.total -= conn._unread
            conn._unread = 0

    def _measure(self) -> None:
        now, total = time.monotonic(), 0
        for conn in list(self._owing):
            held, acked = conn.unread_now()
            seen = conn._seen
            if held < MIN_READ_PROGRESS or (seen is not None and acked - seen[0] >= min(MIN_READ_PROGRESS, seen[1])):
                conn._seen, conn._read_at = (acked, held), now
            elif seen is None:
                conn._seen = (acked, held)
            conn._unread = held
            total += held
            if not held:
                del self._owing[conn]
        self.total = total
        if total > self.budget:
            self._cut(now, total)
        self._next = max(self.budget, self.total + MEASURE_STEP)

    def _cut(self, now: float, total: int) -> None:
        for conn in sorted(self._owing, key=lambda c: (c._read_at, -c._unread)):
            if self.total <= self.after_cut:
                break
            self.cut += 1
            conn.limits.warn(
                "unread",
                "connection from %s cut off: %d bytes of answers unread since %.1f s, with %d MB unread in all "
                "(over %d MB); %d cut so far",
                conn.client,
                conn._unread,
                now - conn._read_at,
                total >> 20,
                self.budget >> 20,
                self.cut,
            )
            self.forget(conn)
            conn.cut_off()


class Deadlines:
    """Connections that owe bytes by a time, kept by one watchdog rather than a timer per request: a head
    that arrives whole in one read (every request the API server sends) never gets here."""

    def __init__(self, *, stalled: bool = False) -> None:
        self._stalled = stalled  # due connections are told they stalled (not reading), not that they are late
        self._due: dict[_LimitedProtocol, float] = {}
        self._armed = False

    def start(self, conn: _LimitedProtocol, seconds: float) -> None:
        self._due[conn] = time.monotonic() + seconds
        if not self._armed:
            self._armed = True
            conn.loop.call_later(_TICK, self._check, conn.loop)

    def stop(self, conn: _LimitedProtocol) -> bool:
        """Whether `conn` had a deadline running."""
        return self._due.pop(conn, None) is not None

    def __contains__(self, conn: object) -> bool:
        return conn in self._due

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        for conn in [c for c, due in self._due.items() if due <= now]:
            del self._due[conn]
            conn.stalled() if self._stalled else conn.overdue()
        if self._due:
            loop.call_later(_TICK, self._check, loop)
        else:
            self._armed = False


class _JoinedWrites:
    """A response cycle's transport that holds the response head (the first write once the response has
    started) until the next write, or the response's end, and sends them as one. Writes before the
    response (a 100 Continue) and after the first body bytes pass straight through."""

    __slots__ = ("_conn", "_cycle", "_head", "_joining", "_transport")

    def __init__(self, transport: Any, cycle: Any, conn: _LimitedProtocol) -> None:
        # Weakly: the cycle holds this as its transport, and a reference cycle would keep every request's
        # cycle (its scope, its body) alive until the collector runs, or for good once a relist freezes it.
        self._transport, self._cycle, self._conn = transport, weakref.ref(cycle), weakref.ref(conn)
        self._head: bytes | None = None
        self._joining = True

    def _write(self, data: bytes) -> None:
        conn = self._conn()
        if conn is not None:
            conn.send(data)
        else:
            self._transport.write(data)

    def write(self, data: bytes) -> None:
        cycle = self._cycle()
        if self._joining and cycle is not None and cycle.response_started:
            if self._head is None:
                self._head = data
                return
            data, self._head, self._joining = self._head + data, None, False
        self._write(data)

    def flush(self) -> None:
        if self._head is not None:
            head, self._head, self._joining = self._head, None, False
            self._write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def protocol_class(
    limits: Limits, direct: Direct | None = None, paths: Mapping[bytes, str] | None = None
) -> type[HttpToolsProtocol]:
    """The protocol for one server; `direct` answers POSTs to `paths` (the target as sent, without its
    query, to the endpoint's name) itself, when they are shaped as the API server sends them."""

    class Protocol(_LimitedProtocol):
        pass

    Protocol.limits = limits
    if direct is not None:
        Protocol.direct, Protocol.direct_paths = direct, dict(paths or {})
    return Protocol


class _LimitedProtocol(HttpToolsProtocol):
    limits: Limits
    direct: Direct | None = None
    direct_paths: Mapping[bytes, str] = {}
    _pending: _Pending | None = None  # a direct request between its head and the end of its body
    _head: int | None = None  # bytes of the head counted so far; None outside a head
    _head_reads = 0  # bytes of the reads that ended inside the head (a field still arriving is not counted yet)
    _fields = 0
    _message_done = True
    _began = False  # a message began in the read being parsed
    _closing = False  # answered 408 or 431, or a direct answer closed the connection: the rest is dropped
    _refusal: tuple[int, str] | None = None  # a 400, 408 or 431 held until the answers ahead of it are written
    _unparsed = b""  # bytes read behind a request whose answer is being made: parsed once it is written
    _trailer: int | None = None  # bytes since a chunk's size line with no data after it: trailers (or the end)
    _quiet = True  # the piece being parsed reached no chunk, body or trailer callback
    _answered_early = False  # the request whose body is arriving was answered already (a page that reads none)
    _running: Any = None  # the ASGI cycle started last (self.cycle may be one queued behind it)
    _acked = 0  # bytes the client had acknowledged when its reading was last checked (stalled)
    _turn = 0  # requests answered directly since this connection's turn began (TURN_ANSWERS)
    _unread = 0  # bytes of answers written since the client was last measured to have read them all (Unread)
    _read_at = 0.0  # when the client was last seen reading (Unread)
    _seen: tuple[int, int] | None = None  # bytes acknowledged and held when last seen reading; None: not measured

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.limits.refuse(len(self.connections))
            transport.close()
            return
        # Until the first request arrives, the keep-alive timer is the time-to-first-request limit. uvicorn's
        # own setting is whole seconds, and the metrics port's server had none: every timer here uses ours.
        self.timeout_keep_alive = self.limits.idle_timeout  # type: ignore[assignment]  # call_later takes a float
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self.limits.late.stop(self)
        self.limits.stalled.stop(self)
        self.limits.unread.forget(self)
        if self._pending is not None and self.direct is not None:
            self.direct.finished(self._pending.endpoint, "client_gone", None)
            self._pending = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, but for the head's bounds and deadline, without upgrades, and one request at a time: bytes
        behind a complete request wait, unparsed and unread, until its answer is written (as Go's server
        does), instead of each becoming a queued request (a client that pipelined requests and read no
        answers grew the process by hundreds of MB a second)."""
        if self._closing:
            return
        if self._unparsed or self._held():
            self._unparsed += data  # reading is paused: at most the read that was under way
            self.flow.pause_reading()
            return
        self._unset_keepalive_if_required()
        self._turn = 0
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        if len(data) <= FEED_BYTES:
            if self._parse(data):
                self._start_deadlines()
            return
        view = memoryview(data)
        for start in range(0, len(data), FEED_BYTES):
            held = start and self._held()
            if held or (start and self._turn >= TURN_ANSWERS):
                self._unparsed = bytes(view[start:])
                self.flow.pause_reading()
                if not held:
                    self.loop.call_soon(self._resume)  # its next turn: after every other connection's
                return  # no deadline runs while the connection waits on us
            if not self._parse(view[start : start + FEED_BYTES]):
                return
        self._start_deadlines()

    def _parse(self, data: bytes | memoryview) -> bool:
        """Feed the parser; False when the connection reads no more (refused, closing, upgraded)."""
        self._began, self._quiet = False, True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            return False  # the request is served as plain HTTP and its connection closed (on_headers_complete)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, HeadTooLarge):
                self._refuse(431, str(exc.__context__))
            else:
                self._refuse(400, "Invalid HTTP request received.")
            return False
        if self._closing:
            return False
        if self._trailer is not None and self._quiet:  # a piece all inside trailers (or a field of them)
            # httptools joins a field's pieces by concatenation (quadratic in the field's size) and calls
            # on_header only once it ends: bounded here, as a head's fields are, or one endless trailer
            # held megabytes and blocked every connection for seconds.
            self._trailer += len(data)
            if self._trailer > MAX_HEAD_BYTES:
                self._refuse(431, f"request trailers over {MAX_HEAD_BYTES} bytes")
                return False
        if self._head is not None:  # the piece ended inside a head: it is slow, or large, or both
            # A head that began in this piece counts what its callbacks saw (earlier requests in the piece
            # are not its bytes); every later piece is all head.
            self._head_reads += self._head if self._began else len(data)
            if self._head_reads > MAX_HEAD_BYTES:
                self._refuse(431, f"request headers over {MAX_HEAD_BYTES} bytes")
                return False
        return True

    def _held(self) -> bool:
        """Whether parsing waits: answers the client has not read, or an answer still being made. Only the
        body of the request being answered is still parsed (the application reads it); a piece that ended
        inside the next request's head, or a queued request's body, holds the rest like a complete request
        does (a piece almost always ends inside one: tiny pipelined GETs queued thousands of requests per
        connection, and fifty connections took the server to 900 MB)."""
        if self.flow.write_paused:
            return True
        if not self._answering():
            return False
        return self._message_done or self._head is not None or self.cycle is not self._running

    def _resume(self) -> None:
        """The connection stopped waiting on us: parse what was read meanwhile, then read again."""
        if self._closing or self.transport.is_closing() or self._held():
            return
        if self._unparsed:
            data, self._unparsed = self._unparsed, b""
            self._unset_keepalive_if_required()
            self._turn = 0
            self._feed(data)  # starts the deadlines, or holds the rest again
        else:
            self._start_deadlines()
        if not self._unparsed and not self._held() and not self._closing:
            self.flow.resume_reading()

    def _answering(self) -> bool:
        """Whether an ASGI answer is still being made (a request behind it waits its turn)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _waiting(self) -> bool:
        """Whether the connection waits on us, not on the client: an answer still being made (a request
        pipelined behind it is not late), or answers the client has not read (reading is paused)."""
        return self._answering() or self.flow.write_paused

    def _head_of(self, status: int, fields: bytes) -> list[bytes]:
        """The head of an answer the connection writes itself: the status line, uvicorn's default headers
        (the date), then `fields` (each ending in CRLF)."""
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        head.append(fields)
        return head

    def _start_deadlines(self) -> None:
        """What the client owes now, and by when, after a read or once it reads its answers again: the rest
        of a head or a body within server.deadlineSeconds, or, with no request in progress, a next request
        within the idle timeout (the drain's grace once the server drains)."""
        if self._waiting() or self.transport.is_closing():
            return
        if self._head is not None:
            if self not in self.limits.late:
                self.limits.late.start(self, self.limits.deadline)
        elif self._pending is not None and self.direct is not None:
            if self not in self.limits.late:
                self.limits.late.start(self, self.direct.body_seconds())
        elif not self._message_done:  # a body nobody reads: the answer went before it (a 413, GET with a body)
            if self not in self.limits.late:
                self.limits.late.start(self, self.limits.deadline)
        else:
            self._unset_keepalive_if_required()
            seconds = CLOSE_GRACE_SECONDS if self.limits.draining else self.timeout_keep_alive
            self.timeout_keep_alive_task = self.loop.call_later(seconds, self.timeout_keep_alive_handler)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # An idle timer armed as the last request's unread body ended, in the read this one began in.
        self._unset_keepalive_if_required()
        self._head = self._head_reads = self._fields = 0
        self._message_done = self._answered_early = False
        self._trailer = None
        self._began = True

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._fields += 1
        if self._fields > MAX_HEADER_FIELDS:
            raise HeadTooLarge(f"request headers over {MAX_HEADER_FIELDS} fields")
        if self._head is None:  # a trailer, after a chunked body: counted with the head's fields, not a head
            self._quiet = False
            self._trailer = (self._trailer or 0) + len(name) + len(value) + 4
            if self._trailer > MAX_HEAD_BYTES:
                raise HeadTooLarge(f"request trailers over {MAX_HEAD_BYTES} bytes")
            return
        self._count(len(name) + len(value) + 4)

    def _count(self, size: int) -> None:
        self._head = (self._head or 0) + size
        if self._head > MAX_HEAD_BYTES:
            raise HeadTooLarge(f"request headers over {MAX_HEAD_BYTES} bytes")

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def _should_upgrade(self) -> bool:
        return False  # whatever websocket library is installed: no endpoint speaks websocket

    def on_headers_complete(self) -> None:
        self._head = None
        self.limits.late.stop(self)
        if self._closing:
            return  # pipelined behind an answer that closed the connection: never answered, never counted
        if self.direct is not None and self._take_directly():
            return
        super().on_headers_complete()
        if self.cycle is not None:
            joined = _JoinedWrites(self.transport, self.cycle, self)
            self.cycle.transport = cast(asyncio.Transport, joined)  # duck-typed: what the cycle calls
            done = self.cycle.on_response

            def on_response() -> None:
                joined.flush()  # a head never followed by a write (an answer to HEAD): sent as the answer ends
                done()

            self.cycle.on_response = on_response
        if not self.url.startswith(b"/"):
            # Absolute-form or asterisk-form: keep the target as sent, so no route matches it.
            self.scope["raw_path"] = self.url
        if self.cycle is not None and (self.limits.draining or self.parser.should_upgrade()):
            # After an Upgrade request httptools stops parsing the connection: it ends with this answer.
            self.cycle.keep_alive = False

    def _take_directly(self) -> bool:
        """Whether this request is one the connection answers itself (Direct), and if so start it."""
        url = self.url
        endpoint = self.direct_paths.get(url.split(b"?", 1)[0] if b"?" in url else url)
        if endpoint is None or self.parser.get_method() != b"POST" or self.parser.should_upgrade():
            return False
        if self._answering():
            return False  # pipelined behind a request still being answered: it waits its turn (uvicorn)
        length = _admission_length(self.headers)
        if length is None or length > self.direct.body_limit():  # type: ignore[union-attr]
            return False
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        self._pending = _Pending(endpoint, keep_alive, time.perf_counter())
        return True

    def on_chunk_header(self) -> None:
        self._trailer, self._quiet = 0, False  # data follows, or (after the last chunk) trailers

    def on_body(self, body: bytes) -> None:
        self._trailer, self._quiet = None, False
        if self._pending is not None:
            self._pending.chunks.append(body)
        elif not self._closing:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._trailer, self._quiet, self._answered_early = None, False, False
        if self._closing:
            return
        pending = self._pending
        if pending is not None and self.direct is not None:
            self._pending = None
            self._message_done = True
            self.limits.late.stop(self)
            chunks = pending.chunks
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            self._turn += 1
            self.direct.answer(pending.endpoint, body, pending.started, self._direct_writer(pending))
            return
        super().on_message_complete()
        self._message_done = True
        if self.limits.late.stop(self) and self.cycle is not None and self.cycle.response_complete:
            # The rest of a body nobody read: the connection is idle again (each read stopped the idle timer).
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _direct_writer(self, pending: _Pending) -> Callable[[int, bytes], None]:
        def write(status: int, body: bytes) -> None:
            keep_alive = pending.keep_alive and not self.limits.draining
            head = self._head_of(status, b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
            if not keep_alive:
                head.append(b"connection: close\r\n")
            head += (b"\r\n", body)
            self.send(b"".join(head))
            self.server_state.total_requests += 1
            if not keep_alive:
                self._closing = True
                self.transport.close()
                return
            if self.flow.write_paused:
                # Answers back up (pause_writing says so once, as they cross the mark): read no more requests.
                self.flow.pause_reading()

        return write

    def pause_writing(self) -> None:
        """The client reads its answers slower than it sends requests: read no more of them until it catches
        up (a direct answer is written at once, so pipelined requests would pile up answers unbounded)."""
        super().pause_writing()
        self.flow.pause_reading()
        # A client we do not read from owes no request bytes (their deadlines start again once we read); it
        # owes reading its answers, MIN_READ_PROGRESS of them every STALL_SECONDS (stalled).
        self.limits.late.stop(self)
        self._unset_keepalive_if_required()
        self._acked = self._bytes_acked()
        self.limits.stalled.start(self, STALL_SECONDS)

    def resume_writing(self) -> None:
        super().resume_writing()
        self.limits.stalled.stop(self)
        # Also while an answer is being made: its request's body may be what waits unparsed, and the
        # application reading it asks for no more (it resumed reading before the client stopped reading).
        self._resume()

    def stalled(self) -> None:
        """STALL_SECONDS since reading paused, or since the last check: a client still reading (a large
        preview over a slow link) gets another; one that read less than MIN_READ_PROGRESS is cut off (a
        close would wait for the answers to be read, which is what it does not do)."""
        acked = self._bytes_acked()
        if acked - self._acked >= MIN_READ_PROGRESS:
            self._acked = acked
            self.limits.stalled.start(self, STALL_SECONDS)
            return
        self.limits.warn("stalled", "connection from %s cut off: its answers were not read", self.client)
        self.cut_off()

    def send(self, data: bytes) -> None:
        """Write answer bytes, counted until the client has read them (Unread)."""
        self.transport.write(data)
        if not self.transport.is_closing():
            self.limits.unread.wrote(self, len(data))

    def cut_off(self) -> None:
        """Close at once, with a reset: a close would wait for the answers to be read, which is what the client
        does not do, and the kernel kept an aborted socket's unsent answers (and its memory) for minutes."""
        self._closing = True
        sock = self.transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        self.transport.abort()

    def unread_now(self) -> tuple[int, int]:
        """Bytes of answers waiting in the transport and the socket's send queue (sent, not acknowledged, or
        not sent yet), and the bytes the client has acknowledged so far."""
        held = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError, ValueError):
            held += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        return held, self._bytes_acked(sock)

    def _bytes_acked(self, sock: Any = None) -> int:
        """Bytes of answers the client's end has acknowledged (Linux's TCP_INFO tcpi_bytes_acked; 0 where it
        cannot say). Once its receive buffer is full it acknowledges only what it reads. Neither the
        transport's buffer nor the socket's send queue measure that: the kernel refills its queue from the
        buffers above it in bursts, so both rise and fall while a client reads steadily. `sock`: the
        transport's, when the caller has it already."""
        if sock is None:
            sock = self.transport.get_extra_info("socket")
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
        except (OSError, AttributeError, ValueError):
            return 0
        return int(_BYTES_ACKED.unpack_from(info)[0]) if len(info) >= _BYTES_ACKED.size else 0

    def on_response_complete(self) -> None:
        super().on_response_complete()  # resumes reading, and arms the idle timer when nothing is pipelined
        if self.transport.is_closing():
            return
        if self._refusal is not None:  # the answers ahead of it are written: now the refusal, then the close
            if not self._answering():
                self._unset_keepalive_if_required()
                self._answer_refusal(*self._refusal)
            return
        early = not self._message_done and self.cycle.response_complete
        if early:
            # Answered before the body was read (a page that takes none, a 413), or a head pipelined behind
            # the answer: a body that breaks later gets no second answer, whenever it is parsed.
            self._answered_early = self._head is None
        if self.flow.write_paused or self._unparsed:
            # The answers written so far are not read yet (resume_writing), or requests wait unparsed: read
            # nothing more until they are, or before those are parsed.
            self.flow.pause_reading()
            self._unset_keepalive_if_required()
            if not self._held():  # the body of the request now running waits unparsed: parse it
                self.loop.call_soon(self._resume)  # not inside the application's send()
            return
        if early:
            self.limits.late.start(self, self.limits.deadline)  # the rest must come in time

    def overdue(self) -> None:
        if self.transport.is_closing():
            return
        if self._head is not None:
            self._refuse(
                408, f"request headers not received within server.deadlineSeconds ({self.limits.deadline:g} s)"
            )
        elif self._pending is not None and self.direct is not None:
            pending, self._pending = self._pending, None
            seconds = self.direct.body_seconds()
            self._refuse(408, f"body not received within server.deadlineSeconds ({seconds:g} s)")
            self.direct.finished(pending.endpoint, "timeout", pending.started)
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` and close, unless an answer to an earlier (pipelined) request is under way."""
        self.limits.warn(str(status), "%d from %s: %s (one line per 10 s)", status, self.client, message)
        self.limits.late.stop(self)
        self._closing = True
        if self._answered_early:  # the request that broke has its answer: a second one would answer nothing
            self.transport.close()
            return
        if self._answering():
            in_body = self._head is None and not self._message_done  # it broke in self.cycle's body
            if in_body and self.pipeline and self.pipeline[0][0] is self.cycle:
                # The request that broke is queued behind answers still being made: it never starts, and its
                # refusal follows those answers.
                self.pipeline.popleft()
                self.cycle = self.pipeline[0][0] if self.pipeline else self._running
                self._refusal = (status, message)
            elif in_body and self.cycle.more_body:
                self.transport.close()  # the request being answered is the one that broke: no answer is right
            else:  # a later request, in its head: after the answers to those before it
                self._refusal = (status, message)
            return
        self._answer_refusal(status, message)

    def _answer_refusal(self, status: int, message: str) -> None:
        self._refusal = None
        body = orjson.dumps({"error": message})
        fields = b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
        self.send(b"".join(self._head_of(status, fields)) + body)
        self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def shutdown(self) -> None:
        if self._pending is not None:
            self._pending.keep_alive = False  # its body is on the way: answered, then the connection closes
        elif self._head is not None:
            pass  # a head on the way: answered (with Connection: close) if it arrives within its deadline
        elif not self._answering():
            # Idle: a request may be on the wire already. Serve it (with Connection: close) if it comes soon.
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(CLOSE_GRACE_SECONDS, self.timeout_keep_alive_handler)
        else:
            self.cycle.keep_alive = False
