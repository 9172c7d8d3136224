"""A cluster of realistic nodes behind the tests' list/watch API server, in a process of its own, for the
node-cache benchmarks. It prints `URL NODE_JSON_BYTES TABLE_ROW_BYTES`, then takes commands on stdin:

    events RATE   status updates (a new heartbeat time on a node's Ready condition) at RATE a second; 0 stops
    relist        compact the history and drop every watch: watchers come back with 410 Gone and relist
    stats         print a JSON line: events written to watches, list bytes sent, the resourceVersion

    python bench/cluster.py --nodes 65000 [--images 50]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.fake_apiserver import FakeAPIServer, managed_fields, node

NODES = "/api/v1/nodes"
RUNTIMES = ["containerd://1.7.11"] * 8 + ["containerd://1.7.7-k3s1.27", "docker://24.0.7"]
ZONES = ["eu-west-1a", "eu-west-1b", "eu-west-1c"]


def realistic(i: int, images: int, extra: int = 0, per: str = "pool") -> dict[str, Any]:
    """A node as a managed cluster (EKS here) labels and annotates it: 15 labels (the hostname, os and arch
    with their beta twins, instance type, zone and region with their deprecated twins, node group and its
    image, capacity type, the cloud provider's hash) and 4 annotations, the rows carrying the managed fields
    the API server records. `extra` more label keys, each with a value per node group (`per` "pool": a team,
    a cost centre) or per node ("node": an id)."""
    zone, instance = ZONES[i % 3], ["m6i.2xlarge", "m6i.4xlarge", "c6i.8xlarge"][i % 3]
    pool = f"pool-{i % 20}"
    name = f"ip-10-{i // 65536}-{i // 256 % 256}-{i % 256}.eu-west-1.compute.internal"
    labels = {
        "beta.kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/instance-type": instance,
        "beta.kubernetes.io/os": "linux",
        "eks.amazonaws.com/capacityType": "ON_DEMAND",
        "eks.amazonaws.com/nodegroup": pool,
        "eks.amazonaws.com/nodegroup-image": f"ami-0{i % 20:016x}",
        "failure-domain.beta.kubernetes.io/region": "eu-west-1",
        "failure-domain.beta.kubernetes.io/zone": zone,
        "k8s.io/cloud-provider-aws": "a94967527effcefb5f5829f529c0a1b9",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": instance,
        "topology.kubernetes.io/region": "eu-west-1",
        "topology.kubernetes.io/zone": zone,
    }  # with the hostname and kubernetes.io/os that every node gets: 15
    for k in range(extra):
        labels[f"example.com/extra-{k}"] = f"{pool}-{k}" if per == "pool" else f"n{i}-{k}"
    annotations = {
        "alpha.kubernetes.io/provided-node-ip": f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
        "csi.volume.kubernetes.io/nodeid": json.dumps({"ebs.csi.aws.com": f"i-0{i:016x}"}),
        "volumes.kubernetes.io/controller-managed-attach-detach": "true",
    }  # with node.alpha.kubernetes.io/ttl: 4
    obj = node(name, RUNTIMES[i % 10], labels=labels, annotations=annotations, images=images)
    obj["metadata"]["creationTimestamp"] = "2026-11-01T00:00:00Z"
    obj["metadata"]["managedFields"] = managed_fields(obj)
    return obj


class Heartbeats:
    """Status updates at a steady rate, spread over the nodes in turn."""

    def __init__(self, api: FakeAPIServer) -> None:
        self.api = api
        self.rate = 0.0
        self.names = sorted(api.objects[NODES])
        self.next = 0
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        tick = 0.01
        owed = 0.0
        while True:
            time.sleep(tick)
            owed += self.rate * tick
            batch, owed = int(owed), owed - int(owed)
            if not batch:
                continue
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            with self.api.cond:
                for _ in range(batch):
                    name = self.names[self.next % len(self.names)]
                    self.next += 1
                    obj = copy.copy(self.api.objects[NODES][name])
                    status = dict(obj["status"])
                    status["conditions"] = [dict(c, lastHeartbeatTime=stamp) for c in status["conditions"]]
                    obj["status"] = status
                    self.api._record(NODES, "MODIFIED", obj, owned=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--images", type=int, default=50)
    parser.add_argument("--extra-labels", type=int, default=0)
    parser.add_argument("--per", choices=["pool", "node"], default="pool")
    args = parser.parse_args()
    api = FakeAPIServer()
    api.max_events = 50_000
    api.put_many(NODES, [realistic(i, args.images, args.extra_labels, args.per) for i in range(args.nodes)])
    full = sum(len(api._encoded(NODES, obj, False)) for obj in api.objects[NODES].values())
    rows = sum(len(api._encoded(NODES, obj, True)) for obj in api.objects[NODES].values())
    api.start()
    heartbeats = Heartbeats(api)
    print(api.url, full, rows, flush=True)
    for line in sys.stdin:
        command, _, value = line.strip().partition(" ")
        if command == "events":
            heartbeats.rate = float(value)
        elif command == "relist":
            with api.cond:
                api.rv += 1  # history moves on and is compacted past every watcher's version
            api.compact()
            api.drop_watches()
        elif command == "stats":
            with api.cond:
                stats = {"delivered": api.delivered.get(NODES, 0), "generated": heartbeats.next, "sent": api.sent}
            print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
