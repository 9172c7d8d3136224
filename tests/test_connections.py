"""One request at a time on a connection (admission.py): bytes behind a request whose answer is being made
wait unparsed until it is written, so a client that pipelines without reading costs the server no memory;
a request that breaks behind answers still being made is refused after them; and the timers that bound a
connection (idle, head deadline, drain grace) start from what the client actually owes. On the admission
port and the plain-HTTP metrics port alike."""

from __future__ import annotations

import contextlib
import signal
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from harness.server_process import Reader, Server, free_port, open_port, running_server, status_kb
from tests.helpers import pod, review

PORTS = ["admission", "metrics"]
HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
# What HEALTHZ gets on each port: the metrics port serves /metrics only, and its small 404 serves as well.
ANSWERS = {
    "admission": (200, b'{"status":"ok"}'),
    "metrics": (404, b'{"error":"no endpoint /healthz; this port serves GET /metrics only"}'),
}


def _with_metrics_port(tls_dir: Path, workdir: Path, deadline: float) -> Iterator[tuple[Server, int]]:
    metrics_port = free_port()
    config = f"server:\n  deadlineSeconds: {deadline}\n  metricsPort: {metrics_port}\n"
    with running_server(tls_dir, workdir, config=config) as running:
        yield running, metrics_port


@pytest.fixture(scope="module")
def served(tls_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int]]:
    """A head deadline of 1 s and the default idle timeout (120 s), with a metrics port."""
    yield from _with_metrics_port(tls_dir, tmp_path_factory.mktemp("connections"), 1)


def _post(body: bytes, path: bytes = b"/mutate") -> bytes:
    head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    return head % (path, len(body)) + body


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's RSS from /proc")
@pytest.mark.parametrize("port", PORTS)
def test_pipelined_requests_unread_cost_no_memory_and_are_all_answered_once_read(
    served: tuple[Server, int], port: str
) -> None:
    """Tiny requests pipelined by a client that reads nothing: the server used to parse each read whole,
    every request in it becoming a queued ASGI cycle, and 10 MB of them grew it from 76 to 606 MB.
    Now it stops reading (the client's writes block) and answers every request, in order, once read."""
    server = served[0]
    conn = open_port(served, port, receive_buffer=4096)
    before = status_kb(server.process.pid) / 1024
    batch, sent, blocked = HEALTHZ * 1000, 0, False
    conn.settimeout(1.5)
    try:
        while sent < 300_000:  # 10 MB of requests
            try:
                conn.sendall(batch)
            except TimeoutError:
                blocked = True
                break
            sent += 1000
        grown = status_kb(server.process.pid) / 1024 - before
        assert blocked, f"the server read all {sent} requests without their answers being read"
        assert grown < 40, f"{grown:.0f} MB more resident after {sent} pipelined requests"
        conn.settimeout(10)
        reader = Reader(conn)
        answers = {reader.answer()[::2] for _ in range(sent)}
    finally:
        conn.close()
    assert sent >= 1000
    assert answers == {ANSWERS[port]}
    assert "Traceback" not in server.output()


@pytest.mark.parametrize("port", PORTS)
@pytest.mark.parametrize(
    "garbage",
    [
        b"\x16\x03\x01\x02\x00garbage\r\n\r\n",
        b"GET / HTTP/1.1\r\nbad header\r\n\r\n",
        b"POST /healthz HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",  # in a queued body
    ],
)
def test_garbage_behind_an_answer_being_made_is_refused_after_it(
    served: tuple[Server, int], port: str, garbage: bytes
) -> None:
    """A good request and garbage in one write: the answer to the good one used to be lost with the
    connection; now it comes, then a 400 naming the problem, then the close."""
    with open_port(served, port) as conn:
        conn.sendall(HEALTHZ + garbage)
        reader = Reader(conn)
        first = reader.answer()
        status, headers, body = reader.answer()
        assert conn.recv(100) == b""
    assert first[::2] == ANSWERS[port]
    assert (status, headers[b"connection"]) == (400, b"close")
    assert orjson.loads(body) == {"error": "Invalid HTTP request received."}
    assert "Traceback" not in served[0].output()


