"""The node cache at scale, against nodes as a managed cluster has them (15 labels, 4 annotations, 50 images,
conditions) served in pages of 500 by the tests' list/watch API server in a process of its own
(bench/cluster.py).

1. Formats, side by side in this process: full Node objects against the API server's Table rendering
   (metadata and the runtime column): bytes sent per relist, sync time, RSS growth.
2. The real server (`copilot-webhook serve`), started `--repeat` times: time to list and project every
   node (its own log line), RSS with the cache held and the peak (VmHWM), per thousand nodes.
3. Label keys, in this process: the cache's memory (tracemalloc) with the 15 labels, then with 10 keys
   more valued per node group, then per node, each from a cluster of its own: the cost of one key.
4. Admission latency, in one server and one run: POST /mutate (a Flyte 1.15 review) idle, while the API
   server sends node status updates at `--events` a second, and while the node cache relists over and
   over; each round measures the three in turn, each twice: saturated by wrk (8 connections; the p99 is
   the server's queue, so it says what the background work costs in throughput, beside each process's
   CPU), then at `--rate` a second, open loop (bench/paced.py: what holds the loop, as a caller below
   saturation feels it). Medians over rounds.
5. With `--beside DIR` (repeatable): the relist at `--rate`, this checkout's server and each other
   checkout's in turn against the same cluster, the order reversed every other round. With `--elsewhere`,
   also the control: this checkout's server idle while the same relists, paced the same way, run in a
   process of their own (what the relist costs through the machine's CPU rather than the interpreter).

    python bench/nodes_bench.py [--nodes 5000] [--images 50] [--repeat 3] [--events 2000] [--seconds 8]
        [--rate 1000] [--beside DIR] [--elsewhere]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import load  # noqa: E402 - the wrk runner
from bench.load import cpu_seconds  # noqa: E402 - a process's CPU time from /proc
from harness.fake_apiserver import write_kubeconfig  # noqa: E402
from harness.server_process import free_port, stop_process  # noqa: E402

BODY = ROOT / "bench" / "data" / "flyte-1.15-review.json"
POOL = "eks.amazonaws.com/nodegroup"  # bench/cluster.py: 20 node groups
SYNCED = re.compile(r"node cache: listed \d+ \(\d+ changed\) at resourceVersion \d+ in ([\d.]+) s")
POST_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open("{body}", "rb"); wrk.body = f:read("*a"); f:close()
"""


