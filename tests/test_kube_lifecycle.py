"""The chart's whole life on the real API server, and every call the server and its commands make checked
against the RBAC the chart grants: install, the server and `certs ensure` as the chart's ServiceAccount,
the labeller and `label-nodes`, `verify`, `audit` (pods created before the install included), `helm
upgrade` keeping the caBundle, and `helm uninstall` running its pre-delete hook's command as that hook's
Job would, as the hook's ServiceAccount."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.controlplane import ControlPlane
from harness.kube_api import ChartPods, Hooks, Kube, Release, mwc_path, wait_for
from tests.test_kube_install import pod
from tests.test_kube_node_cache import add_node

NAMESPACE = "cwlife"
FULLNAME = "cwlife-copilot-webhook"
SERVICE_ACCOUNT = f"system:serviceaccount:{NAMESPACE}:{FULLNAME}"
LABEL = "copilot-webhook.io/container-runtime"
FLYTE_115 = Path(__file__).parent / "golden" / "pods" / "flyte-1.15.yaml"


@pytest.fixture(scope="module")
def pods(kube_admin: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChartPods]:
    # Running before the install: audit must find it.
    kube_admin.create_namespace("life-before")
    kube_admin.create_pod("life-before", pod(FLYTE_115, "ran-before-install"))
    add_node(kube_admin, "n-life", "containerd://1.7.11")
    kube_admin.create_namespace(NAMESPACE)
    work = tmp_path_factory.mktemp("life")
    release = Release(kube_admin, NAMESPACE, NAMESPACE, kube_admin.plane.kubeconfig(work / "admin.kubeconfig"))
    release.install({"imagePuller": {"labeller": True}})
    yield ChartPods(release, work / "pods")
    release.remove_webhooks()
    kube_admin.delete("/api/v1/nodes/n-life")


def test_the_server_labels_nodes_and_verify_passes_as_the_charts_service_account(
    pods: ChartPods, kube_admin: Kube
) -> None:
    pods.run("replica")
    try:
        assert wait_for(lambda: pods.release.bundles() != {""}), pods.output()
        node = "/api/v1/nodes/n-life"
        assert wait_for(lambda: kube_admin.get(node)["metadata"]["labels"].get(LABEL) == "containerd"), pods.output()
        host, port = pods.service_address()
        verify = pods.cli(FULLNAME, "verify", f"--webhook-config={FULLNAME}", f"--address={host}:{port}")
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert [line[:4] for line in verify.stdout.splitlines()] == ["ok  "] * 3, verify.stdout
    finally:
        pods.stop()


def test_label_nodes_as_the_service_account(pods: ChartPods, kube_admin: Kube) -> None:
    kube_admin.patch("/api/v1/nodes/n-life", {"metadata": {"labels": {LABEL: "docker"}}})
    done = pods.cli(FULLNAME, "label-nodes")
    assert done.returncode == 0, done.stderr
    assert f"n-life: {LABEL}: docker -> containerd" in done.stdout
    assert kube_admin.get("/api/v1/nodes/n-life")["metadata"]["labels"][LABEL] == "containerd"


def test_audit_finds_the_pods_that_ran_before_the_install(pods: ChartPods, tmp_path: Path) -> None:
    config = tmp_path / "drop.yaml"
    config.write_text("ptrace:\n  mode: drop\n")
    done = pods.cli(None, "audit", f"--config={config}", "--namespace=life-before")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "ran-before-install" in done.stdout


def test_certs_ensure_again_changes_nothing(pods: ChartPods) -> None:
    before = pods.release.bundles()
    done = pods.cli(
        FULLNAME,
        "certs",
        "ensure",
        f"--secret={FULLNAME}-tls",
        f"--webhook-config={FULLNAME}",
        f"--service={FULLNAME}",
        f"--namespace={NAMESPACE}",
    )
    assert done.returncode == 0, done.stderr
    assert pods.release.bundles() == before


def test_helm_upgrade_keeps_the_ca_bundle(pods: ChartPods) -> None:
    before = pods.release.bundles()
    assert before != {""}
    pods.release.upgrade({"imagePuller": {"labeller": True}, "ptrace": {"mode": "drop"}})
    assert pods.release.bundles() == before


def test_helm_uninstall_runs_the_pre_delete_hook_and_leaves_no_webhook(
    pods: ChartPods, kube_admin: Kube, kube: ControlPlane
) -> None:
    with Hooks(pods) as hooks:
        pods.release.helm().uninstall(pods.release.name, timeout=60)
    assert [(name, code) for name, code, _ in hooks.ran] == [(f"{FULLNAME}-unregister", 0)], hooks.ran
    assert not kube_admin.exists(mwc_path(FULLNAME))
    deletes = [
        e["responseStatus"]["code"]
        for e in kube.audit_events(SERVICE_ACCOUNT)
        if e["verb"] == "delete" and e["objectRef"]["resource"] == "mutatingwebhookconfigurations"
    ]
    assert deletes == [200], "the hook deleted it, as the chart's account"


def test_the_charts_grants_are_exactly_what_its_commands_use(kube: ControlPlane, pods: ChartPods) -> None:
    """Every call the server and its commands made as the chart's ServiceAccount was allowed, and every
    verb the chart grants was used by one of them: none is missing, none broader than needed."""
    events = kube.audit_events(SERVICE_ACCOUNT)
    refused = [(e["verb"], e.get("objectRef"), e["requestURI"]) for e in events if e["responseStatus"]["code"] == 403]
    assert refused == []
    used = {(e["objectRef"]["resource"], e["verb"]) for e in events if "objectRef" in e}
    roles = [pods.release.manifest[f"{kind}/{FULLNAME}"] for kind in ("ClusterRole", "Role")]
    granted = {(r, v) for role in roles for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert ("secrets", "create") not in granted, "the chart creates the Secret; the server only patches it"
    assert granted - used == set(), "granted but never used"
    assert used - granted == set(), "used but not granted"