def test_a_body_that_arrived_while_answers_went_unread_is_read_once_they_are(tls_dir: Path, tmp_path: Path) -> None:
    """Two large answers the client does not read yet stop the server reading; the body of a third request,
    begun before that, arrives meanwhile and waits. Once the client reads, that body used to stay unread
    until its deadline answered 408, although it had arrived in time."""
    config = "server:\n  deadlineSeconds: 3\n  maxBodyBytes: 30000000\n"

    def large(uid_bytes: int) -> bytes:  # its answer echoes the uid: megabytes the client must read
        return _post(orjson.dumps(review(pod("flyte-1.15-bare.yaml"), uid="u" * uid_bytes)))

    body = orjson.dumps(review(pod("flyte-1.15-bare.yaml"), uid="third"))
    third = (  # chunked: the application reads it, not the connection
        b"POST /mutate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(body)
        + body
        + b"\r\n0\r\n\r\n"
    )
    cut = third.index(b"\r\n\r\n") + 14
    first, second = large(8_000_000), large(1_000_000)
    with running_server(tls_dir, tmp_path, config=config) as server:
        conn = server.connect(receive_buffer=4096)
        conn.settimeout(10)
        with conn:
            conn.sendall(first)
            time.sleep(0.3)
            conn.sendall(second[:-200])
            time.sleep(0.3)
            conn.sendall(second[-200:] + third[:cut])
            time.sleep(0.3)
            conn.sendall(third[cut:])
            time.sleep(0.3)
            reader = Reader(conn)
            answers = [reader.answer() for _ in range(3)]
    assert [status for status, _headers, _body in answers] == [200, 200, 200], answers[2][2][:200]
    assert orjson.loads(answers[2][2])["response"]["uid"] == "third"


def test_an_unread_body_does_not_leave_the_idle_timer_on_the_next_request(tls_dir: Path, tmp_path: Path) -> None:
    """A GET's declared body is not read by the page, its answer goes first; when the rest of that body and
    the start of the next request came in one read, the idle timer armed as the body ended cut the next
    request off at the idle timeout (1 s) although its body was due within the deadline (3 s)."""
    config = "server:\n  deadlineSeconds: 3\n  idleTimeoutSeconds: 1\n"
    admission = _post(orjson.dumps(review(pod("flyte-1.15-bare.yaml"), uid="after-the-body")))
    with running_server(tls_dir, tmp_path, config=config) as server, server.connect() as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n")
        reader = Reader(conn)
        assert reader.answer()[0] == 200
        conn.sendall(b"0123456789" + admission[:-100])
        time.sleep(1.5)
        conn.sendall(admission[-100:])
        status, _headers, body = reader.answer()
    assert status == 200
    assert orjson.loads(body)["response"]["uid"] == "after-the-body"


@pytest.mark.parametrize("port", PORTS)
def test_trailers_are_not_taken_for_a_head_that_never_ends(served: tuple[Server, int], port: str) -> None:
    """Trailers after a chunked body count toward the head's field limit but are no head: trailers that came
    after the answer (the page reads no body) left the connection owing a head, answered 408 at the head
    deadline while it was idle."""
    with open_port(served, port) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n0\r\n")
        reader = Reader(conn)
        assert reader.answer()[::2] == ANSWERS[port]
        conn.sendall(b"x-trailer: 1\r\n\r\n")
        time.sleep(1.5)  # past the head deadline (1 s), within the idle timeout (120 s)
        conn.sendall(HEALTHZ)
        assert reader.answer()[::2] == ANSWERS[port]


@pytest.fixture(scope="module")
def patient(tls_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int]]:
    """A head and body deadline of 10 s: what closes a connection sooner is not a deadline."""
    yield from _with_metrics_port(tls_dir, tmp_path_factory.mktemp("patient"), 10)


