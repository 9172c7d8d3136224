"""The puller counts a runtime's answer only when it has read it to its end within its bounds and it is the
message the API documents. Hostile Docker Engine sockets and CRI servers, each in a thread here, answer cut
short, undelimited, oversized, malformed or stalled: the image fails, retried as any transient failure is,
instead of being reported present or pulled."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.test_pull import Answer, _docker_socket, _image_absent, _one_endless_line, _peak_memory_kib, _pull
from webhook.pull.clients import BODY_LIMIT, INSPECT_LIMIT, _field, _varint

RETRIES = 2


def _head(status: str, *headers: str) -> bytes:
    return f"HTTP/1.1 {status}\r\n".encode() + b"".join(f"{h}\r\n".encode() for h in headers) + b"\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


OK_CHUNKED = _head("200 OK", "Content-Type: application/json", "Transfer-Encoding: chunked")


def _with_length(body: bytes, *headers: str) -> bytes:
    return _head("200 OK", "Content-Type: application/json", f"Content-Length: {len(body)}", *headers) + body


# --- the image inspect (GET /images/{name}/json), answered 200 -------------------------------------------


def _inspect_cut_short(request: str, connection: socket.socket) -> None:
    """dockerd dying in the middle of an inspect answer: 6 of the 1000 bytes it declared."""
    connection.sendall(_head("200 OK", "Content-Type: application/json", "Content-Length: 1000") + b'{"Id":')


def _absent_cut_short(request: str, connection: socket.socket) -> None:
    """A 404 is "absent" only when whole: this one is 27 of 100 bytes."""
    head = _head("404 Not Found", "Content-Type: application/json", "Content-Length: 100")
    connection.sendall(head + b'{"message":"No such image: ')


def _inspect_chunks_unfinished(request: str, connection: socket.socket) -> None:
    """Whole chunks, but never the last (empty) one."""
    connection.sendall(OK_CHUNKED + _chunk(b'{"Id":"sha256:0123",') + _chunk(b'"RepoTags":[]}'))


def _inspect_undelimited(request: str, connection: socket.socket) -> None:
    """Neither a length nor chunks: the body ends where the connection does, so a cut looks like an end."""
    connection.sendall(_head("200 OK", "Content-Type: application/json") + b'{"Id":"sha256:0123"}')


def _inspect_not_json(request: str, connection: socket.socket) -> None:
    connection.sendall(_with_length(b"<html><body>Bad Gateway</body></html>"))


def _inspect_not_an_object(request: str, connection: socket.socket) -> None:
    connection.sendall(_with_length(b'["Id"]'))


def _inspect_without_id(request: str, connection: socket.socket) -> None:
    connection.sendall(_with_length(b'{"RepoTags":["busybox:1"],"Size":4261550}'))


def _inspect_declared_too_long(request: str, connection: socket.socket) -> None:
    head = _head("200 OK", "Content-Type: application/json", f"Content-Length: {2 * INSPECT_LIMIT}")
    connection.sendall(head + b'{"Id":"sha256:0123","Pad":"' + b"x" * 65536)


def _inspect_endless(request: str, connection: socket.socket) -> None:
    """Chunks of one JSON string that never ends, as fast as the socket takes them."""
    connection.sendall(OK_CHUNKED + _chunk(b'{"Id":"sha256:0123","Pad":"'))
    piece = _chunk(b"x" * 65536)
    while True:
        connection.sendall(piece)


# --- the pull stream (POST /images/create), after an inspect that says absent --------------------------

PULLING = b'{"status":"Pulling from library/busybox","id":"1"}\r\n'


def _stream(name: str, *chunks: bytes, end: bool = True) -> Answer:
    """Absent, then a pull stream of these chunks, ending with the last (empty) chunk if `end`."""

    def answer(request: str, connection: socket.socket) -> None:
        if not _image_absent(request, connection):
            connection.sendall(OK_CHUNKED + b"".join(_chunk(c) for c in chunks) + (b"0\r\n\r\n" if end else b""))

    answer.__name__ = name  # the test's id
    return answer


_stream_cut_mid_line = _stream("stream_cut_mid_line", PULLING, b'{"status":"Downloa', end=False)
_stream_ends_mid_line = _stream("stream_ends_mid_line", PULLING, b'{"status":"Downloa')
_stream_ends_in_error = _stream(
    "stream_ends_in_error",
    PULLING,
    b'{"errorDetail":{"message":"toomanyrequests: pull rate limit"},"error":"toomanyrequests: pull rate limit"}\r\n',
)
_stream_error_detail_alone = _stream(
    "stream_error_detail_alone", PULLING, b'{"errorDetail":{"message":"read: connection reset by peer"}}\r\n'
)
_stream_line_not_json = _stream(
    "stream_line_not_json", PULLING, b"<html>Bad Gateway</html>\r\n", b'{"status":"Status: Downloaded"}\r\n'
)
_stream_empty = _stream("stream_empty")


def _stream_negative_chunk(request: str, connection: socket.socket) -> None:
    """A chunk size of -1, then data without end (http.client reads such a chunk to the stream's end)."""
    if not _image_absent(request, connection):
        connection.sendall(OK_CHUNKED + b"-1\r\n")
        piece = b"x" * 65536
        while True:
            connection.sendall(piece)


def _counted(answer: Answer) -> tuple[Answer, list[str]]:
    """The answer, and the request lines it was asked (the method and the path)."""
    requests: list[str] = []
    lock = threading.Lock()

    def counting(request: str, connection: socket.socket) -> None:
        with lock:
            requests.append(request)
        answer(request, connection)

    return counting, requests


def _failed_line(stdout: str, image: str) -> str:
    lines = stdout.splitlines()
    assert lines[0].startswith(f"image={image} result=failed "), stdout
    assert lines[-1].startswith("summary present=0 pulled=0 failed=1 cancelled=0"), stdout
    return lines[0]


def _pull_from_docker(
    tmp_path: Path, answer: Answer, policy: str
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """busybox:1 pulled by the puller through a Docker socket that answers with `answer`; the requests it
    received. The puller never prints a traceback, whatever the answer."""
    counting, requests = _counted(answer)
    with _docker_socket(tmp_path / "docker.sock", counting) as path:
        done = _pull(
            "--runtime=docker",
            f"--socket={path}",
            f"--retries={RETRIES}",
            "--backoff=0.05",
            f"--failure-policy={policy}",
            "--",
            "busybox:1",
        )
    assert "Traceback" not in done.stderr, done.stderr
    return done, requests


@pytest.mark.parametrize("policy", ["Ignore", "Fail"])
@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (_inspect_cut_short, "the Docker Engine answer to image inspect was cut short after 6 of 1000 bytes"),
        (_absent_cut_short, "the Docker Engine answer to image inspect was cut short after 27 of 100 bytes"),
        (_inspect_chunks_unfinished, "image inspect was cut short after 34 bytes, before its last chunk"),
        (_inspect_undelimited, "image inspect declares neither its length nor chunks"),
        (_inspect_not_json, "image inspect is not JSON: <html><body>Bad Gateway"),
        (_inspect_not_an_object, "image inspect is JSON but not an object"),
        (_inspect_without_id, "image inspect is an object without a string Id"),
        (_inspect_declared_too_long, f"declares {2 * INSPECT_LIMIT} bytes, more than the {INSPECT_LIMIT} read"),
        (_inspect_endless, f"image inspect runs past {INSPECT_LIMIT} bytes"),
    ],
)
def test_an_inspect_answer_not_read_whole_or_not_an_image_is_no_image(
    tmp_path: Path, answer: Answer, says: str, policy: str
) -> None:
    done, requests = _pull_from_docker(tmp_path, answer, policy)
    line = _failed_line(done.stdout, "busybox:1")
    assert says in line
    assert " attempts=0 " in line, "no pull was tried"
    assert requests == ["GET /v1.41/images/docker.io/library/busybox:1/json HTTP/1.1"] * RETRIES, (
        "retried as a transient failure"
    )
    assert done.returncode == (1 if policy == "Fail" else 0)


