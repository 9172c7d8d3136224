"""The admission protocol: HTTP/1.1 as the API server speaks it to a webhook, owned here, over httptools.

One connection is in one of five states (State), and `_to` is the only place it changes:

    IDLE ──first byte──▶ HEAD ──head complete──▶ BODY ──body complete, answered──▶ IDLE
      ▲                   │                        │
      │                   │                        └─ (keep-alive off, draining) ──▶ CLOSING
      │                   └──── a route of the human API ──▶ RELAY ──its answer ends──▶ CLOSING
      └── timers: IDLE the idle timeout, HEAD and BODY server.deadlineSeconds; a refusal (400, 408, 413,
          431) answers, then CLOSING reads and drops for LINGER_SECONDS and closes.

What the connection answers itself (the Site decides at each head): admission POSTs, the probes and
/metrics, and refusals of their wrong shapes. Everything else (the preview, the docs, unknown paths) is
relayed to the human API, stock uvicorn behind a private socket (relay.py), one request per upstream
connection: its answer closes the client's connection.

Rules and bounds:
- a head within MAX_HEAD_BYTES and MAX_HEADER_FIELDS (431), trailers within the same; it is due within
  server.deadlineSeconds of its first byte (408); an admission body within its deadline (408) and
  server.maxBodyBytes (413);
- a first request and each next one within server.idleTimeoutSeconds (then a silent close; empty lines
  restart it); it must outlast the API server's 90 s, which reuses idle connections without a retry;
- one request at a time: a read is parsed FEED_BYTES at a time and stops between pieces while the client
  does not read its answers (writes paused) or after TURN_ANSWERS answers in one turn of the event loop;
  what follows waits unparsed and unread. A piece started is parsed whole: at most FEED_BYTES of requests;
- a connection whose client does not read owes no request bytes; it must read its answers (reading.py:
  the stall cut, and the process's unread budget);
- no protocol upgrades: a request asking for one is answered as plain HTTP, its declared body unread, and
  the connection closed after it;
- drain: once the process drains, every answer says Connection: close; once it stops, an idle connection
  gets CLOSE_GRACE_SECONDS to deliver a request already on the wire;
- each answer is one write: its head and body in one TLS record.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import http
import socket
import struct
import time
from collections.abc import Callable, Sequence
from email.utils import formatdate
from typing import Any, NamedTuple, Protocol

import httptools
import orjson

from webhook.web.limits import Limits
from webhook.web.reading import STALL_SECONDS, Stalls, Unread
from webhook.web.relay import HumanApi, Relay, forwarded_head

CLOSE_GRACE_SECONDS = 0.5  # how long an idle connection may still deliver a request once the process stops
# The API server sends a few hundred bytes of headers; a browser on /docs a few KB. nginx's default
# buffers hold 32 KB, Apache takes 100 fields.
MAX_HEAD_BYTES = 32 * 1024
MAX_HEADER_FIELDS = 100
LINGER_SECONDS = 0.5  # after a refusal, reading and dropping goes on this long, so the client reads the answer
FEED_BYTES = 4096  # the parser takes a read this much at a time, so it can stop between requests
TURN_ANSWERS = 4  # answers a connection makes in one turn of the event loop, before every other connection's
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close resets, and drops what was not sent
_JSON = "application/json"
_STATUS = {status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in http.HTTPStatus}

Headers = Sequence[tuple[bytes, bytes]]  # names lower-cased, in the order sent


class State(enum.Enum):
    IDLE = "idle"  # between requests: the client owes a next one within the idle timeout
    HEAD = "head"  # a head is arriving: due within the deadline from its first byte
    BODY = "body"  # a request of ours whose body is arriving: read (admission) or dropped
    RELAY = "relay"  # a request of the human API: its body goes there, its answer comes back
    CLOSING = "closing"  # the last answer is written: what arrives is dropped until the close


class Answered(Protocol):
    """An answer the connection writes itself (webhook.web.server.Answer)."""

    status: int
    body: bytes
    content_type: str
    headers: tuple[tuple[bytes, bytes], ...]
    result: str


class When(enum.Enum):
    NOW = "now"  # answered at its head; a body that follows is dropped under the deadline
    AFTER_BODY = "after-body"  # answered once its body is in (dropped), so a body that breaks gets a 400
    # instead; for GET and HEAD, whose bodies mean nothing, at the head
    READ = "read"  # an admission POST: its body is read, then the Site answers it
    RELAY = "relay"  # the human API's


class Verdict(NamedTuple):
    """What a Site makes of a request's head."""

    when: When
    endpoint: str = "unknown"  # the metrics' label of the request
    answer: Answered | None = None  # NOW and AFTER_BODY
    close: bool = False  # NOW: the connection closes after the answer (a body too large to read)
    limit: int = 0  # READ: the body's bound
    seconds: float = 0.0  # READ: the body's deadline