@pytest.mark.parametrize(
    ("port", "request_head"),
    [
        ("admission", b"POST /preview HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"),
        ("admission", b"GET /healthz HTTP/1.1\r\nhost: x\r\n"),
        ("metrics", b"GET /metrics HTTP/1.1\r\nhost: x\r\n"),
    ],
)
def test_endless_trailers_are_cut_off_at_the_head_bound(
    patient: tuple[Server, int], port: str, request_head: bytes
) -> None:
    """httptools joins the pieces of a header field by concatenation and reports it once it ends: a trailer
    field that never ended held every byte sent and blocked the event loop for seconds (a /mutate's body
    deadline of 2 s fired after 19 s). Trailers are bounded as a head is, and the connection closes long
    before its deadline; a request already answered (a page that reads no body) gets no second answer."""
    server = patient[0]
    started = time.monotonic()
    with open_port(patient, port) as conn:
        conn.sendall(request_head + b"transfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nx-endless: ")
        try:
            for _ in range(64):  # 4 MB
                conn.sendall(b"a" * 65536)
        except OSError:
            pass  # reset: the server closed while the trailer was still arriving
        conn.settimeout(5)
        received = b""
        try:
            while chunk := conn.recv(65536):
                received += chunk
        except TimeoutError:
            pytest.fail(f"still open {time.monotonic() - started:.1f} s after an endless trailer began")
        except OSError:
            pass  # reset
    assert received.count(b"HTTP/1.1 ") <= 1, received[:300]
    assert b"HTTP/1.1 408" not in received
    with server.client() as client:
        assert client.get("/healthz").status_code == 200
    assert "Traceback" not in server.output()


def test_a_head_on_the_way_at_shutdown_is_answered_within_its_deadline(tls_dir: Path, tmp_path: Path) -> None:
    """Once the drain ends, a connection idle between requests gets half a second to deliver one; a
    connection whose head is arriving has its head deadline instead, and used to be cut at the half second."""
    config = "server:\n  deadlineSeconds: 3\n"
    with running_server(tls_dir, tmp_path, config=config) as server, server.connect() as conn:  # a 0.2 s drain
        conn.sendall(HEALTHZ[:20])
        time.sleep(0.2)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(1.2)
        conn.sendall(HEALTHZ[20:])
        reader = Reader(conn)
        status, headers, _body = reader.answer()
        assert conn.recv(100) == b""
    assert (status, headers[b"connection"]) == (200, b"close")


def test_a_client_that_closes_behind_pipelined_requests_leaves_nothing_behind(served: tuple[Server, int]) -> None:
    """Pipelined requests and then a close without reading: the server drops what waited unparsed, logs
    nothing alarming and serves the next client."""
    server = served[0]
    for _ in range(20):
        conn = open_port(served, "admission")
        conn.sendall(HEALTHZ * 2000)
        conn.close()
    with server.client() as client:
        assert client.get("/healthz").status_code == 200
    assert "Traceback" not in server.output()
    assert " ERROR " not in server.output()


def test_a_connection_the_api_server_leaves_idle_is_still_served(served: tuple[Server, int]) -> None:
    """The API server keeps an idle connection to a webhook for 90 s and reuses it for its next review; a
    server that closes it first races that POST, which Go does not retry (a Go client with the API server's
    transport lost 6 of 80 POSTs sent within 2 ms of a 1 s idle timeout: EOF). The default outlasts it: a
    connection idle past the old default (5 s) still serves its next request, on both ports."""
    with open_port(served, "admission") as admission, open_port(served, "metrics") as metrics:
        readers = {"admission": Reader(admission), "metrics": Reader(metrics)}
        for conn in (admission, metrics):
            conn.sendall(HEALTHZ)
        assert {port: reader.answer()[::2] for port, reader in readers.items()} == ANSWERS
        time.sleep(6)
        for conn in (admission, metrics):
            conn.sendall(HEALTHZ)
        assert {port: reader.answer()[::2] for port, reader in readers.items()} == ANSWERS


def test_an_idle_timeout_shorter_than_the_api_servers_is_warned_about(
    served: tuple[Server, int], tls_dir: Path, tmp_path: Path
) -> None:
    """Every review the API server sends as a connection closes under it fails the call: an operator who sets
    the idle timeout below the API server's learns so at start, and the default says nothing."""
    with running_server(tls_dir, tmp_path, config="server:\n  idleTimeoutSeconds: 30\n") as short:
        assert "server.idleTimeoutSeconds 30 s is not longer than the 90 s the API server keeps" in short.output()
    assert "idleTimeoutSeconds" not in served[0].output()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's RSS from /proc")
