"""Node cache at scale: 5,000 realistic nodes (50 images each, the usual conditions) listed in pages of
500 by the real kubernetes client from a list/watch server in another process; sync time and memory.
Then the cost a request pays to decide the runtime with those nodes cached.

    python bench/nodes_bench.py [--nodes 5000] [--images 50] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SERVER = """
import sys, time
sys.path.insert(0, {root!r})
from tests.fake_apiserver import FakeAPIServer, node
api = FakeAPIServer()
runtimes = ["containerd://1.7.11"] * 8 + ["containerd://1.7.7-k3s1.27", "docker://24.0.7"]
nodes = [node(f"node-{{i:05d}}", runtimes[i % 10], labels={{"pool": f"pool-{{i % 20}}"}}, images={images})
         for i in range({nodes})]
api.put_many("/api/v1/nodes", nodes)
api.start()
print(api.url, len(b"".join(api.encoded["/api/v1/nodes"].values())), flush=True)
time.sleep(3600)
"""


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--images", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from kubernetes import client

    from tests.fake_apiserver import write_kubeconfig
    from webhook.cluster.access import api_client
    from webhook.cluster.nodes import NodeCache
    from webhook.config import ClusterSettings, Settings
    from webhook.mutation.facts import ClusterFacts, Facts, RequestFacts
    from webhook.mutation.plan import PULLER, plan

    code = SERVER.format(root=str(ROOT), nodes=args.nodes, images=args.images)
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        url, size = server.stdout.readline().split()  # type: ignore[union-attr]
        work = Path(tempfile.mkdtemp())
        kubeconfig = write_kubeconfig(work / "kubeconfig", url)
        core = client.CoreV1Api(api_client(ClusterSettings(kubeconfig=str(kubeconfig))))
        times, deltas = [], []
        cache = None
        for _ in range(args.repeat):
            cache = None
            gc.collect()
            before = rss_mb()
            cache = NodeCache(core.list_node)
            started = time.perf_counter()
            cache.informer.list_once()
            times.append(time.perf_counter() - started)
            gc.collect()
            deltas.append(rss_mb() - before)
        assert cache is not None
        print(f"{args.nodes} nodes, {args.images} images each: {int(size) / 1e6:.1f} MB of node JSON, pages of 500")
        print()
        print("| measure | median | runs |")
        print("|---|---:|---|")
        runs = ", ".join(f"{t:.2f}" for t in times)
        print(f"| list and project all nodes (sync) | {statistics.median(times):.2f} s | {runs} |")
        runs = ", ".join(f"{d:.1f}" for d in deltas)
        print(f"| process RSS growth over a sync | {statistics.median(deltas):.1f} MB | {runs} |")
        print(f"| process RSS with the cache held | {rss_mb():.1f} MB | |")
        print(f"| runtimes | {cache.by_runtime()} | |")

        settings = Settings()
        cluster = ClusterFacts(None, cache.snapshot, "synced")
        facts = Facts(RequestFacts("ns"), cluster)
        base = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "main", "image": "python:3.11"},
            {"name": "flyte-copilot-uploader", "image": "cr.flyte.org/flyteorg/flytecopilot:v1.15.0"}]}}  # fmt: skip
        selected = {**base, "spec": {**base["spec"], "nodeSelector": {"pool": "pool-3"}}}
        pinned = {**base, "spec": {**base["spec"], "nodeName": "node-00042"}}
        for label, pod in (
            ("any node (runtime groups)", base),
            ("nodeSelector matching 250 nodes (label index)", selected),
            ("nodeName", pinned),
        ):
            n = 200
            us = (
                statistics.median(
                    timeit.repeat(lambda pod=pod: plan(pod, facts, settings, (PULLER,)), number=n, repeat=5)
                )
                / n
                * 1e6
            )
            print(f"| plan the puller, pod for {label} | {us:,.0f} µs | |")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