@pytest.mark.parametrize("policy", ["Ignore", "Fail"])
@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (_stream_cut_mid_line, "the Docker Engine answer to image pull was cut short after 70 bytes, before its last"),
        (_stream_ends_mid_line, 'image pull is not JSON: {"status":"Downloa'),
        (_stream_ends_in_error, "error=toomanyrequests: pull rate limit"),
        (_stream_error_detail_alone, "error=read: connection reset by peer"),
        (_stream_line_not_json, "image pull is not JSON: <html>Bad Gateway</html>"),
        (_stream_empty, "the Docker Engine answer to image pull ended without a status"),
        (_one_endless_line, f"image pull has a line past {BODY_LIMIT} bytes"),
        (_stream_negative_chunk, "image pull has a malformed chunk size after 0 bytes"),
    ],
)
def test_a_pull_stream_not_read_to_its_end_or_ending_in_an_error_is_no_pull(
    tmp_path: Path, answer: Answer, says: str, policy: str
) -> None:
    done, requests = _pull_from_docker(tmp_path, answer, policy)
    line = _failed_line(done.stdout, "busybox:1")
    assert says in line
    assert f" attempts={RETRIES} " in line, "retried as a transient failure"
    assert [r.split()[0] for r in requests] == ["GET", "POST"] * RETRIES
    assert done.returncode == (1 if policy == "Fail" else 0)


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (_inspect_endless, f"image inspect runs past {INSPECT_LIMIT} bytes"),
        (_one_endless_line, f"image pull has a line past {BODY_LIMIT} bytes"),
        (_stream_negative_chunk, "image pull has a malformed chunk size after 0 bytes"),
    ],
)
def test_an_endless_answer_is_read_no_further_than_its_cap(tmp_path: Path, answer: Answer, says: str) -> None:
    """What a socket sends past the cap is never read: the image fails at once, not at the deadline, and
    the puller's memory stays that of a few buffers."""
    with _docker_socket(tmp_path / "docker.sock", answer) as path:
        command = [sys.executable, "-m", "webhook.pull", "--runtime=docker", f"--socket={path}", "--retries=1"]
        process = subprocess.Popen(
            [*command, "--timeout=10", "--", "busybox:1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        peak = _peak_memory_kib(process)
        out, err = process.communicate(timeout=60)
    assert "Traceback" not in err, err
    line = _failed_line(out, "busybox:1")
    assert says in line
    assert " error=timed out" not in line
    assert peak < 80 * 1024, f"peak RSS {peak} KiB"


# --- a socket that stalls or trickles: the run's deadline ends it -----------------------------------------


def _inspect_stalls(request: str, connection: socket.socket) -> None:
    """6 of 1000 bytes, then silence with the connection open, until the puller closes its end."""
    connection.sendall(_head("200 OK", "Content-Length: 1000") + b'{"Id":')
    connection.recv(1)


def _inspect_trickles(request: str, connection: socket.socket) -> None:
    """A byte every 0.1 s of a 1000-byte answer (100 s in all), on a connection the answer says it closes."""
    connection.sendall(_head("200 OK", "Content-Length: 1000", "Connection: close") + b'{"Id":"')
    while True:
        connection.sendall(b"0")
        time.sleep(0.1)


@pytest.mark.parametrize("answer", [_inspect_stalls, _inspect_trickles])
def test_an_answer_that_stalls_or_trickles_ends_at_the_deadline(tmp_path: Path, answer: Answer) -> None:
    with _docker_socket(tmp_path / "docker.sock", answer) as path:
        started = time.monotonic()
        done = _pull("--runtime=docker", f"--socket={path}", "--timeout=2", "--failure-policy=Fail", "--", "busybox:1")
        seconds = time.monotonic() - started
    assert "Traceback" not in done.stderr, done.stderr
    line = _failed_line(done.stdout, "busybox:1")
    assert line.endswith(" error=timed out"), line
    assert done.returncode == 1
    assert seconds < 20, f"a --timeout=2 run took {seconds:.1f} s"


# --- the CRI: ImageStatus and PullImage answers that are not their messages -------------------------------

SIZE = _varint(4 << 3) + _varint(4261550)  # Image.size, a varint
IMAGE_ID = _field(1, b"sha256:" + b"ab" * 32)  # Image.id


@contextmanager
def _cri_socket(path: Path, status: bytes, pulled: bytes) -> Iterator[tuple[str, list[str]]]:
    """A CRI ImageService answering every ImageStatus and PullImage with these bytes, as they are."""
    calls: list[str] = []

    def handler(method: str, answer: bytes) -> Any:
        def respond(request: bytes, context: Any) -> bytes:
            calls.append(method)
            return answer

        return grpc.unary_unary_rpc_method_handler(respond)  # no (de)serializers: the bytes themselves

    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    methods = {"ImageStatus": handler("ImageStatus", status), "PullImage": handler("PullImage", pulled)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("runtime.v1.ImageService", methods),))
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        yield str(path), calls
    finally:
        server.stop(None)


def _cri_pull(path: str) -> subprocess.CompletedProcess[str]:
    return _pull(
        "--runtime=cri", f"--socket={path}", f"--retries={RETRIES}", "--backoff=0.05", "--failure-policy=Fail",
        "--", "busybox:1",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("status", "says"),
    [
        pytest.param(b"\x0a\x05abc", "(a field of 5 bytes where 3 are left)", id="garbage"),
        pytest.param(b"\x0a\xff\xff", "(a number cut short)", id="length-cut"),
        pytest.param(_field(1, IMAGE_ID + SIZE) + b"\xff", "(a number cut short)", id="trailing-byte"),
        pytest.param(_field(1, IMAGE_ID + SIZE) + b"\x0b", "(wire type 3)", id="group"),
        pytest.param(_field(1, IMAGE_ID + _field(4, b"big")), "(field 4 of wire type 2)", id="size-not-varint"),
        pytest.param(_field(1, _field(1, b"sha256:\xff") + SIZE), "(a string that is not UTF-8)", id="id-not-utf8"),
        pytest.param(
            _field(1, IMAGE_ID + SIZE + _field(7, b"\x0a\x09short")),
            "(a field of 9 bytes where 5 are left)",
            id="spec-garbage",
        ),
        pytest.param(_field(1, b""), "holds an image without its id or size", id="empty-image"),
        pytest.param(_field(1, IMAGE_ID), "holds an image without its id or size", id="no-size"),
        pytest.param(_field(1, SIZE), "holds an image without its id or size", id="no-id"),
    ],
)
def test_an_image_status_that_is_not_its_message_is_no_image(tmp_path: Path, status: bytes, says: str) -> None:
    with _cri_socket(tmp_path / "cri.sock", status, b"") as (path, calls):
        done = _cri_pull(path)
    assert "Traceback" not in done.stderr, done.stderr
    line = _failed_line(done.stdout, "busybox:1")
    assert "error=the CRI answer to ImageStatus " in line, line
    assert says in line
    assert calls == ["ImageStatus"] * RETRIES, "retried as a transient failure, and never pulled"
    assert done.returncode == 1


@pytest.mark.parametrize(
    ("pulled", "says"),
    [
        pytest.param(b"", "PullImage names no image (its image_ref is empty)", id="empty"),
        pytest.param(_field(1, b""), "PullImage names no image (its image_ref is empty)", id="empty-ref"),
        pytest.param(b"\x0a\x09sha256:", "PullImage is not its protobuf message (a field of 9 bytes", id="garbage"),
        pytest.param(
            _varint(1 << 3) + _varint(7), "PullImage is not its protobuf message (field 1 of wire", id="ref-not-string"
        ),
    ],
)
def test_a_pull_image_answer_that_names_no_image_is_no_pull(tmp_path: Path, pulled: bytes, says: str) -> None:
    with _cri_socket(tmp_path / "cri.sock", b"", pulled) as (path, calls):
        done = _cri_pull(path)
    assert "Traceback" not in done.stderr, done.stderr
    line = _failed_line(done.stdout, "busybox:1")
    assert f"error=the CRI answer to {says}" in line, line
    assert f" attempts={RETRIES} " in line, "retried as a transient failure"
    assert calls == ["ImageStatus", "PullImage"] * RETRIES
    assert done.returncode == 1


@pytest.mark.parametrize(
    ("status", "pulled", "result"),
    [
        pytest.param(
            _field(1, IMAGE_ID + SIZE + _field(99, b"new") + _field(7, _field(1, b"busybox:1"))),
            b"",
            "present",
            id="image-with-a-newer-field",
        ),
        pytest.param(
            _field(1, IMAGE_ID) + _field(1, SIZE) + _field(2, _field(1, b"k") + _field(2, b"v")),
            b"",
            "present",
            id="image-split-and-info",
        ),
        pytest.param(b"", _field(1, b"sha256:" + b"ab" * 32), "pulled", id="absent-then-pulled"),
        pytest.param(
            _field(2, _field(1, b"info") + _field(2, b"{}")),
            _field(1, b"sha256:" + b"ab" * 32),
            "pulled",
            id="info-alone-then-pulled",
        ),
    ],
)
def test_well_formed_cri_answers_still_count(tmp_path: Path, status: bytes, pulled: bytes, result: str) -> None:
    """The controls: what the strict reading must still take, a split message merged as protobuf merges."""
    with _cri_socket(tmp_path / "cri.sock", status, pulled) as (path, _calls):
        done = _cri_pull(path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0].startswith(f"image=busybox:1 result={result} "), done.stdout