def test_many_connections_pipelining_tiny_requests_queue_few(served: tuple[Server, int]) -> None:
    """Twenty clients pipelining 39-byte GETs of the 7 KB /openapi.json, reading nothing. Each 4 KB piece
    parsed almost always ends inside a request's head, which was taken for the body of the request being
    answered, so parsing went on: with the event loop busy, every read was parsed whole and queued
    thousands of requests per connection (+125 MB in 10 s; fifty clients, +460 MB). Now a head that began
    behind an answer holds the rest, as a complete request does."""
    server = served[0]
    before = status_kb(server.process.pid) / 1024
    requests = b"GET /openapi.json HTTP/1.1\r\nhost: x\r\n\r\n" * 200
    conns = [server.connect(None, receive_buffer=4096) for _ in range(20)]
    try:
        for conn in conns:
            conn.setblocking(False)
        until = time.monotonic() + 10
        while time.monotonic() < until:
            for conn in conns:
                # Blocked: the server stopped reading it (or cut it off).
                with contextlib.suppress(BlockingIOError, ssl.SSLWantWriteError, OSError):
                    conn.send(requests)
            time.sleep(0.01)
        grown = status_kb(server.process.pid) / 1024 - before
    finally:
        for conn in conns:
            conn.close()
    assert grown < 60, f"{grown:.0f} MB more resident"
    with server.client() as client:
        assert client.get("/healthz").status_code == 200