class Cluster:
    def __init__(self, nodes: int, images: int, extra: int = 0, per: str = "pool") -> None:
        # At the lowest CPU priority: in a cluster the API server runs elsewhere; here it shares two cores
        # with the server under test and the load generator, and should take only what they leave.
        command = [sys.executable, str(ROOT / "bench" / "cluster.py"), "--nodes", str(nodes), "--images", str(images),
                   "--extra-labels", str(extra), "--per", per]  # fmt: skip
        self.process = subprocess.Popen(
            ["nice", "-n", "19", *command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        url, full, rows = self.process.stdout.readline().split()  # type: ignore[union-attr]
        self.url, self.full_bytes, self.table_bytes = url, int(full), int(rows)
        self.lock = threading.Lock()

    def command(self, text: str) -> dict[str, Any] | None:
        with self.lock:
            self.process.stdin.write(text + "\n")  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]
            if text == "stats":
                stats: dict[str, Any] = json.loads(self.process.stdout.readline())  # type: ignore[union-attr]
                return stats
        return None

    def close(self) -> None:
        self.process.kill()


def _status(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _core_api(cluster: Cluster) -> Any:
    """The kubernetes client's CoreV1Api on `cluster`, built as the server builds its own."""
    from kubernetes import client

    from webhook.cluster.access import api_client
    from webhook.config import ClusterSettings

    kubeconfig = write_kubeconfig(Path(tempfile.mkdtemp()) / "kubeconfig", cluster.url)
    return client.CoreV1Api(api_client(ClusterSettings(kubeconfig=str(kubeconfig))))


def formats(cluster: Cluster, repeat: int) -> list[str]:
    from webhook.cluster.nodes import NodeCache

    core = _core_api(cluster)
    results: dict[str, tuple[list[float], list[float]]] = {"full objects": ([], []), "Table rows": ([], [])}
    cache_for_plans: Any = None
    for _ in range(repeat):
        for label, table in (("full objects", None), ("Table rows", "default")):
            cache = None
            gc.collect()
            before = _status_self()
            cache = NodeCache(core.list_node, **({"table": None} if table is None else {}))
            started = time.perf_counter()
            cache.informer.list_once()
            results[label][0].append(time.perf_counter() - started)
            gc.collect()
            results[label][1].append(_status_self() - before)
            cache_for_plans = cache
    plans = _plan_timings(cache_for_plans)
    sent = (cluster.command("stats") or {})["sent"]
    lines = ["| format | bytes per relist | sync (median) | RSS growth (median) |", "|---|---:|---:|---:|"]
    for label, key in (("full objects", "/api/v1/nodes"), ("Table rows", "/api/v1/nodes as Table")):
        times, growth = results[label]
        per_relist = sent.get(key, 0) / repeat
        lines.append(
            f"| {label} | {per_relist / 1e6:.1f} MB | {statistics.median(times):.2f} s | "
            f"{statistics.median(growth):.1f} MB |"
        )
    return [*lines, "", *plans]


def _cache_bytes(cluster: Cluster) -> int:
    """Python memory the node cache holds once it has listed `cluster` (tracemalloc: what is allocated and
    kept, not the allocator's pages, which earlier lists leave behind in this process)."""
    import tracemalloc

    from webhook.cluster.nodes import NodeCache

    core = _core_api(cluster)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = NodeCache(core.list_node)
        cache.informer.list_once()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        del cache
    finally:
        tracemalloc.stop()
    return held


def label_keys(cluster: Cluster, nodes: int, images: int, extra: int = 10) -> list[str]:
    """What each label key costs the cache: the benchmark's 15 labels, then `extra` keys more with a value
    per node group (20 groups), then `extra` keys more with a value per node, each in a cluster of its own."""
    base = _cache_bytes(cluster)
    rows = [f"| the 15 labels above | {base / 1e6:.1f} MB | {base / nodes * 1000 / 1e6:.2f} MB | |"]
    for per, what in (("pool", "a value per node group"), ("node", "a value per node")):
        more = Cluster(nodes, images, extra, per)
        try:
            held = _cache_bytes(more)
        finally:
            more.close()
        key = (held - base) / extra
        rows.append(
            f"| {extra} keys more, {what} | {held / 1e6:.1f} MB | {held / nodes * 1000 / 1e6:.2f} MB | "
            f"{key / 1e6:.2f} MB ({key / nodes * 1000 / 1e6:.3f} MB per 1,000 nodes) |"
        )
    return [
        f"| labels ({nodes:,} nodes, Table rows; tracemalloc) | cache held | per 1,000 nodes | per key more |",
        "|---|---:|---:|---:|",
        *rows,
    ]


def _plan_timings(cache: Any) -> list[str]:
    """What a request pays to decide the runtime with the nodes cached (in-process, no HTTP)."""
    import timeit

    from webhook.config import Settings
    from webhook.mutation.facts import ClusterFacts, Facts, RequestFacts
    from webhook.mutation.plan import PULLER, plan

    settings = Settings()
    facts = Facts(RequestFacts("ns"), ClusterFacts(None, cache.snapshot, "synced"))
    base: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [
        {"name": "main", "image": "python:3.11"},
        {"name": "flyte-copilot-uploader", "image": "cr.flyte.org/flyteorg/flytecopilot:v1.15.0"}]}}  # fmt: skip
    pools = sum(1 for name in cache.snapshot.nodes if cache.snapshot.nodes[name].labels.get(POOL) == "pool-3")
    lines = ["| plan the puller (in-process), pod for | median |", "|---|---:|"]
    for label, pod in (
        ("any node (runtime groups)", base),
        (
            f"a nodeSelector matching {pools:,} nodes (label index)",
            {**base, "spec": {**base["spec"], "nodeSelector": {POOL: "pool-3"}}},
        ),
        ("a nodeName", {**base, "spec": {**base["spec"], "nodeName": "node-00042"}}),
    ):

        def once(pod: dict[str, Any] = pod) -> None:
            plan(pod, facts, settings, kinds=(PULLER,))

        seconds = statistics.median(timeit.repeat(once, number=50, repeat=5))
        lines.append(f"| {label} | {seconds / 50 * 1e6:,.0f} µs |")
    return lines


