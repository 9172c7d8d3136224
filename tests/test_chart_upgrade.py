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

from harness.fake_apiserver import FakeAPIServer
from tests.test_chart import CHART, CRDS

MWC = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/cw-copilot-webhook"
DECLARED = {"webhook": {"ptrace": {"failurePolicy": "Fail"}}}


def _objects(manifest: str) -> dict[str, dict[str, Any]]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(manifest) if d}


def _store_release(
    api: FakeAPIServer,
    chart: helm.Chart,
    manifest: str,
    values: dict[str, Any],
    chart_values: dict[str, Any] | None = None,
) -> None:
    """Revision 1 as Helm's Secret driver keeps it: gzip, base64, in a labelled Secret. `chart_values` are the
    defaults of the chart it was installed with, which `helm upgrade --reuse-values` renders with."""
    release = {
        "name": "cw",
        "namespace": "flyte",
        "version": 1,
        "info": {
            "status": "deployed",
            "first_deployed": "2026-11-30T09:00:00Z",
            "last_deployed": "2026-11-30T09:01:00Z",
        },
        "chart": {"metadata": chart.metadata, "templates": [], "values": chart_values or {}},
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


SECRET = "/api/v1/namespaces/flyte/secrets/cw-copilot-webhook-tls"
BEFORE_CHART_OWNED_SECRET = Path(__file__).parent / "releases" / "before-chart-owned-secret.yaml"


def _server_created_secret() -> dict[str, Any]:
    """The TLS Secret as the server created it before the chart owned it: its own label, no Helm metadata."""
    pem = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nserver-written\n").decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": "cw-copilot-webhook-tls",
            "namespace": "flyte",
            "resourceVersion": "3",
            "labels": {"app.kubernetes.io/name": "copilot-webhook"},
        },
        "data": {"ca.crt": pem, "tls.crt": pem, "tls.key": pem},
    }


def test_upgrade_from_a_release_whose_server_created_the_tls_secret(api: FakeAPIServer, tmp_path: Path) -> None:
    """A release made before the chart owned the TLS Secret: Helm refuses to take over an object that lacks
    its ownership metadata ("invalid ownership metadata"), so the chart leaves such a Secret to the server
    (which keeps using it); once it carries Helm's metadata (docs/upgrading.md's step), the next upgrade
    adopts it, still without writing its data."""
    chart = helm.Chart.load(CHART)
    old = BEFORE_CHART_OWNED_SECRET.read_text()
    assert "Secret/cw-copilot-webhook-tls" not in _objects(old)
    _store_release(api, chart, old, {})
    api.store[SECRET] = _server_created_secret()
    config = helm.Config(kubeconfig_path=api.kubeconfig(tmp_path / "kc"), namespace="flyte")
    upgraded = config.upgrade(chart, "cw", {}, namespace="flyte", dry_run="server", timeout=30)
    assert upgraded["revision"] == 2
    objects = _objects(upgraded["manifest"])
    assert "Secret/cw-copilot-webhook-tls" not in objects, "not Helm's: left to the server"
    assert "Deployment/cw-copilot-webhook" in objects
    rules = objects["Role/cw-copilot-webhook"]["rules"]
    assert rules[0]["resourceNames"] == ["cw-copilot-webhook-tls"], "the server still reads and renews it"
    assert rules[0]["verbs"] == ["get", "patch"]

    # The step docs/upgrading.md gives: kubectl label and annotate the Secret with Helm's ownership metadata.
    metadata = api.store[SECRET]["metadata"]
    metadata["labels"]["app.kubernetes.io/managed-by"] = "Helm"
    metadata["annotations"] = {"meta.helm.sh/release-name": "cw", "meta.helm.sh/release-namespace": "flyte"}
    adopted = _objects(config.upgrade(chart, "cw", {}, namespace="flyte", dry_run="server", timeout=30)["manifest"])
    secret = adopted["Secret/cw-copilot-webhook-tls"]
    assert "data" not in secret, "adopted without touching what the server wrote"


