"""A bounded soak: the real server under sustained mixed load for a few minutes, on loopback only.

    python bench/soak.py [--seconds 120] [--review-clients 3] [--json FILE]

At once, for `--seconds`: admission reviews on keep-alive connections (every endpoint, one bad review in
twenty), previews of a 40-pod List in every output, Prometheus scrapes of the plain metrics port and
readiness probes, an adversary cycling through what the server must refuse (headers trickled a byte at a
time, oversized heads, websocket upgrades, wrong methods, garbage), and a SIGHUP every 5 s. Every answer
is checked; memory is sampled every 2 s. Exits 1 on any failed check, a traceback or an ERROR in the
server's log, or when the server's RSS grows by more than `--max-growth-mb` after the first 20% of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import ssl
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench.load import BODY, bench_certs  # noqa: E402 - the load bench's review body and certificates
from harness.server_process import Server, client_context, free_port, running_server  # noqa: E402

JSON = {"content-type": "application/json"}
OUTPUTS = ("json", "yaml", "patch", "diff")


class Tally:
    """What every loop saw, shared by the threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self.latencies: list[float] = []

    def ok(self, kind: str, seconds: float | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if seconds is not None:
                self.latencies.append(seconds)

    def fail(self, kind: str, what: str) -> None:
        with self.lock:
            self.failures[kind] += 1
            self.examples.setdefault(kind, what[:300])


def _rss_kb(pid: int) -> int:
    """The server's resident memory, its preview workers' included."""
    total = 0
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):  # a worker is the child of the thread that started it
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    for one in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{one}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


def _server_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def reviews(server: Server, n: int, stop: threading.Event, tally: Tally) -> None:
    template = orjson.loads(BODY.read_bytes())
    paths = ("/mutate", "/mutate/ptrace", "/mutate/image-puller")
    i = 0
    with server.client(timeout=10) as client:
        while not stop.is_set():
            i += 1
            uid = f"soak-{n}-{i}"
            bad = i % 20 == 0
            body = (
                b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}'
                if bad
                else orjson.dumps({**template, "request": {**template["request"], "uid": uid}})
            )
            started = time.perf_counter()
            try:
                res = client.post(paths[i % 3], content=body, headers=JSON)
            except httpx.HTTPError as exc:
                tally.fail("review", f"{type(exc).__name__}: {exc}")
                continue
            seconds = time.perf_counter() - started
            if bad and res.status_code == 400 and "error" in res.json():
                tally.ok("bad review")
            elif not bad and res.status_code == 200 and res.json()["response"]["uid"] == uid:
                tally.ok("review", seconds)
            else:
                tally.fail("bad review" if bad else "review", f"{res.status_code} {res.text}")


def previews(server: Server, stop: threading.Event, tally: Tally) -> None:
    flyte = yaml.safe_load((ROOT / "tests" / "golden" / "pods" / "flyte-1.15-bare.yaml").read_text())
    body = orjson.dumps({"apiVersion": "v1", "kind": "List", "items": [flyte] * 40})
    i = 0
    with server.client(timeout=30) as client:
        while not stop.is_set():
            output = OUTPUTS[i % len(OUTPUTS)]
            i += 1
            try:
                res = client.post(f"/preview?output={output}", content=body, headers=JSON)
            except httpx.HTTPError as exc:
                tally.fail("preview", f"{type(exc).__name__}: {exc}")
                continue
            if res.status_code == 200:
                tally.ok(f"preview {output}")
            elif res.status_code == 503 and res.headers.get("retry-after") == "1":
                tally.ok("preview busy (503, retry)")
            else:
                tally.fail("preview", f"{res.status_code} {res.text}")
            stop.wait(0.2)


