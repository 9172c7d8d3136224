"""Pods that a real kubelet runs (harness/node.py: containerd 1.6 with its CRI plugin, the kubelet v1.35 built
from Kubernetes' module, registered to the real API server with a certificate of the node's own), admitted
through the chart-installed webhook (its server run as the chart's ServiceAccount, harness/kube_api.py).

What a user of the chart sees on a node: the image puller pulls a copilot pod's images from a registry
through the node's own containerd socket, plainly and with the pod's imagePullSecrets, and the kubelet
then finds them present; the puller's failure policies as the pod's status shows them; `helm test`
running its pod against the Service; and a Flyte-shaped pod admitted by Pod Security `baseline` with
`ptrace.mode=drop` that runs to completion.

The images under test (the Dockerfile's puller and webhook targets) are the ones tests/test_images.py
starts: built once per test session by a real dockerd on a stand-in base made from Debian's packages
(harness/image_builds.py), and imported into the node's containerd (`docker save | ctr images import`)."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.controlplane import ControlPlane
from harness.image_builds import ImageBuilder
from harness.kube_api import (
    FAIL,
    PRIVILEGED_BY_DEFAULT,
    ChartPods,
    Kube,
    KubeError,
    Obj,
    Release,
    events,
    pods_left,
    release,
    started,
    wait_pod,
)
from harness.node import Node, NodeRegistry, node_registry
from harness.node_setup import Images, import_dockerfile_images, running_node
from tests.helpers import load_yaml

NAMESPACE = "cwnode"  # the release's (never sent to the webhook)
PODS = "cwnode-pods"
BASELINE_PODS = "cwnode-baseline"
PULLER = "copilot-webhook-image-puller"
USER = ("puller", "s3cret-pw")
GOLDEN_PODS = Path(__file__).parent / "golden" / "pods"
STANDIN = Path(__file__).parent / "node" / "standin"


@pytest.fixture(scope="module")
def the_node(kube: ControlPlane) -> Iterator[Node]:
    yield from running_node(kube, "dockerd", "docker", "mmdebstrap", "skopeo", "umoci", "docker-registry", "htpasswd")


@pytest.fixture(scope="module")
def images(
    the_node: Node,
    image_builder: ImageBuilder,
    dockerfile_images: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Images:
    """The Dockerfile's targets (built once for the session) and the Flyte stand-ins, imported into the node."""
    work = tmp_path_factory.mktemp("node-images")
    standins = _build_standins(work, image_builder.base, image_builder.env)
    return import_dockerfile_images(the_node, work, image_builder, dockerfile_images, standins)


def _build_standins(work: Path, base: str, env: dict[str, str]) -> list[str]:
    """Stand-ins for Flyte's images (no registry on the internet here): the raw-container task's script and
    a copilot that does its part of the task's data flow in shell, tagged as the pods name them."""
    context = work / "standin"
    shutil.copytree(STANDIN, context)
    names = ["cr.flyte.org/flyteorg/flytecopilot:v1.15.0", "ghcr.io/flyteorg/rawcontainers-shell:v2"]
    subprocess.run(
        ["docker", "build", "--quiet", "--network", "none", "--build-arg", f"BASE={base}",
         *(a for n in names for a in ("--tag", n)), str(context)],
        check=True, capture_output=True, env=env, timeout=300,
    )  # fmt: skip
    return names


@dataclass
class Registries:
    plain: NodeRegistry
    private: NodeRegistry
    copilot: str  # the plain registry's, named as Flyte names its copilot image (the webhook knows it by it)
    secret: str  # the private registry's


@pytest.fixture(scope="module")
def registries(the_node: Node, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registries]:
    """A plain registry and one behind htpasswd, on the node's loopback, each holding a runnable image:
    the node's own pause binary with a file that makes its digest its own."""
    work = tmp_path_factory.mktemp("node-registries")
    with node_registry(the_node) as plain, node_registry(the_node, USER) as private:
        copilot = _runnable_image(the_node, plain, work / "copilot", "flyteorg/flytecopilot")
        secret = _runnable_image(the_node, private, work / "secret", "team/task")
        yield Registries(plain, private, copilot, secret)