def test_install_over_a_secret_a_removed_release_left_behind(api: FakeAPIServer, tmp_path: Path) -> None:
    """helm uninstall of such a release kept the server-created Secret: a new install reuses it."""
    api.store[SECRET] = _server_created_secret()
    config = helm.Config(kubeconfig_path=api.kubeconfig(tmp_path / "kc"), namespace="flyte")
    release = config.install(helm.Chart.load(CHART), "cw", {}, namespace="flyte", dry_run="server", timeout=30)
    assert "Secret/cw-copilot-webhook-tls" not in _objects(release["manifest"])


BEFORE_STANDARD_KNOBS = Path(__file__).parent / "releases" / "chart-values-before-standard-knobs.yaml"


def _upgrade_from_the_chart_before_preStopSeconds(
    api: FakeAPIServer, tmp_path: Path, user_values: dict[str, Any], new_values: dict[str, Any], reuse_values: bool
) -> Any:
    """A release installed with user_values by the chart whose values.yaml was BEFORE_STANDARD_KNOBS (drainSeconds
    for the preStop pause, none of the standard knobs), upgraded to this chart."""
    chart = helm.Chart.load(CHART)
    config = helm.Config(kubeconfig_path=api.kubeconfig(tmp_path / "kc"), namespace="flyte")
    old_defaults = yaml.safe_load(BEFORE_STANDARD_KNOBS.read_text())
    assert old_defaults["drainSeconds"] == 5
    assert "preStopSeconds" not in old_defaults
    assert "podSecurityContext" not in old_defaults
    _store_release(api, chart, "", user_values, chart_values=old_defaults)
    return config.upgrade(
        chart, "cw", new_values, namespace="flyte", dry_run="server", timeout=30, reuse_values=reuse_values
    )


def _deployment(release: Any) -> dict[str, Any]:
    deployment: dict[str, Any] = _objects(release["manifest"])["Deployment/cw-copilot-webhook"]
    return deployment


@pytest.mark.parametrize("reuse_values", [True, False])
def test_upgrade_of_a_release_that_set_drainseconds_keeps_its_prestop_pause(
    api: FakeAPIServer, tmp_path: Path, reuse_values: bool
) -> None:
    """drainSeconds (the preStop pause) is now preStopSeconds: a release installed with the old name keeps its
    pause through `helm upgrade --reuse-values`, or with the same values file, and is told of the new name."""
    old_values = {"drainSeconds": 11}
    upgraded = _upgrade_from_the_chart_before_preStopSeconds(
        api, tmp_path, old_values, {} if reuse_values else old_values, reuse_values
    )
    assert upgraded["revision"] == 2
    pod = _deployment(upgraded)["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "11"]
    assert pod["terminationGracePeriodSeconds"] == 26
    assert "drainSeconds is now preStopSeconds" in upgraded["notes"]
    assert "Its value, 11, is still used" in upgraded["notes"]


def test_reuse_values_from_the_chart_before_the_standard_knobs_renders_what_a_fresh_install_does(
    api: FakeAPIServer, tmp_path: Path
) -> None:
    """--reuse-values renders with the older chart's values.yaml, which lacks the keys added since
    (preStopSeconds, podSecurityContext, revisionHistoryLimit, ...): the Deployment is the one a fresh install
    of this chart renders, with the same pause, user and history."""
    upgraded = _upgrade_from_the_chart_before_preStopSeconds(api, tmp_path, {}, {}, reuse_values=True)
    config = helm.Config(kubeconfig_path=api.kubeconfig(tmp_path / "kc-fresh"), namespace="flyte")
    del api.store["/api/v1/namespaces/flyte/secrets/sh.helm.release.v1.cw.v1"]
    fresh = config.install(helm.Chart.load(CHART), "cw", {}, namespace="flyte", dry_run="server", timeout=30)
    assert _deployment(upgraded) == _deployment(fresh)
    pod = _deployment(upgraded)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert _deployment(upgraded)["spec"]["revisionHistoryLimit"] == 5
    for obj in _objects(upgraded["manifest"]).values():
        if obj["kind"] not in CRDS:
            kubernetes_validate.validate(obj, api.version, strict=True)
