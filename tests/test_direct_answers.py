"""Admission requests the connection answers itself (admission.py): a POST to /mutate* shaped as
the API server sends it is answered inside the read that completes its body, without an ASGI cycle. These
tests hold that path to the application's own answers, byte for byte, and to what HTTP/1.1 asks of a
server: pipelined requests answered in order, bodies in pieces, HTTP/1.0, slow and vanished clients
counted in the metrics, and a client that never reads its answers."""

from __future__ import annotations

import contextlib
import re
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from harness.environment import eventually
from harness.server_process import Reader, Server, running_server, status_kb
from tests.asgi import call
from tests.helpers import pod, review
from webhook.config import build_settings
from webhook.web.server import WebhookApp

BAD_SHAPE = pod("flyte-1.15-bare.yaml")
BAD_SHAPE["spec"]["containers"][0]["securityContext"] = {"capabilities": {"add": "SYS_PTRACE"}}

BODIES = {
    "flyte 1.15 review": orjson.dumps(review(pod("flyte-1.15-bare.yaml"), uid="u-1")),
    "v1beta1 review": orjson.dumps(
        review(pod("flyte-1.15-bare.yaml"), uid="u-2", api_version="admission.k8s.io/v1beta1")
    ),
    "an UPDATE": orjson.dumps(review(pod("flyte-1.15-bare.yaml"), uid="u-3", operation="UPDATE")),
    "a pod field of the wrong type": orjson.dumps(review(BAD_SHAPE, uid="u-4")),
    "object is a list": orjson.dumps(review([], uid="u-5")),
    "no uid": orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}),
    "not a review": b'{"kind":"Pod"}',
    "a JSON array": b"[1,2]",
    "truncated JSON": b'{"apiVersion":',
    "not UTF-8": b'{"kind":"\xff"}',
    "empty": b"",
    "nested 10,000 deep": b"[" * 10_000 + b"]" * 10_000,
}
PATHS = ["/mutate", "/mutate/ptrace", "/mutate/image-puller"]