def _runnable_image(the_node: Node, registry: NodeRegistry, work: Path, repository: str) -> str:
    layout = work / "oci"
    shutil.copytree(the_node.work / "pause" / "oci", layout)
    payload = work / "content.txt"
    payload.write_text(f"{repository} in {registry.host}\n")
    image = f"{layout}:v1"
    subprocess.run(
        ["umoci", "tag", "--image", f"{layout}:{the_node.sandbox_image.rsplit(':', 1)[1]}", "v1"],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ["umoci", "insert", "--rootless", "--image", image, str(payload), "/content.txt"],
        check=True,
        capture_output=True,
    )
    return registry.push(layout, "v1", repository)


def _values(the_node: Node, images: Images, failure_policy: str) -> Obj:
    repository, tag = images.webhook.rsplit(":", 1)
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
        "imagePuller": {
            "pullerImages": {"containerd": images.puller},
            "sockets": {"containerd": str(the_node.containerd_socket)},
            "failurePolicy": failure_policy,
        },
        "ptrace": {"mode": "drop"},
        "podSecurity": PRIVILEGED_BY_DEFAULT,
        **FAIL,
    }


@pytest.fixture(scope="module")
def webhook(
    kube_admin: Kube, the_node: Node, images: Images, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChartPods]:
    kube_admin.create_namespace(PODS)
    kube_admin.create_namespace(BASELINE_PODS, {"pod-security.kubernetes.io/enforce": "baseline"})
    work = tmp_path_factory.mktemp("node-webhook")
    installed = release(kube_admin, NAMESPACE, work, _values(the_node, images, "Ignore"))
    yield from started(installed, work / "pods", policy="Fail")


def _policy(pods: ChartPods, the_node: Node, images: Images, failure_policy: str) -> None:
    """helm upgrade to the puller failure policy, and the replica restarted on the new ConfigMap."""
    pods.release.upgrade(_values(the_node, images, failure_policy))
    pods.run(f"replica-{failure_policy.lower()}")
    pods.release.wait_policies("Fail")


# --- reading what the kubelet did -----------------------------------------------------------------------


def _pod(kube: Kube, namespace: str, name: str) -> Obj:
    return kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}")


def _events(kube: Kube, namespace: str, name: str) -> list[tuple[str, str]]:
    """(reason, message) of the kubelet's events about the pod, oldest first."""
    return [(e["reason"], e["message"]) for e in events(kube, namespace, name)]


def _statuses(pod: Obj, field: str = "containerStatuses") -> dict[str, Obj]:
    return {s["name"]: s for s in pod.get("status", {}).get(field) or []}


def _wait_pod(
    kube: Kube, the_node: Node, namespace: str, name: str, check: Callable[[Obj], bool], what: str, timeout: float = 120
) -> Obj:
    return wait_pod(kube, namespace, name, check, what, timeout, more=the_node.logs)


@contextlib.contextmanager
def _created(kube: Kube, namespace: str, pod: Obj) -> Iterator[Obj]:
    name = pod["metadata"]["name"]
    stored = kube.create_pod(namespace, pod)
    try:
        yield stored
    finally:
        with contextlib.suppress(KubeError):
            kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", {"gracePeriodSeconds": 1})
        left = pods_left(kube, namespace, [name])
    if left:  # after a test that passed; a failing one keeps its own failure
        pytest.fail(left)


