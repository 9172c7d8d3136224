"""Load benchmark of POST /mutate over TLS with keep-alive connections, side by side with the reference
webhooks, in one run: the same certificate, load generator, body, connection count and machine.

    python bench/load.py --anchors DIR [--baseline CHECKOUT] [--rounds 3] [--seconds 10] [--connections 16]

DIR holds the anchors: go-floor/ (Go standard library webhook), py-naive/app.py (the FastAPI webhook most
people write first), post.lua (wrk script). Needs wrk (Debian package `wrk`) and, for go-floor, Go (any
release from 1.19 on; built once into the Go tools cache, keyed by its sources and the Go version).
Targets are measured in turn within each round, so a noisy neighbour hurts all of them alike; the table
gives the median over rounds of requests per second, of p50/p99 latency and of each server's CPU per
request (user and system time of its process from /proc, while wrk ran): the cores a server may use
differ (go-floor runs on every core, ours on one), so requests per CPU-second compare the work itself.
`--baseline` adds our server as another checkout has it (`git worktree add /tmp/base <commit>`), to show
a change did not slow /mutate.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from harness.gotools import cache_root  # noqa: E402 - where the tests' Go binaries are cached
from harness.server_process import free_port, stop_process  # noqa: E402 - the tests' process helpers

BODY = HERE / "data" / "flyte-1.15-review.json"


def _wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


@contextmanager
def _process(command: list[str], port: int, cwd: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port)
        yield proc
    finally:
        stop_process(proc)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process, all its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def bench_certs() -> Path:
    """A fresh folder with a CA and a serving certificate for 127.0.0.1, as `make run` makes them."""
    work = Path(tempfile.mkdtemp(prefix="copilot-webhook-bench-"))
    subprocess.run(
        [sys.executable, "-m", "webhook", "certs", "generate", "--out", str(work), "--service", "bench",
         "--namespace", "bench", "--dns", "localhost", "--ip", "127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return work


def go_toolchain() -> str | None:
    """The `go` on PATH, else where the official tarball and Debian's packages put it."""
    for candidate in (shutil.which("go"), "/usr/local/go/bin/go", *sorted(glob.glob("/usr/lib/go-1.*/bin/go"))[::-1]):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def build_go_floor(anchors: Path) -> Path | None:
    """The go-floor anchor built with the installed Go (any version from the go.mod's 1.19 on: the module
    has no dependencies). None, with a message, where there is no Go."""
    return build_go(anchors / "go-floor", "go-floor")