def _send_queue(port: int) -> int:
    """Bytes in the send queues of the server's established sockets on `port` (/proc/net/tcp's tx_queue):
    answers written and not acknowledged, held in the server's memory."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "01":  # local address, ESTABLISHED
            total += int(fields[4].split(":")[0], 16)
    return total


def _settled_send_queue(port: int) -> int:
    """_send_queue once every answer is written: unchanged over 1 s."""
    queued, settled = _send_queue(port), 0
    until = time.monotonic() + 30
    while settled < 3 and time.monotonic() < until:
        time.sleep(0.3)
        now = _send_queue(port)
        settled, queued = (settled + 1 if now == queued else 0), now
    return queued


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the server's send queues from /proc")
def test_answers_nobody_reads_are_held_within_a_budget_and_a_reader_still_gets_its_own(
    served: tuple[Server, int],
) -> None:
    """Sixteen clients ask for the 1.5 MB script /docs loads and read none of it. The kernel takes a whole
    answer into the socket's send queue (on loopback it grows to 4 MB), so our writes never paused and each
    held 1.4 MB of the server's memory for the idle timeout: 22 MB here, 1.4 GB at server.maxConnections,
    against a 256 Mi limit. Now they hold at most the 16 MB budget: the clients that went longest without
    reading (the first ten) are cut off first, the later ones still get their answers whole, and so does a client
    that reads. Nor is the API server's connection cut, which reads each answer at once but holds the last
    one in our send queue until its next review carries the acknowledgement: it was taken for the client
    that had read nothing longest, and cut first."""
    server = served[0]
    page = b"GET /static-offline-docs/swagger-ui-bundle.js HTTP/1.1\r\nhost: x\r\n\r\n"
    reviews, admitted, stop = _post(orjson.dumps(review(pod("flyte-1.15.yaml")))), [0], threading.Event()

    def api_server() -> None:  # a review at a time on one keep-alive connection, each answer read at once
        with server.connect(10) as conn:
            reader = Reader(conn)
            while not stop.is_set():
                conn.sendall(reviews)
                status, _headers, _body = reader.answer()
                assert status == 200
                admitted[0] += 1
                time.sleep(0.01)

    api = threading.Thread(target=api_server)
    api.start()
    time.sleep(1)  # its first answer long before any page's
    older = [server.connect(None) for _ in range(10)]
    newer = [server.connect(None) for _ in range(6)]
    try:
        for conn in older:
            conn.sendall(page)
        assert 12 * 2**20 < _settled_send_queue(server.port) <= 16 * 2**20  # within the budget: all held
        for conn in newer:
            conn.sendall(page)
        queued = _settled_send_queue(server.port)
        assert 7 * 2**20 < queued <= 17 * 2**20, f"{queued / 2**20:.1f} MB of answers held for clients not reading"
        with server.client() as client:
            answer = client.get("/static-offline-docs/swagger-ui-bundle.js")
        assert answer.status_code == 200
        length = int(answer.headers["content-length"])
        assert len(answer.content) == length > 1_000_000
        cut = 0
        for conn in older:
            try:
                Reader(conn).answer()
            except ConnectionError:  # what reached its socket before the cut, then a reset
                cut += 1
        assert cut >= 5, f"{cut} of the 10 older clients cut off"  # 16 MB hold at most 5 of them beside the newer
        for conn in newer:
            status, _headers, body = Reader(conn).answer()
            assert (status, len(body)) == (200, length)
        assert api.is_alive(), "the API server's connection was cut off"
    finally:
        stop.set()
        api.join(10)
        for conn in older + newer:
            conn.close()
    assert admitted[0] > 20
    assert "cut off: " in server.output()
    assert "Traceback" not in server.output()


def test_a_queued_request_whose_body_waited_is_answered_once_its_turn_comes(served: tuple[Server, int]) -> None:
    """A GET and a 9 KB review in one write: the review's head is parsed behind the GET's answer being made
    and its body waits unparsed. Once the GET is answered the review is the request running, and its body
    must be parsed then: it waited for the deadline and got a 408."""
    body = orjson.dumps(review(pod("flyte-1.15-bare.yaml"), uid="queued")).replace(b"{", b"{" + b" " * 4000, 1)
    with open_port(served, "admission") as conn:
        conn.sendall(HEALTHZ + _post(body))
        reader = Reader(conn)
        assert reader.answer()[::2] == ANSWERS["admission"]
        status, _headers, answer = reader.answer()
    assert status == 200, answer[:200]
    assert orjson.loads(answer)["response"]["uid"] == "queued"


def test_a_scrape_during_the_drain_closes_its_connection_and_the_server_exits(tls_dir: Path, tmp_path: Path) -> None:
    """The metrics port drains with the admission port: a scrape answered after SIGTERM says Connection: close.
    It was answered keep-alive, and the server's exit waited for the scraper's idle connection to time out
    (the idle timeout, 120 s by default), past the pod's grace period."""
    metrics_port = free_port()
    env = {"COPILOT_WEBHOOK_SERVER__DRAIN_SECONDS": "0.5"}
    config = f"server:\n  metricsPort: {metrics_port}\n"
    with running_server(tls_dir, tmp_path, config=config, env=env) as server:
        scrape = b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n"
        with open_port((server, metrics_port), "metrics", timeout=30) as conn:
            reader = Reader(conn)
            conn.sendall(scrape)
            assert reader.answer()[0] == 200
            conn.sendall(scrape[:20])  # a scrape on its way as the signal comes
            signalled = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            time.sleep(0.8)  # past the drain: the servers are shutting down
            conn.sendall(scrape[20:])
            status, headers, _body = reader.answer()
            assert status == 200
            assert headers.get(b"connection") == b"close"
            server.process.wait(timeout=15)
            exited = time.monotonic() - signalled
    assert exited < 5, f"the server exited {exited:.1f} s after SIGTERM"


def test_a_request_answered_before_its_body_is_not_answered_again_when_the_body_breaks_later(
    served: tuple[Server, int],
) -> None:
    """Four reviews, then a chunked POST the application answers (404) without reading its body, whose chunk
    runs past where the connection's turn ends, then a malformed chunk, in one write. The 404 went while
    the rest of its body waited for the next turn; parsed then, the bad chunk got the same request a second
    answer (a 400). Now the connection just closes after the 404."""
    directs = b"".join(_post(orjson.dumps(review(pod("flyte-1.15-bare.yaml"), uid=f"u{i}"))) for i in range(4))
    head = b"POST /nope HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    size = (len(directs) + len(head)) // 4096 * 4096 + 4096 - len(directs) - len(head) + 500
    broken = b"%x\r\n" % size + b"x" * size + b"\r\nnot-a-chunk-size\r\n\r\n"
    with open_port(served, "admission") as conn:
        conn.sendall(directs + head + broken)
        reader = Reader(conn)
        statuses = [reader.answer()[0] for _ in range(5)]
        conn.settimeout(3)
        rest = conn.recv(100)
    assert statuses == [200, 200, 200, 200, 404]
    assert rest == b"", f"a second answer: {rest!r}"
