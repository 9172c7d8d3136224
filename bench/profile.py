"""Where the time of one request goes: our server under wrk load (TLS, 16 keep-alive connections, the 5 KB
Flyte 1.15 review), its CPU time per request read from /proc, and a py-spy profile of the same run sorted
into what each part of the work costs.

    python bench/profile.py [--seconds 10] [--rounds 3] [--paths /mutate/ptrace /mutate /healthz]

py-spy samples the server's Python stacks (no native frames: sampling those stops the process at every
sample). Time spent in C under a Python line (uvloop's socket and TLS calls, httptools' parser, orjson) is
counted to that line, which names the work: `transport.write` is encrypting and sending, the parser's
feed is HTTP parsing. The event loop's own time (epoll, reading sockets, calling callbacks) has no Python
frame above it but the loop's `run`. For each path: CPU µs per request (median over rounds, no profiler
attached), then each part's share of the profiled run's samples times that CPU time.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from bench.load import BODY, _wait_port, bench_certs, cpu_seconds, wrk  # noqa: E402 - the load benchmark's helpers
from harness.server_process import free_port, stop_process  # noqa: E402

POST_LUA = 'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
POST_LUA += 'local f = io.open("{body}", "rb"); wrk.body = f:read("*a"); f:close()\n'

# (part, pattern over a sample's frames from the root down, first match wins), most specific first.
PARTS: list[tuple[str, re.Pattern[str]]] = [
    (p, re.compile(rx))
    for p, rx in [
        ("metrics (prometheus_client counters and the latency histogram)", r"prometheus_client|count_plan"),
        (
            "write the answer: TLS encryption and send (transport.write), the idle timer re-armed",
            r"RequestResponseCycle\.send|_JoinedWrites|_direct_writer",
        ),
        (
            "JSON decode of the review (msgspec into the shapes admission reads, orjson for what does not fit)",
            r"load_json|shaped \(webhook/documents\.py",
        ),
        ("read the review's envelope and facts", r"read_review|request_facts"),
        ("the plan (webhook/mutation)", r"webhook/mutation/|webhook/references\.py"),
        (
            "the answer: JSONPatch, base64, envelope (orjson.dumps)",
            r"admission_response|envelope|response \(|b64encode",
        ),
        ("the decision around the plan (review.decide)", r"review\.py"),
        ("the body: receive() and the deadline watchdog", r"_read_body|BodyDeadlines|RequestResponseCycle\.receive"),
        ("the route and the Answer; for /healthz the ASGI call too (server.py)", r"webhook/web/server\.py"),
        (
            "HTTP parsing (httptools), the connection's limits and states (admission.py)",
            r"data_received|on_url|on_header|on_message|_count|on_body|webhook/web/admission\.py|"
            r"webhook/web/limits\.py|webhook/web/reading\.py",
        ),
        ("uvicorn's ASGI cycle (task start, proxy headers)", r"run_asgi|ProxyHeadersMiddleware|_start_asgi_task"),
        ("TLS decryption (SSLObject.read)", r"SSLObject\.read"),
        ("TLS encryption outside the answer's write", r"SSLObject\.write"),
        ("the tick (reloads; uvicorn's, behind the human API)", r"_tick|Server\.main_loop|Server\.on_tick"),
        ("the event loop: epoll, socket reads, callbacks (uvloop, C)", r"Runner\.run|run_until_complete"),
    ]
]


# py-spy samples without pausing the server (--nonblocking), so a sample taken as the interpreter changes
# frames can read no frame at all: a tenth of them under this load. Blocking sampling reads none empty, but
# stops the server at every sample. Such samples fall anywhere, so they are left out of the shares.
TORN = "no frame"
OTHER = "other Python (a stack read too short to place)"


def run_wrk(url: str, lua: Path | None, seconds: int) -> int:
    """The requests wrk made in `seconds`, 16 connections (bench/load.py's runner)."""
    return int(wrk(url, lua, seconds, 16)["requests"])


def cpu_per_request(pid: int, url: str, lua: Path | None, seconds: int) -> float:
    before = cpu_seconds(pid)
    requests = run_wrk(url, lua, seconds)
    return (cpu_seconds(pid) - before) / requests * 1e6


def profile(pid: int, url: str, lua: Path | None, seconds: int, out: Path) -> Counter[str]:
    spy = subprocess.Popen(
        [str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid), "-o", str(out), "-f", "raw",
         "-r", "400", "--nonblocking", "-d", str(seconds)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(0.5)
    run_wrk(url, lua, seconds - 1)
    spy.wait()
    parts: Counter[str] = Counter()
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:  # no frame: py-spy read the stack as it changed (--nonblocking); spread like the rest
            parts[TORN] += int(count)
            continue
        frames = stack.split(";")
        leafward = ";".join(reversed(frames))
        part = next((name for name, rx in PARTS if rx.search(leafward)), OTHER)
        parts[part] += int(count)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paths", nargs="+", default=["/mutate/ptrace", "/mutate", "/healthz"])
    args = parser.parse_args()
    certs = bench_certs()
    work = Path(tempfile.mkdtemp(prefix="copilot-webhook-profile-"))
    lua = work / "post.lua"
    lua.write_text(POST_LUA.format(body=BODY))
    port = free_port()
    command = [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level",
               "warning", "--tls-cert", str(certs / "tls.crt"), "--tls-key", str(certs / "tls.key")]  # fmt: skip
    os.environ["COPILOT_WEBHOOK_CLUSTER__ENABLED"] = "false"
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid = server.pid
    try:
        _wait_port(port)
        for path in args.paths:
            url, body = f"https://127.0.0.1:{port}{path}", lua if path.startswith("/mutate") else None
            run_wrk(url, body, 2)  # warm
            cpu = statistics.median(cpu_per_request(pid, url, body, args.seconds) for _ in range(args.rounds))
            parts = profile(pid, url, body, args.seconds, work / f"profile{path.replace('/', '-')}.txt")
            torn = parts.pop(TORN, 0)
            total = sum(parts.values())
            print(f"\n{path}: {cpu:.0f} µs of CPU per request (median of {args.rounds} runs of {args.seconds} s)")
            print(f"({torn} of {torn + total} samples had no frame, read as the stack changed: left out)\n")
            print("| part | share of samples | µs per request |")
            print("|---|---:|---:|")
            for name, count in parts.most_common():
                print(f"| {name} | {count / total:.1%} | {cpu * count / total:.1f} |")
    finally:
        stop_process(server)


if __name__ == "__main__":
    main()
