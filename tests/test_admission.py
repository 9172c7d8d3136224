"""The admission connection (webhook/web/admission.py) driven in-process: a fake transport stands for the
socket, a fake human API for the relay, and a timer running out is `expired()` called by the test. Every state
(idle, head, body, relay, closing) and every bound is held to the bytes the client would read and to whether
its connection stays open, without a socket and without sleeping."""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple, ParamSpec, cast

import orjson
import pytest

from tests.helpers import pod, review
from webhook.config import build_settings
from webhook.web import reading
from webhook.web.admission import (
    CLOSE_GRACE_SECONDS,
    FEED_BYTES,
    LINGER_SECONDS,
    MAX_HEAD_BYTES,
    MAX_HEADER_FIELDS,
    TURN_ANSWERS,
    Connection,
    Listener,
    Site,
    State,
)
from webhook.web.limits import Limits, Timed, Timers
from webhook.web.metrics import Metrics
from webhook.web.reading import MEASURE_STEP, MIN_READ_PROGRESS, STALL_SECONDS, UNREAD_BUDGET, Stalls, Unread
from webhook.web.server import MetricsApp, WebhookApp

P = ParamSpec("P")
PEER = ("10.0.0.1", 5555)
POD = pod("flyte-1.15-bare.yaml")
MAX_BODY = 64 * 1024
DEADLINE = 2.0
IDLE = 60.0
BAD_REQUEST = b'{"error":"Invalid HTTP request received."}'


