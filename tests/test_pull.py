"""The puller's pure parts: reference normalisation, the credential keyring, its command line. Every
client path runs against real daemons in test_pull_daemons.py."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from webhook.config import build_settings
from webhook.errors import InvalidReference
from webhook.mutation.pod import read_pod
from webhook.mutation.puller import select_images
from webhook.pull import distinct
from webhook.pull.errors import ERROR_LIMIT, PullError
from webhook.pull.keyring import Credential, Keyring
from webhook.pull.native import PASSWORD_LIMIT, _typed
from webhook.references import normalise, parse


@pytest.mark.parametrize(
    ("written", "normalised"),
    [
        ("busybox", "docker.io/library/busybox:latest"),
        ("library/busybox", "docker.io/library/busybox:latest"),
        ("docker.io/library/busybox:latest", "docker.io/library/busybox:latest"),
        ("index.docker.io/library/busybox", "docker.io/library/busybox:latest"),
        ("index.docker.io/busybox:1", "docker.io/library/busybox:1"),
        # Only index.docker.io, spelled exactly so, is an alias to the runtimes: these are names of their own.
        ("registry-1.docker.io/library/busybox:1", "registry-1.docker.io/library/busybox:1"),
        ("registry-1.docker.io/busybox", "registry-1.docker.io/busybox:latest"),
        ("INDEX.DOCKER.IO/library/busybox", "INDEX.DOCKER.IO/library/busybox:latest"),
        ("team/app:1", "docker.io/team/app:1"),
        ("localhost/app", "localhost/app:latest"),
        ("localhost:5000/app:v1", "localhost:5000/app:v1"),
        ("registry.example.com:5000/a/b/c@sha256:" + "ab" * 32, "registry.example.com:5000/a/b/c@sha256:" + "ab" * 32),
        ("cr.flyte.org/flyteorg/flytecopilot:v1.15.3", "cr.flyte.org/flyteorg/flytecopilot:v1.15.3"),
    ],
)
def test_references_normalise_as_the_runtimes_do(written: str, normalised: str) -> None:
    assert normalise(written) == normalised


@pytest.mark.parametrize(
    "text", ["--help", "-x", "UPPER/app", "app:", "a b", "", "app@sha256:xyz", "x" * 600, "busybox\n", "app:v1\n"]
)
def test_invalid_references_never_reach_a_client(text: str) -> None:
    with pytest.raises(InvalidReference):
        parse(text)


def test_the_webhook_selects_by_the_same_names_the_runtimes_use() -> None:
    images = ["busybox:1", "docker.io/library/busybox:1", "index.docker.io/library/busybox:1"]
    images += ["registry-1.docker.io/library/busybox:1", "registry-1.docker.io/library/busybox:1"]
    pod = {"spec": {"containers": [{"name": f"c{i}", "image": image} for i, image in enumerate(images)]}}
    selected = select_images(read_pod(pod), build_settings({}).image_puller)
    assert selected == ["docker.io/library/busybox:1", "registry-1.docker.io/library/busybox:1"]


def _keyring(tmp_path: Path, auths: dict[str, object]) -> Keyring:
    (tmp_path / "s.json").write_text(json.dumps({"auths": auths}))
    keyring, problems = Keyring.from_directory(str(tmp_path))
    assert problems == []
    return keyring


def _auth(user: str) -> dict[str, str]:
    return {"auth": base64.b64encode(f"{user}:pw".encode()).decode()}


def test_keyring_matches_as_the_kubelet_does(tmp_path: Path) -> None:
    keyring = _keyring(
        tmp_path,
        {
            "https://index.docker.io/v1/": _auth("hub"),
            "registry.example.com": _auth("any-path"),
            "registry.example.com/team": _auth("team"),
            "*.corp.example": _auth("wildcard"),
            "registry.example.com:5000": _auth("port"),
        },
    )

    def users(image: str) -> list[str]:
        return [c.username for c in keyring.lookup(parse(image))]

    assert users("busybox") == ["hub"]
    assert users("registry.example.com/team/app:1") == ["team", "any-path"], "most specific first, then the rest"
    assert users("registry.example.com/other/app:1") == ["any-path"]
    assert users("registry.example.com:5000/team/app:1") == ["port"], "ports must be equal"
    assert users("git.corp.example/tools/agent:3") == ["wildcard"]
    assert users("a.b.corp.example/x:1") == [], "a * matches one label"
    assert users("registry-1.docker.io/library/busybox:1") == [], "another registry to the kubelet's keyring"


def test_registry_1_docker_io_has_keys_of_its_own(tmp_path: Path) -> None:
    keyring = _keyring(tmp_path, {"docker.io": _auth("hub"), "registry-1.docker.io": _auth("r1")})
    assert [c.username for c in keyring.lookup(parse("registry-1.docker.io/team/app:1"))] == ["r1"]
    assert [c.username for c in keyring.lookup(parse("index.docker.io/team/app:1"))] == ["hub"]


def test_broken_pull_secrets_are_reported_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "badauth.json").write_text(json.dumps({"auths": {"r.example": {"auth": "!!"}}}))
    (tmp_path / "good.json").write_text(json.dumps({"auths": {"r.example": _auth("ok")}}))
    keyring, problems = Keyring.from_directory(str(tmp_path))
    assert len(problems) == 2
    assert [c.username for c in keyring.lookup(parse("r.example/x:1"))] == ["ok"]


def test_a_secret_nested_deeper_than_the_parser_recurses_is_named_and_skipped(tmp_path: Path) -> None:
    (tmp_path / "deep.json").write_text("[" * 200_000 + "]" * 200_000)  # 400 KB: a Secret may hold 1 MiB
    (tmp_path / "deep-auths.json").write_text(json.dumps({"auths": {"r.example": "@"}}).replace('"@"', "[" * 100_000))
    (tmp_path / "good.json").write_text(json.dumps({"auths": {"r.example": _auth("ok")}}))
    keyring, problems = Keyring.from_directory(str(tmp_path))
    assert problems == [
        "pull secret deep-auths.json ignored: nested too deeply to read",
        "pull secret deep.json ignored: nested too deeply to read",
    ]
    assert [c.username for c in keyring.lookup(parse("r.example/x:1"))] == ["ok"]


def test_a_registry_key_that_is_no_url_is_named_and_its_entry_skipped(tmp_path: Path) -> None:
    auths = {"r.example:abc": _auth("bad-port"), "https://[oops": _auth("bad-host"), "r.example": _auth("ok")}
    (tmp_path / "team.json").write_text(json.dumps({"auths": auths}))
    keyring, problems = Keyring.from_directory(str(tmp_path))
    assert problems == [
        "pull secret team.json: registry 'r.example:abc' ignored: Port could not be cast to integer value as 'abc'",
        "pull secret team.json: registry 'https://[oops' ignored: Invalid IPv6 URL",
    ]
    assert [c.username for c in keyring.lookup(parse("r.example/x:1"))] == ["ok"]


def test_a_file_larger_than_any_secret_is_not_read_whole(tmp_path: Path) -> None:
    (tmp_path / "huge.json").write_bytes(b" " * (2 * 1024 * 1024))
    _, problems = Keyring.from_directory(str(tmp_path))
    assert problems == ["pull secret huge.json ignored: larger than 1048576 bytes, more than a Secret holds"]


def test_images_are_pulled_once_however_they_are_spelled() -> None:
    images = ["busybox", "docker.io/library/busybox:latest", "library/busybox", "index.docker.io/busybox"]
    images += ["registry-1.docker.io/library/busybox", "--help", "--help", "busybox:1", "docker.io/busybox:1"]
    assert distinct(images) == ["busybox", "registry-1.docker.io/library/busybox", "--help", "busybox:1"]


@pytest.mark.parametrize(
    ("username", "password", "says"),
    [
        ("a:b", "pw", "the user name for r.example holds ':'"),
        ("alice", "", "cannot be typed at ctr's prompt"),
        ("alice", "two\nlines", "cannot be typed at ctr's prompt"),
        ("alice", "x" * (PASSWORD_LIMIT + 1), "cannot be typed at ctr's prompt"),
    ],
)
def test_what_ctrs_prompt_cannot_take_is_refused_for_that_key(username: str, password: str, says: str) -> None:
    with pytest.raises(PullError, match=says) as refused:
        _typed(Credential("r.example", username, password))
    assert refused.value.permanent, "the next credential, or none, is tried"
    assert _typed(Credential("r.example", "alice", "x" * PASSWORD_LIMIT)) == b"x" * PASSWORD_LIMIT + b"\n"


def test_long_errors_keep_what_failed_and_why() -> None:
    error = PullError("failed to pull " + "x" * 500 + ": not found")
    assert len(error.message) <= ERROR_LIMIT
    assert error.message.startswith("failed to pull")
    assert error.message.endswith(": not found")
    assert error.permanent


def _pull(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "webhook.pull", *args], capture_output=True, text=True, timeout=60)


def test_usage_errors_exit_2_and_no_images_is_fine() -> None:
    assert _pull("--runtime=podman", "--socket=/s", "--", "x").returncode == 2
    for option in ("--timeout=nan", "--timeout=inf", "--timeout=1e308", "--timeout=0", "--backoff=nan", "--backoff=-1"):
        done = _pull("--runtime=docker", "--socket=/s", option, "--", "x")
        assert (done.returncode, "Traceback" in done.stderr) == (2, False), (option, done.stderr)
        assert option.split("=")[0] + " must be" in done.stderr
    assert _pull("--runtime=docker", "--socket=/s", "--pod-network-registry=r", "--", "x").returncode == 2
    done = _pull("--runtime=cri", "--socket=/s")
    assert done.returncode == 0
    assert done.stdout.startswith("summary present=0")


@pytest.mark.parametrize(("make", "says"), [(None, "no such directory"), ("file", "not a directory")])
def test_a_pull_secrets_path_that_is_no_directory_is_a_usage_error(tmp_path: Path, make: str | None, says: str) -> None:
    path = tmp_path / "secrets"
    if make == "file":
        path.write_text("{}")
    done = _pull("--runtime=docker", "--socket=/s", f"--pull-secrets={path}", "--", "busybox:1")
    assert "Traceback" not in done.stderr
    assert done.returncode == 2, "the documented exit code of a usage error"
    assert f"--pull-secrets {path}: {says}" in done.stderr


def test_an_absent_socket_fails_each_image_with_its_cause() -> None:
    done = _pull("--runtime=docker", "--socket=/nonexistent.sock", "--retries=1", "--", "busybox:1")
    assert done.returncode == 0, done.stderr
    assert "image=busybox:1 result=failed attempts=0" in done.stdout, "it never got to pull"
    assert "No such file or directory" in done.stdout


@pytest.mark.parametrize(
    ("message", "permanent"),
    [
        ('Get "http://127.0.0.1:40135/v2/": dial tcp 127.0.0.1:40135: connect: connection refused', False),
        ("dial tcp 10.0.0.1:4030: i/o timeout", False),
        ("pulling from host r:5000 failed with status code [manifests v1]: 401 Unauthorized", True),
        ("unexpected status: 403 Forbidden", True),
        ("failed to resolve reference: not found", True),
    ],
)
def test_refusals_are_told_from_addresses_that_contain_the_same_digits(message: str, permanent: bool) -> None:
    assert PullError(message).permanent is permanent


# --- a docker socket that does not answer as dockerd does ---------------------------------------------

Answer = Callable[[str, socket.socket], None]  # (request line, connection): writes whatever it writes


@contextmanager
def _docker_socket(path: Path, answer: Answer) -> Iterator[str]:
    """A unix socket that reads each request's head and answers through `answer`; closed after each."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(16)
    stop = threading.Event()

    def serve(connection: socket.socket) -> None:
        with connection, suppress(OSError):
            head = b""
            while b"\r\n\r\n" not in head and (chunk := connection.recv(65536)):
                head += chunk
            if head and not stop.is_set():
                answer(head.split(b"\r\n", 1)[0].decode(), connection)

    def accept() -> None:
        with suppress(OSError):
            while not stop.is_set():
                connection, _ = server.accept()
                threading.Thread(target=serve, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield str(path)
    finally:
        stop.set()
        server.shutdown(socket.SHUT_RDWR)
        server.close()


def _image_absent(request: str, connection: socket.socket) -> bool:
    """Answer an inspection with dockerd's 404; True when it was one."""
    if request.startswith("GET "):
        body = b'{"message":"No such image"}'
        connection.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        return True
    return False


def _garbage(request: str, connection: socket.socket) -> None:
    connection.sendall(b"\x00\x01 not http at all\r\n\r\n")


def _cut_short_error(request: str, connection: socket.socket) -> None:
    connection.sendall(b'HTTP/1.1 500 Internal Server Error\r\nContent-Length: 100\r\n\r\n{"mess')


def _cut_short_stream(request: str, connection: socket.socket) -> None:
    if not _image_absent(request, connection):
        connection.sendall(b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n{"status":"Pulling')


def _endless_headers(request: str, connection: socket.socket) -> None:
    connection.sendall(b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 1000 + b"\r\n")


def _progress_forever(request: str, connection: socket.socket) -> None:
    """What dockerd does while a registry trickles a layer: a progress message every 0.2 s."""
    if not _image_absent(request, connection):
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            line = b'{"status":"Downloading","progressDetail":{"current":1,"total":9},"id":"0123"}\r\n'
            connection.sendall(b"%x\r\n%s\r\n" % (len(line), line))
            time.sleep(0.2)


def _one_endless_line(request: str, connection: socket.socket) -> None:
    """A line that never ends, 16 MB a second."""
    if not _image_absent(request, connection):
        connection.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * (1024 * 1024)
        while True:
            connection.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            time.sleep(1 / 16)


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (_garbage, "not an HTTP answer (BadStatusLine"),
        (_cut_short_error, "HTTP 500"),
        (
            _cut_short_stream,
            "the Docker Engine answer to image pull was cut short after 18 bytes, before its last chunk",
        ),
        (_endless_headers, "not an HTTP answer (HTTPException: got more than 100 headers)"),
    ],
)
def test_a_docker_socket_answering_garbage_fails_the_image_not_the_puller(
    tmp_path: Path, answer: Answer, says: str
) -> None:
    with _docker_socket(tmp_path / "docker.sock", answer) as path:
        done = _pull("--runtime=docker", f"--socket={path}", "--retries=2", "--backoff=0.05", "--", "busybox:1")
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0, "failure policy Ignore"
    line = done.stdout.splitlines()[0]
    assert line.startswith("image=busybox:1 result=failed attempts="), done.stdout
    assert says in line


def _peak_memory_kib(process: subprocess.Popen[str]) -> int:
    """The child's resident high-water mark, read until it exits."""
    peak = 0
    while process.poll() is None:
        with suppress(OSError, StopIteration):
            status = Path(f"/proc/{process.pid}/status").read_text()
            peak = max(peak, int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM:")).split()[1]))
        time.sleep(0.05)
    return peak


def test_timeout_is_the_whole_runs_deadline_and_a_stream_holds_one_line(tmp_path: Path) -> None:
    """A line past the cap fails at the cap instead (test_pull_answers.py)."""
    with _docker_socket(tmp_path / "docker.sock", _progress_forever) as path:
        started = time.monotonic()
        command = [sys.executable, "-m", "webhook.pull", "--runtime=docker", f"--socket={path}", "--timeout=3"]
        process = subprocess.Popen(
            [*command, "--failure-policy=Fail", "--", "busybox:1", "team/app:2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        peak = _peak_memory_kib(process)
        out, err = process.communicate(timeout=30)
        seconds = time.monotonic() - started
    assert "Traceback" not in err, err
    assert seconds < 8, f"a --timeout=3 run took {seconds:.1f} s"  # was: never ended
    for image, line in zip(("busybox:1", "team/app:2"), out.splitlines(), strict=False):
        assert line.startswith(f"image={image} result=failed attempts=1 "), out
        assert line.endswith(" error=timed out"), line
    assert process.returncode == 1, "failure policy Fail"
    assert peak < 80 * 1024, f"peak RSS {peak} KiB for a stream of {seconds * 16:.0f} MB"


def test_long_references_are_refused_without_being_kept() -> None:
    """References are parsed once and kept (every pod of a task names the same images), except those over
    512 characters, which never parse and would hold megabytes if kept."""
    import gc
    import tracemalloc

    from webhook.errors import InvalidReference
    from webhook.references import normalise, parse

    assert normalise("busybox") == "docker.io/library/busybox:latest"
    assert parse("busybox") is parse("busybox")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(50):
            for read in (parse, normalise):
                with pytest.raises(InvalidReference, match="invalid image reference"):
                    read(f"registry/{i}/" + "a" * 1_000_000)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 1_000_000, f"{kept} bytes kept after refusing 100 MB of references"