RELAYED = Verdict(When.RELAY)


class Site(Protocol):
    """What one listener serves (webhook.web.server: WebhookApp, MetricsApp)."""

    def at_head(self, method: str, target: bytes, headers: Headers) -> Verdict: ...
    def answer(self, endpoint: str, body: bytes, started: float, write: Callable[[int, bytes], None]) -> None: ...
    def finished(self, endpoint: str, result: str, started: float | None) -> None: ...


class Listener:
    """The connections of one listening socket and what they share."""

    def __init__(
        self, site: Site, limits: Limits, *, unread: Unread, stalls: Stalls, human: HumanApi | None = None
    ) -> None:
        self.site, self.limits, self.unread, self.stalls, self.human = site, limits, unread, stalls, human
        self.connections: set[Connection] = set()
        self._date = (0, b"")

    def __call__(self) -> Connection:
        return Connection(self)

    def date(self) -> bytes:
        """The Date header's line, made once a second."""
        now = int(time.time())
        if now != self._date[0]:
            self._date = (now, b"date: %s\r\n" % formatdate(now, usegmt=True).encode())
        return self._date[1]

    def stop(self) -> None:
        """The process stops: idle connections get a short grace, the others finish their request."""
        self.limits.draining = self.limits.stopping = True
        for conn in list(self.connections):
            conn.stopping()

    def abort(self) -> None:
        for conn in list(self.connections):
            conn.transport.abort()