@pytest.fixture(scope="module")
def server(tls_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = "server:\n  deadlineSeconds: 0.5\n"
    with running_server(tls_dir, tmp_path_factory.mktemp("direct"), config=config) as running:
        yield running


def _post(path: str, body: bytes, content_type: bytes = b"application/json", version: bytes = b"1.1") -> bytes:
    head = b"POST %s?timeout=10s HTTP/%s\r\nhost: x\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
    return head % (path.encode(), version, content_type, len(body)) + body


@pytest.mark.parametrize("path", PATHS)
def test_answers_are_the_applications_byte_for_byte(server: Server, path: str) -> None:
    """Every body, good or hostile, gets from the connection exactly what the ASGI application answers."""
    app = WebhookApp(build_settings({"server": {"deadlineSeconds": 0.5}}))
    with server.connect() as conn:
        reader = Reader(conn)
        for name, body in BODIES.items():
            conn.sendall(_post(path, body))
            status, headers, answer = reader.answer()
            expected = call(app, "POST", path + "?timeout=10s", body, content_type="application/json")
            assert (status, answer) == (expected.status_code, expected.content), name
            assert headers[b"content-type"] == b"application/json", name
            assert status < 500, name
    assert "Traceback" not in server.output()


def test_pipelined_requests_are_answered_in_order_around_those_the_application_answers(server: Server) -> None:
    """One write carrying five requests: two the application answers (a GET and a wrong content type) sit
    between direct ones, and every answer comes back in the order its request was sent."""
    flyte = pod("flyte-1.15-bare.yaml")
    requests = [
        _post("/mutate", orjson.dumps(review(flyte, uid="p-1"))),
        b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n",
        _post("/mutate/ptrace", orjson.dumps(review(flyte, uid="p-2"))),
        _post("/mutate", orjson.dumps(review(flyte, uid="p-3")), content_type=b"text/plain"),
        _post("/mutate", orjson.dumps(review(flyte, uid="p-4"))),
    ]
    with server.connect() as conn:
        conn.sendall(b"".join(requests))
        reader = Reader(conn)
        answers = [reader.answer() for _ in requests]
    statuses = [status for status, _headers, _body in answers]
    assert statuses == [200, 200, 200, 415, 200]
    uids = [orjson.loads(body)["response"]["uid"] for status, _h, body in answers if body.startswith(b'{"apiV')]
    assert uids == ["p-1", "p-2", "p-4"]
    assert orjson.loads(answers[1][2]) == {"status": "ok"}


def test_a_body_in_many_pieces_is_answered_once_whole(server: Server) -> None:
    request = _post("/mutate", orjson.dumps(review(pod("flyte-1.15-bare.yaml"), uid="pieces")))
    with server.connect() as conn:
        for i in range(0, len(request), 700):
            conn.sendall(request[i : i + 700])
            time.sleep(0.01)
        status, _headers, body = Reader(conn).answer()
    assert status == 200
    answer = orjson.loads(body)["response"]
    assert answer["uid"] == "pieces"
    assert answer["patchType"] == "JSONPatch"


def test_an_http_1_0_request_is_answered_and_its_connection_closed(server: Server) -> None:
    with server.connect() as conn:
        conn.sendall(_post("/mutate", orjson.dumps(review(pod("flyte-1.15-bare.yaml"), uid="old")), version=b"1.0"))
        reader = Reader(conn)
        status, headers, body = reader.answer()
        assert conn.recv(100) == b"", "the connection stays open after an HTTP/1.0 answer"
    assert status == 200
    assert headers[b"connection"] == b"close"
    assert orjson.loads(body)["response"]["uid"] == "old"


def _counter(text: str, path: str, result: str) -> float:
    match = re.search(rf'copilot_webhook_requests_total{{path="{re.escape(path)}",result="{result}"}} (\S+)', text)
    return float(match.group(1)) if match else 0.0


def _timed(text: str, path: str) -> float:
    match = re.search(rf'copilot_webhook_request_duration_seconds_count{{path="{re.escape(path)}"}} (\S+)', text)
    return float(match.group(1)) if match else 0.0


def _metrics(server: Server) -> str:
    with server.client() as client:
        return client.get("/metrics").text


def test_answers_late_bodies_and_vanished_clients_are_counted(server: Server) -> None:
    path = "/mutate/image-puller"
    results = ("patched", "unchanged", "bad_request", "timeout", "client_gone")
    before = _metrics(server)
    with server.connect() as conn:
        reader = Reader(conn)
        conn.sendall(_post(path, orjson.dumps(review(pod("flyte-1.15-bare.yaml")))))
        assert reader.answer()[0] == 200
        conn.sendall(_post(path, b"{"))
        assert reader.answer()[0] == 400
    with server.connect() as conn:  # a body that stops halfway: 408 after server.deadlineSeconds
        conn.sendall(_post(path, b'{"apiVersion": "admission.k8s.io/v1"}')[:-10])
        status, headers, body = Reader(conn).answer()
        assert status == 408
        assert headers[b"connection"] == b"close"
        assert b"body not received within server.deadlineSeconds (0.5 s)" in body
    with server.connect() as conn:  # a client that leaves halfway through its body
        conn.sendall(_post(path, b'{"apiVersion": "admission.k8s.io/v1"}')[:-10])
        time.sleep(0.1)
    gone = _counter(before, path, "client_gone")
    assert eventually(lambda: _counter(_metrics(server), path, "client_gone") > gone, 5), "the vanished client"
    after = _metrics(server)
    added = {result: _counter(after, path, result) - _counter(before, path, result) for result in results}
    assert added["patched"] + added["unchanged"] == 1, added
    assert (added["bad_request"], added["timeout"], added["client_gone"]) == (1, 1, 1), added
    assert _timed(after, path) - _timed(before, path) == 3, "the answered requests are timed, the vanished one not"


def _preview_list(count: int) -> bytes:
    obj = pod("flyte-1.15-bare.yaml")
    items = [{**obj, "metadata": {**obj["metadata"], "name": f"p{i}"}} for i in range(count)]
    return orjson.dumps({"apiVersion": "v1", "kind": "List", "items": items})


@pytest.mark.parametrize("first", ["nothing", "previews"])
def test_a_client_that_never_reads_its_answers_stops_being_read(server: Server, first: str) -> None:
    """Pipelined requests written without reading a single answer: the server answers until its send buffer
    is full, then reads no more (the client's writes block) instead of holding every answer in memory;
    also when what filled the buffer were answers the application wrote (previews of a few MB)."""
    request = _post("/mutate", b"{")  # 150 bytes that earn a 400 of about the same size
    conn = server.connect(None, receive_buffer=4096)
    if first == "previews":
        previews = _preview_list(150)
        done = _counter(_metrics(server), "/preview", "ok")
        for i in range(1, 4):
            conn.sendall(
                b"POST /preview HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % len(previews) + previews
            )

            def written(count: float = done + i) -> bool:  # its answer is written (not read) once counted
                return _counter(_metrics(server), "/preview", "ok") >= count

            assert eventually(written, 60), "a preview was not answered"
    before = status_kb(server.process.pid) / 1024
    batch = request * 100
    sent = 0
    try:
        conn.settimeout(3)
        blocked = False
        while sent < 500_000:  # 75 MB: far beyond every buffer on the way
            try:
                conn.sendall(batch)
            except TimeoutError:
                blocked = True
                break
            sent += 100
        assert blocked, f"the server read all {sent} requests without their answers being read"
        with server.client() as client:
            assert client.get("/healthz").status_code == 200, "other clients are still served"
        grown = status_kb(server.process.pid) / 1024 - before
        assert grown < 40, f"{grown:.0f} MB more resident after {sent} unread answers"
    finally:
        conn.close()
    assert "Traceback" not in server.output()


def test_clients_pipelining_reviews_leave_a_new_connection_its_turn(server: Server) -> None:
    """Sixty clients pipelining reviews (and reading the answers): each read was parsed whole, and libuv reads
    a socket up to 32 times a turn, so one turn of the event loop lasted seconds and a new connection (the
    API server's) waited 36 s for its handshake (71 s here). A connection now answers a few requests per
    turn and the rest of what it sent waits for its next turn, after every other connection's (0.2 s)."""
    one = _post("/mutate/ptrace", orjson.dumps(review(pod("flyte-1.15-bare.yaml"))))
    batch = one * 20
    conns = [server.connect(None) for _ in range(60)]
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            for conn in conns:
                with contextlib.suppress(BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError, OSError):
                    while conn.recv(1 << 20):
                        pass
                with contextlib.suppress(BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError, OSError):
                    conn.send(batch)
            time.sleep(0.005)

    for conn in conns:
        conn.setblocking(False)
    thread = threading.Thread(target=flood)
    thread.start()
    try:
        time.sleep(2)
        started = time.monotonic()
        with server.connect(60) as conn:
            conn.sendall(one)
            status = Reader(conn).answer()[0]
        took = time.monotonic() - started
    finally:
        stop.set()
        thread.join()
        for conn in conns:
            conn.close()
    assert status == 200
    assert took < 10, f"a new connection's review took {took:.1f} s while others pipelined"


def test_a_client_that_reads_late_gets_every_answer(server: Server) -> None:
    """While the server does not read (its answers are not being read), the client owes nothing: no body
    deadline and no idle timeout runs out, and once it reads, every request it sent is answered."""
    request = _post("/mutate", orjson.dumps(review(pod("flyte-1.15-bare.yaml"))))
    conn = server.connect(None, receive_buffer=4096)
    conn.settimeout(1)
    stream, sent = request * 4000, 0
    try:
        while sent < len(stream):
            conn.sendall(stream[sent : sent + 5107])  # pieces that end inside bodies
            sent += 5107
    except TimeoutError:
        pass
    time.sleep(1.5)  # past server.deadlineSeconds (0.5 s); a client that never reads is cut off after 5 s
    conn.settimeout(10)
    reader = Reader(conn)
    accepted = min(sent, len(stream)) // len(request)
    statuses = [reader.answer()[0] for _ in range(accepted)]
    conn.close()
    assert accepted > 100, "the client's writes blocked almost at once"
    assert set(statuses) == {200}, statuses[-5:]


@pytest.fixture(scope="module")
def quick(tls_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose idle timeout (1 s) is shorter than its deadline (3 s)."""
    config = "server:\n  deadlineSeconds: 3\n  idleTimeoutSeconds: 1\n"
    with running_server(tls_dir, tmp_path_factory.mktemp("quick"), config=config) as running:
        yield running


def test_a_request_pipelined_behind_a_direct_answer_meets_its_deadline_not_the_idle_timeout(quick: Server) -> None:
    """The idle timeout starts when no request is in progress: a body still due (here within 3 s) behind a
    direct answer is not cut at the idle timeout (1 s)."""
    body = orjson.dumps(review(pod("flyte-1.15-bare.yaml"), uid="second"))
    with quick.connect() as conn:
        second = _post("/mutate/ptrace", body)
        conn.sendall(_post("/mutate", orjson.dumps(review(pod("flyte-1.15-bare.yaml")))) + second[:-100])
        reader = Reader(conn)
        assert reader.answer()[0] == 200
        time.sleep(1.5)
        conn.sendall(second[-100:])
        status, _headers, answer = reader.answer()
    assert status == 200
    assert orjson.loads(answer)["response"]["uid"] == "second"


def test_bare_line_breaks_do_not_hold_a_connection_open(quick: Server) -> None:
    """Empty lines between requests are allowed and ignored, and keep nothing open past the idle timeout,
    before a first request or after an answer."""
    with quick.connect() as fresh, quick.connect() as answered:
        fresh.sendall(b"\r\n")
        answered.sendall(_post("/mutate", b"{"))
        assert Reader(answered).answer()[0] == 400
        answered.sendall(b"\r\n")
        started = time.monotonic()
        for conn in (fresh, answered):
            conn.settimeout(5)
            assert conn.recv(100) == b""
        assert time.monotonic() - started < 3


def test_a_client_that_reads_none_of_its_answers_is_cut_off_in_5_s(tls_dir: Path, tmp_path: Path) -> None:
    """It owes no request while it is not read from, but it owes reading: a client that stops reading for
    5 s holds no connection (nor the answers buffered for it) any longer. Not the idle timeout: that
    outlasts the API server's 90 s (120 s by default), and non-reading clients held their answers that long."""
    with running_server(tls_dir, tmp_path) as server:
        conn = server.connect(None, receive_buffer=4096)
        conn.settimeout(2)
        try:
            for _ in range(10_000):
                conn.sendall(_post("/mutate", b"{") * 100)
        except (TimeoutError, OSError):
            pass
        assert eventually(lambda: "cut off: its answers were not read" in server.output(), 9), "not cut off in 9 s"
        conn.close()
        with server.client() as client:
            assert client.get("/healthz").status_code == 200


def test_a_client_that_reads_slowly_is_not_cut_off(quick: Server) -> None:
    """A client whose unread answers shrink at every idle timeout is reading, if slowly (a large preview over
    a slow link): it keeps its connection past many idle timeouts, and once it catches up it is read again.
    Its progress is what its end of the connection acknowledged: the server's own buffer can stay full for
    tens of seconds while the kernel drains its send queue, then refill it in a burst."""
    logged = len(quick.output())
    conn = quick.connect(None, receive_buffer=4096)
    conn.settimeout(0.1)  # it starts reading well within the idle timeout of the server's pause
    try:
        for _ in range(10_000):
            conn.sendall(_post("/mutate", b"{") * 100)
    except (TimeoutError, OSError):
        pass  # the server stopped reading: its answers are not read
    with conn:
        conn.settimeout(10)
        received = b""
        until = time.monotonic() + 4  # four idle timeouts; at this pace the answers owed take about 40 s to read
        while time.monotonic() < until:
            goal = len(received) + 8192  # each answer is a TLS record of its own: a recv returns one
            while len(received) < goal:
                chunk = conn.recv(8192)
                assert chunk, "a client reading its answers was cut off"
                received += chunk
            time.sleep(0.1)
        assert "cut off" not in quick.output()[logged:], "a client reading its answers was cut off"
        reader = Reader(conn)
        reader.buffer = received
        statuses = []
        with contextlib.suppress(ConnectionError):  # every answer owed; then the connection ends, idle or late
            while True:
                statuses.append(reader.answer()[0])
    assert len(statuses) > 100
    assert set(statuses[:-1]) == {400}, "answers to the requests sent whole"
    assert statuses[-1] in (400, 408), "the last: answered, or the rest of the request cut mid-write was late"
    assert "Traceback" not in quick.output()[logged:]


@pytest.mark.parametrize(
    ("types", "status"), [((b"text/plain", b"application/json"), 415), ((b"application/json", b"text/plain"), 200)]
)
def test_a_repeated_content_type_is_read_as_the_application_reads_it(
    server: Server, types: tuple[bytes, bytes], status: int
) -> None:
    """The first one counts, as the application reads it (bodies.header)."""
    body = orjson.dumps(review(pod("flyte-1.15-bare.yaml")))
    head = b"POST /mutate HTTP/1.1\r\nhost: x\r\ncontent-type: %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
    with server.connect() as conn:
        conn.sendall(head % (*types, len(body)) + body)
        assert Reader(conn).answer()[0] == status


def test_requests_pipelined_behind_a_closing_answer_are_neither_answered_nor_counted(
    tls_dir: Path, tmp_path: Path
) -> None:
    """Once the server drains, an answer closes its connection; the requests that came with it in the same
    read are dropped, not answered into a closed connection, counted and logged."""
    import signal

    path = "/mutate/ptrace"
    env = {"COPILOT_WEBHOOK_SERVER__DRAIN_SECONDS": "5"}
    with running_server(tls_dir, tmp_path, env=env) as draining, draining.connect() as conn:
        reader = Reader(conn)
        conn.sendall(_post(path, b"{"))
        assert reader.answer()[0] == 400
        before = _counter(_metrics(draining), path, "bad_request")
        draining.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        conn.sendall(_post(path, b"{") * 51)
        status, headers, _body = reader.answer()
        assert conn.recv(100) == b""
        counted = _counter(_metrics(draining), path, "bad_request") - before
    assert (status, headers[b"connection"]) == (400, b"close")
    assert counted == 1
    assert "SSL connection is closed" not in draining.output()


def test_pipelined_requests_and_the_start_of_the_next_head_are_all_answered(server: Server) -> None:
    """Seven whole requests (35 KB) and the first bytes of an eighth in one write: the head limit counts
    the eighth's bytes only."""
    request = _post("/mutate/ptrace", orjson.dumps(review(pod("flyte-1.15-bare.yaml"))))
    with server.connect() as conn:
        conn.sendall(request * 7 + request[:40])
        time.sleep(0.2)
        conn.sendall(request[40:])
        reader = Reader(conn)
        statuses = [reader.answer()[0] for _ in range(8)]
    assert statuses == [200] * 8