def _status_self() -> float:
    """This process's resident memory in MB."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Server:
    """`copilot-webhook serve` against the cluster, with the tests' certificate."""

    def __init__(self, cluster: Cluster, tls: Path, work: Path, checkout: Path | None = None) -> None:
        """`checkout`: another checkout of this project whose server to run (default: this one's)."""
        self.port = free_port()
        config = work / "config.yaml"
        config.write_text(f"cluster:\n  kubeconfig: {write_kubeconfig(work / 'kubeconfig', cluster.url)}\n")
        self.log = work / f"server-{self.port}.log"
        command = [sys.executable, "-m", "webhook", "serve", "--config", str(config), "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--tls-cert", str(tls / "tls.crt"), "--tls-key", str(tls / "tls.key")]
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=checkout or ROOT)

    def synced(self, timeout: float = 120) -> float:
        """Seconds the node cache took to list and project every node, from its log line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(
                r"node cache: listed \d+ \(\d+ changed\) at resourceVersion \d+ in ([\d.]+) s", self.log.read_text()
            )
            if match:
                return float(match.group(1))
            if self.process.poll() is not None:
                raise RuntimeError(self.log.read_text())
            time.sleep(0.05)
        raise RuntimeError(f"no sync within {timeout} s:\n{self.log.read_text()}")

    def listed(self) -> int:
        return len(re.findall(r"node cache: listed", self.log.read_text()))

    def close(self) -> None:
        stop_process(self.process)


def _children(pid: int) -> list[int]:
    """Child processes of every thread of `pid` (a worker started from a thread is that thread's child)."""
    return [int(p) for task in Path(f"/proc/{pid}/task").iterdir() for p in (task / "children").read_text().split()]


def _preview(port: int, tls: Path) -> None:
    """One preview, so a worker process starts and receives the node table."""
    import httpx

    body = (ROOT / "tests" / "golden" / "pods" / "flyte-1.15-bare.yaml").read_bytes()
    with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=str(tls / "ca.crt"), timeout=60) as client:
        answer = client.post("/preview", content=body, headers={"Content-Type": "application/yaml"})
        answer.raise_for_status()


def real_server(cluster: Cluster, tls: Path, work: Path, repeat: int, nodes: int, base: float) -> list[str]:
    syncs, cpus, rss, peaks, with_preview = [], [], [], [], []
    for _ in range(repeat):
        server = Server(cluster, tls, work)
        try:
            syncs.append(server.synced())
            cpus.append(cpu_seconds(server.process.pid))
            time.sleep(2)  # let the collector and the allocator settle
            rss.append(_status(server.process.pid, "VmRSS"))
            peaks.append(_status(server.process.pid, "VmHWM"))
            _preview(server.port, tls)
            time.sleep(1)
            pids = [server.process.pid, *_children(server.process.pid)]
            with_preview.append(sum(_status(pid, "VmRSS") for pid in pids))
        finally:
            server.close()
    per = max(nodes, 1) / 1000

    def row(label: str, values: list[float], unit: str, offset: float = 0.0) -> str:
        runs = ", ".join(f"{v:.2f}" if unit == "s" else f"{v:.0f}" for v in values)
        median = statistics.median(values)
        each = f"{(median - offset) / per:.2f} {unit}"
        return f"| {label} | {median:.2f} {unit} | {each} | {runs} |"

    return [
        f"| the real server ({base:.0f} MB with no nodes) | median | per 1,000 nodes, over the empty server | runs |",
        "|---|---:|---:|---|",
        row("list and project every node (sync)", syncs, "s"),
        row("the server's CPU from its start to the sync (start-up included)", cpus, "s"),
        row("process RSS with the cache held", rss, "MB", base),
        row("process peak RSS (VmHWM)", peaks, "MB", base),
        row("RSS with a preview worker started (process tree)", with_preview, "MB", base),
    ]


def empty_server(tls: Path, work: Path) -> float:
    """RSS of the server with cluster access and no nodes: what the cache adds is measured over it."""
    cluster = Cluster(0, 0)
    try:
        server = Server(cluster, tls, work)
        try:
            server.synced()
            time.sleep(2)
            return _status(server.process.pid, "VmRSS")
        finally:
            server.close()
    finally:
        cluster.close()


Round = tuple[float, float, float, float, float, float]