def in_loop(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """Run an async test in a fresh event loop (Timers and the turn's call_soon need a running one)."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


async def next_turn() -> None:
    """Let the callbacks scheduled with call_soon run: the next turn of the event loop."""
    await asyncio.sleep(0)


# --- fakes ---------------------------------------------------------------------------------------------------


class FakeTransport:
    """What the connection sees of its socket. `held` is what the client has not read of the answers (all of
    them, unless `reads` says it reads at once)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False
        self.reading = True
        self.reads = False
        self.read = 0

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        if self.reads:
            self.read += len(data)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_write_buffer_size(self) -> int:
        return sum(map(len, self.writes)) - self.read

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": PEER, "socket": None}.get(name, default)

    @property
    def data(self) -> bytes:
        return b"".join(self.writes)


class RecordingTimers(Timers):
    """limits.Timers that also records each start: (connection, seconds, restart)."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[tuple[Timed, float, bool]] = []

    def start(self, conn: Timed, seconds: float, *, restart: bool = True) -> None:
        self.started.append((conn, seconds, restart))
        super().start(conn, seconds, restart=restart)

    def of(self, conn: Timed) -> list[float]:
        return [seconds for started, seconds, _ in self.started if started is conn]


class FakeRelay:
    """relay.Relay as the connection uses it: what it was given, and whether it was told to stop."""

    def __init__(self, client: Connection, head: bytes) -> None:
        self.client, self.head = client, head
        self.body_parts: list[bytes] = []
        self.paused = False
        self.aborted = False

    def body(self, data: bytes) -> None:
        self.body_parts.append(bytes(data))

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def abort(self) -> None:
        self.aborted = True

    @property
    def forwarded(self) -> bytes:
        return b"".join(self.body_parts)


class FakeHuman:
    """relay.HumanApi: every request it is given becomes a FakeRelay the test answers."""

    def __init__(self) -> None:
        self.relays: list[FakeRelay] = []

    def relay(self, client: Connection, head: bytes) -> FakeRelay:
        relay = FakeRelay(client, head)
        self.relays.append(relay)
        return relay


class Rig:
    """One listener, as serve.py makes it, with its site, limits, timers and fake human API."""

    def __init__(self, site: Site | None = None, *, max_connections: int = 64, unread: Unread | None = None) -> None:
        settings = build_settings(
            {"server": {"deadlineSeconds": DEADLINE, "maxBodyBytes": MAX_BODY, "idleTimeoutSeconds": IDLE}}
        )
        self.app = WebhookApp(settings)
        self.site: Site = site or self.app
        self.limits = Limits(
            max_connections, IDLE, deadline=DEADLINE, on_refused=self.app.metrics.connections_refused.inc
        )
        self.timers = self.limits.timers = RecordingTimers()
        self.human = FakeHuman()
        self.listener = Listener(
            self.site, self.limits, unread=unread or Unread(), stalls=Stalls(), human=cast(Any, self.human)
        )

    def connect(self) -> tuple[Connection, FakeTransport]:
        conn, transport = self.listener(), FakeTransport()
        conn.connection_made(transport)
        return conn, transport

    def counted(self, path: str, result: str) -> float:
        value = self.app.metrics.registry.get_sample_value(
            "copilot_webhook_requests_total", {"path": path, "result": result}
        )
        return value or 0.0


# --- requests and answers ------------------------------------------------------------------------------------


class Reply(NamedTuple):
    status: int
    headers: dict[bytes, bytes]
    body: bytes


def replies(data: bytes) -> list[Reply]:
    """The answers in `data`, framed by their Content-Length."""
    out = []
    while data:
        end = data.index(b"\r\n\r\n") + 4
        head, data = data[:end], data[end:]
        lines = head[:-4].split(b"\r\n")
        fields = (line.partition(b":") for line in lines[1:])
        headers = {name.strip().lower(): value.strip() for name, _, value in fields}
        size = int(headers.get(b"content-length", b"0"))
        out.append(Reply(int(lines[0].split()[1]), headers, data[:size]))
        data = data[size:]
    return out


def undated(data: bytes) -> bytes:
    return re.sub(rb"date: [^\r]*\r\n", b"", data)


def review_body(uid: str = "u-1") -> bytes:
    return orjson.dumps(review(POD, uid=uid))


def post(body: bytes, path: str = "/mutate", extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    head = b"POST %s?timeout=10s HTTP/%s\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
    return head % (path.encode(), version, len(body), extra) + body


def chunked(path: str = "/mutate", extra: bytes = b"") -> bytes:
    head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n%s\r\n"
    return head % (path.encode(), extra)


def chunks(body: bytes, size: int) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


def get(path: str, extra: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nhost: x\r\n%s\r\n" % (path.encode(), extra)


def state(conn: Connection) -> State:
    """The connection's state, read anew (a call may have changed it since the last look)."""
    return conn.state


def uid_of(reply: Reply) -> str:
    uid: str = orjson.loads(reply.body)["response"]["uid"]
    return uid


def assert_refused(transport: FakeTransport, conn: Connection, status: int, error: bytes = b"") -> None:
    """The last answer is `status`, closing; the connection lingers (reads and drops), then closes."""
    last = replies(transport.data)[-1]
    assert last.status == status
    assert last.headers[b"connection"] == b"close"
    assert error in last.body
    assert conn.state is State.CLOSING
    assert not transport.closed
    assert conn in conn.limits.timers
    conn.expired()  # LINGER_SECONDS later
    assert transport.closed


# --- pipelining and partial requests -------------------------------------------------------------------------


@in_loop
async def test_pipelined_admission_requests_are_answered_in_order_one_write_each() -> None:
    """Requests sent together are answered in the order sent, each answer (head and body) in one write."""
    rig = Rig()
    conn, transport = rig.connect()
    uids = [f"u-{n}" for n in range(2)]
    conn.data_received(b"".join(post(review_body(uid)) for uid in uids) + get("/healthz"))
    assert len(transport.writes) == 3
    answers = [replies(write) for write in transport.writes]
    assert all(len(answer) == 1 for answer in answers)
    assert [uid_of(answer[0]) for answer in answers[:2]] == uids
    assert answers[2][0].body == b'{"status":"ok"}'
    assert conn.state is State.IDLE
    assert not transport.closed


def _answered_in_first_turn(requests: list[bytes]) -> int:
    """How many requests end within the pieces parsed before TURN_ANSWERS answers stop the turn."""
    ends, offset = [], 0
    for request in requests:
        offset += len(request)
        ends.append(offset)
    parsed = FEED_BYTES
    while sum(end <= parsed for end in ends) < TURN_ANSWERS:
        parsed += FEED_BYTES
    return sum(end <= parsed for end in ends)


@in_loop
async def test_a_long_pipelined_read_answers_a_turns_worth_then_the_rest_on_the_next_turns() -> None:
    """A read of many requests is answered TURN_ANSWERS (and what ends in the same piece) per turn of the
    event loop; the rest waits unparsed, reading paused, and is answered on the next turns, in order."""
    rig = Rig()
    conn, transport = rig.connect()
    requests = [post(review_body(f"u-{n}")) for n in range(12)]
    conn.data_received(b"".join(requests))
    first = _answered_in_first_turn(requests)
    assert TURN_ANSWERS <= first < len(requests)
    assert len(replies(transport.data)) == first
    assert not transport.reading
    for _ in range(len(requests)):
        await next_turn()
    answers = replies(transport.data)
    assert [uid_of(answer) for answer in answers] == [f"u-{n}" for n in range(12)]
    assert len(transport.writes) == len(requests)
    assert transport.reading
    assert conn.state is State.IDLE


@in_loop
async def test_a_request_trickled_byte_by_byte_is_answered_once_whole() -> None:
    """A head arriving a byte at a time is a head (under its deadline) until whole, then its body is read a
    byte at a time; the request is answered once, when its last byte arrives."""
    rig = Rig()
    conn, transport = rig.connect()
    body = review_body()
    request = post(body)
    head_end = len(request) - len(body)
    for i in range(head_end):
        conn.data_received(request[i : i + 1])
        assert conn.state is (State.HEAD if i < head_end - 1 else State.BODY), i
    assert DEADLINE in rig.timers.of(conn)
    for i in range(head_end, len(request) - 1):
        conn.data_received(request[i : i + 1])
    assert conn.state is State.BODY
    assert conn in rig.limits.timers
    assert transport.writes == []
    conn.data_received(request[-1:])
    assert [uid_of(answer) for answer in replies(transport.data)] == ["u-1"]
    assert state(conn) is State.IDLE
    assert rig.timers.of(conn)[-1] == IDLE


@in_loop
async def test_an_admission_body_in_pieces_is_answered_once_whole() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    request = post(review_body())
    cut = len(request) // 3
    conn.data_received(request[:cut])
    conn.data_received(request[cut : 2 * cut])
    assert transport.writes == []
    conn.data_received(request[2 * cut :])
    assert [uid_of(answer) for answer in replies(transport.data)] == ["u-1"]


@in_loop
async def test_a_chunked_admission_body_is_answered_like_the_content_length_one() -> None:
    """The same review, sent chunked in pieces, gets the same answer byte for byte."""
    rig = Rig()
    body = review_body()
    conn, plain = rig.connect()
    conn.data_received(post(body))
    conn, framed = rig.connect()
    request = chunked() + chunks(body, 100)
    for start in range(0, len(request), 333):
        conn.data_received(request[start : start + 333])
    assert undated(framed.data) == undated(plain.data)
    assert replies(framed.data)[0].status == 200
    assert conn.state is State.IDLE


@in_loop
async def test_expect_100_continue_gets_the_interim_answer_before_the_answer() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    body = review_body()
    request = post(body, extra=b"expect: 100-continue\r\n")
    conn.data_received(request[: -len(body)])
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    conn.data_received(body)
    assert [reply.status for reply in replies(transport.data)] == [100, 200]


@in_loop
async def test_http_1_0_requests_are_answered_then_closed() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(post(review_body(), version=b"1.0"))
    assert replies(transport.data)[0].headers[b"connection"] == b"close"
    assert transport.closed
    assert conn.state is State.CLOSING


# --- the head's bounds ---------------------------------------------------------------------------------------

BIG = MAX_HEAD_BYTES + 1024


def _huge_header() -> bytes:
    return get("/healthz", b"x-big: %s\r\n" % (b"a" * BIG))


def _many_headers() -> bytes:
    return get("/healthz", b"".join(b"x-h%d: %s\r\n" % (n, b"a" * 400) for n in range(90)))


def _huge_target() -> bytes:
    return get("/healthz?" + "q" * BIG)


HUGE_HEADS = {"one huge header": _huge_header, "many small headers": _many_headers, "a huge target": _huge_target}


@pytest.mark.parametrize("make", HUGE_HEADS.values(), ids=HUGE_HEADS.keys())
@pytest.mark.parametrize("read", [1024, 1 << 20], ids=["in 1 KB reads", "in one read"])
@in_loop
async def test_a_head_over_max_head_bytes_is_refused_431(make: Callable[[], bytes], read: int) -> None:
    rig = Rig()
    conn, transport = rig.connect()
    request = make()
    for start in range(0, len(request), read):
        conn.data_received(request[start : start + read])
    assert len(replies(transport.data)) == 1
    assert_refused(transport, conn, 431, b"request headers over")


@in_loop
async def test_a_head_of_exactly_max_header_fields_is_answered() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(get("/healthz", b"".join(b"x-%d: 1\r\n" % n for n in range(MAX_HEADER_FIELDS - 1))))
    assert replies(transport.data)[0].status == 200


@in_loop
async def test_more_than_max_header_fields_is_refused_431() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(get("/healthz", b"".join(b"x-%d: 1\r\n" % n for n in range(MAX_HEADER_FIELDS + 1))))
    assert_refused(transport, conn, 431, b"fields")


def _one_huge_trailer() -> bytes:
    return b"x-t: %s\r\n\r\n" % (b"a" * BIG)


def _many_small_trailers() -> bytes:
    return b"".join(b"x-t%d: %s\r\n" % (n, b"a" * 400) for n in range(90)) + b"\r\n"


TRAILERS = {"one huge trailer": _one_huge_trailer, "many small trailers": _many_small_trailers}


@pytest.mark.parametrize("make", TRAILERS.values(), ids=TRAILERS.keys())
@pytest.mark.parametrize("read", [1024, 1 << 20], ids=["in 1 KB reads", "in one read"])
@in_loop
async def test_trailers_over_max_head_bytes_are_refused_431(make: Callable[[], bytes], read: int) -> None:
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(chunked() + b"2\r\n{}\r\n0\r\n")
    trailers = make()
    for start in range(0, len(trailers), read):
        conn.data_received(trailers[start : start + read])
    assert [reply.status for reply in replies(transport.data)] == [431]
    assert_refused(transport, conn, 431, b"trailers")


# --- timers --------------------------------------------------------------------------------------------------


@in_loop
async def test_a_head_not_whole_by_the_deadline_gets_408() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(b"POST /mutate HTTP/1.1\r\nhost: x\r\n")
    assert conn.state is State.HEAD
    assert rig.timers.of(conn)[-1] == DEADLINE
    conn.expired()
    assert_refused(transport, conn, 408, b"request headers not received")


@in_loop
async def test_a_body_not_whole_by_its_deadline_gets_408_counted_as_a_timeout() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(post(review_body())[:-10])
    assert conn.state is State.BODY
    assert rig.timers.of(conn)[-1] == DEADLINE
    conn.expired()
    assert rig.counted("/mutate", "timeout") == 1
    assert_refused(transport, conn, 408, b"body not received")


@in_loop
async def test_a_client_gone_inside_an_admission_body_is_counted() -> None:
    rig = Rig()
    conn, _ = rig.connect()
    conn.data_received(post(review_body())[:-10])
    conn.connection_lost(None)
    assert rig.counted("/mutate", "client_gone") == 1
    assert conn not in rig.listener.connections
    assert conn not in rig.limits.timers


@in_loop
async def test_an_idle_connection_closes_silently_at_the_idle_timeout() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    assert conn.state is State.IDLE
    assert rig.timers.of(conn) == [IDLE]
    conn.expired()
    assert transport.closed
    assert transport.writes == []


@in_loop
async def test_empty_lines_between_requests_keep_the_connection_idle_and_restart_its_timeout() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(b"\r\n\r\n")
    assert conn.state is State.IDLE
    assert rig.timers.started[-1] == (conn, IDLE, True)
    assert len(rig.timers.of(conn)) == 2
    conn.data_received(get("/healthz"))
    assert replies(transport.data)[0].status == 200


# --- the body's bounds ---------------------------------------------------------------------------------------


@in_loop
async def test_a_declared_length_over_max_body_bytes_is_refused_413_at_the_head() -> None:
    """Refused as the head arrives, before any of the body; what follows is read and dropped until the close."""
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(post(b"x" * (MAX_BODY + 1))[: -(MAX_BODY + 1)])
    assert_refused(transport, conn, 413, b"over server.maxBodyBytes")
    assert rig.timers.of(conn)[-1] == LINGER_SECONDS


@in_loop
async def test_a_chunked_body_over_max_body_bytes_is_refused_413() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(chunked())
    piece = b"a" * 8192
    for _ in range(MAX_BODY // len(piece)):
        conn.data_received(b"%x\r\n%s\r\n" % (len(piece), piece))
    assert transport.writes == []
    conn.data_received(b"1\r\na\r\n")
    assert_refused(transport, conn, 413, b"over server.maxBodyBytes")
    conn.data_received(b"0\r\n\r\n")  # dropped while lingering
    assert len(replies(transport.data)) == 1


# --- a client that does not read -----------------------------------------------------------------------------


@in_loop
async def test_a_client_that_does_not_read_its_answers_is_not_read_from() -> None:
    """Writes paused: reading stops, requests that still arrive wait unparsed, and the stall timer runs."""
    rig = Rig()
    conn, transport = rig.connect()
    conn.pause_writing()
    assert not transport.reading
    assert rig.timers.of(conn)[-1] == STALL_SECONDS
    conn.data_received(post(review_body()))
    assert transport.writes == []
    assert conn.state is State.IDLE
    assert not transport.reading


@in_loop
async def test_a_client_that_reads_nothing_while_paused_is_cut_off() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(post(review_body()))
    conn.pause_writing()
    conn.data_received(post(review_body("u-2")))
    conn.expired()  # STALL_SECONDS later, nothing more acknowledged
    assert transport.aborted
    assert conn.state is State.CLOSING
    assert len(replies(transport.data)) == 1


@in_loop
async def test_a_paused_client_that_reads_enough_keeps_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig()
    conn, transport = rig.connect()
    acked = iter([0, MIN_READ_PROGRESS, MIN_READ_PROGRESS + 1])
    monkeypatch.setattr(reading, "bytes_acked", lambda transport: next(acked))
    conn.pause_writing()
    conn.expired()  # read MIN_READ_PROGRESS since the pause: checked again later
    assert not transport.is_closing()
    assert rig.timers.of(conn)[-1] == STALL_SECONDS
    conn.expired()  # one byte more since: cut off
    assert transport.aborted


@in_loop
async def test_requests_held_while_paused_are_answered_once_the_client_reads() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    conn.pause_writing()
    conn.data_received(post(review_body("u-1")))
    conn.data_received(post(review_body("u-2")))
    conn.resume_writing()
    assert [uid_of(answer) for answer in replies(transport.data)] == ["u-1", "u-2"]
    assert transport.reading
    assert conn.state is State.IDLE
    assert rig.timers.of(conn)[-1] == IDLE


# --- drain and stop ------------------------------------------------------------------------------------------


@in_loop
async def test_while_draining_every_answer_closes_the_connection() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    rig.limits.draining = True
    conn.data_received(post(review_body()))
    answer = replies(transport.data)[0]
    assert (answer.status, answer.headers[b"connection"]) == (200, b"close")
    assert transport.closed


@in_loop
async def test_while_draining_a_probe_answer_closes_the_connection() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    rig.limits.draining = True
    conn.data_received(get("/healthz"))
    assert replies(transport.data)[0].headers[b"connection"] == b"close"
    assert transport.closed


@in_loop
async def test_stop_gives_an_idle_connection_a_short_grace_and_a_head_its_deadline() -> None:
    rig = Rig()
    idle, idle_transport = rig.connect()
    inside, inside_transport = rig.connect()
    inside.data_received(b"GET /healthz HTTP/1.1\r\n")
    rig.listener.stop()
    assert rig.timers.of(idle) == [IDLE, CLOSE_GRACE_SECONDS]
    assert rig.timers.of(inside) == [IDLE, DEADLINE]
    assert inside in rig.limits.timers
    inside.data_received(b"host: x\r\n\r\n")
    assert replies(inside_transport.data)[0].headers[b"connection"] == b"close"
    assert inside_transport.closed
    idle.expired()
    assert idle_transport.closed
    assert idle_transport.writes == []


# --- a client that reads again ------------------------------------------------------------------------------


@in_loop
async def test_a_lingering_connection_still_closes_after_its_client_reads_again() -> None:
    """After a refusal the connection reads and drops for LINGER_SECONDS, then closes; a pause of its writes
    on the way (the client reading late) does not take the close away."""
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(b"NOT HTTP\r\n\r\n")
    conn.pause_writing()
    conn.resume_writing()
    assert conn in rig.limits.timers
    conn.expired()
    assert transport.closed


@in_loop
async def test_a_broken_relayed_body_is_still_refused_after_its_client_reads_again() -> None:
    """A relayed body that broke is refused once the human API has had LINGER_SECONDS to begin an answer,
    whether or not the client's reading paused meanwhile."""
    rig = Rig()
    conn, transport, relay = _relayed(rig, chunked("/nowhere") + b"2\r\n{}\r\nzz\r\n")
    conn.pause_writing()
    conn.resume_writing()
    assert conn in rig.limits.timers
    conn.expired()
    assert relay.aborted
    assert replies(transport.data)[0].status == 400


# --- garbage and upgrades ------------------------------------------------------------------------------------


@in_loop
async def test_bytes_that_are_not_http_get_400_and_close() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
    assert replies(transport.data)[0].body == BAD_REQUEST
    assert_refused(transport, conn, 400)


@in_loop
async def test_garbage_after_a_good_request_gets_the_good_answer_then_400() -> None:
    rig = Rig()
    conn, transport = rig.connect()
    conn.data_received(post(review_body()) + b"NOT HTTP AT ALL\r\n\r\n")
    first, second = replies(transport.data)
    assert uid_of(first) == "u-1"
    assert second.body == BAD_REQUEST
    assert_refused(transport, conn, 400)


@in_loop
async def test_an_upgrade_request_is_answered_as_plain_http_and_closed() -> None:
    """A request asking for a protocol upgrade is answered as HTTP, its declared body unread, then closed."""
    rig = Rig()
    conn, transport = rig.connect()
    upgrade = b"upgrade: websocket\r\nconnection: Upgrade\r\ncontent-length: 5\r\n"
    conn.data_received(get("/healthz", upgrade) + b"hello" + get("/healthz"))
    (answer,) = replies(transport.data)
    assert (answer.status, answer.headers[b"connection"]) == (200, b"close")
    assert transport.closed
    assert rig.counted("/healthz", "ok") == 1


# --- the relay -----------------------------------------------------------------------------------------------

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"


def _relayed(rig: Rig, request: bytes) -> tuple[Connection, FakeTransport, FakeRelay]:
    conn, transport = rig.connect()
    conn.data_received(request)
    assert conn.state is State.RELAY
    return conn, transport, rig.human.relays[-1]


@pytest.mark.pure  # the human API is a fake: no preview is rendered
@in_loop
async def test_unknown_paths_and_the_preview_are_relayed_without_hop_by_hop_headers() -> None:
    rig = Rig()
    hops = b"connection: keep-alive, x-hop\r\nkeep-alive: timeout=5\r\nx-hop: 1\r\nx-kept: 2\r\n"
    _, _, relay = _relayed(rig, get("/nowhere", hops))
    assert relay.head == b"GET /nowhere HTTP/1.1\r\nhost: x\r\nx-kept: 2\r\nconnection: close\r\n\r\n"
    _, _, preview = _relayed(rig, get("/preview"))
    assert preview.head.startswith(b"GET /preview HTTP/1.1\r\n")


@in_loop
async def test_a_relayed_answer_to_a_whole_request_keeps_a_keep_alive_connection_open() -> None:
    """uvicorn closes every answer; for a keep-alive client with a whole request the connection takes the
    `connection: close` out of its head, and returns to idle once the answer ended as framed."""
    rig = Rig()
    conn, transport, relay = _relayed(rig, get("/nowhere"))
    relay.client.relayed(ANSWER[:20])
    relay.client.relayed(ANSWER[20:])
    assert transport.data == ANSWER.replace(b"connection: close\r\n", b"")
    relay.client.relay_ended(True)
    assert conn.state is State.IDLE
    assert not transport.closed
    assert rig.timers.of(conn)[-1] == IDLE
    conn.data_received(get("/healthz"))
    assert replies(transport.data)[-1].body == b'{"status":"ok"}'


@in_loop
async def test_bytes_arriving_during_a_relay_are_parsed_after_its_answer() -> None:
    rig = Rig()
    conn, transport, relay = _relayed(rig, get("/nowhere"))
    conn.data_received(get("/healthz"))
    assert not transport.reading
    assert len(rig.human.relays) == 1
    relay.client.relayed(ANSWER)
    relay.client.relay_ended(True)
    assert [reply.status for reply in replies(transport.data)] == [200, 200]
    assert replies(transport.data)[-1].body == b'{"status":"ok"}'
    assert transport.reading
    assert conn.state is State.IDLE


@in_loop
async def test_a_request_pipelined_behind_a_relayed_one_closes_the_connection_after_its_answer() -> None:
    """The request behind was parsed (and dropped) with the relayed one: the answer keeps its close."""
    rig = Rig()
    _, transport, relay = _relayed(rig, get("/nowhere") + get("/healthz"))
    relay.client.relayed(ANSWER)
    relay.client.relay_ended(True)
    assert transport.data == ANSWER
    assert transport.closed
    assert len(rig.human.relays) == 1


@in_loop
async def test_while_draining_a_relayed_answer_keeps_its_close() -> None:
    rig = Rig()
    _, transport, relay = _relayed(rig, get("/nowhere"))
    rig.limits.draining = True
    relay.client.relayed(ANSWER)
    relay.client.relay_ended(True)
    assert transport.data == ANSWER
    assert transport.closed


@in_loop
async def test_a_relay_ended_unanswered_gets_503_and_closes() -> None:
    rig = Rig()
    _, transport, relay = _relayed(rig, get("/nowhere"))
    relay.client.relay_ended(False)
    answer = replies(transport.data)[0]
    assert (answer.status, answer.headers[b"retry-after"], answer.headers[b"connection"]) == (503, b"1", b"close")
    assert transport.closed


@in_loop
async def test_a_chunked_relayed_body_is_reframed_and_ends_with_the_last_chunk() -> None:
    rig = Rig()
    body = b"hello, relay" * 50
    request = chunked("/nowhere") + chunks(body, 100)
    conn, _, relay = _relayed(rig, request[:300])
    for start in range(300, len(request), 77):
        conn.data_received(request[start : start + 77])
    assert relay.forwarded.endswith(b"0\r\n\r\n")
    assert _dechunk(relay.forwarded) == body
    assert b"transfer-encoding: chunked\r\n" in relay.head


def _dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if not size:
            return out
        out, data = out + data[:size], data[size + 2 :]


@in_loop
async def test_a_relayed_content_length_body_is_forwarded_as_it_came() -> None:
    rig = Rig()
    body = b"x" * 10_000
    request = post(body, "/nowhere")
    conn, _, relay = _relayed(rig, request[:2000])
    conn.data_received(request[2000:])
    assert relay.forwarded == body


BROKEN_BODIES = {
    "a bad chunk size": (b"zz\r\n", 400),
    "trailers over the bound": (b"0\r\n" + _one_huge_trailer(), 431),
}


@pytest.mark.parametrize(("tail", "status"), BROKEN_BODIES.values(), ids=BROKEN_BODIES.keys())
@in_loop
async def test_a_relayed_body_that_breaks_with_no_answer_begun_gets_the_refusal(tail: bytes, status: int) -> None:
    """The human API gets LINGER_SECONDS to begin an answer; with none, the relay is aborted and the refusal
    is the client's answer."""
    rig = Rig()
    conn, transport, relay = _relayed(rig, chunked("/nowhere") + b"2\r\n{}\r\n")
    conn.data_received(tail)
    assert transport.writes == []
    assert rig.timers.of(conn)[-1] == LINGER_SECONDS
    conn.expired()
    assert relay.aborted
    assert_refused(transport, conn, status)


@in_loop
async def test_a_relayed_body_that_breaks_after_the_answer_began_gets_no_second_answer() -> None:
    rig = Rig()
    conn, transport, relay = _relayed(rig, chunked("/nowhere") + b"2\r\n{}\r\n")
    relay.client.relayed(ANSWER)
    conn.data_received(b"zz\r\n")
    conn.expired()
    assert not relay.aborted
    relay.client.relay_ended(True)
    assert transport.data == ANSWER
    assert transport.closed


@in_loop
async def test_an_answer_before_the_relayed_body_is_whole_keeps_its_close_and_the_rest_is_read() -> None:
    rig = Rig()
    conn, transport, relay = _relayed(rig, post(b"x" * 100, "/nowhere")[:-50])
    relay.client.relayed(ANSWER)
    relay.client.relay_ended(True)
    assert transport.data == ANSWER
    assert conn.state is State.CLOSING
    assert rig.timers.of(conn)[-1] == LINGER_SECONDS
    assert not transport.closed


@in_loop
async def test_a_relay_backlog_pauses_reading_until_it_drains() -> None:
    rig = Rig()
    request = post(b"x" * 100, "/nowhere")
    conn, transport, relay = _relayed(rig, request[:-60])
    relay.client.relay_backlog(True)
    assert not transport.reading
    conn.data_received(request[-60:-30])
    assert relay.forwarded == b"x" * 40
    relay.client.relay_backlog(False)
    assert relay.forwarded == b"x" * 70
    assert transport.reading
    conn.data_received(request[-30:])
    assert relay.forwarded == b"x" * 100


@in_loop
async def test_a_client_that_does_not_read_pauses_the_relay_and_a_lost_client_aborts_it() -> None:
    rig = Rig()
    conn, _, relay = _relayed(rig, get("/nowhere"))
    conn.pause_writing()
    assert relay.paused
    conn.resume_writing()
    assert not relay.paused
    conn.connection_lost(None)
    assert relay.aborted


# --- connection limit ----------------------------------------------------------------------------------------


@in_loop
async def test_connections_over_max_connections_are_closed_at_once_and_counted() -> None:
    rig = Rig(max_connections=2)
    opened = [rig.connect() for _ in range(3)]
    assert [transport.closed for _, transport in opened] == [False, False, True]
    assert opened[2][0].state is State.CLOSING
    assert rig.limits.refused == 1
    assert rig.app.metrics.registry.get_sample_value("copilot_webhook_connections_refused_total") == 1


# --- the unread budget ---------------------------------------------------------------------------------------

MIB = 1 << 20
BIG_ANSWER_HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"


def _unread_answer(rig: Rig, size: int) -> tuple[Connection, FakeTransport]:
    """A connection whose client asked for a relayed answer of `size` bytes and reads none of it."""
    conn, transport, relay = _relayed(rig, get("/big"))
    relay.client.relayed(BIG_ANSWER_HEAD % size + b"a" * size)
    return conn, transport


@pytest.fixture
def measures(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """How many times each transport (by id) was measured by the unread budget."""
    counted: dict[int, int] = {}
    measure = reading.held_and_acked

    def counting(transport: Any) -> tuple[int, int]:
        counted[id(transport)] = counted.get(id(transport), 0) + 1
        return measure(transport)

    monkeypatch.setattr(reading, "held_and_acked", counting)
    return counted


@in_loop
async def test_clients_just_under_the_unread_budget_are_measured_once_per_measure_step(
    measures: dict[int, int],
) -> None:
    """A client that reads writes MEASURE_STEP while others hold just under UNREAD_BUDGET: every connection
    is measured at most twice, not at every write, and none is cut."""
    rig = Rig()
    held = [_unread_answer(rig, size) for size in (5 * MIB, 5 * MIB, UNREAD_BUDGET - 10 * MIB - 64 * 1024)]
    _, reader, relay = _relayed(rig, get("/stream"))
    reader.reads = True
    piece = 16 * 1024
    relay.client.relayed(BIG_ANSWER_HEAD % MEASURE_STEP)
    for _ in range(MEASURE_STEP // piece):
        relay.client.relayed(b"a" * piece)
    for _, transport in held:
        assert 1 <= measures[id(transport)] <= 2
        assert not transport.aborted
    assert rig.listener.unread.cut == 0


@in_loop
async def test_past_the_unread_budget_the_longest_unread_connection_is_cut_first() -> None:
    """Not the one holding the most: the one whose client went longest without reading."""
    rig = Rig()
    oldest, oldest_transport = _unread_answer(rig, 5 * MIB + MIB // 2)
    _, middle = _unread_answer(rig, 5 * MIB)
    _, newest, relay = _relayed(rig, get("/big"))
    relay.client.relayed(BIG_ANSWER_HEAD % (6 * MIB) + b"a" * (5 * MIB + 2 * MIB // 5))
    assert not oldest_transport.aborted
    relay.client.relayed(b"a" * (MIB // 2))
    assert oldest_transport.aborted
    assert oldest.state is State.CLOSING
    assert not middle.aborted
    assert not newest.aborted
    assert rig.listener.unread.cut == 1


# --- the metrics port ----------------------------------------------------------------------------------------


@in_loop
async def test_the_metrics_port_answers_404_for_any_other_path() -> None:
    rig = Rig(MetricsApp(Metrics()))
    conn, transport = rig.connect()
    conn.data_received(get("/healthz"))
    answer = replies(transport.data)[0]
    assert answer.status == 404
    assert b"this port serves GET /metrics only" in answer.body
    assert conn.state is State.IDLE


@in_loop
async def test_the_metrics_port_answers_405_to_a_post_after_its_body() -> None:
    rig = Rig(MetricsApp(Metrics()))
    conn, transport = rig.connect()
    request = post(b"{}" * 10, "/metrics")
    conn.data_received(request[:-5])
    assert transport.writes == []
    conn.data_received(request[-5:])
    answer = replies(transport.data)[0]
    assert (answer.status, answer.headers[b"allow"]) == (405, b"GET, HEAD")
    conn.data_received(get("/metrics"))
    assert replies(transport.data)[1].status == 200
