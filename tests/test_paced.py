"""bench/paced.py, the open-loop client, against a TLS server in-process: a slow answer shows in the tail
(latency is counted from each request's due time), the warm-up is not measured, and answers other than
200 are failures, named by status."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import uvloop

from bench.paced import WARMUP, paced
from certs.authority import generate_files

RATE = 200.0


class Server:
    """HTTP/1.1 keep-alive over TLS: each request read whole (its Content-Length), then answered `status`;
    the requests whose numbers (from 1, in the order read) are in `slow` wait 350 ms first: the loop's timers
    count from its cached clock in whole milliseconds and may end a wait a little early, and the test asks
    for at least 300."""

    def __init__(self, status: int, slow: set[int]) -> None:
        self.status, self.slow, self.count = status, slow, 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
                await reader.readexactly(int(fields[b"Content-Length"]))
                self.count += 1
                if self.count in self.slow:
                    await asyncio.sleep(0.35)
                writer.write(f"HTTP/1.1 {self.status} X\r\nContent-Length: 2\r\n\r\n{{}}".encode())
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def _run(tmp: Path, status: int, slow: set[int]) -> dict[str, Any]:
    files, _ = generate_files(tmp, "paced", "test", ips=["127.0.0.1"])
    serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serving.load_cert_chain(files["tls.crt"], files["tls.key"])
    server = await asyncio.start_server(Server(status, slow).handle, "127.0.0.1", 0, ssl=serving)
    port = server.sockets[0].getsockname()[1]
    client = ssl.create_default_context(cafile=str(files["ca.crt"]))
    async with server:
        return await paced(f"https://127.0.0.1:{port}/mutate", b'{"x": 1}', client, RATE, 1.0, 32)


def test_a_slow_answer_is_in_the_tail_and_the_warmup_is_not_measured(tmp_path: Path) -> None:
    warmup = int(RATE * WARMUP)
    result = uvloop.run(_run(tmp_path, 200, {5, warmup + 100}))  # one in the warm-up, one measured
    assert result["failures"] == {}
    assert result["requests"] == RATE  # the warm-up's answers are not among them
    assert result["rate"] >= 0.97 * RATE
    assert result["max"] >= 300
    assert result["p50"] < 100


def test_answers_other_than_200_are_failures_by_status(tmp_path: Path) -> None:
    result = uvloop.run(_run(tmp_path, 503, set()))
    assert result["failures"] == {"503": RATE * (1 + WARMUP)}
    assert result["requests"] == 0