def build_go(source: Path, name: str) -> Path | None:
    """A standard-library Go program (`source` holds its go.mod and .go files) built with the installed Go,
    cached beside the tests' Go tools and keyed by its sources and the Go version, so a warm run builds
    nothing. None, with a message, where there is no Go."""
    go = go_toolchain()
    if go is None:
        print(f"no Go toolchain (install Go, e.g. from go.dev/dl): {name} is left out of this run", file=sys.stderr)
        return None
    version = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, check=True).stdout.strip()
    digest = hashlib.sha256(version.encode() + b"\0")
    for path in sorted(p for p in source.iterdir() if p.suffix in {".go", ".mod", ".sum"}):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    target = cache_root() / f"{name}-{digest.hexdigest()[:16]}" / name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{name}.partial-{os.getpid()}")
        # GOTOOLCHAIN=local: the installed Go builds it, whatever the environment asks for.
        env = {**os.environ, "GOFLAGS": "-buildvcs=false", "GOTOOLCHAIN": "local", "CGO_ENABLED": "0"}
        started = time.monotonic()
        subprocess.run([go, "build", "-trimpath", "-o", str(partial), "."], cwd=source, check=True, env=env)
        partial.rename(target)
        print(f"built {name} with {version} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return target


def wrk(url: str, lua: Path | None, seconds: int, connections: int) -> dict[str, float]:
    command = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", url]
    if lua is not None:
        command[1:1] = ["-s", str(lua)]
    out = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "BODY": str(BODY)}, check=True
    ).stdout
    stats = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))}  # type: ignore[union-attr]
    stats["requests"] = float(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    for pct in ("50", "99"):
        stats[f"p{pct}"] = _ms(re.search(rf"\s{pct}(?:\.000)?%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    stats["errors"] = float(non2xx.group(1)) if non2xx else 0.0
    # wrk's "Socket errors: connect N, read N, write N, timeout N" (timeout: no answer within 2 s)
    failed = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    counts = [float(n) for n in failed.groups()] if failed else [0.0] * 4
    stats["socket_errors"] = sum(counts)
    for kind, count in zip(("connect", "read", "write", "timeout"), counts, strict=True):
        stats[f"socket_errors_{kind}"] = count
    return stats


Server = tuple[list[str], int, "Path | None"]  # command, port, another checkout to run it from
Targets = dict[str, tuple[str, "Path | None", int]]  # name: (URL, wrk script, the port of the server that answers it)
REFERENCE = "copilot-webhook POST /mutate/ptrace (the anchors' work)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--anchors", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--baseline", type=Path, help="another checkout of this project, measured beside")
    args = parser.parse_args()
    work = bench_certs()
    servers, targets = _plan(args, work)
    results = _measure(args, servers, targets)
    _print_table(args, targets, results)
    shutil.rmtree(work, ignore_errors=True)


def _plan(args: argparse.Namespace, work: Path) -> tuple[list[Server], Targets]:
    """The servers to start and the targets to load, each on a free port."""
    anchors = args.anchors.resolve()
    lua = anchors / "post.lua"
    cert, key = str(work / "tls.crt"), str(work / "tls.key")
    go_bin = build_go_floor(anchors) or work / "go-floor"
    ours, go_port, naive = free_port(), free_port(), free_port()
    servers: list[Server] = [
        ([sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", str(ours), "--tls-cert", cert,
          "--tls-key", key, "--log-level", "warning"], ours, None),
        ([str(go_bin), "-addr", f"127.0.0.1:{go_port}", "-cert", cert, "-key", key], go_port, None),
        ([sys.executable, "-m", "uvicorn", "app:app", "--app-dir", str(anchors / "py-naive"), "--host", "127.0.0.1",
          "--port", str(naive), "--ssl-certfile", cert, "--ssl-keyfile", key, "--no-access-log", "--log-level",
          "warning"], naive, None),
    ]  # fmt: skip
    targets: Targets = {
        REFERENCE: (f"https://127.0.0.1:{ours}/mutate/ptrace", lua, ours),
        "copilot-webhook POST /mutate (ptrace and image puller)": (f"https://127.0.0.1:{ours}/mutate", lua, ours),
        "copilot-webhook GET /healthz (no-op, same server)": (f"https://127.0.0.1:{ours}/healthz", None, ours),
        "go-floor POST /mutate": (f"https://127.0.0.1:{go_port}/mutate", lua, go_port),
        "py-naive POST /mutate": (f"https://127.0.0.1:{naive}/mutate", lua, naive),
        "py-naive POST /noop (FastAPI no-op)": (f"https://127.0.0.1:{naive}/noop", lua, naive),
    }  # fmt: skip
    if not go_bin.exists():
        del servers[1], targets["go-floor POST /mutate"]
    if args.baseline is not None:
        base = free_port()
        command = [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", str(base),
                   "--tls-cert", cert, "--tls-key", key, "--log-level", "warning"]  # fmt: skip
        servers.append((command, base, args.baseline.resolve()))
        targets["baseline POST /mutate/ptrace"] = (f"https://127.0.0.1:{base}/mutate/ptrace", lua, base)
        targets["baseline POST /mutate"] = (f"https://127.0.0.1:{base}/mutate", lua, base)
    return servers, targets


def _measure(args: argparse.Namespace, servers: list[Server], targets: Targets) -> dict[str, list[dict[str, float]]]:
    """Every target loaded in turn for each round, with the answering server's CPU over the run."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    with contextlib.ExitStack() as stack:
        pids = {server[1]: stack.enter_context(_process(*server)).pid for server in servers}
        for url, script, _port in targets.values():  # warm-up
            wrk(url, script, 2, args.connections)
        for round_ in range(args.rounds):
            for name, (url, script, port) in targets.items():
                before = cpu_seconds(pids[port])
                stats = wrk(url, script, args.seconds, args.connections)
                used = cpu_seconds(pids[port]) - before
                stats["cpu_us"], stats["cores"] = used / stats["requests"] * 1e6, used / args.seconds
                results[name].append(stats)
                print(f"round {round_ + 1} {name}: {results[name][-1]}", file=sys.stderr)
    return results


def _print_table(args: argparse.Namespace, targets: Targets, results: dict[str, list[dict[str, float]]]) -> None:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print(f"wrk -t1 -c{args.connections}, {args.seconds} s per target, {args.rounds} rounds; medians over rounds")
    print()
    print("The server's CPU is user and system time of its process (every thread) while wrk ran: per request,")
    print("in cores used, and as requests per CPU-second, ours over the target's.")
    print()
    print(
        "| target | req/s | p50 ms | p99 ms | non-2xx | server CPU µs/request | cores used "
        "| ours ÷ target (req/s) | ours ÷ target (requests per CPU-second) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in targets:
        errors = int(sum(r["errors"] for r in results[name]))
        ratio = med(REFERENCE, "rps") / med(name, "rps")
        efficiency = med(name, "cpu_us") / med(REFERENCE, "cpu_us")
        rps, p50, p99, cpu, cores = (med(name, k) for k in ("rps", "p50", "p99", "cpu_us", "cores"))
        print(
            f"| {name} | {rps:,.0f} | {p50:.2f} | {p99:.2f} | {errors} | {cpu:,.0f} | {cores:.2f} "
            f"| {ratio:.2f} | {efficiency:.2f} |"
        )


if __name__ == "__main__":
    main()