def wrk(port: int, seconds: int, script: Path, server: int = 0, cluster: int = 0) -> Round:
    """(requests per second, p50 ms, p99 ms) of /mutate with 8 connections (bench/load.py's runner), and the
    CPU seconds per second of the window spent by the server's process (`server`: its pid), the cluster's
    (`cluster`) and wrk: where the two cores went."""

    def cpu(pid: int) -> float:
        return cpu_seconds(pid) if pid else 0.0

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    before, start = (cpu(server), cpu(cluster)), time.monotonic()
    stats = load.wrk(f"https://127.0.0.1:{port}/mutate", script, seconds, 8)
    elapsed = time.monotonic() - start
    after, waited = (cpu(server), cpu(cluster)), resource.getrusage(resource.RUSAGE_CHILDREN)
    if stats["errors"] or stats["socket_errors"]:
        raise RuntimeError(f"wrk saw failures: {stats}")
    load_cpu = waited.ru_utime + waited.ru_stime - children.ru_utime - children.ru_stime
    shares = [(a - b) / elapsed for a, b in zip(after, before, strict=True)]
    return stats["rps"], stats["p50"], stats["p99"], shares[0], shares[1], load_cpu / elapsed


def paced(port: int, tls: Path, rate: float, seconds: int) -> dict[str, Any]:
    """/mutate at `rate` a second, open loop (bench/paced.py, a process of its own)."""
    command = [sys.executable, str(ROOT / "bench" / "paced.py"), "--url", f"https://127.0.0.1:{port}/mutate",
               "--body", str(BODY), "--ca", str(tls / "ca.crt"),
               "--rate", str(rate), "--seconds", str(seconds)]  # fmt: skip
    result: dict[str, Any] = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    if result["failures"] or result["rate"] < 0.97 * rate or result["late_ms"] > 100:
        raise RuntimeError(f"the paced client failed or fell behind: {result}")
    return result


PHASES = ("idle", "watch", "relist")


def latency(
    cluster: Cluster, tls: Path, work: Path, rounds: int, seconds: int, events: float, rate: float
) -> list[str]:
    """Each round measures /mutate idle, under node status updates and under relists one after another, each
    twice: saturated by wrk (the latency is the server's queue, so it says what the background work costs in
    throughput), then at `rate` a second, open loop (what holds the loop, as a caller below saturation feels it)."""
    script = work / "post.lua"
    script.write_text(POST_LUA.format(body=BODY))
    server = Server(cluster, tls, work)
    results: dict[str, list[Round]] = {phase: [] for phase in PHASES}
    fixed: dict[str, list[dict[str, Any]]] = {phase: [] for phase in PHASES}
    absorbed: list[float] = []
    generated: list[float] = []
    relists: list[int] = []

    def measure(phase: str) -> None:
        results[phase].append(wrk(server.port, seconds, script, *pids))
        fixed[phase].append(paced(server.port, tls, rate, seconds))

    try:
        server.synced()
        pids = (server.process.pid, cluster.process.pid)
        time.sleep(2)
        wrk(server.port, 2, script)  # warm up
        for _ in range(rounds):
            measure("idle")

            cluster.command(f"events {events}")
            time.sleep(1)
            before = cluster.command("stats") or {}
            start = time.monotonic()
            measure("watch")
            after = cluster.command("stats") or {}
            elapsed = time.monotonic() - start
            absorbed.append((after["delivered"] - before["delivered"]) / elapsed)
            generated.append((after["generated"] - before["generated"]) / elapsed)
            cluster.command("events 0")
            time.sleep(1)

            done = server.listed()
            with relisting(cluster, server):
                measure("relist")
            relists.append(server.listed() - done)
    finally:
        cluster.command("events 0")
        server.close()

    notes = {
        "idle": "",
        "watch": f"{statistics.median(absorbed):,.0f} node events/s delivered to and read by the server "
        f"({statistics.median(generated):,.0f} made)",
        "relist": f"{statistics.median(relists)} full relists per {2 * seconds} s (both measures)",
    }
    return [*_saturated_table(results, notes), "", *_paced_table(fixed, rate)]