def _copilot_pod(the_node: Node, name: str, main: str, sidecar: str, secret: str | None = None) -> Obj:
    """A copilot pod as the tests' registries serve it: on the node's network, bound to the node."""
    spec: Obj = {
        "nodeName": the_node.name,
        "hostNetwork": True,
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {"name": "main", "image": main, "imagePullPolicy": "IfNotPresent"},
            {"name": "flyte-copilot-sidecar", "image": sidecar, "imagePullPolicy": "IfNotPresent"},
        ],
    }
    if secret is not None:
        spec["imagePullSecrets"] = [{"name": secret}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _pull_secret(kube: Kube, namespace: str, name: str, registry: NodeRegistry) -> None:
    assert registry.user is not None
    auth = base64.b64encode(":".join(registry.user).encode()).decode()
    config = {"auths": {registry.host: {"auth": auth}}}
    secret = {
        "metadata": {"name": name},
        "type": "kubernetes.io/dockerconfigjson",
        "data": {".dockerconfigjson": base64.b64encode(json.dumps(config).encode()).decode()},
    }
    with contextlib.suppress(KubeError):
        kube.create(f"/api/v1/namespaces/{namespace}/secrets", secret)


def _ptrace(container: Obj) -> bool:
    return "SYS_PTRACE" in (container.get("securityContext", {}).get("capabilities", {}).get("add") or [])


def _running(pod: Obj) -> bool:
    statuses = _statuses(pod)
    return bool(statuses) and all("running" in s["state"] for s in statuses.values())


# --- 1. the puller, run by the kubelet, pulls through the node's containerd -------------------------


def test_the_puller_init_container_pulls_through_the_nodes_containerd(
    kube_admin: Kube, the_node: Node, webhook: ChartPods, registries: Registries
) -> None:
    for image in (registries.secret, registries.copilot):
        the_node.remove_image(image)
        # Absent before the pod starts: the pulls the row counts below can only be this pod's.
        assert the_node.references(image) == [], the_node.images()
    _pull_secret(kube_admin, PODS, "regcred", registries.private)
    pod = _copilot_pod(the_node, "pulled", registries.secret, registries.copilot, secret="regcred")
    with _created(kube_admin, PODS, pod) as stored:
        (puller,) = [c for c in stored["spec"]["initContainers"] if c["name"] == PULLER]
        assert puller["args"][-2:] == [registries.secret, registries.copilot], puller["args"]
        running = _wait_pod(kube_admin, the_node, PODS, "pulled", _running, "running (every container)")
        (init,) = _statuses(running, "initContainerStatuses").values()
        assert init["state"]["terminated"]["exitCode"] == 0, init
        log = the_node.container_log(PODS, "pulled", PULLER)
        for image in (registries.copilot, registries.secret):
            assert f"image={image} result=pulled attempts=1" in log, log
            assert image in the_node.images()
        events = _events(kube_admin, PODS, "pulled")
    # The main containers found their images present: the kubelet says so, and containerd served exactly one
    # pull of each (the puller's).
    for image in (registries.copilot, registries.secret):
        present = f'Container image "{image}" already present on machine'
        assert any(r == "Pulled" and m.startswith(present) for r, m in events), events
        assert the_node.containerd_log().count(f'msg="PullImage \\"{image}\\""') == 1  # logfmt escapes quotes


# --- 2. the puller's failure policies, as the pod's status shows them ------------------------------------


def test_ignore_lets_the_pod_meet_its_own_err_image_pull(
    kube_admin: Kube, the_node: Node, webhook: ChartPods, registries: Registries
) -> None:
    missing = f"{registries.plain.host}/team/missing:v1"
    pod = _copilot_pod(the_node, "ignored", missing, registries.copilot)
    with _created(kube_admin, PODS, pod):

        def err_image_pull(p: Obj) -> bool:
            waiting = _statuses(p).get("main", {}).get("state", {}).get("waiting", {})
            return waiting.get("reason") in ("ErrImagePull", "ImagePullBackOff")

        seen = _wait_pod(
            kube_admin, the_node, PODS, "ignored", err_image_pull, "main in ErrImagePull or ImagePullBackOff"
        )
        (init,) = _statuses(seen, "initContainerStatuses").values()
        assert init["state"]["terminated"]["exitCode"] == 0, "Ignore: the puller finishes"
        log = the_node.container_log(PODS, "ignored", PULLER)
        assert f"image={missing} result=failed" in log, log


def test_fail_keeps_the_pod_in_init_naming_the_image_and_cause(
    kube_admin: Kube, the_node: Node, images: Images, webhook: ChartPods, registries: Registries
) -> None:
    _policy(webhook, the_node, images, "Fail")
    try:
        missing = f"{registries.plain.host}/team/absent:v1"
        pod = _copilot_pod(the_node, "failed", missing, registries.copilot)
        with _created(kube_admin, PODS, pod):

            def failed_init(p: Obj) -> bool:
                init = _statuses(p, "initContainerStatuses").get(PULLER, {})
                return "terminated" in init.get("lastState", {}) or "terminated" in init.get("state", {})

            seen = _wait_pod(kube_admin, the_node, PODS, "failed", failed_init, f"{PULLER} terminated")
            init = _statuses(seen, "initContainerStatuses")[PULLER]
            terminated = init.get("lastState", {}).get("terminated") or init["state"]["terminated"]
            assert terminated["exitCode"] != 0
            assert f"image={missing} result=failed" in terminated["message"], terminated
            assert "not found" in terminated["message"].lower(), terminated
            assert seen["status"]["phase"] == "Pending"
            assert all("waiting" in s["state"] for s in _statuses(seen).values()), "nothing else starts"
    finally:
        _policy(webhook, the_node, images, "Ignore")


# --- 5. helm test -------------------------------------------------------------------------------------


def test_helm_test_runs_its_pod_against_the_service(kube_admin: Kube, the_node: Node, webhook: ChartPods) -> None:
    host, _ = webhook.service_address()
    release: Release = webhook.release
    the_node.dns.records[f"{release.fullname}.{release.namespace}.svc.cluster.local"] = host
    # The test pod is the chart's as rendered: no nodeName, and no scheduler here, so bind it as the
    # scheduler would the moment it appears.
    binder = _Binder(kube_admin, release.namespace, the_node.name)
    with binder:
        try:
            result = release.helm().test(release.name, timeout=180)
        except Exception as err:
            log = the_node.container_log(release.namespace, f"{release.fullname}-verify", "verify")
            pytest.fail(f"{err}\nverify's log:\n{log}\nDNS queries: {the_node.dns.queries}")
    # helm raised had the pod failed; it deleted the pod because it succeeded (hook-succeeded). What the
    # kubelet and the cluster's DNS saw of it:
    verify = f"{release.fullname}-verify"
    assert result["release"]["status"] == "deployed"
    assert binder.bound == [verify]
    assert not kube_admin.exists(f"/api/v1/namespaces/{release.namespace}/pods/{verify}")
    reasons = [reason for reason, _ in _events(kube_admin, release.namespace, verify)]
    assert "Started" in reasons, reasons
    assert f"{release.fullname}.{release.namespace}.svc.cluster.local" in the_node.dns.queries


class _Binder:
    """What kube-scheduler does for pods without a node, for the one node there is: a Binding."""

    def __init__(self, kube: Kube, namespace: str, node_name: str) -> None:
        import threading

        self.kube, self.namespace, self.node_name = kube, namespace, node_name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.bound: list[str] = []

    def __enter__(self) -> _Binder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        while not self._stop.wait(0.2):
            for pod in self.kube.get(path)["items"]:
                name = pod["metadata"]["name"]
                if pod["spec"].get("nodeName") or name in self.bound:
                    continue
                binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                           "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name}}  # fmt: skip
                with contextlib.suppress(KubeError):
                    self.kube.create(f"{path}/{name}/binding", binding)
                    self.bound.append(name)


# --- 4. Pod Security baseline with ptrace.mode=drop ---------------------------------------------------


def test_a_flyte_pod_runs_to_completion_under_baseline_with_drop(
    kube_admin: Kube, the_node: Node, images: Images, webhook: ChartPods
) -> None:
    pod = load_yaml(GOLDEN_PODS / "flyte-1.15.yaml")
    pod["metadata"].pop("namespace")
    pod["metadata"]["name"] = "flyte-baseline"
    pod["spec"]["nodeName"] = the_node.name
    pod["spec"]["terminationGracePeriodSeconds"] = 0
    with _created(kube_admin, BASELINE_PODS, pod) as stored:
        holders = [c["name"] for c in [*stored["spec"]["initContainers"], *stored["spec"]["containers"]] if _ptrace(c)]
        assert holders == []
        done = _wait_pod(
            kube_admin,
            the_node,
            BASELINE_PODS,
            "flyte-baseline",
            lambda p: p["status"]["phase"] in ("Succeeded", "Failed"),
            "Succeeded or Failed",
            timeout=180,
        )
        assert done["status"]["phase"] == "Succeeded", done["status"]