class Refusal(Exception):
    """Raised from a parser callback, to stop httptools at once and answer `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _Request:
    """The request whose head has arrived."""

    __slots__ = (
        "answer",
        "answered",
        "chunked",
        "chunks",
        "followed",
        "head_only",
        "keep_alive",
        "refusal",
        "relay",
        "size",
        "started",
        "verdict",
        "whole",
    )

    def __init__(self, verdict: Verdict, keep_alive: bool, started: float, method: str, headers: Headers) -> None:
        self.verdict, self.keep_alive, self.started = verdict, keep_alive, started
        self.answered = False  # its answer is written (NOW), or the human API began one
        self.chunks: list[bytes] = []
        self.size = 0
        self.chunked = any(name == b"transfer-encoding" for name, _ in headers)
        self.relay: Relay | None = None  # the human API's, until its answer ends
        self.whole = False  # a relayed request's body is all forwarded (or broke): what follows waits
        self.followed = False  # another request began behind it in the same piece: parsed, so dropped
        self.head_only = method == "HEAD"  # its answer has no body
        self.answer: _RelayedAnswer | None = None
        self.refusal: tuple[int, str] | None = (
            None  # a relayed request whose body broke: answered if the human API does not
        )


class Connection(asyncio.Protocol):
    """One client connection (see the module's docstring)."""

    transport: Any

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.limits = listener.limits
        self.state = State.IDLE
        self.client = "?"
        self.parser = httptools.HttpRequestParser(self)
        self._request: _Request | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head: int | None = None  # bytes of the head counted by the callbacks; None outside a head
        self._head_reads = 0  # bytes of the pieces that ended inside the head
        self._fields = 0
        self._trailer: int | None = None  # bytes since a chunk's size line with no data after it: trailers
        self._quiet = True  # the piece being parsed reached no chunk, body or trailer callback
        self._began = False  # a head began in the piece being parsed
        self._unparsed = b""  # read, not parsed: waits while the connection holds
        self._paused = False  # the client does not read its answers (our writes are paused)
        self._backlog = False  # the human API reads the request's body slower than it arrives
        self._turn = 0  # answers made since this connection's turn began

    # --- the transitions -------------------------------------------------------------------------------

    def _to(self, state: State) -> None:
        """The one place the state changes; a new state's timer starts once the read is parsed (_arm)."""
        self.state = state
        if not self._paused:  # the stall cut's timer runs across states
            self.limits.timers.stop(self)

    def _arm(self) -> None:
        """Start what the client owes now (nothing while it waits on us or on its reading), or the linger that
        ends a refused connection."""
        if self._paused or self.transport.is_closing():
            return
        timers, limits = self.limits.timers, self.limits
        request = self._request
        if self._lingering():
            timers.start(self, LINGER_SECONDS, restart=False)
            return
        if self._unparsed:
            return
        if self.state is State.IDLE:
            timers.start(self, CLOSE_GRACE_SECONDS if limits.stopping else limits.idle_timeout)
        elif self.state is State.HEAD:
            timers.start(self, limits.deadline, restart=False)
        elif self.state is State.BODY:
            seconds = request.verdict.seconds if request and request.verdict.when is When.READ else limits.deadline
            timers.start(self, seconds, restart=False)

    def _lingering(self) -> bool:
        """Refused: closing, or a relayed request whose body broke, waiting for the human API's answer."""
        request = self._request
        if self.state is State.RELAY and request is not None:
            return request.refusal is not None and not request.answered
        return self.state is State.CLOSING

    def expired(self) -> None:
        """A timer ran out (limits.Timers)."""
        if self.transport.is_closing():
            return
        if self._paused:
            if self.listener.stalls.check(self):
                self.limits.timers.start(self, STALL_SECONDS)
        elif self.state is State.HEAD:
            self._refuse(
                408, f"request headers not received within server.deadlineSeconds ({self.limits.deadline:g} s)"
            )
        elif self.state is State.RELAY:
            self._relay_refused()
        elif self.state is State.BODY and self._request is not None and not self._request.answered:
            request, verdict = self._request, self._request.verdict
            seconds = verdict.seconds if verdict.when is When.READ else self.limits.deadline
            self._refuse(408, f"body not received within server.deadlineSeconds ({seconds:g} s)")
            self.listener.site.finished(verdict.endpoint, "timeout", request.started)
        else:  # idle, lingering, or a body nobody reads
            self.transport.close()

    def _relay_refused(self) -> None:
        """A relayed request's body broke and the human API began no answer in time: the refusal is its answer."""
        request = self._request
        if request is None or request.refusal is None or request.answered or request.relay is None:
            return  # its answer is on the way: it ends the connection
        self._request = None
        request.relay.abort()
        self._answer_refusal(*request.refusal)

    # --- asyncio.Protocol ------------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"
        connections = self.listener.connections
        connections.add(self)
        if len(connections) > self.limits.max_connections:
            self.limits.refuse(len(connections))
            self._to(State.CLOSING)
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.listener.connections.discard(self)
        self.limits.timers.stop(self)
        self.listener.unread.forget(self)
        self.listener.stalls.resumed(self)
        request, self._request = self._request, None
        if request is not None and request.relay is not None:
            request.relay.abort()
        elif request is not None and request.verdict.when is When.READ and self.state is State.BODY:
            self.listener.site.finished(request.verdict.endpoint, "client_gone", None)
        self._to(State.CLOSING)

    def data_received(self, data: bytes) -> None:
        if self._dropping():
            return
        if self._unparsed or self._holding():
            self._unparsed += data  # reading is paused: at most the read under way
            self.transport.pause_reading()
            return
        self._turn = 0
        self._feed(data)

    def eof_received(self) -> bool | None:
        return None  # the client is done: close

    def pause_writing(self) -> None:
        """The client reads its answers slower than it asks: read nothing more until it catches up."""
        self._paused = True
        self.transport.pause_reading()
        self.limits.timers.stop(self)
        self.listener.stalls.paused(self)
        self.limits.timers.start(self, STALL_SECONDS)
        if self._request is not None and self._request.relay is not None:
            self._request.relay.pause()

    def resume_writing(self) -> None:
        self._paused = False
        self.limits.timers.stop(self)
        self.listener.stalls.resumed(self)
        if self._request is not None and self._request.relay is not None:
            self._request.relay.resume()
        self._resume()
        self._arm()  # what was owed before the pause: a linger (the rest _resume starts)

    # --- reading ---------------------------------------------------------------------------------------

    def _dropping(self) -> bool:
        """Whether what the client sends now is dropped: after the last answer."""
        return self.state is State.CLOSING

    def _relayed_whole(self) -> bool:
        """A relayed request is all forwarded: what follows waits for its answer."""
        return self.state is State.RELAY and self._request is not None and self._request.whole

    def _holding(self) -> bool:
        return self._paused or self._backlog or self._relayed_whole()

    def _feed(self, data: bytes) -> None:
        if len(data) <= FEED_BYTES:
            if self._parse(data) and not self._dropping():
                self._arm()
            return
        view = memoryview(data)
        for start in range(0, len(data), FEED_BYTES):
            if start and (self._holding() or self._turn >= TURN_ANSWERS):
                self._unparsed = bytes(view[start:])
                self.transport.pause_reading()
                if not self._holding():
                    asyncio.get_running_loop().call_soon(self._resume)  # after every other connection's turn
                return
            if not self._parse(view[start : start + FEED_BYTES]):
                return
            if self._dropping():
                return
        self._arm()

    def _resume(self) -> None:
        """The connection stopped waiting: parse what was read meanwhile, then read again."""
        if self._holding() or self.transport.is_closing():
            return
        data, self._unparsed = self._unparsed, b""
        if data and not self._dropping():
            self._turn = 0
            self._feed(data)
        else:
            self._arm()
        if not self._unparsed and not self._holding() and not self.transport.is_closing():
            self.transport.resume_reading()

    def _parse(self, data: bytes | memoryview) -> bool:
        """Feed the parser; False when the connection reads no more of this read."""
        self._began, self._quiet = False, True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            return False  # answered as plain HTTP, then closed (on_headers_complete)
        except httptools.HttpParserError as exc:
            refusal = exc.__context__
            if isinstance(refusal, Refusal):
                self._refuse(refusal.status, refusal.message)
            else:
                self._refuse(400, "Invalid HTTP request received.")
            return False
        if self._trailer is not None and self._quiet:
            # A piece all inside trailers: httptools joins a field's pieces and calls on_header once it ends.
            self._trailer += len(data)
            if self._trailer > MAX_HEAD_BYTES:
                self._refuse(431, f"request trailers over {MAX_HEAD_BYTES} bytes")
                return False
        if self._head is not None:  # the piece ended inside a head: count all of it that was head
            self._head_reads += self._head if self._began else len(data)
            if self._head_reads > MAX_HEAD_BYTES:
                self._refuse(431, f"request headers over {MAX_HEAD_BYTES} bytes")
                return False
        return True

    # --- httptools' callbacks --------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._relayed_whole():
            self._request.followed = True  # type: ignore[union-attr]  # dropped: its bytes are parsed already
        if self._dropping() or self._relayed_whole():
            return
        self._to(State.HEAD)
        self._url, self._headers = b"", []
        self._head, self._head_reads, self._fields, self._trailer = 0, 0, 0, None
        self._began = True

    def on_url(self, url: bytes) -> None:
        if self.state is State.HEAD:
            self._url += url
            self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._dropping() or self._relayed_whole():
            return
        self._fields += 1
        if self._fields > MAX_HEADER_FIELDS:
            raise Refusal(431, f"request headers over {MAX_HEADER_FIELDS} fields")
        if self._head is None:  # a trailer, after a chunked body
            self._quiet = False
            self._trailer = (self._trailer or 0) + len(name) + len(value) + 4
            if self._trailer > MAX_HEAD_BYTES:
                raise Refusal(431, f"request trailers over {MAX_HEAD_BYTES} bytes")
            return
        self._count(len(name) + len(value) + 4)
        self._headers.append((name.lower(), value))

    def _count(self, size: int) -> None:
        self._head = (self._head or 0) + size
        if self._head > MAX_HEAD_BYTES:
            raise Refusal(431, f"request headers over {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        if self._dropping() or self._relayed_whole():
            return
        self._head = None
        parser = self.parser
        method = parser.get_method().decode("latin-1")
        upgrade = parser.should_upgrade()
        keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive() and not upgrade
        verdict = self.listener.site.at_head(method, self._url, self._headers)
        if verdict.when is When.AFTER_BODY and method in ("GET", "HEAD"):
            verdict = verdict._replace(when=When.NOW)  # a GET's body means nothing: answered at its head
        request = self._request = _Request(verdict, keep_alive, time.perf_counter(), method, self._headers)
        if verdict.when is When.RELAY:
            self._relay(request, method, upgrade)
            return
        self._to(State.BODY)
        if verdict.when is When.NOW:
            self._reply(request, verdict.answer, head_only=request.head_only, close=verdict.close)  # type: ignore[arg-type]
        elif verdict.when is When.READ and _expects_continue(self._headers):
            self._send(b"HTTP/1.1 100 Continue\r\n\r\n")
        if upgrade:
            self.on_message_complete()  # httptools reads no further: the declared body is never read

    def _relay(self, request: _Request, method: str, upgrade: bool) -> None:
        human = self.listener.human
        if human is None:  # a Site without a human API never relays
            raise RuntimeError("no human API to relay to")
        try:
            head = forwarded_head(
                method.encode(), self._url, self.parser.get_http_version(), self._headers, upgrade=upgrade
            )
        except ValueError:
            raise Refusal(400, "Invalid HTTP request received.") from None
        self._to(State.RELAY)
        request.relay = human.relay(self, head)
        request.whole = upgrade  # an upgrade's body is never read: what follows waits

    def on_body(self, body: bytes) -> None:
        self._trailer, self._quiet = None, False
        request = self._request
        if request is None or self._dropping() or self._relayed_whole():
            return
        if request.relay is not None:  # re-framed: httptools hands over a chunked body's data without its sizes
            request.relay.body(b"%x\r\n%s\r\n" % (len(body), body) if request.chunked else bytes(body))
            return
        if request.verdict.when is not When.READ or request.answered:
            return  # dropped: the answer does not read it
        request.size += len(body)
        if request.size > request.verdict.limit:
            raise Refusal(413, f"body is over server.maxBodyBytes ({request.verdict.limit})")
        request.chunks.append(bytes(body))

    def on_chunk_header(self) -> None:
        self._trailer, self._quiet = 0, False  # data follows, or (after the last chunk) trailers

    def on_message_complete(self) -> None:
        self._trailer, self._quiet = None, False
        request = self._request
        if request is None or self._dropping() or self._relayed_whole():
            return
        if request.relay is not None:
            if request.chunked:
                request.relay.body(b"0\r\n\r\n")
            request.whole = True  # what follows waits for its answer
            return
        self._request = None
        verdict = request.verdict
        if verdict.when is When.READ:
            chunks = request.chunks
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            self._turn += 1
            self.listener.site.answer(verdict.endpoint, body, request.started, self._writer(request))
        elif verdict.when is When.AFTER_BODY:
            self._reply(request, verdict.answer)  # type: ignore[arg-type]
        if self.state is State.BODY:
            self._to(State.IDLE)

    # --- answering -------------------------------------------------------------------------------------

    def _writer(self, request: _Request) -> Callable[[int, bytes], None]:
        def write(status: int, body: bytes) -> None:
            keep_alive = request.keep_alive and not self.limits.draining
            fields = b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
            self._send(
                b"".join(
                    (
                        _STATUS[status],
                        self.listener.date(),
                        fields,
                        b"" if keep_alive else b"connection: close\r\n",
                        b"\r\n",
                        body,
                    )
                )
            )
            if not keep_alive:
                self._close()

        return write

    def _reply(self, request: _Request, answer: Answered, *, head_only: bool = False, close: bool = False) -> None:
        """Write `answer` to `request` and count it."""
        request.answered = True
        keep_alive = request.keep_alive and not close and not self.limits.draining
        parts = [_STATUS[answer.status], self.listener.date()]
        parts.append(b"content-type: %s\r\ncontent-length: %d\r\n" % (answer.content_type.encode(), len(answer.body)))
        parts += (b"%s: %s\r\n" % field for field in answer.headers)
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        if not head_only:
            parts.append(answer.body)
        self._turn += 1
        self._send(b"".join(parts))
        self.listener.site.finished(request.verdict.endpoint, answer.result, request.started)
        if close:
            self._linger()
        elif not keep_alive:
            self._close()

    def _send(self, data: bytes) -> None:
        """Write answer bytes, counted until the client has read them (reading.Unread)."""
        self.transport.write(data)
        if not self.transport.is_closing():
            self.listener.unread.wrote(self, len(data))

    def _close(self) -> None:
        self._to(State.CLOSING)
        self.transport.close()

    def _linger(self) -> None:
        """Read and drop for LINGER_SECONDS, so a client still writing reads the answer, then close."""
        self._to(State.CLOSING)
        self.limits.timers.start(self, LINGER_SECONDS)

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` and close; a request already answered, or relayed, gets no second answer."""
        self.limits.warn(str(status), "%d from %s: %s (one line per 10 s)", status, self.client, message)
        request = self._request
        if request is not None and request.relay is not None:
            # The human API has its head, and may have answered it already (a page that reads no body): it
            # gets LINGER_SECONDS to begin an answer, else the refusal is the answer (expired).
            request.whole, request.keep_alive, request.refusal = True, False, (status, message)
            self.limits.timers.start(self, LINGER_SECONDS)
            return
        self._request = None
        if request is not None and request.answered:
            self._close()
            return
        self._answer_refusal(status, message)

    def _answer_refusal(self, status: int, message: str) -> None:
        body = orjson.dumps({"error": message})
        fields = b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
        self._send(b"".join((_STATUS[status], self.listener.date(), fields, body)))
        self._linger()

    def cut_off(self, kind: str, message: str, *args: object) -> None:
        """Close at once, with a reset: a close would wait for the client to read, which it does not do."""
        self.limits.warn(kind, message, *args)
        self._to(State.CLOSING)
        sock = self.transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        self.transport.abort()

    def stopping(self) -> None:
        """The process stops: an idle connection gets a short grace for a request already on the wire."""
        if self.state is State.IDLE and not self._paused and not self._unparsed:
            self.limits.timers.start(self, CLOSE_GRACE_SECONDS)

    # --- relay.Downstream ------------------------------------------------------------------------------

    def relayed(self, data: bytes) -> None:
        request = self._request
        if request is None:
            return
        request.answered = True
        if request.answer is None:
            request.answer = _RelayedAnswer(request.head_only)
        # The connection stays open after the answer only for a request whole before it, with nothing
        # parsed behind it, whose client keeps its connection.
        keep = request.whole and not request.followed and request.keep_alive and not self.limits.draining
        self._send(request.answer.feed(data, keep))

    def relay_ended(self, answered: bool) -> None:
        request, self._request = self._request, None
        if self.transport.is_closing():
            return
        if not answered:
            body = b'{"error":"the server is shutting down; retry"}'
            fields = (
                b"content-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
            )
            self._send(b"".join((_STATUS[503], self.listener.date(), fields % len(body), body)))
        if request is not None and request.answer is not None and request.answer.kept():
            self._to(State.IDLE)
            self._resume()
        elif request is not None and not request.whole:
            self._linger()  # its body is still arriving: read the rest before the close
        else:
            self._close()

    def relay_backlog(self, full: bool) -> None:
        self._backlog = full
        if full:
            self.transport.pause_reading()
        else:
            self._resume()


class _RelayedAnswer:
    """A relayed answer on its way to the client. The human API closes every answer (one request per upstream
    connection); its head is held until whole, and when the connection can stay open its `connection: close`
    is taken out. Then the connection stays open only if the answer ended as its head framed it."""

    MAX_HEAD = 64 * 1024  # past this without a head's end, the answer passes as it is and the connection closes

    def __init__(self, head_only: bool) -> None:
        self._head_only = head_only
        self._pending = b""  # the head so far
        self._headed = False
        self._keep = False
        self._left: int | None = None  # body bytes still due by Content-Length
        self._chunked = False
        self._tail = b""  # the last bytes of a chunked body

    def feed(self, data: bytes, keep: bool) -> bytes:
        """What to send of `data` now."""
        if self._headed:
            self._track(data)
            return data
        pending = self._pending + data
        out = b""
        while True:
            end = pending.find(b"\r\n\r\n")
            if end < 0:
                if len(pending) > self.MAX_HEAD:
                    self._headed, self._pending = True, b""
                    return out + pending
                self._pending = pending
                return out
            head, pending = pending[: end + 4], pending[end + 4 :]
            if head[9:10] == b"1":  # an interim answer (100 Continue): the final one follows
                out += head
                continue
            self._headed, self._pending = True, b""
            out += self._final_head(head, keep)
            self._track(pending)
            return out + pending

    def _final_head(self, head: bytes, keep: bool) -> bytes:
        lines = head.split(b"\r\n")
        self._left, self._chunked = _framing(lines[1:])
        if self._head_only or lines[0][9:12] in (b"204", b"304"):
            self._left, self._chunked = 0, False
        self._keep = keep and (self._left is not None or self._chunked)
        if not self._keep:
            return head
        return b"\r\n".join(line for line in lines if line.lower().replace(b" ", b"") != b"connection:close")

    def _track(self, data: bytes) -> None:
        if self._left is not None:
            self._left -= len(data)
        elif self._chunked:
            self._tail = (self._tail + data)[-5:]

    def kept(self) -> bool:
        """Whether the connection stays open: the answer's head said so and its body ended as framed."""
        if not self._keep or not self._headed:
            return False
        if self._chunked:
            return self._tail == b"0\r\n\r\n"
        return self._left == 0


def _framing(fields: list[bytes]) -> tuple[int | None, bool]:
    """An answer's Content-Length (None without one) and whether it is chunked, from its header lines."""
    length, chunked = None, False
    for line in fields:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip()
        if name == b"content-length" and value.isdigit():
            length = int(value)
        elif name == b"transfer-encoding" and value.lower().endswith(b"chunked"):
            chunked = True
    return length, chunked


def _expects_continue(headers: Headers) -> bool:
    return any(name == b"expect" and value.lower() == b"100-continue" for name, value in headers)
