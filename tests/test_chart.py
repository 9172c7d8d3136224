"""The Helm chart, rendered and linted by the real Helm engine (helm-python-sdk, no helm binary), every
object validated against the Kubernetes schemas of the oldest and newest versions we claim."""

from __future__ import annotations

import base64
import functools
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from webhook.config import build_settings

CHART = Path(__file__).parent.parent / "deploy" / "helm" / "copilot-webhook"
README = Path(__file__).parent.parent / "README.md"
K8S_VERSIONS = ("1.29.0", "1.37.0")
CRDS = {"Certificate", "Issuer"}  # cert-manager's kinds: no Kubernetes schema to check them against


@functools.cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The rendered objects by "Kind/name"."""
    manifests = _chart().render(values or {}, name="cw", namespace="flyte", is_install=True)
    objects = {}
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return objects


VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "ptrace-drop": {"ptrace": {"mode": "drop"}, "webhook": {"ptrace": {"failurePolicy": "Fail"}}},
    "ptrace-keep": {"ptrace": {"mode": "keep"}},
    "puller-off": {"imagePuller": {"enabled": False}},
    "puller-all-pinned": {"imagePuller": {"scope": "all", "heterogeneous": "pin", "labeller": True}},
    "preview-off": {"preview": {"enabled": False}},
    "shadow": {"mode": "shadow"},
    "no-match-conditions": {"webhook": {"matchConditions": False}},
    "cert-manager": {"tls": {"mode": "cert-manager"}},
    "secret": {
        "tls": {
            "mode": "secret",
            "secretName": "my-tls",
            "caBundle": base64.b64encode(b"-----BEGIN CERTIFICATE-----").decode(),
        }
    },
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_object_validates(variant: str) -> None:
    objects = render(VARIANTS[variant])
    for obj in objects.values():
        if obj["kind"] in CRDS:
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    config = yaml.safe_load(objects["ConfigMap/cw-copilot-webhook"]["data"]["config.yaml"])
    build_settings(config)  # the chart and the server agree on every configuration key


def test_default_objects() -> None:
    assert set(render()) == {
        "ServiceAccount/cw-copilot-webhook",
        "ClusterRole/cw-copilot-webhook",
        "ClusterRoleBinding/cw-copilot-webhook",
        "Role/cw-copilot-webhook",
        "RoleBinding/cw-copilot-webhook",
        "ConfigMap/cw-copilot-webhook",
        "Service/cw-copilot-webhook",
        "Deployment/cw-copilot-webhook",
        "PodDisruptionBudget/cw-copilot-webhook",
        "MutatingWebhookConfiguration/cw-copilot-webhook",
    }


def _webhooks(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    config = render(values)["MutatingWebhookConfiguration/cw-copilot-webhook"]
    return {w["name"]: w for w in config["webhooks"]}


def test_webhook_configuration_selectors_and_rules() -> None:
    hooks = _webhooks()
    assert set(hooks) == {"ptrace.copilot-webhook.io", "image-puller.copilot-webhook.io"}
    for name, path in (
        ("ptrace.copilot-webhook.io", "/mutate/ptrace"),
        ("image-puller.copilot-webhook.io", "/mutate/image-puller"),
    ):
        hook = hooks[name]
        assert hook["clientConfig"]["service"] == {
            "name": "cw-copilot-webhook",
            "namespace": "flyte",
            "path": path,
            "port": 443,
        }
        assert hook["rules"] == [
            {
                "operations": ["CREATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ]
        assert hook["sideEffects"] == "None"
        assert hook["admissionReviewVersions"] == ["v1", "v1beta1"]
        assert (hook["failurePolicy"], hook["timeoutSeconds"], hook["reinvocationPolicy"]) == ("Ignore", 5, "IfNeeded")
        excluded, opt_out = hook["namespaceSelector"]["matchExpressions"]
        assert excluded == {
            "key": "kubernetes.io/metadata.name",
            "operator": "NotIn",
            "values": ["kube-system", "kube-public", "kube-node-lease", "flyte"],
        }
        assert opt_out == {"key": "copilot-webhook.io/inject", "operator": "NotIn", "values": ["disabled"]}
        assert hook["objectSelector"]["matchExpressions"] == [
            {"key": "copilot-webhook.io/webhook-release", "operator": "NotIn", "values": ["cw-copilot-webhook"]}
        ]
        assert "flyte-copilot-" in hook["matchConditions"][0]["expression"]
        assert "caBundle" not in hook["clientConfig"], "self-signed: the server patches the caBundle in"


def test_each_webhook_has_its_own_failure_policy() -> None:
    hooks = _webhooks({"webhook": {"ptrace": {"failurePolicy": "Fail"}}})
    assert hooks["ptrace.copilot-webhook.io"]["failurePolicy"] == "Fail"
    assert hooks["image-puller.copilot-webhook.io"]["failurePolicy"] == "Ignore"


def test_what_each_flag_changes() -> None:
    assert set(_webhooks({"imagePuller": {"enabled": False}})) == {"ptrace.copilot-webhook.io"}
    assert "matchConditions" not in _webhooks({"webhook": {"matchConditions": False}})["ptrace.copilot-webhook.io"]
    assert "matchConditions" not in _webhooks({"imagePuller": {"scope": "all"}})["image-puller.copilot-webhook.io"]
    config = yaml.safe_load(
        render({"ptrace": {"mode": "drop"}, "mode": "shadow"})["ConfigMap/cw-copilot-webhook"]["data"]["config.yaml"]
    )
    settings = build_settings(config)
    assert (settings.ptrace.mode, settings.mode) == ("drop", "shadow")
    preview_off = yaml.safe_load(
        render({"preview": {"enabled": False}})["ConfigMap/cw-copilot-webhook"]["data"]["config.yaml"]
    )
    assert build_settings(preview_off).preview.enabled is False


def _rules(values: dict[str, Any] | None = None) -> dict[str, list[str]]:
    role = render(values)["ClusterRole/cw-copilot-webhook"]
    return {rule["resources"][0]: rule["verbs"] for rule in role["rules"]}


def test_rbac_is_minimal() -> None:
    assert _rules() == {
        "nodes": ["list", "watch"],
        "namespaces": ["list", "watch"],
        "mutatingwebhookconfigurations": ["get", "patch"],
    }
    assert _rules({"imagePuller": {"labeller": True}})["nodes"] == ["list", "watch", "patch"]
    role = render()["ClusterRole/cw-copilot-webhook"]["rules"][2]
    assert role["resourceNames"] == ["cw-copilot-webhook"]
    secrets = render()["Role/cw-copilot-webhook"]["rules"]
    assert secrets[0] == {
        "apiGroups": [""],
        "resources": ["secrets"],
        "resourceNames": ["cw-copilot-webhook-tls"],
        "verbs": ["get", "update"],
    }
    assert "Role/cw-copilot-webhook" not in render({"tls": {"mode": "cert-manager"}})
    assert _rules({"tls": {"mode": "cert-manager"}})["mutatingwebhookconfigurations"] == ["get"]


def test_deployment_is_hardened() -> None:
    deployment = render()["Deployment/cw-copilot-webhook"]
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {c["topologyKey"] for c in pod["topologySpreadConstraints"]} == {
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    }
    for container in pod["containers"] + pod["initContainers"]:
        sc = container["securityContext"]
        # Pod Security "restricted": no escalation, every capability dropped, non-root, RuntimeDefault seccomp.
        assert sc == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        assert container["resources"]["limits"]
    webhook = pod["containers"][0]
    assert webhook["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    assert webhook["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}
    assert webhook["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert "--certs-secret=cw-copilot-webhook-tls" in webhook["args"]
    assert pod["initContainers"][0]["args"][:2] == ["certs", "ensure"]
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert "subPath" not in next(m for m in webhook["volumeMounts"] if m["name"] == "config"), (
        "subPath mounts never update"
    )
    assert config_volume["configMap"]["name"] == "cw-copilot-webhook"


def test_tls_modes() -> None:
    managed = render({"tls": {"mode": "cert-manager"}})
    config = managed["MutatingWebhookConfiguration/cw-copilot-webhook"]
    # The CA is injected, not the serving certificate: renewals of the latter leave the caBundle alone.
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "flyte/cw-copilot-webhook-ca"
    ca = managed["Certificate/cw-copilot-webhook-ca"]
    assert ca["spec"]["isCA"] is True
    assert ca["spec"]["issuerRef"] == {"name": "cw-copilot-webhook-selfsigned", "kind": "Issuer"}
    assert managed["Issuer/cw-copilot-webhook-selfsigned"]["spec"] == {"selfSigned": {}}
    assert managed["Issuer/cw-copilot-webhook"]["spec"] == {"ca": {"secretName": ca["spec"]["secretName"]}}
    certificate = managed["Certificate/cw-copilot-webhook"]
    assert certificate["spec"]["issuerRef"] == {"name": "cw-copilot-webhook", "kind": "Issuer"}
    hours = lambda duration: int(duration.removesuffix("h"))  # noqa: E731
    assert hours(ca["spec"]["duration"]) >= max(10 * hours(certificate["spec"]["duration"]), 43800)
    assert certificate["spec"]["dnsNames"][2] == "cw-copilot-webhook.flyte.svc"
    assert certificate["spec"]["secretName"] == "cw-copilot-webhook-tls"
    assert "initContainers" not in managed["Deployment/cw-copilot-webhook"]["spec"]["template"]["spec"]
    bundle = VARIANTS["secret"]["tls"]["caBundle"]
    own = render(VARIANTS["secret"])
    assert all(
        w["clientConfig"]["caBundle"] == bundle
        for w in own["MutatingWebhookConfiguration/cw-copilot-webhook"]["webhooks"]
    )
    volume = next(
        v for v in own["Deployment/cw-copilot-webhook"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"
    )
    assert volume["secret"]["secretName"] == "my-tls"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"ptrace": {"mode": "maybe"}}, "at '/ptrace/mode': value must be one of 'add', 'drop', 'keep'"),
        ({"imagePuller": {"runtime": "podman"}}, "/imagePuller/runtime"),
        ({"webhook": {"failurePolicy": "ignore"}}, "/webhook/failurePolicy"),
        ({"ptrace": {"mood": "add"}}, "mood"),
        ({"imagePuller": {"resources": {"limits": {"memory": "lots"}}}}, "/imagePuller/resources/limits/memory"),
        # The prefix is written into CEL: only what can start a container name passes.
        ({"copilot": {"namePrefix": "x') || true || ('"}}, "/copilot/namePrefix"),
        ({"copilot": {"namePrefix": "Flyte-"}}, "/copilot/namePrefix"),
    ],
)
def test_bad_values_fail_through_the_schema(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        render(values)


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ({"mode": "secret", "caBundle": "eA=="}, "tls.secretName is required when tls.mode is secret"),
        ({"mode": "secret", "secretName": "mine"}, "tls.caBundle is required when tls.mode is secret"),
    ],
)
def test_secret_mode_needs_a_secret_and_its_ca(tls: dict[str, str], message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render({"tls": tls})


@pytest.mark.parametrize("variant", ["defaults", "cert-manager", "puller-all-pinned"])
def test_lint_has_no_errors(variant: str) -> None:
    report = helm.lint(CHART, VARIANTS[variant], strict=False, namespace="flyte")
    errors = [m for m in report["messages"] if m["severity"] >= 3] + report["errors"]
    assert errors == []


def _leaves(values: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in ("requests", "limits"):
            keys += _leaves(value, path + ".")
        else:
            keys.append(path)
    return keys


def test_the_readme_values_table_covers_values_yaml() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    table = README.read_text().split("<!-- values table -->")[1]
    missing = [key for key in _leaves(values) if f"`{key}`" not in table]
    assert missing == [], f"values.yaml keys missing from the README's values table: {missing}"


def test_a_single_replica_gets_no_disruption_budget_and_two_get_one_that_lets_unhealthy_pods_go() -> None:
    assert "PodDisruptionBudget/cw-copilot-webhook" not in render({"replicaCount": 1})
    pdb = render({"replicaCount": 2})["PodDisruptionBudget/cw-copilot-webhook"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_control_plane_namespaces_are_excluded_whatever_the_values_say() -> None:
    hooks = _webhooks({"webhook": {"excludeNamespaces": ["legacy-team"]}})
    for hook in hooks.values():
        excluded = hook["namespaceSelector"]["matchExpressions"][0]["values"]
        assert excluded == ["kube-system", "kube-public", "kube-node-lease", "legacy-team", "flyte"]


def test_usable_as_a_dependency_of_an_umbrella_chart() -> None:
    """Helm passes `global` to every subchart; the schema must accept it."""
    assert "Deployment/cw-copilot-webhook" in render({"global": {"imageRegistry": "registry.example.com"}})


def test_a_deadline_the_api_server_would_not_wait_for_is_refused_at_render() -> None:
    with pytest.raises(
        helm.HelmRenderError, match=r"server.deadlineSeconds \(5\) must be below webhook.timeoutSeconds"
    ):
        render({"server": {"deadlineSeconds": 5}, "webhook": {"timeoutSeconds": 5}})
    assert "MutatingWebhookConfiguration/cw-copilot-webhook" in render({"server": {"deadlineSeconds": 4.5}})
