"""The time the image puller adds to a pod's start, in each mode, for a cached image and a fresh one: what
a user of the puller feels, on the real node the tests run (harness/node.py).

    python bench/puller_bench.py [--rounds 7]

The control plane, the node (containerd, the kubelet, kube-proxy, the DaemonSet controller), the images
of the Dockerfile and the chart's webhook are the tests' own (harness/controlplane.py, harness/node.py,
harness/image_builds.py, harness/kube_api.py; needs root and `make go-tools`). The chart is installed three
times over one release, one mode at a time: `none` (imagePuller.enabled=false: the kubelet pulls),
`socket` (the init container holds the runtime socket) and `agent` (the init container asks the node's
agent). The registry is the distribution registry on the node's loopback, which the node's containerd
trusts, so all three pull the same bytes from the same place.

Each round creates one copilot pod (two images: a main container and the copilot sidecar, each the
node's pause binary with a file of its own) per mode and case, the modes taking turns in an order that
rotates each round, so a neighbour's load on this machine falls on all of them alike. `fresh`: both images
are removed from the node first; `cached`: they are present. A pod's start is from the create request
to the first moment its status shows every container running, polled every 20 ms. The report gives
each mode's median and its spread (min, max) over the rounds, and the median added to `none`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.controlplane import control_plane
from harness.gotools import binary
from harness.image_builds import build_targets, start_builder
from harness.kube_api import FAIL, PRIVILEGED, ChartPods, Kube, KubeError, release
from harness.node import Node, NodeRegistry, node, node_registry
from harness.node_setup import Images, import_dockerfile_images

NAMESPACE = "cwbench"
PODS = "cwbench-pods"
MODES = ("none", "socket", "agent")
CASES = ("cached", "fresh")

Obj = dict[str, Any]


@dataclass
class Results:
    seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, mode: str, case: str, value: float) -> None:
        self.seconds.setdefault((mode, case), []).append(value)


def _image(the_node: Node, registry: NodeRegistry, work: Path, repository: str, tag: str) -> str:
    layout = work / repository.replace("/", "-") / tag / "oci"
    shutil.copytree(the_node.work / "pause" / "oci", layout)
    payload = layout.parent / "content.txt"
    payload.write_text(f"{repository}:{tag}\n")
    base = the_node.sandbox_image.rsplit(":", 1)[1]
    subprocess.run(["umoci", "tag", "--image", f"{layout}:{base}", tag], check=True, capture_output=True)
    subprocess.run(
        ["umoci", "insert", "--rootless", "--image", f"{layout}:{tag}", str(payload), "/content.txt"],
        check=True,
        capture_output=True,
    )
    return registry.push(layout, tag, repository)


def _values(the_node: Node, images: Images, mode: str) -> Obj:
    repository, tag = images.webhook.rsplit(":", 1)
    puller = images.puller
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
        "imagePuller": {
            "enabled": mode != "none",
            "mode": "agent" if mode == "agent" else "socket",
            "agent": {"image": puller},
            "pullerImages": {"containerd": puller},
            "sockets": {"containerd": str(the_node.containerd_socket)},
        },
        "nodeAgent": {"socketDirectory": str(Path(the_node.containerd_socket).parent)},
        "podSecurity": {"defaults": {"enforce": "privileged"}},
        "ptrace": {"mode": "drop"},
        **FAIL,
    }


def _pod(name: str, the_node: Node, main: str, sidecar: str) -> Obj:
    containers = [
        {"name": "main", "image": main, "imagePullPolicy": "IfNotPresent"},
        {"name": "flyte-copilot-sidecar", "image": sidecar, "imagePullPolicy": "IfNotPresent"},
    ]
    spec = {"nodeName": the_node.name, "terminationGracePeriodSeconds": 0, "containers": containers}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _pull(the_node: Node, image: str) -> None:
    """Into the node's store, where the kubelet looks, as an earlier pod's pull leaves it."""
    command = ["ctr", "--address", str(the_node.containerd_socket), "--namespace", "k8s.io", "images", "pull"]
    command += ["--plain-http", "--", image]
    subprocess.run(the_node.plane.netns.command(command), check=True, capture_output=True, timeout=120)


def _start_seconds(kube: Kube, pod: Obj, timeout: float = 120) -> float:
    name = pod["metadata"]["name"]
    started = time.monotonic()
    kube.create_pod(PODS, pod)
    path = f"/api/v1/namespaces/{PODS}/pods/{name}"
    try:
        while time.monotonic() - started < timeout:
            statuses = kube.get(path).get("status", {}).get("containerStatuses") or []
            if statuses and all("running" in s["state"] for s in statuses):
                return time.monotonic() - started
            time.sleep(0.02)
        raise RuntimeError(f"pod {name} not running within {timeout} s: {kube.get(path).get('status')}")
    finally:
        with contextlib.suppress(KubeError):
            kube.request("DELETE", path, {"gracePeriodSeconds": 0})


def _agent_ready(kube: Kube, the_node: Node, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pods = kube.get(f"/api/v1/namespaces/{NAMESPACE}/pods", labelSelector="app.kubernetes.io/component=agent")
        for pod in pods["items"]:
            ready = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}.get("Ready")
            if pod["spec"].get("nodeName") == the_node.name and ready == "True":
                return
        time.sleep(0.5)
    raise RuntimeError(f"the agent is not ready on {the_node.name} within {timeout} s:\n{the_node.logs()[-4000:]}")


@contextlib.contextmanager
def _cluster(work: Path) -> Iterator[tuple[Kube, Node, Images]]:
    etcd, apiserver, controllers = binary("etcd"), binary("kube-apiserver"), binary("kube-controller-manager")
    kubelet, proxy = binary("kubelet"), binary("kube-proxy")
    node_work = Path(f"/tmp/cwb-{os.getpid()}")  # unix socket paths are limited to 108 bytes
    for folder in ("kube", "builder", "images"):
        (work / folder).mkdir(parents=True, exist_ok=True)
    with (
        control_plane(work / "kube", etcd, apiserver, controllers) as plane,
        start_builder(work / "builder") as builder,
        node(plane, node_work, kubelet, controllers, proxy) as the_node,
    ):
        images = import_dockerfile_images(the_node, work, builder, build_targets(work / "images", builder))
        kube = Kube(plane)
        try:
            yield kube, the_node, images
        finally:
            kube.close()
    shutil.rmtree(node_work, ignore_errors=True)


def run(rounds: int, work: Path) -> Results:
    results = Results()
    with _cluster(work) as (kube, the_node, images), node_registry(the_node) as registry:
        socket_directory = str(Path(the_node.containerd_socket).parent)
        subprocess.run(["mount", "--bind", socket_directory, socket_directory], check=True, capture_output=True)
        subprocess.run(["mount", "--make-shared", socket_directory], check=True, capture_output=True)
        kube.create_namespace(NAMESPACE, PRIVILEGED)
        kube.create_namespace(PODS, PRIVILEGED)
        installed = release(kube, NAMESPACE, work / "release", _values(the_node, images, "none"))
        pods = ChartPods(installed, work / "pods")
        try:
            for round_ in range(rounds):
                order = MODES[round_ % 3 :] + MODES[: round_ % 3]
                for mode in order:
                    installed.upgrade(_values(the_node, images, mode))
                    pods.run(f"replica-{round_}-{mode}")
                    installed.wait_policies("Fail")
                    if mode == "agent":
                        _agent_ready(kube, the_node)
                    for case in CASES:
                        tag = f"r{round_}{mode[0]}{case[0]}"
                        main = _image(the_node, registry, work / "oci", "bench/main", tag)
                        sidecar = _image(the_node, registry, work / "oci", "flyteorg/flytecopilot", tag)
                        if case == "cached":
                            for image in (main, sidecar):
                                _pull(the_node, image)
                        pod = _pod(f"{tag}", the_node, main, sidecar)
                        results.add(mode, case, _start_seconds(kube, pod))
                        print(
                            f"round {round_ + 1} {mode:6} {case:6} {results.seconds[mode, case][-1]:.2f} s", flush=True
                        )
        finally:
            pods.stop()
            installed.remove_webhooks()
    return results


def report(results: Results, rounds: int) -> str:
    lines = [
        f"Pod start (create to every container running), {rounds} rounds, median [min, max], seconds:",
        "",
        "| mode | cached | fresh | added, cached | added, fresh |",
        "|---|---:|---:|---:|---:|",
    ]
    medians = {key: statistics.median(values) for key, values in results.seconds.items()}
    for mode in MODES:
        cells = []
        for case in CASES:
            values = results.seconds[mode, case]
            cells.append(f"{medians[mode, case]:.2f} [{min(values):.2f}, {max(values):.2f}]")
        added = [f"{medians[mode, case] - medians['none', case]:+.2f}" if mode != "none" else "" for case in CASES]
        lines.append(f"| {mode} | {cells[0]} | {cells[1]} | {added[0]} | {added[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs of every process)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="copilot-webhook-puller-bench-"))
    started = time.monotonic()
    try:
        results = run(args.rounds, work)
    finally:
        if args.keep:
            print(f"work folder kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(report(results, args.rounds))
    print(f"\n(the run took {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
