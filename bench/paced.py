"""An open-loop HTTPS client: requests sent on a schedule, whatever the earlier ones are doing, over a pool of
keep-alive connections (asyncio on uvloop, httptools parsing the answers). A closed-loop load generator (wrk)
measures a saturated server, whose latency is its queue: anything that takes CPU from it shows there. At a
fixed rate below saturation, the tail is what holds the server's loop, which is what a caller feels.

    python bench/paced.py --url https://127.0.0.1:PORT/mutate --body FILE --ca CA --rate 1000 --seconds 8

prints one JSON line: the rate kept, the latencies' percentiles (ms, from when each request was due, so a
late client is counted against the server, never hidden), the worst, and the failures by kind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httptools
import uvloop

REQUEST_TIMEOUT = 10.0  # seconds; a request still unanswered then counts as a failure
WARMUP = 0.5  # seconds of requests at the rate, not measured: the pool's connections are opened then


class _Answer:
    """httptools' callbacks for one response."""

    def __init__(self) -> None:
        self.body = bytearray()
        self.complete = False
        self.close = False  # the server said Connection: close (HTTP/1.1 keeps the connection otherwise)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"connection" and value.lower() == b"close":
            self.close = True

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_message_complete(self) -> None:
        self.complete = True


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Pool:
    """Up to `size` keep-alive HTTPS connections to one server, HTTP/1.1 with httptools parsing the answers: a
    few tens of microseconds of this process per request, where httpx's pool costs milliseconds and grows
    with the number of requests waiting for a connection. A request beyond `size` waits for a free
    connection (counted as the pool running out)."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext, size: int) -> None:
        self.host, self.port, self.context, self.size = host, port, context, size
        self._idle: asyncio.Queue[Stream | None] = asyncio.Queue()
        self._open = 0
        self.opened = 0  # connections opened, replacements included
        self.waited = 0  # requests that found every connection busy

    async def _take(self) -> Stream:
        if self._idle.empty():
            if self._open < self.size:
                self._open += 1
                return await self._connect()
            self.waited += 1
        stream = await self._idle.get()
        return stream if stream is not None else await self._connect()

    async def _connect(self) -> Stream:
        try:
            stream = await asyncio.open_connection(self.host, self.port, ssl=self.context)
        except BaseException:
            self._idle.put_nowait(None)  # a slot to open again
            raise
        self.opened += 1
        return stream

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        reader, writer = stream = await self._take()
        answer = _Answer()
        parser = httptools.HttpResponseParser(answer)
        try:
            writer.write(head.encode() + body)
            while not answer.complete:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("the server closed the connection")
                parser.feed_data(data)
        except BaseException:
            writer.close()
            self._idle.put_nowait(None)
            raise
        if answer.close:
            writer.close()
            self._idle.put_nowait(None)
        else:
            self._idle.put_nowait(stream)
        return parser.get_status_code(), bytes(answer.body)

    async def close(self) -> None:
        while not self._idle.empty():
            stream = self._idle.get_nowait()
            if stream is not None:
                stream[1].close()


def percentile(ordered: list[float], q: float) -> float:
    """Of sorted values, the one at rank int(q * n), the last at most; NaN for none."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def paced(
    url: str, body: bytes, context: ssl.SSLContext, rate: float, seconds: float, size: int
) -> dict[str, Any]:
    """Send `body` to `url` `rate` times a second for `seconds` after WARMUP, open loop; latency from each
    request's due time."""
    parts = urlsplit(url)
    pool = Pool(parts.hostname or "", parts.port or 443, context, size)
    latencies: list[float] = []
    failures: Counter[str] = Counter()

    async def one(due: float, measured: bool) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                status, _ = await pool.post(parts.path or "/", body)
        except (OSError, TimeoutError) as err:
            failures[type(err).__name__] += 1
            return
        if status != 200:
            failures[str(status)] += 1
        elif measured:
            latencies.append((time.perf_counter() - due) * 1000)

    warmup = int(rate * WARMUP)
    count = warmup + int(rate * seconds)
    tasks: list[asyncio.Task[None]] = []
    start = time.perf_counter() + 0.05
    late = 0.0
    while len(tasks) < count:
        now = time.perf_counter()
        due = start + len(tasks) / rate
        if due > now:
            await asyncio.sleep(due - now)
            continue
        late = max(late, now - due)
        while len(tasks) < count and start + len(tasks) / rate <= now:  # every request due by now, at once
            tasks.append(asyncio.create_task(one(start + len(tasks) / rate, len(tasks) >= warmup)))
    sent = time.perf_counter() - start
    await asyncio.gather(*tasks)
    await pool.close()
    latencies.sort()
    return {
        "rate": count / sent,
        "requests": len(latencies),
        **{f"p{name}": percentile(latencies, q) for name, q in (("50", 0.5), ("99", 0.99), ("99.9", 0.999))},
        "max": latencies[-1] if latencies else float("nan"),
        "late_ms": late * 1000,
        "connections": pool.opened,
        "failures": dict(failures),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", required=True)
    parser.add_argument("--body", type=Path, required=True)
    parser.add_argument("--ca", type=Path, required=True)
    parser.add_argument("--rate", type=float, default=1000)
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--connections", type=int, default=32)
    args = parser.parse_args()
    context = ssl.create_default_context(cafile=str(args.ca))
    result = uvloop.run(paced(args.url, args.body.read_bytes(), context, args.rate, args.seconds, args.connections))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
