"""Pod Security enforced by the cluster's defaults, not by namespace labels: the real API server started with
an AdmissionConfiguration whose PodSecurity defaults enforce baseline and exempt one namespace (how RKE2's
CIS profile and hardened kubeadm clusters run), and the chart installed as the README tells hardened
clusters (`ptrace.mode=drop`) with the same exemption.

A Flyte 1.15 copilot pod bound to a containerd node is admitted in every namespace the docs describe:
unlabelled (and not yet seen by the webhook), labelled privileged, labelled baseline, and exempt. The
socket puller is emitted exactly where the level in force allows a hostPath volume, and the API server
itself refuses the puller where it does not, so an absence here is a decision, not an accident."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.controlplane import ControlPlane
from harness.kube_api import PRIVILEGED, ChartPods, Kube, KubeError, Obj, release, started
from tests.test_kube_install import pod, ptrace_holders
from tests.test_kube_node_cache import add_node

FLYTE_115 = Path(__file__).parent / "golden" / "pods" / "flyte-1.15.yaml"
NAMESPACE = "cwpsa"
NODE = "psa-containerd"
EXEMPT = "psa-exempt"
BASELINE = {"pod-security.kubernetes.io/enforce": "baseline"}
PULLER = "copilot-webhook-image-puller"
SOCKET_VOLUME = "copilot-webhook-runtime-socket"
CLUSTER_POD_SECURITY = {"defaults": {"enforce": "baseline"}, "exemptions": {"namespaces": [EXEMPT]}}
# The README's hardened-cluster install; the chart's podSecurity.defaults (baseline) is left as it is.
VALUES = {"ptrace": {"mode": "drop"}, "podSecurity": {"exemptions": {"namespaces": [EXEMPT]}}}


@pytest.fixture(scope="module")
def server(kube: ControlPlane, kube_admin: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChartPods]:
    kube.enforce_pod_security(CLUSTER_POD_SECURITY)
    try:
        add_node(kube_admin, NODE, "containerd://1.7.11")
        work = tmp_path_factory.mktemp("psa")
        yield from started(release(kube_admin, NAMESPACE, work, VALUES), work / "pods")
        kube_admin.delete(f"/api/v1/nodes/{NODE}")
    finally:
        kube.enforce_pod_security(None)


def _copilot_pod(name: str) -> Obj:
    obj = pod(FLYTE_115, name)
    obj["spec"]["nodeName"] = NODE
    return obj


def _puller(stored: Obj) -> list[str]:
    init = [c["name"] for c in stored["spec"].get("initContainers", []) if c["name"] == PULLER]
    volumes = [v["name"] for v in stored["spec"].get("volumes", []) if "hostPath" in v]
    return init + volumes


def _summary(stored: Obj) -> str:
    return str(stored["metadata"].get("annotations", {}).get("copilot-webhook.io/mutated"))


def test_the_cluster_default_refuses_the_socket_puller_in_an_unlabelled_namespace(
    kube_admin: Kube, server: ChartPods
) -> None:
    """The counterpart: the pod as the webhook emits it where hostPath is allowed, sent to an unlabelled
    namespace the webhook does not serve, is refused by the API server for our volume."""
    kube_admin.create_namespace("psa-privileged-preview", PRIVILEGED)
    answer = server.https("POST", "/preview?namespace=psa-privileged-preview", json=_copilot_pod("with-puller"))
    assert answer.status_code == 200, answer.text
    with_puller = answer.json()["object"]
    assert _puller(with_puller) == [PULLER, SOCKET_VOLUME]
    kube_admin.create_namespace("psa-unserved", {"copilot-webhook.io/inject": "disabled"})
    with_puller["metadata"].pop("namespace", None)
    with pytest.raises(KubeError) as refused:
        kube_admin.create_pod("psa-unserved", with_puller)
    assert refused.value.status == 403
    assert 'violates PodSecurity "baseline:latest": hostPath volumes' in refused.value.message
    assert SOCKET_VOLUME in refused.value.message


def test_an_unlabelled_namespace_not_yet_seen_is_served_at_the_cluster_default(
    kube_admin: Kube, server: ChartPods
) -> None:
    kube_admin.create_namespace("psa-unlabelled")
    stored = kube_admin.create_pod("psa-unlabelled", _copilot_pod("unlabelled"))
    assert _summary(stored).startswith("ptrace=drop"), "the webhook reviewed it"
    assert ptrace_holders(stored) == []
    assert _puller(stored) == []
    preview = server.https("POST", "/preview?namespace=psa-unlabelled", json=_copilot_pod("unlabelled")).json()
    assert "copilot-webhook: no image puller: Pod Security 'baseline' (cluster default) forbids its hostPath " in (
        " ".join(preview["warnings"])
    )


def test_a_namespace_labelled_privileged_gets_the_puller(kube_admin: Kube, server: ChartPods) -> None:
    kube_admin.create_namespace("psa-privileged", PRIVILEGED)
    stored = kube_admin.create_pod("psa-privileged", _copilot_pod("privileged"))
    assert _puller(stored) == [PULLER, SOCKET_VOLUME]
    assert "image-puller=containerd:/run/containerd/containerd.sock" in _summary(stored)
    assert ptrace_holders(stored) == []


def test_a_namespace_labelled_baseline_gets_no_puller(kube_admin: Kube, server: ChartPods) -> None:
    kube_admin.create_namespace("psa-baseline", BASELINE)
    stored = kube_admin.create_pod("psa-baseline", _copilot_pod("baseline"))
    assert _summary(stored).startswith("ptrace=drop")
    assert _puller(stored) == []


def test_an_exempt_namespace_gets_the_puller_whatever_its_label(kube_admin: Kube, server: ChartPods) -> None:
    kube_admin.create_namespace(EXEMPT, {"pod-security.kubernetes.io/enforce": "restricted"})
    stored = kube_admin.create_pod(EXEMPT, _copilot_pod("exempt"))
    assert _puller(stored) == [PULLER, SOCKET_VOLUME]