def _saturated_table(results: dict[str, list[Round]], notes: dict[str, str]) -> list[str]:
    idle_p99 = statistics.median(r[2] for r in results["idle"])
    lines = [
        "Saturated (wrk, 8 connections; CPU seconds per second of each process):\n",
        "| /mutate under | requests/s | p50 | p99 | p99 / idle | p99 of each round | CPU s/s: server, cluster, wrk | |",
        "|---|---:|---:|---:|---:|---|---|---|",
    ]
    for phase, runs in results.items():
        rate_seen = statistics.median(r[0] for r in runs)
        p50 = statistics.median(r[1] for r in runs)
        p99 = statistics.median(r[2] for r in runs)
        each = ", ".join(f"{r[2]:.2f}" for r in runs)
        cpu = ", ".join(f"{statistics.median(r[i] for r in runs):.2f}" for i in (3, 4, 5))
        lines.append(
            f"| {phase} | {rate_seen:,.0f} | {p50:.2f} ms | {p99:.2f} ms | {p99 / idle_p99:.2f}x | {each} | {cpu} "
            f"| {notes[phase]} |"
        )
    return lines


def _paced_table(fixed: dict[str, list[dict[str, Any]]], rate: float) -> list[str]:
    idle_p99 = statistics.median(r["p99"] for r in fixed["idle"])
    lines = [
        f"At {rate:,.0f} requests a second, open loop (bench/paced.py; latency from each request's due time):\n",
        "| /mutate under | p50 | p99 | p99 / idle | p99.9 | worst | p99 of each round |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for phase, paced_runs in fixed.items():
        p50, p99, p999, worst = (
            statistics.median(r[key] for r in paced_runs) for key in ("p50", "p99", "p99.9", "max")
        )
        each = ", ".join(f"{r['p99']:.2f}" for r in paced_runs)
        lines.append(
            f"| {phase} | {p50:.2f} ms | {p99:.2f} ms | {p99 / idle_p99:.2f}x | {p999:.2f} ms | {worst:.2f} ms "
            f"| {each} |"
        )
    return lines


class Elsewhere:
    """This checkout's node cache in a process of its own against the cluster: after its first list it relists
    on each `relist` line, paced as the server's (its cache synced), and answers `listed`. The control for the
    relist measures: the same work on the same machine, outside the server's interpreter."""

    def __init__(self, cluster: Cluster, work: Path) -> None:
        kubeconfig = write_kubeconfig(work / "kubeconfig-elsewhere", cluster.url)
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--relist-loop", str(kubeconfig)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.process.stdout.readline()  # type: ignore[union-attr]  # the first list

    def relist(self) -> None:
        self.process.stdin.write("relist\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        self.process.stdout.readline()  # type: ignore[union-attr]

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def relist_loop(kubeconfig: Path) -> None:
    """Elsewhere's process."""
    from kubernetes import client

    from webhook.cluster.access import api_client
    from webhook.cluster.nodes import NodeCache
    from webhook.config import ClusterSettings

    cache = NodeCache(client.CoreV1Api(api_client(ClusterSettings(kubeconfig=str(kubeconfig)))).list_node)
    cache.informer.list_once()
    print("listed", flush=True)
    for _ in sys.stdin:
        cache.informer.list_once()
        print("listed", flush=True)


@contextlib.contextmanager
def relisting_elsewhere(elsewhere: Elsewhere) -> Iterator[None]:
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            elsewhere.relist()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _beside_round(
    cluster: Cluster, tls: Path, work: Path, checkout: Path | None, seconds: int, rate: float
) -> tuple[float, float, float]:
    """One round of `beside` for `checkout`'s server (None: this checkout's, the relists elsewhere): the idle
    p99 (the median of before and after), and the p99 and p99.9 during relists."""
    server = Server(cluster, tls, work, checkout or ROOT)
    other = Elsewhere(cluster, work) if checkout is None else None
    try:
        server.synced()
        time.sleep(2)
        paced(server.port, tls, rate, 2)  # warm up
        before = paced(server.port, tls, rate, seconds)["p99"]
        with relisting(cluster, server) if other is None else relisting_elsewhere(other):
            time.sleep(1)
            during = paced(server.port, tls, rate, seconds)
        after = paced(server.port, tls, rate, seconds)["p99"]
    finally:
        server.close()
        if other is not None:
            other.close()
    return statistics.median((before, after)), during["p99"], during["p99.9"]


def beside(
    cluster: Cluster,
    tls: Path,
    work: Path,
    checkouts: list[Path],
    rounds: int,
    seconds: int,
    rate: float,
    elsewhere: bool = False,
) -> list[str]:
    """/mutate at `rate` a second, open loop, idle then during relists then idle again, for this checkout's
    server and each of `checkouts`, one after another against the same cluster, the order reversed every
    other round: what a change does to the tail during a relist, side by side on the same machine."""
    servers: list[Path | None] = [ROOT, *checkouts, *([None] if elsewhere else [])]
    runs: dict[Path | None, list[tuple[float, float, float]]] = {checkout: [] for checkout in servers}
    for turn in range(rounds):
        for checkout in servers if turn % 2 == 0 else servers[::-1]:
            runs[checkout].append(_beside_round(cluster, tls, work, checkout, seconds, rate))
    lines = [
        f"/mutate at {rate:,.0f} requests a second, open loop, side by side ({rounds} rounds of {seconds} s; "
        "idle: the median of the measures before and after the relists):\n",
        "| server | idle p99 | relist p99 | relist ÷ idle | relist ÷ idle, each round | relist p99.9 |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for checkout, results in runs.items():
        idle, during_p99, during_p999 = (statistics.median(r[i] for r in results) for i in range(3))
        each = ", ".join(f"{r[1] / r[0]:.2f}" for r in results)
        names = {ROOT: "this checkout", None: "this checkout, the relist in another process"}
        name = names.get(checkout, str(checkout))
        lines.append(
            f"| {name} | {idle:.2f} ms | {during_p99:.2f} ms | {during_p99 / idle:.2f}x | {each} "
            f"| {during_p999:.2f} ms |"
        )
    return lines


@contextlib.contextmanager
def relisting(cluster: Cluster, server: Server) -> Iterator[None]:
    """The server's node cache relisting over and over while the block runs, and the last relist finished
    when it ends."""
    stop = threading.Event()
    thread = threading.Thread(target=_keep_relisting, args=(cluster, server, stop), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _keep_relisting(cluster: Cluster, server: Server, stop: threading.Event) -> None:
    """Force a relist, wait for it to finish, force the next, until told to stop; the last one is waited
    for, so it does not run into the next idle measurement."""
    while not stop.is_set():
        done = server.listed()
        cluster.command("relist")
        _until(functools.partial(_more_listed, server, done))


def _more_listed(server: Server, done: int) -> bool:
    return server.listed() > done


def _until(check: Callable[[], bool]) -> None:
    while not check():
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--images", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--events", type=float, default=2400)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--rate", type=float, default=1000, help="/mutate's fixed rate a second, below saturation")
    parser.add_argument("--skip", action="append", default=[], choices=["formats", "keys", "server", "latency"])
    parser.add_argument(
        "--beside", type=Path, action="append", default=[], help="another checkout, its relist measured beside"
    )
    parser.add_argument(
        "--elsewhere", action="store_true", help="beside: also this checkout idle, the same relists in another process"
    )
    parser.add_argument("--relist-loop", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relist_loop:
        relist_loop(args.relist_loop)
        return

    from certs.authority import generate_files

    work = Path(tempfile.mkdtemp())
    tls = work / "tls"
    generate_files(tls, "copilot-webhook", "bench", dns=["localhost"], ips=["127.0.0.1"])
    cluster = Cluster(args.nodes, args.images)
    try:
        print(
            f"{args.nodes:,} nodes, {args.images} images each: {cluster.full_bytes / 1e6:.1f} MB as Node objects, "
            f"{cluster.table_bytes / 1e6:.1f} MB as Table rows; pages of 500\n"
        )
        if "formats" not in args.skip:
            print("\n".join(formats(cluster, args.repeat)) + "\n")
        if "server" not in args.skip:
            base = empty_server(tls, work)
            print("\n".join(real_server(cluster, tls, work, args.repeat, args.nodes, base)) + "\n")
        if "keys" not in args.skip:
            print("\n".join(label_keys(cluster, args.nodes, args.images)) + "\n")
        if "latency" not in args.skip:
            print("\n".join(latency(cluster, tls, work, args.repeat, args.seconds, args.events, args.rate)) + "\n")
        if args.beside or args.elsewhere:
            lines = beside(cluster, tls, work, args.beside, args.repeat, args.seconds, args.rate, args.elsewhere)
            print("\n".join(lines))
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