def scrapes(server: Server, metrics_port: int, stop: threading.Event, tally: Tally) -> None:
    with httpx.Client(timeout=5) as plain, server.client(timeout=5) as tls:
        while not stop.is_set():
            checks: tuple[tuple[str, httpx.Client, str], ...] = (
                ("scrape", plain, f"http://127.0.0.1:{metrics_port}/metrics"),
                ("readyz", tls, "/readyz"),
            )
            for kind, client, url in checks:
                try:
                    res = client.get(url)
                except httpx.HTTPError as exc:
                    tally.fail(kind, f"{type(exc).__name__}: {exc}")
                    continue
                if res.status_code == 200:
                    tally.ok(kind)
                else:
                    tally.fail(kind, f"{res.status_code} {res.text[:200]}")
            stop.wait(0.5)


def _connect(server: Server, metrics_port: int, tls: bool) -> socket.socket:
    if not tls:
        return socket.create_connection(("127.0.0.1", metrics_port), timeout=10)
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return client_context(server.ca).wrap_socket(raw, server_hostname="localhost")


def _until_closed(conn: socket.socket) -> bytes:
    answer = b""
    with contextlib.suppress(OSError):
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def _trickle(conn: socket.socket) -> tuple[bytes, float]:
    """Headers, one byte every 0.3 s: what came back, and when the server closed."""
    conn.sendall(b"GET /metrics HTTP/1.1\r\nX: ")
    conn.settimeout(0.3)
    started = time.monotonic()
    answer = b""
    while time.monotonic() - started < 15:
        try:
            conn.sendall(b"a")
            chunk = conn.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        answer += chunk
    return answer, time.monotonic() - started


def _websocket(conn: socket.socket) -> bytes:
    conn.sendall(
        b"GET /metrics HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
    )
    return _until_closed(conn)


def _oversized(conn: socket.socket) -> bytes:
    with contextlib.suppress(OSError):
        conn.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n" + b"a:b\r\n" * 200_000 + b"\r\n")
    return _until_closed(conn)


def _request(data: bytes) -> Callable[[socket.socket], bytes]:
    def send(conn: socket.socket) -> bytes:
        conn.sendall(data)
        return _until_closed(conn)

    return send


ADVERSARY: list[tuple[str, Callable[[socket.socket], bytes], Callable[[bytes], bool]]] = [
    ("1 MB of headers (431)", _oversized, lambda a: a == b"" or a.startswith(b"HTTP/1.1 431")),
    ("websocket upgrade (no 101, no 5xx)", _websocket, lambda a: a.startswith(b"HTTP/1.1 200")),
    (
        "POST /openapi.json (405, Allow: GET, HEAD)",
        _request(b"POST /openapi.json HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"),
        lambda a: a.startswith(b"HTTP/1.1 405") and b"allow: GET, HEAD" in a,
    ),
    ("garbage (400)", _request(b"\x00\x01garbage\r\n\r\n"), lambda a: a == b"" or a.startswith(b"HTTP/1.1 400")),
]


