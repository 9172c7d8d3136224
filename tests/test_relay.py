"""The relay (webhook/web/relay.py): requests handed over a Unix socket to a stock uvicorn server and answered
back byte for byte, driven as the admission connection drives it, under both event loops."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import pytest
import uvloop

from tests.helpers import PODS
from webhook.config import build_settings
from webhook.web.relay import HIGH_WATER, HumanApi, Relay, State, forwarded_head
from webhook.web.server import WebhookApp

T = TypeVar("T")
LoopFactory = Callable[[], asyncio.AbstractEventLoop]
Message = dict[str, Any]

BIG_CHUNKS = 64
BIG = b"".join(b"%08d" % i * 8192 for i in range(BIG_CHUNKS))  # 4 MiB; each 64 KiB chunk names its place


@pytest.fixture(params=[asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def loop_factory(request: pytest.FixtureRequest) -> LoopFactory:
    factory: LoopFactory = request.param
    return factory


def run(loop_factory: LoopFactory, main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run `main`, cut off after 30 s should it hang (a guard, not a measure)."""
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(asyncio.wait_for(main(), 30))


class App:
    """An ASGI application of the test's own: /echo answers what it was asked, /big 4 MiB, /refuse 413 without
    reading the body, and /hold answers a first chunk and then waits for what receive() says next."""

    def __init__(self) -> None:
        self.sent = 0  # bytes of /big sent so far
        self.after_answer: asyncio.Future[str] | None = None

    async def __call__(self, scope: Message, receive: Callable[[], Awaitable[Message]], send: Any) -> None:
        if scope["path"] == "/echo":
            await self._echo(scope, receive, send)
        elif scope["path"] == "/big":
            length = [(b"content-length", b"%d" % len(BIG))]
            await send({"type": "http.response.start", "status": 200, "headers": length})
            for start in range(0, len(BIG), 64 * 1024):
                await send({"type": "http.response.body", "body": BIG[start : start + 64 * 1024], "more_body": True})
                self.sent = start + 64 * 1024
            await send({"type": "http.response.body", "body": b""})
        elif scope["path"] == "/refuse":
            await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
        else:
            self.after_answer = asyncio.get_running_loop().create_future()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await receive()  # the request itself
            self.after_answer.set_result((await receive())["type"])

    @staticmethod
    async def _echo(scope: Message, receive: Callable[[], Awaitable[Message]], send: Any) -> None:
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        seen = {
            "method": scope["method"],
            "version": scope["http_version"],
            "query": scope["query_string"].decode(),
            "headers": [[name.decode(), value.decode()] for name, value in scope["headers"]],
            "body": body.decode(),
        }
        answer = json.dumps(seen).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


