"""Does a running preview slow admission? /mutate/ptrace latency under wrk, idle and while large previews
run back to back, measured in alternating rounds in one run on one server.

    python bench/preview_isolation.py [--rounds 3] [--seconds 8] [--connections 16]

Needs wrk (Debian package `wrk`) and the anchors' post.lua beside the review body (bench/data). The
preview load is one client posting a ~120 KB List (12 pods of 100 containers) with output=diff, again
and again: about a second of planning and rendering each, the worst a single user can ask for within
preview.maxBodyBytes at preview.concurrency 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
from pathlib import Path

import httpx
import orjson
import yaml

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench.load import _process, bench_certs, wrk  # noqa: E402 - the load bench's wrk runner
from harness.server_process import client_context, free_port  # noqa: E402

JSON = {"content-type": "application/json"}
POST_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open(os.getenv("BODY"), "rb")
wrk.body = f:read("*a")
f:close()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--connections", type=int, default=16)
    args = parser.parse_args()
    work = bench_certs()
    lua = work / "post.lua"
    lua.write_text(POST_LUA)
    port = free_port()
    big = yaml.safe_load((ROOT / "tests" / "golden" / "many-containers-100.yaml").read_text())
    preview_body = orjson.dumps({"apiVersion": "v1", "kind": "List", "items": [big] * 12})
    command = [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--tls-cert", str(work / "tls.crt"), "--tls-key", str(work / "tls.key"),
               "--log-level", "warning"]  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    results: dict[str, list[dict[str, float]]] = {"idle": [], "previews running": []}
    previews = [0]

    def preview_loop(stop: threading.Event) -> None:
        with httpx.Client(verify=client_context(work / "ca.crt"), timeout=60) as client:
            while not stop.is_set():
                res = client.post(
                    url + "/preview?output=diff", content=preview_body, headers={"content-type": "application/json"}
                )
                previews[0] += res.status_code == 200

    with _process(command, port):
        wrk(url + "/mutate/ptrace", lua, 2, args.connections)  # warm-up
        for round_ in range(args.rounds):
            for name in results:
                stop = threading.Event()
                loader = threading.Thread(target=preview_loop, args=(stop,)) if name != "idle" else None
                if loader is not None:
                    loader.start()
                results[name].append(wrk(url + "/mutate/ptrace", lua, args.seconds, args.connections))
                stop.set()
                if loader is not None:
                    loader.join()
                print(f"round {round_ + 1} {name}: {results[name][-1]}", file=sys.stderr)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print(f"wrk -t1 -c{args.connections} POST /mutate/ptrace, {args.seconds} s, {args.rounds} rounds; medians")
    print(f"previews completed while measuring: {previews[0]}")
    print()
    print("| /mutate/ptrace | req/s | p50 ms | p99 ms | non-2xx |")
    print("|---|---:|---:|---:|---:|")
    for name in results:
        errors = int(sum(r["errors"] for r in results[name]))
        print(f"| {name} | {med(name, 'rps'):,.0f} | {med(name, 'p50'):.2f} | {med(name, 'p99'):.2f} | {errors} |")
    print(f"\np99 ratio (previews running / idle): {med('previews running', 'p99') / med('idle', 'p99'):.2f}")


if __name__ == "__main__":
    main()
