"""The node-agent puller (`imagePuller.mode: agent`, spec 1.3a) the way a hardened cluster runs it: the real
API server enforcing Pod Security `baseline` by its own defaults (no namespace label), the chart installed
with the Dockerfile's images, the agent's DaemonSet pod created by the real DaemonSet controller and run by
the real kubelet, its Service routed by the real kube-proxy with `internalTrafficPolicy: Local`
(harness/node.py), and the images served by a registry that only the pod network reaches: a Service whose
name the node's containerd cannot resolve (the Orchest case).

A copilot pod in a namespace labelled `restricted`, and another in an unlabelled namespace under the
cluster's `baseline` default, are both admitted with the agent's client, their images are pre-pulled by the
agent (the kubelet then finds them present), and they run. The socket mode, in the same cluster, is never
emitted where the level in force forbids hostPath."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.controlplane import ControlPlane
from harness.image_builds import ImageBuilder
from harness.kube_api import (
    FAIL,
    PRIVILEGED,
    ChartPods,
    Kube,
    KubeError,
    Obj,
    events,
    pods_left,
    release,
    started,
    wait_pod,
)
from harness.node import Node, publish_namespace_endpoint
from harness.node_setup import Images, import_dockerfile_images, running_node

NAMESPACE = "cwagent"  # the release's: it must admit the agent's hostPath
RESTRICTED = "cwagent-restricted"
UNLABELLED = "cwagent-default"
REGISTRY_NS = "cwagent-registry"
PULLER = "copilot-webhook-image-puller"
CLUSTER_POD_SECURITY = {"defaults": {"enforce": "baseline"}}
RESTRICTED_LABEL = {"pod-security.kubernetes.io/enforce": "restricted"}


@pytest.fixture(scope="module")
def hardened(kube: ControlPlane) -> Iterator[None]:
    """The API server enforces baseline wherever a namespace has no label."""
    kube.enforce_pod_security(CLUSTER_POD_SECURITY)
    try:
        yield
    finally:
        kube.enforce_pod_security(None)


@pytest.fixture(scope="module")
def the_node(kube: ControlPlane, hardened: None) -> Iterator[Node]:
    yield from running_node(kube, "dockerd", "docker", "mmdebstrap", "skopeo", "umoci", "docker-registry")


@pytest.fixture(scope="module")
def images(
    the_node: Node,
    image_builder: ImageBuilder,
    dockerfile_images: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Images:
    return import_dockerfile_images(the_node, tmp_path_factory.mktemp("agent-images"), image_builder, dockerfile_images)


@dataclass
class PodNetworkRegistry:
    host: str  # <service>.<namespace>.svc.cluster.local:<port>: a name only the pods' resolver knows
    main: str
    copilot: str  # named as Flyte names its copilot image


@pytest.fixture(scope="module")
def pod_registry(
    kube_admin: Kube, the_node: Node, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PodNetworkRegistry]:
    """The distribution registry on every address of the node's network, behind a Service: pods reach it by
    its cluster DNS name through kube-proxy; the node's containerd, resolving with the host's resolver,
    cannot."""
    work = tmp_path_factory.mktemp("agent-registry")
    port = 5000
    config = work / "config.yml"
    config.write_text(
        "version: 0.1\nlog: {level: info}\n"
        f"storage: {{filesystem: {{rootdirectory: {work / 'data'}}}}}\nhttp: {{addr: '0.0.0.0:{port}'}}\n"
    )
    log = work / "registry.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            the_node.plane.netns.command(["docker-registry", "serve", str(config)]), stdout=out, stderr=out
        )
    try:
        kube_admin.create_namespace(REGISTRY_NS)
        service = {"metadata": {"name": "registry"}, "spec": {"ports": [{"name": "http", "port": port}]}}
        kube_admin.create(f"/api/v1/namespaces/{REGISTRY_NS}/services", service)
        publish_namespace_endpoint(kube_admin, REGISTRY_NS, "registry")
        host = f"registry.{REGISTRY_NS}.svc.cluster.local:{port}"
        main = _push(the_node, work / "main", port, "team/task", host)
        copilot = _push(the_node, work / "copilot", port, "flyteorg/flytecopilot", host)
        yield PodNetworkRegistry(host, main, copilot)
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        if process.poll() is None:
            process.kill()


def _push(the_node: Node, work: Path, port: int, repository: str, host: str) -> str:
    """A runnable image (the node's pause binary, and a file that makes its digest its own), pushed over the
    node's loopback and named by the registry's Service."""
    layout = work / "oci"
    shutil.copytree(the_node.work / "pause" / "oci", layout)
    (work / "content.txt").write_text(f"{repository} from the pod network\n")
    tag = the_node.sandbox_image.rsplit(":", 1)[1]
    subprocess.run(["umoci", "tag", "--image", f"{layout}:{tag}", "v1"], check=True, capture_output=True)
    subprocess.run(
        ["umoci", "insert", "--rootless", "--image", f"{layout}:v1", str(work / "content.txt"), "/content.txt"],
        check=True,
        capture_output=True,
    )
    command = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:v1"]
    command.append(f"docker://127.0.0.1:{port}/{repository}:v1")
    subprocess.run(the_node.plane.netns.command(command), check=True, capture_output=True, timeout=120)
    return f"{host}/{repository}:v1"


def _values(the_node: Node, images: Images, registry: PodNetworkRegistry, mode: str = "agent") -> Obj:
    repository, tag = images.webhook.rsplit(":", 1)
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
        "imagePuller": {
            "mode": mode,
            "agent": {"image": images.puller},
            "pullerImages": {"containerd": images.puller},
            "sockets": {"containerd": str(the_node.containerd_socket)},
            "registries": {registry.host: {"plainHttp": True}},
            "failurePolicy": "Fail",
        },
        "nodeAgent": {"socketDirectory": str(Path(the_node.containerd_socket).parent)},
        "ptrace": {"mode": "drop"},
        **FAIL,
    }


@pytest.fixture(scope="module")
def webhook(
    kube_admin: Kube,
    the_node: Node,
    images: Images,
    pod_registry: PodNetworkRegistry,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ChartPods]:
    # The agent mounts the socket's directory with HostToContainer propagation, which needs the host's mount
    # of it shared (systemd makes / shared; this machine's may be private).
    socket_directory = str(Path(the_node.containerd_socket).parent)
    subprocess.run(["mount", "--bind", socket_directory, socket_directory], check=True, capture_output=True)
    subprocess.run(["mount", "--make-shared", socket_directory], check=True, capture_output=True)
    kube_admin.create_namespace(NAMESPACE, PRIVILEGED)
    kube_admin.create_namespace(RESTRICTED, RESTRICTED_LABEL)
    kube_admin.create_namespace(UNLABELLED)
    work = tmp_path_factory.mktemp("agent-webhook")
    installed = release(kube_admin, NAMESPACE, work, _values(the_node, images, pod_registry))
    yield from started(installed, work / "pods", policy="Fail")


def _agent_pod(kube: Kube, the_node: Node, timeout: float = 180) -> Obj:
    """The agent's pod on the node, once ready: created by the DaemonSet controller, run by the kubelet."""
    deadline = time.monotonic() + timeout
    seen: list[Obj] = []
    while time.monotonic() < deadline:
        seen = kube.get(f"/api/v1/namespaces/{NAMESPACE}/pods", labelSelector="app.kubernetes.io/component=agent")[
            "items"
        ]
        for pod in seen:
            conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
            if pod["spec"].get("nodeName") == the_node.name and conditions.get("Ready") == "True":
                return pod
        time.sleep(1)
    statuses = [(p["metadata"]["name"], p.get("status", {})) for p in seen]
    raise AssertionError(f"no ready agent pod on {the_node.name} within {timeout} s: {statuses}\n{the_node.logs()}")


def _copilot_pod(name: str, registry: PodNetworkRegistry, *, restricted: bool) -> Obj:
    """A copilot pod on the pods' bridge; `restricted`: what Pod Security restricted requires of its own
    containers (a Flyte pod template gives it that)."""
    secure: Obj = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    containers: list[Obj] = [
        {"name": "main", "image": registry.main, "imagePullPolicy": "IfNotPresent"},
        {"name": "flyte-copilot-sidecar", "image": registry.copilot, "imagePullPolicy": "IfNotPresent"},
    ]
    spec: Obj = {"terminationGracePeriodSeconds": 0, "containers": containers}
    if restricted:
        for container in containers:
            container["securityContext"] = dict(secure)
        spec["securityContext"] = {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


@contextlib.contextmanager
def _created(kube: Kube, namespace: str, pod: Obj, the_node: Node) -> Iterator[Obj]:
    pod["spec"]["nodeName"] = the_node.name
    name = pod["metadata"]["name"]
    stored = kube.create_pod(namespace, pod)
    try:
        yield stored
    finally:
        with contextlib.suppress(KubeError):
            kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", {"gracePeriodSeconds": 1})
        left = pods_left(kube, namespace, [name])
        assert not left, left


def _running(pod: Obj) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return bool(statuses) and all("running" in s["state"] for s in statuses)


@pytest.mark.parametrize(("namespace", "restricted"), [(RESTRICTED, True), (UNLABELLED, False)])
def test_a_copilot_pod_gets_its_images_from_the_pod_network_through_its_nodes_agent(
    kube_admin: Kube,
    the_node: Node,
    webhook: ChartPods,
    pod_registry: PodNetworkRegistry,
    namespace: str,
    restricted: bool,
) -> None:
    agent = _agent_pod(kube_admin, the_node)
    for image in (pod_registry.main, pod_registry.copilot):
        the_node.remove_image(image)
        assert the_node.references(image) == [], the_node.images()
    name = f"agent-{'restricted' if restricted else 'default'}"
    with _created(kube_admin, namespace, _copilot_pod(name, pod_registry, restricted=restricted), the_node) as stored:
        (client,) = [c for c in stored["spec"]["initContainers"] if c["name"] == PULLER]
        assert client["securityContext"]["runAsNonRoot"] is True
        assert not [v for v in stored["spec"]["volumes"] if "hostPath" in v], "no hostPath in the user's pod"
        running = wait_pod(kube_admin, namespace, name, _running, "running (every container)", 180, more=the_node.logs)
        (init,) = running["status"]["initContainerStatuses"]
        assert init["state"]["terminated"]["exitCode"] == 0, init
        log = the_node.container_log(namespace, name, PULLER)
        for image in (pod_registry.main, pod_registry.copilot):
            assert f"image={image} result=pulled" in log, log
        seen = [(e["reason"], e["message"]) for e in events(kube_admin, namespace, name)]
    for image in (pod_registry.main, pod_registry.copilot):
        present = f'Container image "{image}" already present on machine'
        assert any(r == "Pulled" and m.startswith(present) for r, m in seen), seen
    agent_log = the_node.container_log(NAMESPACE, agent["metadata"]["name"], "agent")
    assert f"pull {namespace}/{name} images=2" in agent_log, agent_log


def test_the_socket_mode_is_never_emitted_where_the_level_forbids_hostpath(
    kube_admin: Kube, the_node: Node, images: Images, webhook: ChartPods, pod_registry: PodNetworkRegistry
) -> None:
    webhook.release.upgrade(_values(the_node, images, pod_registry, mode="socket"))
    webhook.run("replica-socket")
    webhook.release.wait_policies("Fail")
    for namespace, restricted in ((RESTRICTED, True), (UNLABELLED, False)):
        pod = _copilot_pod(f"socket-{namespace}", pod_registry, restricted=restricted)
        pod["spec"]["nodeName"] = the_node.name
        stored = kube_admin.create_pod(namespace, pod, dry_run=True)
        assert PULLER not in [c["name"] for c in stored["spec"].get("initContainers", [])], stored["spec"]
        assert not [v for v in stored["spec"].get("volumes", []) if "hostPath" in v]
        answer = webhook.https("POST", f"/preview?namespace={namespace}", json=pod)
        assert answer.status_code == 200, answer.text
        level = "'restricted' (namespace label)" if restricted else "'baseline' (cluster default)"
        warning = f"no image puller: Pod Security {level} forbids its hostPath socket volume"
        assert warning in " ".join(answer.json()["warnings"]), answer.json()["warnings"]