class Client:
    """A Downstream that records what the relay tells it."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.ended: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.backlog: list[bool] = []
        self.late: list[str] = []  # calls after relay_ended

    def relayed(self, data: bytes) -> None:
        if self.ended.done():
            self.late.append("relayed")
        self.data += data

    def relay_ended(self, answered: bool) -> None:
        if self.ended.done():
            self.late.append("relay_ended")
        else:
            self.ended.set_result(answered)

    def relay_backlog(self, full: bool) -> None:
        if self.ended.done():
            self.late.append("relay_backlog")
        self.backlog.append(full)

    def answer(self) -> tuple[str, dict[str, str], bytes]:
        head, _, body = bytes(self.data).partition(b"\r\n\r\n")
        status, *lines = head.decode().split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.lower()] = value.strip()
        return status, headers, body


@contextlib.asynccontextmanager
async def serving(app: Any, signals: list[int] | None = None) -> AsyncIterator[HumanApi]:
    api = HumanApi(app, on_signal=(signals if signals is not None else []).append)
    await api.start()
    try:
        yield api
    finally:
        await api.stop()


async def connected(relay: Relay) -> None:
    while relay.state is State.CONNECTING:
        await asyncio.sleep(0)


def head(method: bytes, target: bytes, *headers: tuple[bytes, bytes], upgrade: bool = False) -> bytes:
    return forwarded_head(method, target, "1.1", [(b"Host", b"webhook"), *headers], upgrade=upgrade)


def test_a_relayed_get_gets_its_whole_answer_and_the_connection_closes(loop_factory: LoopFactory) -> None:
    async def main() -> None:
        async with serving(App()) as api:
            client = Client()
            api.relay(client, head(b"GET", b"/echo?output=diff"))
            assert await client.ended is True
            status, headers, body = client.answer()
            assert status == "HTTP/1.1 200 OK"
            assert headers["connection"] == "close"
            assert "server" not in headers
            assert len(body) == int(headers["content-length"])
            seen = json.loads(body)
            assert (seen["method"], seen["query"], seen["body"]) == ("GET", "output=diff", "")
            assert client.backlog == []
            assert client.late == []

    run(loop_factory, main)


@pytest.mark.parametrize(
    ("framing", "pieces"),
    [
        ((b"Content-Length", b"11"), [b"hello ", b"wor", b"ld"]),
        ((b"Transfer-Encoding", b"chunked"), [b"6\r\nhel", b"lo \r\n5\r\nworld\r", b"\n0\r\n\r\n"]),
    ],
    ids=["content-length", "chunked"],
)
def test_a_body_in_pieces_before_and_after_the_connection_arrives_whole(
    loop_factory: LoopFactory, framing: tuple[bytes, bytes], pieces: list[bytes]
) -> None:
    async def main() -> None:
        async with serving(App()) as api:
            client = Client()
            relay = api.relay(client, head(b"POST", b"/echo", framing))
            relay.body(pieces[0])
            assert relay.state is State.CONNECTING
            await connected(relay)
            for piece in pieces[1:]:
                relay.body(piece)
            assert await client.ended is True
            assert json.loads(client.answer()[2])["body"] == "hello world"

    run(loop_factory, main)


def test_an_answer_before_the_body_ends_the_relay_and_the_body_is_dropped(loop_factory: LoopFactory) -> None:
    async def main() -> None:
        async with serving(App()) as api:
            client = Client()
            relay = api.relay(client, head(b"POST", b"/refuse", (b"Content-Length", b"%d" % (4 * HIGH_WATER))))
            assert await client.ended is True
            assert client.answer()[0] == "HTTP/1.1 413 Request Entity Too Large"
            for _ in range(4):
                relay.body(b"x" * HIGH_WATER)
            assert client.backlog == []
            assert client.late == []

    run(loop_factory, main)


def test_hop_by_hop_headers_do_not_reach_the_application(loop_factory: LoopFactory) -> None:
    async def main() -> None:
        async with serving(App()) as api:
            client = Client()
            api.relay(
                client,
                head(
                    b"GET",
                    b"/echo",
                    (b"Connection", b"keep-alive, x-foo"),
                    (b"x-foo", b"1"),
                    (b"Upgrade", b"websocket"),
                    (b"Keep-Alive", b"timeout=5"),
                    (b"TE", b"trailers"),
                    (b"Proxy-Connection", b"keep-alive"),
                    (b"X-Bar", b"2"),
                ),
            )
            assert await client.ended is True
            seen = json.loads(client.answer()[2])["headers"]
            assert seen == [["host", "webhook"], ["x-bar", "2"], ["connection", "close"]]

    run(loop_factory, main)


def test_an_upgrade_request_is_answered_at_once_without_its_declared_body(loop_factory: LoopFactory) -> None:
    async def main() -> None:
        async with serving(App()) as api:
            client = Client()
            api.relay(
                client,
                head(
                    b"POST",
                    b"/echo",
                    (b"Connection", b"Upgrade"),
                    (b"Upgrade", b"websocket"),
                    (b"Content-Length", b"100"),
                    upgrade=True,
                ),
            )
            assert await client.ended is True  # not waiting for 100 bytes that never come
            seen = json.loads(client.answer()[2])
            assert seen["body"] == ""
            assert seen["headers"] == [["host", "webhook"], ["connection", "close"]]

    run(loop_factory, main)


def test_the_forwarded_head_keeps_the_version_and_the_framing() -> None:
    headers = [
        (b"Host", b"webhook"),
        (b"Connection", b"keep-alive, Content-Length, Host, X-Foo"),
        (b"X-Foo", b"1"),
        (b"Content-Length", b"2"),
    ]
    assert forwarded_head(b"POST", b"/preview?output=diff", "1.0", headers, upgrade=False) == (
        b"POST /preview?output=diff HTTP/1.0\r\nHost: webhook\r\nContent-Length: 2\r\nconnection: close\r\n\r\n"
    )
    chunked = [(b"Host", b"webhook"), (b"Transfer-Encoding", b"chunked"), (b"Connection", b"upgrade")]
    assert forwarded_head(b"GET", b"/", "1.1", chunked, upgrade=True) == (
        b"GET / HTTP/1.1\r\nHost: webhook\r\nconnection: close\r\n\r\n"
    )
    with pytest.raises(ValueError, match="CR, LF or NUL"):
        forwarded_head(b"GET", b"/", "1.1", [(b"X-Foo", b"1\r\nX-Injected: 2")], upgrade=False)
    with pytest.raises(ValueError, match="version"):
        forwarded_head(b"GET", b"/", "2", [], upgrade=False)


def test_a_large_answer_arrives_whole_and_in_order_while_its_client_pauses_and_resumes(
    loop_factory: LoopFactory,
) -> None:
    class Pausing(Client):
        relay: Relay
        paused = False
        while_paused = 0

        def relayed(self, data: bytes) -> None:
            super().relayed(data)
            self.while_paused += self.paused
            if not self.paused and not self.first.done():
                self.relay.pause()
                self.paused = True
                self.first.set_result(None)

        first: asyncio.Future[None]

    async def main() -> None:
        app = App()
        async with serving(app) as api:
            client = Pausing()
            client.first = asyncio.get_running_loop().create_future()
            client.relay = api.relay(client, head(b"GET", b"/big"))
            await client.first
            await asyncio.sleep(0.2)  # time for the application to run as far as it can
            assert client.while_paused == 0
            assert app.sent < len(BIG) // 2  # held by the client that reads nothing
            client.paused = False
            client.relay.resume()
            assert await client.ended is True
            status, _, body = client.answer()
            assert status == "HTTP/1.1 200 OK"
            assert body == BIG

    run(loop_factory, main)


def test_request_bytes_waiting_upstream_hold_the_client_until_they_drain(loop_factory: LoopFactory) -> None:
    body = b"x" * (16 * HIGH_WATER)

    async def main() -> None:
        async with serving(App()) as api:
            client = Client()
            request = head(b"POST", b"/echo", (b"Content-Length", b"%d" % len(body)))
            relay = api.relay(client, request)
            first = HIGH_WATER - len(request)
            relay.body(body[:first])
            assert client.backlog == []  # HIGH_WATER bytes queued, head included
            relay.body(body[first : first + 1])
            assert client.backlog == [True]  # one more, before the connection was made
            for start in range(first + 1, len(body), HIGH_WATER):
                relay.body(body[start : start + HIGH_WATER])
            assert await client.ended is True
            assert client.backlog == [True, False]
            assert json.loads(client.answer()[2])["body"] == body.decode()

    run(loop_factory, main)


def test_an_abort_mid_answer_is_a_disconnect_for_the_application(loop_factory: LoopFactory) -> None:
    class Aborting(Client):
        relay: Relay

        def relayed(self, data: bytes) -> None:
            super().relayed(data)
            self.relay.abort()

    async def main() -> None:
        app = App()
        async with serving(app) as api:
            client = Aborting()
            client.relay = api.relay(client, head(b"GET", b"/hold"))
            while app.after_answer is None:
                await asyncio.sleep(0.01)
            assert await app.after_answer == "http.disconnect"
        assert not client.ended.done()  # the server stopped: every connection was gone
        assert client.late == []

    run(loop_factory, main)


def test_an_abort_while_connecting_reaches_nobody(loop_factory: LoopFactory) -> None:
    async def main() -> None:
        async with serving(App()) as api:
            client = Client()
            relay = api.relay(client, head(b"GET", b"/echo"))
            relay.abort()
            relay.body(b"ignored")
        assert not client.ended.done()
        assert client.data == b""

    run(loop_factory, main)


def test_a_stopped_api_ends_a_relay_unanswered(loop_factory: LoopFactory) -> None:
    async def main() -> None:
        async with serving(App()) as api:
            pass
        client = Client()
        relay = api.relay(client, head(b"POST", b"/echo", (b"Content-Length", b"2")))
        relay.body(b"hi")
        assert await client.ended is False
        assert client.data == b""
        assert client.late == []

    run(loop_factory, main)


def test_the_socket_directory_is_private_and_removed_on_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))

    async def main() -> None:
        api = HumanApi(App(), on_signal=print)
        await api.start()
        assert api.directory is not None
        assert api.socket_path is not None
        directory = Path(api.directory)
        assert directory.parent == tmp_path
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert stat.S_ISSOCK(Path(api.socket_path).stat().st_mode)
        await api.stop()
        assert not directory.exists()

    run(asyncio.new_event_loop, main)


@pytest.mark.parametrize("kind", ["missing", "a file", "read-only", "too long for a socket path"])
def test_start_without_a_writable_tmpdir_fails_naming_it(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmpdir = {
        "missing": tmp_path / "missing",
        "a file": tmp_path / "file",
        "read-only": Path("/sys"),  # sysfs: no directory can be made there, whoever asks
        "too long for a socket path": tmp_path / ("x" * 100),
    }[kind]
    if kind == "a file":
        tmpdir.write_bytes(b"")
    if kind.startswith("too long"):
        tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))

    async def main() -> None:
        api = HumanApi(App(), on_signal=print)
        with pytest.raises(RuntimeError, match=f"TMPDIR={tmpdir}"):
            await api.start()

    run(asyncio.new_event_loop, main)
    if kind.startswith("too long"):
        assert list(tmpdir.iterdir()) == []  # nothing left behind


def test_a_signal_reaches_on_signal_only_and_is_not_raised_again(loop_factory: LoopFactory) -> None:
    raised: list[int] = []

    def before(sig: int, frame: FrameType | None) -> None:
        raised.append(sig)

    async def main() -> None:
        signals: list[int] = []
        async with serving(App(), signals) as api:
            signal.raise_signal(signal.SIGTERM)
            api.server.handle_exit(signal.SIGTERM, None)
            assert signals == [signal.SIGTERM, signal.SIGTERM]
            assert not api.server.should_exit
            client = Client()
            api.relay(client, head(b"GET", b"/echo"))
            assert await client.ended is True  # still serving

    previous = signal.signal(signal.SIGTERM, before)
    try:
        run(loop_factory, main)
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert raised == []


def test_the_webhook_application_answers_through_the_relay(loop_factory: LoopFactory) -> None:
    app = WebhookApp(build_settings({}))
    pod = (PODS / "flyte-1.15-bare.yaml").read_bytes()

    async def ask(api: HumanApi, request: bytes, body: bytes = b"") -> tuple[str, dict[str, str], bytes]:
        client = Client()
        api.relay(client, request).body(body)
        assert await client.ended is True
        return client.answer()

    async def main() -> None:
        async with serving(app) as api:
            assert (await ask(api, head(b"GET", b"/healthz")))[0] == "HTTP/1.1 200 OK"
            preview = head(
                b"POST", b"/preview", (b"Content-Type", b"application/yaml"), (b"Content-Length", b"%d" % len(pod))
            )
            status, headers, body = await ask(api, preview, pod)
            assert status == "HTTP/1.1 200 OK"
            assert headers["connection"] == "close"
            assert json.loads(body)["name"] == "bq2m4-n1-0"
            assert (await ask(api, head(b"GET", b"/nowhere")))[0] == "HTTP/1.1 404 Not Found"

    try:
        run(loop_factory, main)
    finally:
        app.previewer.stop()


def test_relay_before_start_is_a_mistake() -> None:
    async def main() -> None:
        with pytest.raises(RuntimeError, match="before start"):
            HumanApi(App(), on_signal=print).relay(Client(), b"")

    run(asyncio.new_event_loop, main)


def test_stop_twice_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))

    async def main() -> None:
        api = HumanApi(App(), on_signal=print)
        await api.start()
        await api.stop()
        await api.stop()

    run(asyncio.new_event_loop, main)
    assert os.listdir(tmp_path) == []
