"""The chart installed by the real Helm engine (default values) on the real kube-apiserver, its server run
as the chart's ServiceAccount, and pods created through the API server's whole admission chain.

The module's release is installed fresh, so the first test sees the fail-open install; the later ones
build on the running replica."""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterator
from pathlib import Path

import pytest

from certs.authority import generate_ca
from harness.kube_api import PRIVILEGED, ChartPods, Kube, Obj, Release, mwc_path, wait_for
from tests.helpers import load_yaml

NAMESPACE = "copilot-webhook"
DECLARED = {"webhook": {"ptrace": {"failurePolicy": "Fail"}}}
EXAMPLE = Path(__file__).parent / "golden" / "pods" / "flyte-1.15-bare.yaml"  # no SYS_PTRACE: add adds it
GOLDEN_PODS = Path(__file__).parent / "golden" / "pods"
BASELINE = {"pod-security.kubernetes.io/enforce": "baseline"}


@pytest.fixture(scope="module")
def release(kube_admin: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    kube_admin.create_namespace(NAMESPACE)
    work = tmp_path_factory.mktemp("release")
    release = Release(kube_admin, "cw", NAMESPACE, kube_admin.plane.kubeconfig(work / "admin.kubeconfig"))
    yield release
    release.remove_webhooks()


@pytest.fixture(scope="module")
def installed(release: Release) -> dict[str, Obj]:
    return release.install(DECLARED)


@pytest.fixture(scope="module")
def running(
    release: Release, installed: dict[str, Obj], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChartPods]:
    pods = ChartPods(release, tmp_path_factory.mktemp("pods"))
    pods.run("replica-a")
    yield pods
    pods.stop()


def pod(path: Path, name: str, **annotations: str) -> Obj:
    obj = copy.deepcopy(load_yaml(path))
    obj["metadata"].pop("namespace", None)
    obj["metadata"]["name"] = name
    if annotations:
        obj["metadata"].setdefault("annotations", {}).update(annotations)
    assert isinstance(obj, dict)
    return obj


def ptrace_holders(stored: Obj) -> list[str]:
    containers = [*stored["spec"].get("initContainers", []), *stored["spec"]["containers"]]
    return [
        c["name"]
        for c in containers
        if "SYS_PTRACE" in c.get("securityContext", {}).get("capabilities", {}).get("add", [])
    ]


def test_helm_install_with_defaults_is_accepted_and_fails_open(
    installed: dict[str, Obj], kube_admin: Kube, release: Release
) -> None:
    assert {"MutatingWebhookConfiguration", "Deployment", "Service", "ClusterRole"} <= {
        k.split("/")[0] for k in installed
    }
    assert set(release.policies().values()) == {"Ignore"}, "no caBundle yet: fail open"
    assert release.bundles() == {""}
    # Every object the chart rendered was accepted by the API server's validation and is stored.
    missing = [key for key, obj in installed.items() if not kube_admin.exists(kube_admin.path_of(obj))]
    assert missing == []


def test_the_server_writes_its_secret_and_bundle_and_promotes_the_declared_policies(
    running: ChartPods, kube_admin: Kube, release: Release
) -> None:
    assert wait_for(lambda: "" not in release.bundles()), running.output()
    assert wait_for(
        lambda: release.policies() == {"ptrace.copilot-webhook.io": "Fail", "image-puller.copilot-webhook.io": "Ignore"}
    ), release.policies()
    secret = kube_admin.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/{release.fullname}-tls")
    (bundle,) = release.bundles()
    assert base64.b64decode(secret["data"]["ca.crt"]) == base64.b64decode(bundle)
    assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm", "the chart's labels stay"


def test_a_copilot_pod_is_mutated_by_the_real_admission_chain(running: ChartPods, kube_admin: Kube) -> None:
    kube_admin.create_namespace("flyte-a", PRIVILEGED)
    stored = kube_admin.create_pod("flyte-a", pod(EXAMPLE, "example"))
    assert stored["metadata"]["annotations"]["copilot-webhook.io/mutated"].startswith("ptrace=add:primary")
    assert ptrace_holders(stored) == ["bq2m4-n1-0"]
    assert stored["spec"]["shareProcessNamespace"] is True


def test_add_in_a_baseline_namespace_grants_nothing_and_says_why(running: ChartPods, kube_admin: Kube) -> None:
    """docs/behaviour.md: SYS_PTRACE is not added where Pod Security baseline is enforced, with a warning;
    a pod that already asks for it (Flyte <= 1.15) is refused by the API server, which is what drop is for."""
    kube_admin.create_namespace("add-baseline", BASELINE)
    answer = kube_admin.http.post("/api/v1/namespaces/add-baseline/pods", json=pod(EXAMPLE, "without"))
    assert answer.status_code == 201, answer.text
    assert ptrace_holders(answer.json()) == []
    warning = answer.headers.get("warning", "")
    assert "copilot-webhook: SYS_PTRACE not added: Pod Security 'baseline' (namespace label) forbids it" in warning
    refused = kube_admin.http.post(
        "/api/v1/namespaces/add-baseline/pods", json=pod(GOLDEN_PODS / "flyte-1.15.yaml", "as-flyte")
    )
    assert refused.status_code == 403
    assert 'violates PodSecurity "baseline:latest"' in refused.json()["message"]


def test_a_blanked_or_foreign_bundle_is_repaired_within_seconds(
    running: ChartPods, kube_admin: Kube, release: Release
) -> None:
    (good,) = release.bundles()
    foreign = base64.b64encode(generate_ca("someone else").cert_pem).decode()
    for replacement in ("", foreign):
        hooks = range(len(release.policies()))
        ops = [{"op": "replace", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": replacement} for i in hooks]
        kube_admin.patch(mwc_path(release.fullname), ops, kind="json")
        assert wait_for(lambda: release.bundles() == {good}, timeout=10), replacement[:20]


def test_a_restarted_replica_keeps_the_ca(running: ChartPods, kube_admin: Kube, release: Release) -> None:
    before = release.bundles()
    running.run("replica-b")
    assert release.bundles() == before
    kube_admin.create_namespace("flyte-b", PRIVILEGED)
    stored = kube_admin.create_pod("flyte-b", pod(EXAMPLE, "after-restart"))
    assert "copilot-webhook.io/mutated" in stored["metadata"]["annotations"]
