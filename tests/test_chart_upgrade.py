"""`helm install` and `helm upgrade` (dry-run=server: rendered with cluster access, nothing applied) by the
real Helm engine against the fake API server, which answers Helm's discovery, its release store (the
release Secret, listed by label) and the chart's `lookup` of its webhook configuration.

What it does not prove: the apply itself (Helm writes the release in protobuf, which the fake does not
speak) and server-side validation (the fake serves an empty OpenAPI document; the objects are validated
against the real schemas here instead)."""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.fake_apiserver import FakeAPIServer
from tests.test_chart import CHART, CRDS

MWC = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/cw-copilot-webhook"
DECLARED = {"webhook": {"ptrace": {"failurePolicy": "Fail"}}}


def _objects(manifest: str) -> dict[str, dict[str, Any]]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(manifest) if d}


def _store_release(api: FakeAPIServer, chart: helm.Chart, manifest: str, values: dict[str, Any]) -> None:
    """Revision 1 as Helm's Secret driver keeps it: gzip, base64, in a labelled Secret."""
    release = {
        "name": "cw",
        "namespace": "flyte",
        "version": 1,
        "info": {
            "status": "deployed",
            "first_deployed": "2026-11-30T09:00:00Z",
            "last_deployed": "2026-11-30T09:01:00Z",
        },
        "chart": {"metadata": chart.metadata, "templates": [], "values": {}},
        "config": values,
        "manifest": manifest,
    }
    payload = base64.b64encode(gzip.compress(json.dumps(release).encode())).decode()
    api.store["/api/v1/namespaces/flyte/secrets/sh.helm.release.v1.cw.v1"] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "helm.sh/release.v1",
        "metadata": {
            "name": "sh.helm.release.v1.cw.v1",
            "namespace": "flyte",
            "resourceVersion": "5",
            "labels": {"name": "cw", "owner": "helm", "status": "deployed", "version": "1"},
        },
        "data": {"release": base64.b64encode(payload.encode()).decode()},
    }


@pytest.mark.parametrize("mode", ["self-signed", "cert-manager"])
def test_install_fails_open_and_upgrade_keeps_the_bundle_in_the_cluster(
    api: FakeAPIServer, tmp_path: Path, mode: str
) -> None:
    chart = helm.Chart.load(CHART)
    values = {**DECLARED, "tls": {"mode": mode}}
    config = helm.Config(kubeconfig_path=api.kubeconfig(tmp_path / "kc"), namespace="flyte")
    fresh = config.install(chart, "cw", values, namespace="flyte", dry_run="server", timeout=30)
    installed = _objects(fresh["manifest"])["MutatingWebhookConfiguration/cw-copilot-webhook"]
    assert {w["failurePolicy"] for w in installed["webhooks"]} == {"Ignore"}, "no caBundle yet: fail open"
    assert all("caBundle" not in w["clientConfig"] for w in installed["webhooks"])
    assert any(r.endswith("/mutatingwebhookconfigurations/cw-copilot-webhook") for r in api.requests), "lookup"

    # The server (or cert-manager's injector) published a bundle and the server promoted the policy.
    _store_release(api, chart, fresh["manifest"], values)
    written = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nserver-written\n").decode()
    api.store[MWC] = dict(installed, metadata={**installed["metadata"], "resourceVersion": "7"})
    for hook in api.store[MWC]["webhooks"]:
        hook["clientConfig"]["caBundle"] = written
    upgraded = config.upgrade(chart, "cw", values, namespace="flyte", dry_run="server", timeout=30)
    assert upgraded["revision"] == 2
    objects = _objects(upgraded["manifest"])
    hooks = {w["name"]: w for w in objects["MutatingWebhookConfiguration/cw-copilot-webhook"]["webhooks"]}
    assert {name: w["clientConfig"]["caBundle"] for name, w in hooks.items()} == {
        "ptrace.copilot-webhook.io": written,
        "image-puller.copilot-webhook.io": written,
    }, "an upgrade must not blank the bundle the API server trusts"
    assert hooks["ptrace.copilot-webhook.io"]["failurePolicy"] == "Fail"
    assert hooks["image-puller.copilot-webhook.io"]["failurePolicy"] == "Ignore"
    for obj in objects.values():
        if obj["kind"] not in CRDS:
            kubernetes_validate.validate(obj, api.version, strict=True)


def test_the_cluster_version_decides_what_is_rendered(tmp_path: Path) -> None:
    """Capabilities.KubeVersion comes from the API server's /version: matchConditions from 1.30 only."""
    chart = helm.Chart.load(CHART)
    for version, expected in (("1.29.0", False), ("1.30.0", True)):
        api = FakeAPIServer(version).start()
        try:
            config = helm.Config(kubeconfig_path=api.kubeconfig(tmp_path / f"kc-{version}"), namespace="flyte")
            release = config.install(chart, "cw", {}, namespace="flyte", dry_run="server", timeout=30)
        finally:
            api.stop()
        hooks = _objects(release["manifest"])["MutatingWebhookConfiguration/cw-copilot-webhook"]["webhooks"]
        assert all(("matchConditions" in w) == expected for w in hooks), version
