"""`helm upgrade` on the real API server from releases made by earlier versions: the chart and the server
as they were at a commit, installed and run, then upgraded to this checkout's chart and server. The
caBundle (and so the CA) survives, and pods are mutated before and after.

The starting points: the last commit before the TLS Secret became the chart's (the server created it,
without Helm's ownership metadata) and the state of main this work started from."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.kube_api import PRIVILEGED, ChartPods, Kube, Release, wait_for
from tests.test_kube_install import EXAMPLE, pod

ROOT = Path(__file__).resolve().parent.parent
STARTS = {
    "server-created-secret": "0493780",  # before 57c53cb made the TLS Secret the chart's
    "previous-main": "e244fcc",
}


def _checkout(commit: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", commit, "webhook", "certs", "deploy"], cwd=ROOT, capture_output=True, check=False
    )
    if archive.returncode != 0:
        shallow = subprocess.run(
            ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True
        )
        if shallow.stdout.strip() == "true":  # a property of the clone, not a missing tool
            pytest.skip(f"a shallow clone has no commit {commit} to upgrade from")
        pytest.fail(f"git archive {commit}: {archive.stderr.decode()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


@pytest.fixture(params=sorted(STARTS), ids=str)
def upgraded(request: pytest.FixtureRequest, kube_admin: Kube, tmp_path: Path) -> Iterator[tuple[Release, ChartPods]]:
    name = f"up{sorted(STARTS).index(request.param)}"
    old = _checkout(STARTS[request.param], tmp_path / "old")
    kube_admin.create_namespace(name)
    release = Release(kube_admin, name, name, kube_admin.plane.kubeconfig(tmp_path / "admin.kubeconfig"))
    release.install(chart=old / "deploy" / "helm" / "copilot-webhook")
    old_pods = ChartPods(release, tmp_path / "old-pods", source=old)
    old_pods.run("old")
    try:
        assert wait_for(lambda: release.bundles() != {""}), old_pods.output()
        kube_admin.create_namespace(f"{name}-pods", PRIVILEGED)
        before = kube_admin.create_pod(f"{name}-pods", pod(EXAMPLE, "before-upgrade"))
        assert "copilot-webhook.io/mutated" in before["metadata"]["annotations"]
    finally:
        old_pods.stop()
    pods = ChartPods(release, tmp_path / "pods")
    yield release, pods
    pods.stop()
    release.remove_webhooks()


def test_upgrade_keeps_the_ca_and_the_new_server_serves(upgraded: tuple[Release, ChartPods], kube_admin: Kube) -> None:
    release, pods = upgraded
    bundle = release.bundles()
    release.upgrade()
    assert release.bundles() == bundle, "the upgrade kept the caBundle the old server published"
    pods.run("new")
    assert release.bundles() == bundle, "the new server kept the CA in the Secret"
    after = kube_admin.create_pod(f"{release.name}-pods", pod(EXAMPLE, "after-upgrade"))
    assert after["metadata"]["annotations"]["copilot-webhook.io/mutated"].startswith("ptrace=add:primary")
    secret = kube_admin.get(f"/api/v1/namespaces/{release.namespace}/secrets/{release.fullname}-tls")
    assert secret["data"]["tls.crt"], "the Secret still holds the certificate"
