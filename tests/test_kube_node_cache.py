"""The node cache on a real watch: Node objects as the API server stores and renders them (its Table
rendering), pods placed by nodeName, nodeSelector and affinity, a runtime that changes, and a watch that
the API server ends with 410 Gone after etcd compacted its history."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from harness.controlplane import ControlPlane
from harness.kube_api import PRIVILEGED, ChartPods, Kube, Obj, release, started, wait_for
from tests.test_kube_install import pod
from webhook.cluster.access import api_client
from webhook.cluster.nodes import NodeCache
from webhook.config import ClusterSettings

PODS = Path(__file__).parent / "golden" / "pods"
NAMESPACE = "cwnodes"
POD_NAMESPACE = "nodes-pods"
PULLER = "copilot-webhook-image-puller"
NODES: dict[str, tuple[str, dict[str, str]]] = {
    "n-containerd": ("containerd://1.7.11", {}),
    "n-docker": ("docker://24.0.7", {}),
    "n-docker2": ("docker://24.0.7", {}),
    "n-crio": ("cri-o://1.28.0", {}),
    "n-k3s": ("containerd://1.7.7-k3s1.27", {}),
    "n-custom": (
        "containerd://1.7.11",
        {"kubeadm.alpha.kubernetes.io/cri-socket": "unix:///var/run/custom/containerd.sock"},
    ),
}
SOCKETS = {
    "n-containerd": ("containerd", "/run/containerd/containerd.sock"),
    "n-docker": ("docker", "/var/run/docker.sock"),
    "n-docker2": ("docker", "/var/run/docker.sock"),
    "n-crio": ("cri-o", "/var/run/crio/crio.sock"),
    "n-k3s": ("containerd", "/run/k3s/containerd/containerd.sock"),
    "n-custom": ("containerd", "/var/run/custom/containerd.sock"),
}


def _node(name: str, annotations: dict[str, str]) -> Obj:
    labels = {"kubernetes.io/hostname": name, "pool": name.split("-")[1]}
    return {"metadata": {"name": name, "labels": labels, "annotations": annotations}}


def _set_runtime(kube: Kube, name: str, runtime: str) -> None:
    keys = ("architecture", "bootID", "kernelVersion", "kubeProxyVersion", "kubeletVersion", "machineID", "osImage")
    info = {**dict.fromkeys(keys, ""), "containerRuntimeVersion": runtime, "operatingSystem": "linux", "systemUUID": ""}
    kube.patch(f"/api/v1/nodes/{name}/status", {"status": {"nodeInfo": info}})


def add_node(kube: Kube, name: str, runtime: str, annotations: dict[str, str] | None = None) -> None:
    """A Node as a kubelet registers one: the object, then its status with the runtime it reports."""
    kube.create("/api/v1/nodes", _node(name, annotations or {}))
    _set_runtime(kube, name, runtime)


@pytest.fixture(scope="module")
def server(kube_admin: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChartPods]:
    for name, (runtime, node_annotations) in NODES.items():
        add_node(kube_admin, name, runtime, node_annotations)
    kube_admin.create_namespace(POD_NAMESPACE, PRIVILEGED)
    work = tmp_path_factory.mktemp("nodes")
    yield from started(release(kube_admin, NAMESPACE, work, {"imagePuller": {"heterogeneous": "pin"}}), work / "pods")
    for name in NODES:
        kube_admin.delete(f"/api/v1/nodes/{name}")


def _copilot_pod(name: str, **spec: Any) -> Obj:
    obj = pod(PODS / "flyte-1.16.yaml", name)
    obj["spec"].update(spec)
    return obj


def _puller(stored: Obj) -> tuple[str, str] | None:
    if PULLER not in [c["name"] for c in stored["spec"].get("initContainers", [])]:
        return None
    (volume,) = (v for v in stored["spec"]["volumes"] if v["name"] == "copilot-webhook-runtime-socket")
    summary = stored["metadata"]["annotations"]["copilot-webhook.io/mutated"]
    flavour = summary.split("image-puller=")[1].split(":")[0]
    return flavour, volume["hostPath"]["path"]


@pytest.mark.parametrize("node", sorted(NODES))
def test_a_pod_bound_to_a_node_gets_the_puller_for_its_runtime(kube_admin: Kube, server: ChartPods, node: str) -> None:
    stored = kube_admin.create_pod(POD_NAMESPACE, _copilot_pod(f"on-{node}", nodeName=node))
    assert _puller(stored) == SOCKETS[node]


def test_node_selector_and_required_affinity_narrow_the_candidates(kube_admin: Kube, server: ChartPods) -> None:
    by_selector = kube_admin.create_pod(POD_NAMESPACE, _copilot_pod("by-selector", nodeSelector={"pool": "docker"}))
    assert _puller(by_selector) == SOCKETS["n-docker"]
    term = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["crio"]}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}
    by_affinity = kube_admin.create_pod(POD_NAMESPACE, _copilot_pod("by-affinity", affinity=affinity))
    assert _puller(by_affinity) == SOCKETS["n-crio"]


def test_disagreeing_candidates_pin_the_majority_runtime(kube_admin: Kube, server: ChartPods) -> None:
    term = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["docker", "docker2", "containerd"]}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}
    stored = kube_admin.create_pod(POD_NAMESPACE, _copilot_pod("two-to-one", affinity=affinity))
    assert _puller(stored) == SOCKETS["n-docker"]
    required = stored["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    pinned = {"key": "copilot-webhook.io/container-runtime", "operator": "In", "values": ["docker"]}
    assert [t["matchExpressions"] for t in required["nodeSelectorTerms"]] == [[*term["matchExpressions"], pinned]]


def _created_on(kube: Kube, node: str) -> tuple[str, str] | None:
    return _puller(kube.create_pod(POD_NAMESPACE, _copilot_pod(f"on-{node}-{time.monotonic_ns()}", nodeName=node)))


def test_a_node_that_changes_runtime_is_seen_within_a_second(kube_admin: Kube, server: ChartPods) -> None:
    _set_runtime(kube_admin, "n-crio", "docker://25.0.0")
    changed = time.monotonic()
    try:
        assert wait_for(lambda: _created_on(kube_admin, "n-crio") == SOCKETS["n-docker"], timeout=5, interval=0.05)
        assert time.monotonic() - changed < 1.0
    finally:
        _set_runtime(kube_admin, "n-crio", NODES["n-crio"][0])


def test_a_watch_ended_by_410_gone_after_compaction_is_survived(
    kube: ControlPlane, kube_admin: Kube, server: ChartPods
) -> None:
    # History moves on (writes to other objects), etcd compacts it, and the API server restarts: the
    # server's watch resumes from a resourceVersion that no longer exists and gets 410 Gone.
    for i in range(20):
        kube_admin.create(f"/api/v1/namespaces/{POD_NAMESPACE}/configmaps", {"metadata": {"name": f"churn-{i}"}})
    kube.compact_etcd()
    kube.restart_apiserver()
    add_node(kube_admin, "n-late", "docker://24.0.7")
    try:
        assert wait_for(lambda: _created_on(kube_admin, "n-late") == SOCKETS["n-docker"], timeout=30, interval=0.5), (
            server.output()[-3000:]
        )
    finally:
        kube_admin.delete("/api/v1/nodes/n-late")


def test_paged_lists_continue_on_the_real_server_read_ahead_first(
    kube: ControlPlane, kube_admin: Kube, tmp_path: Path
) -> None:
    """With pages of two, the first list asks for each next page with the real server's continue token from a
    thread of its own while the caller reads the last; a relist asks in turn, on the caller's thread. Both
    end holding every node with the runtime its status reports, and the relist sees what changed between."""
    runtimes = {f"paged-{i}": "containerd://1.7.11" if i % 2 else "docker://24.0.7" for i in range(7)}
    for name, runtime in runtimes.items():
        add_node(kube_admin, name, runtime)
    kubeconfig = kube.kubeconfig(tmp_path / "admin.kubeconfig")
    api = api_client(ClusterSettings(enabled="true", kubeconfig=str(kubeconfig)))
    assert api is not None
    core = client.CoreV1Api(api)
    asked: list[tuple[str, str]] = []  # (continue token, the thread that asked) of each page after the first

    def list_node(**kwargs: Any) -> Any:
        if kwargs.get("_continue"):
            asked.append((kwargs["_continue"], threading.current_thread().name))
        return core.list_node(**kwargs)

    cache = NodeCache(list_node, page_size=2)
    try:
        cache.informer.list_once()
        flavours = {name: facts.flavour for name, facts in cache.informer.items.items()}
        assert {name: flavours.get(name) for name in runtimes} == {
            name: runtime.split(":")[0] for name, runtime in runtimes.items()
        }
        assert len(asked) >= len(runtimes) // 2, asked  # other modules' nodes may add pages, never remove them
        assert {thread for _token, thread in asked} == {"list-ahead"}
        assert len({token for token, _thread in asked}) == len(asked)

        asked.clear()
        kube_admin.delete("/api/v1/nodes/paged-0")
        _set_runtime(kube_admin, "paged-1", "docker://24.0.7")
        add_node(kube_admin, "paged-7", "cri-o://1.28.0")
        cache.informer.list_once()
        flavours = {name: facts.flavour for name, facts in cache.informer.items.items()}
        expected = {name: runtime.split(":")[0] for name, runtime in runtimes.items() if name != "paged-0"}
        assert {name: flavours.get(name) for name in [*expected, "paged-7"]} == {
            **expected,
            "paged-1": "docker",
            "paged-7": "cri-o",
        }
        assert "paged-0" not in flavours
        assert len(asked) >= len(runtimes) // 2, asked
        assert {thread for _token, thread in asked} == {threading.current_thread().name}
    finally:
        api.close()  # type: ignore[no-untyped-call]
        for name in [*runtimes, "paged-7"]:
            if kube_admin.exists(f"/api/v1/nodes/{name}"):
                kube_admin.delete(f"/api/v1/nodes/{name}")