def adversary(server: Server, metrics_port: int, deadline: float, stop: threading.Event, tally: Tally) -> None:
    i = 0
    while not stop.is_set():
        tls = (i // len(ADVERSARY)) % 2 == 0  # each case on each port in turn
        port = "admission" if tls else "metrics"
        name, act, good = ADVERSARY[i % len(ADVERSARY)]
        if name.startswith("POST /openapi.json") and not tls:
            name, act, good = ADVERSARY[0]  # the metrics port serves no FastAPI page
        i += 1
        try:
            with _connect(server, metrics_port, tls) as conn:
                if i % 5 == 0:
                    answer, took = _trickle(conn)
                    name = "trickled headers (408 or closed at the deadline)"
                    ok = took < deadline + 1.5 and (answer == b"" or answer.startswith(b"HTTP/1.1 408"))
                else:
                    answer = act(conn)
                    ok = good(answer)
        except (OSError, ssl.SSLError) as exc:
            tally.fail(f"{name} on {port}", f"{type(exc).__name__}: {exc}")
            continue
        if ok:
            tally.ok(f"{name} on {port}")
        else:
            tally.fail(f"{name} on {port}", repr(answer[:200]))
        stop.wait(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--review-clients", type=int, default=3)
    parser.add_argument("--max-growth-mb", type=float, default=16)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    tally = Tally()
    elapsed, samples, hups, log = _soak(args, tally)
    warm = _judge(args, tally, samples, log)
    text = json.dumps(_result(tally, elapsed, samples, warm, hups), indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 1 if tally.failures else 0


def _judge(args: argparse.Namespace, tally: Tally, samples: list[Sample], log: str) -> list[Sample]:
    """Fail the run on an error in the server's log or memory growth after warm-up; the warm samples."""
    errors = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
    if errors:
        tally.fail("server log", errors[0])
    warm = [s for s in samples if s[0] >= args.seconds * 0.2] or samples
    growth_mb = (warm[-1][1] - warm[0][1]) / 1024
    if growth_mb > args.max_growth_mb:
        tally.fail("memory", f"server RSS grew {growth_mb:.1f} MB after warm-up")
    return warm


Sample = tuple[float, int, int]  # seconds since the start, the server's RSS and with its workers' (KB)


def _soak(args: argparse.Namespace, tally: Tally) -> tuple[float, list[Sample], int, str]:
    """The server under every load at once for --seconds, a SIGHUP every 5 s: (seconds, RSS samples every
    2 s, SIGHUPs sent, the server's log)."""
    certs = bench_certs()
    metrics_port = free_port()
    deadline = 2.0  # server.deadlineSeconds, the default
    config = f"server:\n  metricsPort: {metrics_port}\n  deadlineSeconds: {deadline}\n"
    stop = threading.Event()
    samples: list[Sample] = []
    hups = 0
    with running_server(
        certs, certs / "server", config=config, env={"COPILOT_WEBHOOK_CLUSTER__ENABLED": "false"}
    ) as server:
        loops: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
            *((reviews, (server, n, stop, tally)) for n in range(args.review_clients)),
            (previews, (server, stop, tally)),
            (scrapes, (server, metrics_port, stop, tally)),
            (adversary, (server, metrics_port, deadline, stop, tally)),
        ]
        threads = [threading.Thread(target=f, args=a, daemon=True) for f, a in loops]
        started = time.monotonic()
        for t in threads:
            t.start()
        next_hup = started + 5
        while (now := time.monotonic()) - started < args.seconds:
            if server.process.poll() is not None:
                tally.fail("server", f"exited with {server.process.returncode}")
                break
            samples.append((now - started, _server_rss_kb(server.process.pid), _rss_kb(server.process.pid)))
            if now >= next_hup:
                server.process.send_signal(signal.SIGHUP)
                hups += 1
                next_hup += 5
            time.sleep(2)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        return time.monotonic() - started, samples, hups, server.output()


def _result(tally: Tally, elapsed: float, samples: list[Sample], warm: list[Sample], hups: int) -> dict[str, Any]:
    latencies = sorted(tally.latencies)
    return {
        "seconds": round(elapsed, 1),
        "requests": dict(sorted(tally.counts.items())),
        "total_checked": sum(tally.counts.values()) + sum(tally.failures.values()),
        "failures": dict(tally.failures),
        "failure_examples": tally.examples,
        "sighups": hups,
        "review_p50_ms": round(statistics.median(latencies) * 1000, 2) if latencies else None,
        "review_p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 2) if latencies else None,
        "server_rss_mb": {
            "first": round(samples[0][1] / 1024, 1),
            "after_warm_up": round(warm[0][1] / 1024, 1),
            "last": round(samples[-1][1] / 1024, 1),
            "max": round(max(s[1] for s in samples) / 1024, 1),
        },
        "with_preview_workers_rss_mb_max": round(max(s[2] for s in samples) / 1024, 1),
    }


if __name__ == "__main__":
    sys.exit(main())
