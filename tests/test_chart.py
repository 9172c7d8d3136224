"""The Helm chart, rendered and linted by the real Helm engine (helm-python-sdk, no helm binary) for each
Kubernetes version we claim (`Capabilities.KubeVersion`), every object validated against that version's
schemas."""

from __future__ import annotations

import base64
import functools
import http.server
import re
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any, ClassVar

import helm_python as helm
import jsonschema
import kubernetes_validate
import orjson
import pytest
import yaml
from kubernetes import client

from certs.authority import generate_ca, issue_serving, service_dns_names
from scripts import values_table
from webhook.cli import _parser
from webhook.cluster.certificates import CertificateManager, handshake_verifies
from webhook.config import Settings, build_settings, dump_settings
from webhook.web.metrics import Metrics

CHART = Path(__file__).parent.parent / "deploy" / "helm" / "copilot-webhook"
K8S_VERSIONS = ("1.29.0", "1.30.0", "1.33.0", "1.37.0")
# cert-manager's and the Prometheus operator's kinds: no Kubernetes schema to check them against
CRDS = {"Certificate", "Issuer", "ServiceMonitor", "PodMonitor", "PrometheusRule"}
# Those checked against their CRD's own schema, vendored as released (tests/crds/)
CRD_FILES = {"PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml"}


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused, as the API server's strict field validation refuses them (it would
    otherwise prune them without a word)."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(item) for item in schema]
    return schema


@functools.cache
def _crd(kind: str) -> tuple[str, str, jsonschema.protocols.Validator]:
    """The CRD's group, its stored version and a validator of that version's schema."""
    crd = yaml.safe_load((Path(__file__).parent / "crds" / CRD_FILES[kind]).read_text())
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: the API server's to check, not the CRD's
    return crd["spec"]["group"], version["name"], jsonschema.Draft7Validator(schema)


def validate_crd_object(obj: dict[str, Any]) -> None:
    group, version, validator = _crd(obj["kind"])
    assert obj["apiVersion"] == f"{group}/{version}"
    validator.validate(obj)


@functools.cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def _manifests(values: dict[str, Any] | None, kube_version: str, name: str) -> dict[str, str]:
    """Template path -> rendered text, as Helm renders the chart for a cluster of `kube_version` (the Python
    binding does not expose the engine's kube_version option; its C entry point takes it)."""
    from helm_python import _native

    options = {"name": name, "namespace": "flyte", "is_install": True, "kube_version": f"v{kube_version}"}
    raw = _native.call_string(
        "helm_render", _chart()._raw(), orjson.dumps(values or {}).decode(), orjson.dumps(options).decode()
    )
    manifests: dict[str, str] = orjson.loads(raw)
    return manifests


def notes(values: dict[str, Any] | None = None, name: str = "cw") -> str:
    """NOTES.txt as `helm install` prints it for release `name` in namespace flyte."""
    return next(text for path, text in _manifests(values, "1.33.0", name).items() if path.endswith("NOTES.txt"))


def render(
    values: dict[str, Any] | None = None, kube_version: str = "1.33.0", name: str = "cw"
) -> dict[str, dict[str, Any]]:
    """The rendered objects by "Kind/name", for release `name` in namespace flyte."""
    manifests = _manifests(values, kube_version, name)
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
    "single-replica": {"replicaCount": 1},
    "autoscaled": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4}},
    "host-network": {"hostNetwork": True, "server": {"port": 10260, "metricsPort": 10261}},
    "pinned-image": {"image": {"digest": "sha256:" + "ab" * 32}},
    "network-policy": {"networkPolicy": {"enabled": True}},
    "monitoring": {
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "podMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
            "grafanaDashboard": {"enabled": True, "namespace": "monitoring"},
        }
    },
    "no-metrics-port": {"server": {"metricsPort": 0}},
    "drop-guaranteed": {"ptrace": {"mode": "drop"}, "webhook": {"ptrace": {"validatingPolicy": True}}},
    "standard-knobs": {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}
                    ]
                }
            },
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "cw"}},
                    }
                ]
            },
        },
        "topologySpreadConstraints": [
            {"topologyKey": "topology.kubernetes.io/zone", "maxSkew": 2, "whenUnsatisfiable": "DoNotSchedule"},
            {"topologyKey": "example.com/rack", "maxSkew": 1, "whenUnsatisfiable": "ScheduleAnyway"},
        ],
        "podLabels": {"team": "platform"},
        "podAnnotations": {"example.com/owner": "platform"},
        "extraEnv": [
            {"name": "HTTPS_PROXY", "value": "http://proxy.example.com:3128"},
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        ],
        "extraVolumes": [{"name": "trust", "configMap": {"name": "corporate-ca"}}],
        "extraVolumeMounts": [{"name": "trust", "mountPath": "/etc/ssl/corporate", "readOnly": True}],
        "revisionHistoryLimit": 2,
        "podSecurityContext": {"runAsUser": None, "runAsGroup": None, "fsGroup": None},
    },
    "secret": {
        "tls": {
            "mode": "secret",
            "secretName": "my-tls",
            "caBundle": base64.b64encode(b"-----BEGIN CERTIFICATE-----").decode(),
        }
    },
    "agent": {"imagePuller": {"mode": "agent"}, "networkPolicy": {"enabled": True}},
    "agent-cert-manager": {"imagePuller": {"mode": "agent"}, "tls": {"mode": "cert-manager"}},
}


NEEDS_1_30 = {"drop-guaranteed"}  # ValidatingAdmissionPolicy is GA from 1.30


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_object_validates(variant: str, version: str) -> None:
    if variant in NEEDS_1_30 and version < "1.30":
        with pytest.raises(helm.HelmRenderError, match=r"Kubernetes 1\.30"):
            render(VARIANTS[variant], version)
        return
    objects = render(VARIANTS[variant], version)
    for obj in objects.values():
        if obj["kind"] in CRD_FILES:
            validate_crd_object(obj)
        if obj["kind"] in CRDS:
            continue
        kubernetes_validate.validate(obj, version, strict=True)
    config = yaml.safe_load(objects["ConfigMap/cw-copilot-webhook"]["data"]["config.yaml"])
    build_settings(config)  # the chart and the server agree on every configuration key
    hooks = objects["MutatingWebhookConfiguration/cw-copilot-webhook"]["webhooks"]
    # matchConditions (GA in 1.30) by default only where the API server has them
    expected = version >= "1.30" and variant != "no-match-conditions"
    assert all(("matchConditions" in h) == expected for h in hooks if h["name"].startswith("ptrace"))


def test_default_objects() -> None:
    assert set(render()) == {
        "ServiceAccount/cw-copilot-webhook",
        "ClusterRole/cw-copilot-webhook",
        "ClusterRoleBinding/cw-copilot-webhook",
        "Role/cw-copilot-webhook",
        "RoleBinding/cw-copilot-webhook",
        "Secret/cw-copilot-webhook-tls",
        "ConfigMap/cw-copilot-webhook",
        "Service/cw-copilot-webhook",
        "Deployment/cw-copilot-webhook",
        "PodDisruptionBudget/cw-copilot-webhook",
        "MutatingWebhookConfiguration/cw-copilot-webhook",
        "Job/cw-copilot-webhook-unregister",  # helm.sh/hook: pre-delete
        "Pod/cw-copilot-webhook-verify",  # helm.sh/hook: test
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
        assert opt_out == {"key": "copilot-webhook.io/inject", "operator": "NotIn", "values": ["disabled", "false"]}
        assert hook["objectSelector"]["matchExpressions"] == [
            {"key": "copilot-webhook.io/webhook-release", "operator": "NotIn", "values": ["cw-copilot-webhook"]}
        ]
        assert "flyte-copilot-" in hook["matchConditions"][0]["expression"]
        assert "caBundle" not in hook["clientConfig"], "self-signed: the server patches the caBundle in"


def test_each_webhook_declares_its_own_failure_policy_and_fails_open_until_its_bundle_is_in_place() -> None:
    """Fresh install (no caBundle yet): every webhook renders Ignore; the declared policies travel in the
    annotation for the server to patch in once its listener verifies against the published bundle."""
    values = {"webhook": {"ptrace": {"failurePolicy": "Fail"}}}
    for mode in ({}, {"tls": {"mode": "cert-manager"}}):
        config = render({**values, **mode})["MutatingWebhookConfiguration/cw-copilot-webhook"]
        assert {h["name"]: h["failurePolicy"] for h in config["webhooks"]} == {
            "ptrace.copilot-webhook.io": "Ignore",
            "image-puller.copilot-webhook.io": "Ignore",
        }
        assert orjson.loads(config["metadata"]["annotations"]["copilot-webhook.io/failure-policies"]) == {
            "ptrace.copilot-webhook.io": "Fail",
            "image-puller.copilot-webhook.io": "Ignore",
        }
    # secret mode: the bundle is known at render, so is the policy
    hooks = _webhooks({**values, **VARIANTS["secret"]})
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
        "mutatingwebhookconfigurations": ["get", "list", "watch", "patch", "delete"],
    }
    assert _rules({"imagePuller": {"labeller": True}})["nodes"] == ["list", "watch", "patch"]
    role = render()["ClusterRole/cw-copilot-webhook"]["rules"][2]
    assert role["resourceNames"] == ["cw-copilot-webhook"]
    secrets = render()["Role/cw-copilot-webhook"]["rules"]
    assert secrets[0] == {
        "apiGroups": [""],
        "resources": ["secrets"],
        "resourceNames": ["cw-copilot-webhook-tls"],
        "verbs": ["get", "patch"],
    }
    assert len(secrets) == 1, "no create on the namespace's Secrets: the chart creates ours"
    assert "Role/cw-copilot-webhook" not in render({"tls": {"mode": "cert-manager"}})
    assert "patch" in _rules({"tls": {"mode": "cert-manager"}})["mutatingwebhookconfigurations"]
    assert "patch" not in _rules(VARIANTS["secret"])["mutatingwebhookconfigurations"]


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

    def hours(duration: str) -> int:
        return int(duration.removesuffix("h"))

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
        # The standard knobs: none may take over what the chart sets, or weaken the restricted defaults.
        ({"podLabels": {"app.kubernetes.io/instance": "x"}}, "invalid propertyName 'app.kubernetes.io/instance'"),
        ({"podLabels": {"copilot-webhook.io/webhook-release": "x"}}, "'copilot-webhook.io/webhook-release'"),
        ({"podAnnotations": {"checksum/config": "x"}}, "invalid propertyName 'checksum/config'"),
        ({"extraEnv": [{"name": "POD_IP", "value": "10.0.0.1"}]}, "at '/extraEnv/0/name': 'not' failed"),
        ({"extraEnv": [{"name": "COPILOT_WEBHOOK_SERVER__PORT", "value": "1"}]}, "at '/extraEnv/0/name'"),
        ({"extraEnv": [{"value": "x"}]}, "missing property 'name'"),
        ({"extraVolumes": [{"name": "tls", "emptyDir": {}}]}, "at '/extraVolumes/0/name'"),
        ({"extraVolumeMounts": [{"name": "x", "mountPath": "/tls/extra"}]}, "at '/extraVolumeMounts/0/mountPath'"),
        ({"extraVolumeMounts": [{"name": "x", "mountPath": "/etc/copilot-webhook"}]}, "/extraVolumeMounts/0/mountPath"),
        ({"podSecurityContext": {"runAsUser": 0}}, "at '/podSecurityContext/runAsUser': minimum"),
        ({"podSecurityContext": {"runAsNonRoot": False}}, "additional properties 'runAsNonRoot' not allowed"),
        ({"podSecurityContext": {"privileged": True}}, "additional properties 'privileged' not allowed"),
        ({"affinity": {"nodeAfinity": {}}}, "additional properties 'nodeAfinity' not allowed"),
        ({"topologySpreadConstraints": [{"topologyKey": "a", "maxSkew": 1}]}, "missing property 'whenUnsatisfiable'"),
        ({"nameOverride": "Copilot"}, "/nameOverride"),
        ({"nameOverride": "a" * 53}, "at '/nameOverride': maxLength"),
        ({"fullnameOverride": "1-webhook"}, "/fullnameOverride"),
        ({"fullnameOverride": "a" * 64}, "at '/fullnameOverride': maxLength"),
        ({"revisionHistoryLimit": -1}, "/revisionHistoryLimit"),
        ({"monitoring": {"prometheusRule": {"severity": ""}}}, "/monitoring/prometheusRule/severity"),
        ({"monitoring": {"prometheusRule": {"labels": {"release": 1}}}}, "/monitoring/prometheusRule/labels/release"),
        ({"monitoring": {"prometheusRule": {"for": "1h"}}}, "additional properties 'for' not allowed"),
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


@pytest.mark.parametrize("variant", ["defaults", "cert-manager", "puller-all-pinned", "standard-knobs", "agent"])
def test_lint_has_no_errors(variant: str) -> None:
    report = helm.lint(CHART, VARIANTS[variant], strict=False, namespace="flyte")
    errors = [m for m in report["messages"] if m["severity"] >= 3] + report["errors"]
    assert errors == []


def test_the_values_table_is_generated_from_values_yaml() -> None:
    assert values_table.current() == values_table.table(), "run: python -m scripts.values_table"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("# -- Described.\na: 1\nb: 2\n", "for b"),
        ("# -- Described.\na: 1\n# --\nb: 2\n", "for b"),
        ("image:\n  # -- Described.\n  repository: x\n  tag: ''\n", "for image.tag"),
        # a description above a mapping listed key by key would be shown nowhere
        ("# -- Lost.\nimage:\n  # -- Described.\n  tag: ''\n", "above image,"),
    ],
)
def test_the_values_table_refuses_a_value_without_a_description(text: str, named: str) -> None:
    with pytest.raises(values_table.UndescribedValueError, match=re.escape(named)):
        values_table.table(text)
    assert "| `a` | `1` | Described. |" in values_table.table("# -- Described.\na: 1\n")


def test_a_single_replica_gets_no_disruption_budget_and_two_get_one_that_lets_unhealthy_pods_go() -> None:
    assert "PodDisruptionBudget/cw-copilot-webhook" not in render({"replicaCount": 1})
    pdb = render({"replicaCount": 2})["PodDisruptionBudget/cw-copilot-webhook"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_control_plane_namespaces_are_excluded_whatever_the_values_say() -> None:
    hooks = _webhooks({"webhook": {"excludeNamespaces": ["legacy-team"]}})
    for hook in hooks.values():
        excluded = hook["namespaceSelector"]["matchExpressions"][0]["values"]
        assert excluded == ["kube-system", "kube-public", "kube-node-lease", "legacy-team", "flyte"]


def _render_umbrella(umbrella: Path, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    manifests = helm.Chart.load(umbrella).render(values, name="platform", namespace="flyte", is_install=True)
    objects = {}
    for path, text in manifests.items():
        if not path.endswith("NOTES.txt"):
            for doc in yaml.safe_load_all(text):
                if doc:
                    objects[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return objects


def test_usable_as_a_dependency_of_an_umbrella_chart(tmp_path: Path) -> None:
    """A platform chart that depends on this one behind `condition: copilot-webhook.enabled`, its values
    under the dependency's name (the condition's key among them, which Helm also validates against our
    schema, helm/helm#10392) and a `global` block (which Helm hands every subchart): the real engine
    renders both, and the condition switches the dependency off."""
    umbrella = tmp_path / "platform"
    (umbrella / "charts").mkdir(parents=True)
    shutil.copytree(CHART, umbrella / "charts" / "copilot-webhook")
    (umbrella / "Chart.yaml").write_text(
        "apiVersion: v2\nname: platform\nversion: 1.0.0\n"
        "dependencies:\n  - name: copilot-webhook\n    version: 0.1.0\n    condition: copilot-webhook.enabled\n"
    )
    (umbrella / "values.yaml").write_text("global:\n  imageRegistry: registry.example.com\n")
    values = {"copilot-webhook": {"enabled": True, "ptrace": {"mode": "drop"}, "replicaCount": 1}}
    objects = _render_umbrella(umbrella, values)
    deployment = objects["Deployment/platform-copilot-webhook"]
    assert deployment["spec"]["replicas"] == 1
    assert "PodDisruptionBudget/platform-copilot-webhook" not in objects
    config = yaml.safe_load(objects["ConfigMap/platform-copilot-webhook"]["data"]["config.yaml"])
    assert build_settings(config).ptrace.mode == "drop"
    for obj in objects.values():
        if obj["kind"] not in CRDS:
            kubernetes_validate.validate(obj, "1.33.0", strict=True)
    assert _render_umbrella(umbrella, {"copilot-webhook": {"enabled": False}}) == {}
    with pytest.raises(helm.HelmValuesError, match="enabled"):
        _render_umbrella(umbrella, {"copilot-webhook": {"enabled": "yes"}})


def test_a_deadline_the_api_server_would_not_wait_for_is_refused_at_render() -> None:
    with pytest.raises(
        helm.HelmRenderError, match=r"server.deadlineSeconds \(5\) must be below webhook.timeoutSeconds"
    ):
        render({"server": {"deadlineSeconds": 5}, "webhook": {"timeoutSeconds": 5}})
    assert "MutatingWebhookConfiguration/cw-copilot-webhook" in render({"server": {"deadlineSeconds": 4.5}})


def _pod(values: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = render(values)["Deployment/cw-copilot-webhook"]["spec"]["template"]["spec"]
    return spec


def test_host_network_and_ports() -> None:
    pod = _pod(VARIANTS["host-network"])
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
    assert ports == {"https": 10260, "metrics": 10261}
    objects = render(VARIANTS["host-network"])
    config = build_settings(yaml.safe_load(objects["ConfigMap/cw-copilot-webhook"]["data"]["config.yaml"]))
    assert (config.server.port, config.server.metrics_port) == (10260, 10261)
    service = {p["name"]: p for p in objects["Service/cw-copilot-webhook"]["spec"]["ports"]}
    assert (service["https"]["port"], service["https"]["targetPort"]) == (443, "https")
    assert service["metrics"]["targetPort"] == "metrics"
    assert "metrics" not in {p["name"] for p in _pod(VARIANTS["no-metrics-port"])["containers"][0]["ports"]}


def test_priority_class_follows_the_failure_policy() -> None:
    assert "priorityClassName" not in _pod()
    assert _pod({"webhook": {"ptrace": {"failurePolicy": "Fail"}}})["priorityClassName"] == "system-cluster-critical"
    assert (
        _pod({"webhook": {"failurePolicy": "Fail"}, "priorityClassName": "platform"})["priorityClassName"] == "platform"
    )


def test_image_digest_pins_every_container_the_chart_runs() -> None:
    digest = VARIANTS["pinned-image"]["image"]["digest"]
    objects = render(VARIANTS["pinned-image"])
    images = [
        c["image"]
        for c in _pod(VARIANTS["pinned-image"])["containers"] + _pod(VARIANTS["pinned-image"])["initContainers"]
    ]
    images += [
        c["image"] for c in objects["Job/cw-copilot-webhook-unregister"]["spec"]["template"]["spec"]["containers"]
    ]
    images += [c["image"] for c in objects["Pod/cw-copilot-webhook-verify"]["spec"]["containers"]]
    assert len(images) == 4
    assert all(i == f"ghcr.io/copilot-webhook/copilot-webhook:0.1.0@{digest}" for i in images)


def _images(text: str) -> list[str]:
    """Every image a rendered manifest names: containers' `image:` and the server's configured puller images."""
    images = re.findall(r"^\s*(?:- )?image: (\S+)$", text, re.MULTILINE)
    return [i.strip("'\"") for i in images] + re.findall(r"(?:docker|containerd|cri-o): (\S+/image-puller\S*)", text)


@pytest.mark.parametrize("mode", ["socket", "agent"])
def test_default_images_are_the_charts_own_version(tmp_path: Path, mode: str) -> None:
    """With no image given, every image the chart runs or injects is the one of its appVersion, so a chart can
    never run or inject an image older than its templates."""
    chart = tmp_path / "copilot-webhook"
    shutil.copytree(CHART, chart)
    meta = chart / "Chart.yaml"
    meta.write_text(re.sub(r"^appVersion: .*$", 'appVersion: "9.8.7"', meta.read_text(), flags=re.MULTILINE))
    rendered = helm.Chart.load(chart).render(
        {"imagePuller": {"mode": mode}}, name="cw", namespace="flyte", is_install=True
    )
    images = [i for text in rendered.values() for i in _images(text)]
    expected = {
        "ghcr.io/copilot-webhook/copilot-webhook:9.8.7",
        "ghcr.io/copilot-webhook/image-puller:9.8.7",
    }
    assert set(images) == expected
    # The server and its certs init container, the unregister hook, the verify test, three puller images; in
    # agent mode also the agent's DaemonSet and its client's image.
    assert len(images) == (9 if mode == "agent" else 7)


def _readme_install() -> str:
    """The README's install from a clone: the shell block that builds the images."""
    readme = (CHART.parents[2] / "README.md").read_text()
    blocks: list[str] = re.findall(r"```sh\n(.*?)```", readme, re.DOTALL)
    return next(block for block in blocks if "make images" in block)


@pytest.mark.parametrize("mode", ["socket", "agent"])
def test_the_readme_install_runs_only_the_images_it_pushes(mode: str) -> None:
    """Followed as written, the README's install from a clone pushes the two images `make images` builds and
    names them to the chart so that no pod it runs or injects, in either puller mode, pulls anything else."""
    block = _readme_install()
    registry = re.search(r"^REGISTRY=(\S+)", block, re.MULTILINE)
    assert registry is not None
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    # VERSION is read by sed (a basic regular expression, its group escaped) from a file the block names.
    sed = re.search(r"^VERSION=\$\(sed -n 's/(.+)/\\1/p' (\S+)\)$", block, re.MULTILINE)
    assert sed is not None
    read = re.search(sed[1].replace("\\(", "(").replace("\\)", ")"), (CHART.parents[2] / sed[2]).read_text(), re.M)
    assert read is not None
    assert read[1] == version
    block = block.replace("$REGISTRY", registry[1]).replace("$VERSION", version)
    assert f"make images REGISTRY={registry[1]}" in block
    pushed = set(re.findall(r"^docker push (\S+)$", block, re.MULTILINE))
    assert pushed == {f"{registry[1]}/copilot-webhook:{version}", f"{registry[1]}/image-puller:{version}"}
    values = helm.parse_set_string(",".join(re.findall(r"--set (\S+)", block)))
    assert values["ptrace"] == {"mode": "drop"}
    values["imagePuller"]["mode"] = mode
    images = [i for text in _manifests(values, "1.33.0", "cw").values() for i in _images(text)]
    assert len(images) == (9 if mode == "agent" else 7)
    assert set(images) == pushed


def test_autoscaling_replaces_the_replica_count() -> None:
    objects = render(VARIANTS["autoscaled"])
    assert "replicas" not in objects["Deployment/cw-copilot-webhook"]["spec"]
    hpa = objects["HorizontalPodAutoscaler/cw-copilot-webhook"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 4)
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "cw-copilot-webhook"}
    assert "PodDisruptionBudget/cw-copilot-webhook" in objects
    assert "PodDisruptionBudget/cw-copilot-webhook" not in render(
        {"autoscaling": {"enabled": True, "minReplicas": 1}, "replicaCount": 3}
    )
    with pytest.raises(helm.HelmRenderError, match="minReplicas"):
        render({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}})


def test_network_policy_opens_admission_to_all_and_metrics_to_the_scrapers() -> None:
    policy = render(VARIANTS["network-policy"])["NetworkPolicy/cw-copilot-webhook"]["spec"]
    admission, metrics = policy["ingress"]
    assert admission == {"ports": [{"port": 8443, "protocol": "TCP"}]}
    assert metrics == {"from": [{"namespaceSelector": {}}], "ports": [{"port": 9090, "protocol": "TCP"}]}
    assert {p["port"] for rule in policy["egress"] for p in rule["ports"]} == {53, 443, 6443}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) applied to a pod's labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for requirement in selector.get("matchExpressions") or ():
        key, operator, values = requirement["key"], requirement["operator"], requirement.get("values") or []
        held = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not held:
            return False
    return True


@pytest.mark.parametrize("host_network", [False, True])
def test_hook_pods_are_outside_the_webhooks_selectors_and_have_a_network_policy_of_their_own(
    host_network: bool,
) -> None:
    """helm test under networkPolicy.enabled: the verify pod is not held by the webhook's policy (whose
    egress would deny its call to the pods' target port) nor routed to by the Service, and its own policy
    lets it reach DNS, the API server and the webhook pods on server.port (the port after the Service's
    translation, which is what a NetworkPolicy sees)."""
    values: dict[str, Any] = {"networkPolicy": {"enabled": True}}
    if host_network:
        values.update(VARIANTS["host-network"])
    objects = render(values)
    port = 10260 if host_network else 8443
    server = objects["Deployment/cw-copilot-webhook"]["spec"]["template"]["metadata"]["labels"]
    hook_pods = {
        "test": objects["Pod/cw-copilot-webhook-verify"]["metadata"]["labels"],
        "unregister": objects["Job/cw-copilot-webhook-unregister"]["spec"]["template"]["metadata"]["labels"],
    }
    webhook_selectors = {
        "NetworkPolicy": objects["NetworkPolicy/cw-copilot-webhook"]["spec"]["podSelector"],
        "Service": {"matchLabels": objects["Service/cw-copilot-webhook"]["spec"]["selector"]},
        "PodDisruptionBudget": objects["PodDisruptionBudget/cw-copilot-webhook"]["spec"]["selector"],
    }
    hooks = objects["NetworkPolicy/cw-copilot-webhook-hooks"]["spec"]
    for component, labels in hook_pods.items():
        assert labels["copilot-webhook.io/webhook-release"] == "cw-copilot-webhook", "never sent to the webhook"
        for kind, selector in webhook_selectors.items():
            assert _selects(selector, server), kind
            assert not _selects(selector, labels), f"{kind} selects the {component} pod"
        assert _selects(hooks["podSelector"], labels), component
    assert not _selects(hooks["podSelector"], server)
    assert hooks["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in hooks, "the hook pods take no connections"
    dns, api_server, webhook = hooks["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert {p["port"] for p in api_server["ports"]} == {443, 6443}
    assert webhook["ports"] == [{"port": port, "protocol": "TCP"}]
    if host_network:
        assert "to" not in webhook, "host-network pods have their nodes' addresses: no pod selector matches them"
    else:
        assert [_selects(peer["podSelector"], server) for peer in webhook["to"]] == [True]
    assert "NetworkPolicy/cw-copilot-webhook-hooks" not in render()


def test_prometheus_operator_scrapes_the_plain_http_port() -> None:
    objects = render(VARIANTS["monitoring"])
    monitor = objects["ServiceMonitor/cw-copilot-webhook"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"][0] == {
        "port": "metrics",
        "path": "/metrics",
        "scheme": "http",
        "interval": "30s",
    }
    assert monitor["spec"]["selector"]["matchLabels"] == objects["Service/cw-copilot-webhook"]["spec"]["selector"]
    pod_monitor = objects["PodMonitor/cw-copilot-webhook"]
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    with pytest.raises(helm.HelmRenderError, match=r"server\.metricsPort"):
        render({**VARIANTS["monitoring"], "server": {"metricsPort": 0}})


def test_the_prometheus_rule_alerts_on_a_replica_that_keeps_stalling() -> None:
    """Off by default; on, beside the ServiceMonitor's labels, it selects the release's replicas by namespace (the
    label both monitors give every target) and reads only what the server exports. Its expression, timing and
    labels are proven in Prometheus itself (tests/test_dashboard.py)."""
    assert not [name for name in render() if name.startswith("PrometheusRule/")]
    objects = render(VARIANTS["monitoring"], name="ops")
    rule = objects["PrometheusRule/ops-copilot-webhook"]
    assert rule["metadata"]["namespace"] == "flyte"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    validate_crd_object(rule)
    (group,) = rule["spec"]["groups"]
    (alert,) = group["rules"]
    assert alert["alert"] == "CopilotWebhookEventLoopStalls"
    assert alert["labels"] == {"severity": "warning"}
    assert 'copilot_webhook_event_loop_stalls_total{namespace="flyte"}' in alert["expr"]
    assert "Event-loop stalls" in alert["annotations"]["description"], "the section of docs/operations.md"
    metrics = Metrics()
    exported = set(re.findall(r"^(copilot_webhook_\w+)", metrics.render().decode(), re.MULTILINE))
    assert set(re.findall(r"copilot_webhook_\w+", alert["expr"])) <= exported
    paged = render({"monitoring": {"prometheusRule": {"enabled": True, "severity": "page"}}})
    assert paged["PrometheusRule/cw-copilot-webhook"]["spec"]["groups"][0]["rules"][0]["labels"] == {"severity": "page"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"for": "15 minutes"}, "does not match"),
        ({"severity": "warning"}, "Additional properties are not allowed"),
    ],
)
def test_the_vendored_crd_schema_refuses_what_the_operator_would(change: dict[str, str], message: str) -> None:
    rule = render(VARIANTS["monitoring"])["PrometheusRule/cw-copilot-webhook"]
    rule["spec"]["groups"][0]["rules"][0].update(change)
    with pytest.raises(jsonschema.ValidationError, match=message):
        validate_crd_object(rule)


def test_the_grafana_dashboard_reads_only_metrics_the_server_exports() -> None:
    """Every series a panel queries exists in the server's own /metrics, so no panel is silently empty."""
    dashboard_map = render(VARIANTS["monitoring"])["ConfigMap/cw-copilot-webhook-dashboard"]
    assert dashboard_map["metadata"]["namespace"] == "monitoring"
    assert dashboard_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = orjson.loads(dashboard_map["data"]["copilot-webhook.json"])
    metrics = Metrics()
    metrics.watch_nodes(lambda: {"containerd": 1})
    for counter in (metrics.requests, metrics.mutations, metrics.skips):
        counter.labels(*["x"] * len(counter._labelnames)).inc()
    metrics.undecided.labels("Ignore").inc()
    metrics.latency.labels("/mutate").observe(0.001)
    metrics.event_loop_lag.observe(0.001)
    exported = set(re.findall(r"^(copilot_webhook_\w+)", metrics.render().decode(), re.MULTILINE))
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"copilot_webhook_\w+", target["expr"])
    }
    assert len(dashboard["panels"]) >= 8
    assert queried - exported == set()
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("requests", "latency", "mutations", "skips", "undecided", "self-check", "expiry", "event-loop lag"):
        assert topic in titles
    assert "event-loop stalls" in titles


def test_the_chart_owns_the_secret_without_writing_its_data() -> None:
    secret = render()["Secret/cw-copilot-webhook-tls"]
    assert "data" not in secret, "an upgrade must leave what the server wrote"
    assert "stringData" not in secret
    assert "Secret/cw-copilot-webhook-tls" not in render({"tls": {"mode": "cert-manager"}})


def test_uninstall_removes_the_webhook_configuration_first_and_helm_test_verifies_through_the_service() -> None:
    objects = render()
    job = objects["Job/cw-copilot-webhook-unregister"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == ["unregister", "--webhook-config=cw-copilot-webhook"]
    assert pod["serviceAccountName"] == "cw-copilot-webhook"
    assert job["spec"]["template"]["metadata"]["labels"]["copilot-webhook.io/webhook-release"] == "cw-copilot-webhook"
    test = objects["Pod/cw-copilot-webhook-verify"]
    assert test["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert test["spec"]["containers"][0]["args"] == ["verify", "--webhook-config=cw-copilot-webhook"]
    for container in pod["containers"] + test["spec"]["containers"]:
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_notes_tell_how_to_verify_the_install() -> None:
    manifests = _chart().render({"webhook": {"failurePolicy": "Fail"}}, name="cw", namespace="flyte", is_install=True)
    notes = next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))
    assert "helm test cw -n flyte" in notes
    assert "Ignore until a replica has verified its own listener" in notes


def test_one_version_everywhere() -> None:
    """webhook.__version__ is the version; the package reads it, and the chart's version and appVersion and
    the server's default puller images must say the same (the chart's own follow its appVersion)."""
    from webhook import __version__

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert chart["version"] == __version__, "docs/upgrading.md: the chart is versioned with the server"
    settings = build_settings({}).image_puller
    assert settings.puller_images.docker.endswith(f":{__version__}")
    assert settings.agent.image.endswith(f":{__version__}")


# Keys the chart's values and the server's settings share whose defaults differ on purpose, with the reason.
DIFFERENT_ON_PURPOSE = {
    "server.metricsPort": "the chart opens the plain-HTTP metrics port for its ServiceMonitor and PodMonitor; a "
    "server started by hand opens no port it was not asked for",
    "podSecurity.defaults.enforce": "the chart cannot read the API server's PodSecurity defaults, and assuming less "
    "than a cluster enforces gets pods refused; a server started by hand is told, and a cluster without an "
    "AdmissionConfiguration enforces privileged",
    "imagePuller.agent.address": 'the chart renders its own agent Service\'s name ("" in values.yaml); a server '
    "started by hand is given one",
    "imagePuller.agent.caFile": "the chart's pods hold the CA that signs the agent's certificate at /tls/ca.crt; a "
    "server started by hand has no such file unless told",
    **{
        f"imagePuller.{key}": '"" in values.yaml: the chart renders the image-puller of its own appVersion '
        "(test_default_images_are_the_charts_own_version); a server started by hand names the one of its own version"
        for key in ("pullerImages.docker", "pullerImages.containerd", "pullerImages.cri-o", "agent.image")
    },
}


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value; lists and empty mappings are values."""
    if not isinstance(value, dict) or not value:
        return {prefix: value}
    leaves: dict[str, Any] = {}
    for key, item in value.items():
        leaves.update(_leaves(item, f"{prefix}.{key}" if prefix else key))
    return leaves


def test_the_chart_and_the_server_have_one_set_of_defaults() -> None:
    """A Helm install runs with the chart's defaults, a server started by hand with the settings': every key
    both have must default alike (values.yaml once had 2 of the server's 4 copilot image globs)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    sections = {field.alias or name for name, field in Settings.model_fields.items()}
    chart = _leaves({key: value for key, value in values.items() if key in sections})
    server = _leaves(dump_settings(Settings()))
    shared = chart.keys() & server.keys()
    assert len(shared) > 40, "the configuration keys of values.yaml were not found"
    assert chart.keys() - server.keys() == set(), "values.yaml has configuration keys the server does not know"
    assert set(DIFFERENT_ON_PURPOSE) <= shared
    differing = {key: (chart[key], server[key]) for key in sorted(shared) if chart[key] != server[key]}
    assert set(differing) == set(DIFFERENT_ON_PURPOSE), differing


def test_the_configuration_reference_is_generated_from_the_settings_model() -> None:
    from scripts import config_reference

    assert config_reference.current() == config_reference.table(), "run: python -m scripts.config_reference"


def _pod_labels(objects: dict[str, dict[str, Any]], name: str = "cw-copilot-webhook") -> dict[str, str]:
    labels: dict[str, str] = objects[f"Deployment/{name}"]["spec"]["template"]["metadata"]["labels"]
    return labels


def test_standard_knobs_reach_the_pods_and_keep_the_chart_s_own() -> None:
    values = VARIANTS["standard-knobs"]
    objects = render(values)
    deployment = objects["Deployment/cw-copilot-webhook"]
    assert deployment["spec"]["revisionHistoryLimit"] == 2
    assert render()["Deployment/cw-copilot-webhook"]["spec"]["revisionHistoryLimit"] == 5
    pod = deployment["spec"]["template"]["spec"]
    labels = _pod_labels(objects)
    assert labels["team"] == "platform"
    assert _selects({"matchLabels": objects["Service/cw-copilot-webhook"]["spec"]["selector"]}, labels)
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["example.com/owner"] == "platform"
    assert "checksum/config" in annotations
    assert pod["affinity"] == values["affinity"]
    webhook, certs = pod["containers"][0], pod["initContainers"][0]
    for container in (webhook, certs):
        env = {e["name"]: e for e in container["env"]}
        assert env["HTTPS_PROXY"]["value"] == "http://proxy.example.com:3128"
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert [e["name"] for e in webhook["env"]][:2] == ["POD_NAMESPACE", "POD_IP"]
    assert {"name": "trust", "configMap": {"name": "corporate-ca"}} in pod["volumes"]
    assert {"name": "trust", "mountPath": "/etc/ssl/corporate", "readOnly": True} in webhook["volumeMounts"]
    assert {v["name"] for v in pod["volumes"]} == {"config", "tls", "tmp", "trust"}
    # null leaves the user and groups to the platform; non-root and RuntimeDefault stay
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    for container in pod["containers"] + pod["initContainers"]:
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # the hook pods run where the webhook's pods may (nodeAffinity), as the same user
    node_affinity = {"nodeAffinity": values["affinity"]["nodeAffinity"]}
    for hook in (
        objects["Job/cw-copilot-webhook-unregister"]["spec"]["template"]["spec"],
        objects["Pod/cw-copilot-webhook-verify"]["spec"],
    ):
        assert hook["affinity"] == node_affinity
        assert hook["securityContext"] == pod["securityContext"]
    defaults = _pod()
    assert "affinity" not in defaults
    assert defaults["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert [e["name"] for e in defaults["containers"][0]["env"]] == ["POD_NAMESPACE", "POD_IP"]
    assert "env" not in defaults["initContainers"][0]


def test_topology_spread_constraints_replace_the_chart_s_on_their_key_and_add_the_others() -> None:
    objects = render(VARIANTS["standard-knobs"])
    labels = _pod_labels(objects)
    constraints = {c["topologyKey"]: c for c in _pod(VARIANTS["standard-knobs"])["topologySpreadConstraints"]}
    assert list(constraints) == ["kubernetes.io/hostname", "topology.kubernetes.io/zone", "example.com/rack"]
    assert constraints["kubernetes.io/hostname"]["whenUnsatisfiable"] == "ScheduleAnyway", "the chart's, kept"
    assert (
        constraints["topology.kubernetes.io/zone"]["maxSkew"],
        constraints["topology.kubernetes.io/zone"]["whenUnsatisfiable"],
    ) == (2, "DoNotSchedule")
    for constraint in constraints.values():
        assert _selects(constraint["labelSelector"], labels), "a constraint without a selector counts our pods"
    own = {"matchLabels": {"tier": "admission"}}
    values = {
        "topologySpreadConstraints": [
            {**VARIANTS["standard-knobs"]["topologySpreadConstraints"][1], "labelSelector": own}
        ]
    }
    assert _pod(values)["topologySpreadConstraints"][2]["labelSelector"] == own
    assert len(_pod(values)["topologySpreadConstraints"]) == 3


@pytest.mark.parametrize(
    ("values", "name", "fullname"),
    [
        ({}, "cw", "cw-copilot-webhook"),
        ({"nameOverride": "ptrace-hook"}, "cw", "cw-ptrace-hook"),
        ({"nameOverride": "cw"}, "cw", "cw"),
        ({"fullnameOverride": "admission"}, "cw", "admission"),
        ({"fullnameOverride": "admission", "tls": {"mode": "cert-manager"}}, "cw", "admission"),
        ({"nameOverride": "ptrace-hook", "networkPolicy": {"enabled": True}}, "cw", "cw-ptrace-hook"),
        ({}, "r" * 60, "r" * 60 + "-copilot-webhook"[:3]),
    ],
)
def test_every_name_follows_the_overrides_and_they_still_agree(
    values: dict[str, Any], name: str, fullname: str
) -> None:
    """The Service, the webhook configuration that calls it, the names in its certificate, what the server is
    told (--service, --webhook-config, --certs-secret) and every object referring to another by name."""
    objects = render(values, name=name)
    fullname = fullname.rstrip("-")
    for key in objects:
        kind, object_name = key.split("/", 1)
        # a Job's name is at most 63 characters: the fullname is cut to leave room for its suffix
        assert object_name.startswith(fullname[:52] if kind == "Job" else fullname), key
    service = objects[f"Service/{fullname}"]
    config = objects[f"MutatingWebhookConfiguration/{fullname}"]
    deployment = objects[f"Deployment/{fullname}"]
    pod = deployment["spec"]["template"]["spec"]
    labels = _pod_labels(objects, fullname)
    assert _selects({"matchLabels": service["spec"]["selector"]}, labels)
    assert _selects(deployment["spec"]["selector"], labels)
    expected_name = values.get("nameOverride", "copilot-webhook")
    assert deployment["metadata"]["labels"]["app.kubernetes.io/name"] == expected_name
    for hook in config["webhooks"]:
        assert hook["clientConfig"]["service"]["name"] == fullname
        assert hook["clientConfig"]["service"]["namespace"] == "flyte"
        assert hook["objectSelector"]["matchExpressions"][0]["values"] == [labels["copilot-webhook.io/webhook-release"]]
    args = pod["containers"][0]["args"]
    assert f"--service={fullname}" in args
    assert f"--webhook-config={fullname}" in args
    secret = f"{fullname}-tls"
    if values.get("tls", {}).get("mode") == "cert-manager":
        certificate = objects[f"Certificate/{fullname}"]["spec"]
        assert f"{fullname}.flyte.svc" in certificate["dnsNames"]
        assert certificate["secretName"] == secret
        injected = config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
        assert f"Certificate/{injected.split('/')[1]}" in objects
        for kind in ("Certificate", "Issuer"):
            for key, obj in objects.items():
                if key.startswith(kind + "/") and "issuerRef" in obj["spec"]:
                    assert f"Issuer/{obj['spec']['issuerRef']['name']}" in objects
    else:
        certs = pod["initContainers"][0]["args"]
        given = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in certs if "=" in a}
        assert (given["--service"], given["--namespace"], given["--webhook-config"]) == (fullname, "flyte", fullname)
        # the names the server's certificate carries are those the API server dials
        assert f"{fullname}.flyte.svc" in service_dns_names(given["--service"], given["--namespace"])
        assert given["--secret"] == secret
        assert f"--certs-secret={secret}" in args
        assert objects[f"Role/{fullname}"]["rules"][0]["resourceNames"] == [secret]
        assert f"Secret/{secret}" in objects
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert f"ConfigMap/{volume['configMap']['name']}" in objects
    assert objects[f"ClusterRole/{fullname}"]["rules"][2]["resourceNames"] == [fullname]
    for binding in ("ClusterRoleBinding", "RoleBinding"):
        if f"{binding}/{fullname}" in objects:
            bound = objects[f"{binding}/{fullname}"]
            assert f"{bound['roleRef']['kind']}/{bound['roleRef']['name']}" in objects
            assert bound["subjects"][0]["name"] == pod["serviceAccountName"]
    assert f"ServiceAccount/{pod['serviceAccountName']}" in objects
    job = next(obj for key, obj in objects.items() if key.startswith("Job/"))
    assert len(job["metadata"]["name"]) <= 63, "the Job controller puts a Job's name in a label"
    verify = objects[f"Pod/{fullname}-verify"]
    for hook_pod in (job["spec"]["template"]["spec"], verify["spec"]):
        assert hook_pod["serviceAccountName"] == pod["serviceAccountName"]
        assert f"--webhook-config={fullname}" in hook_pod["containers"][0]["args"]
    if f"NetworkPolicy/{fullname}" in objects:
        assert _selects(objects[f"NetworkPolicy/{fullname}"]["spec"]["podSelector"], labels)
        hooks = objects[f"NetworkPolicy/{fullname}-hooks"]["spec"]["podSelector"]
        assert _selects(hooks, verify["metadata"]["labels"])
    for obj in objects.values():
        if obj["kind"] not in CRDS:
            kubernetes_validate.validate(obj, "1.33.0", strict=True)


def _pause(values: dict[str, Any]) -> tuple[list[str], int]:
    pod = _pod(values)
    return pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"], pod["terminationGracePeriodSeconds"]


def test_the_prestop_pause_is_prestopseconds_and_an_install_setting_drainseconds_keeps_working() -> None:
    """drainSeconds, the pause's former name beside server.drainSeconds (the server's own drain), still
    works where an install sets it, and the notes say it is deprecated."""
    assert _pause({}) == (["sleep", "5"], 20)
    assert _pause({"preStopSeconds": 3}) == (["sleep", "3"], 18)
    assert _pause({"drainSeconds": 9}) == (["sleep", "9"], 24)
    assert _pause({"drainSeconds": 0, "preStopSeconds": 3}) == (["sleep", "0"], 15), "the old name, when set, wins"
    server = yaml.safe_load(render({"drainSeconds": 9})["ConfigMap/cw-copilot-webhook"]["data"]["config.yaml"])
    assert server["server"]["drainSeconds"] == 2, "the server's own drain is a different value"
    assert "DEPRECATED: drainSeconds is now preStopSeconds" in notes({"drainSeconds": 9})
    assert "Its value, 9, is still used" in notes({"drainSeconds": 9})
    assert "DEPRECATED" not in notes({"preStopSeconds": 9})
    schema = orjson.loads((CHART / "values.schema.json").read_bytes())["properties"]
    assert schema["drainSeconds"]["description"].startswith("Deprecated")
    with pytest.raises(helm.HelmValuesError, match="/drainSeconds"):
        render({"drainSeconds": -1})


NOTES_CASES = [
    ({}, "cw"),
    ({}, "copilot-webhook"),  # a release name holding the chart's name is the fullname
    ({"nameOverride": "ptrace-hook"}, "cw"),
    ({"fullnameOverride": "admission"}, "cw"),
    ({"fullnameOverride": "admission", "tls": {"mode": "cert-manager"}}, "cw"),
    ({"hostNetwork": True, "server": {"port": 10260, "metricsPort": 10261}}, "cw"),
]


def _of_kind(objects: dict[str, dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [obj for key, obj in objects.items() if key.startswith(kind + "/")]
    return found


def _printed_curl(text: str) -> tuple[str, str, int]:
    """The preview command NOTES.txt prints, and the host and port it both resolves and requests."""
    (curl,) = re.findall(r"^  (curl -sS --cacert .*)$", text, re.MULTILINE)
    resolve = re.search(r"--resolve ([^:\s]+):(\d+):127\.0\.0\.1 ", curl)
    url = re.search(r"'https://([^:/']+):(\d+)/preview\?output=diff'", curl)
    assert resolve, curl
    assert url, curl
    assert resolve.groups() == url.groups(), "curl dials 127.0.0.1 only for the host it is asked for"
    return curl, url.group(1), int(url.group(2))


@pytest.mark.parametrize(("values", "release"), NOTES_CASES)
def test_the_notes_commands_name_the_rendered_objects(values: dict[str, Any], release: str) -> None:
    """Every name NOTES.txt prints is that of a rendered object, and the preview's TLS name is one the
    serving certificate carries, for the default release and under nameOverride/fullnameOverride."""
    text, objects = notes(values, release), render(values, name=release)
    service, config = _of_kind(objects, "Service"), _of_kind(objects, "MutatingWebhookConfiguration")
    ports = {p["port"] for p in service["spec"]["ports"]}
    forwards = re.findall(r"kubectl -n (\S+) port-forward service/(\S+) (\d+)(?::(\d+))? ", text)
    assert len(forwards) == 2, "metrics and preview"
    for namespace, name, local, remote in forwards:
        assert (namespace, name) == ("flyte", service["metadata"]["name"])
        assert int(remote or local) in ports, "a port the Service serves"
    assert set(re.findall(r"kubectl get mutatingwebhookconfiguration (\S+) ", text)) == {config["metadata"]["name"]}
    assert re.findall(r"rollout status deployment/(\S+)", text) == [_of_kind(objects, "Deployment")["metadata"]["name"]]
    _, host, port = _printed_curl(text)
    assert [int(local) for *_, local, remote in forwards if remote == "443"] == [port]
    called = config["webhooks"][0]["clientConfig"]["service"]
    assert host == f"{called['name']}.{called['namespace']}.svc", "the name the API server dials"
    if values.get("tls", {}).get("mode") == "cert-manager":
        certificate = objects[f"Certificate/{service['metadata']['name']}"]["spec"]
        assert host in certificate["dnsNames"]
    else:
        certs = _of_kind(objects, "Deployment")["spec"]["template"]["spec"]["initContainers"][0]["args"]
        given = dict(a.removeprefix("--").split("=", 1) for a in certs if "=" in a)
        assert host in service_dns_names(given["service"], given["namespace"])
    assert "/preview" not in notes({**values, "preview": {"enabled": False}}, release), "no hint for a 404"


class _Preview(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Length", "9")
        self.end_headers()
        self.wfile.write(b"previewed")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize(("values", "release"), [({}, "cw"), ({"fullnameOverride": "admission"}, "cw")])
def test_the_notes_preview_command_works_as_printed(tmp_path: Path, values: dict[str, Any], release: str) -> None:
    """The printed curl, run as printed (the port-forward's local port standing in for 8443) against a
    listener whose certificate is issued as the self-signed mode issues it, for the --service and
    --namespace the Deployment gives `certs ensure`, and signed by the CA the hint saves to ca.crt."""
    objects = render(values, name=release)
    certs = _of_kind(objects, "Deployment")["spec"]["template"]["spec"]["initContainers"][0]["args"]
    given = dict(a.removeprefix("--").split("=", 1) for a in certs if "=" in a)
    ca = generate_ca()
    serving = issue_serving(ca, service_dns_names(given["service"], given["namespace"]))
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    (tmp_path / "tls.crt").write_bytes(serving.cert_pem)
    (tmp_path / "tls.key").write_bytes(serving.key_pem)
    (tmp_path / "my-pod.yaml").write_text("apiVersion: v1\nkind: Pod\n")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Preview)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    _Preview.received.clear()
    try:
        curl, _, _ = _printed_curl(notes(values, release))
        ran = subprocess.run(
            ["sh", "-c", curl.replace(":8443", f":{port}")],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert (ran.returncode, ran.stdout) == (0, "previewed"), ran.stderr
        assert _Preview.received == [("/preview?output=diff", "application/yaml", b"apiVersion: v1\nkind: Pod\n")]
        # The same CA without --resolve, dialling 127.0.0.1 by its address: refused for the name.
        bare = subprocess.run(
            ["curl", "-sS", "--cacert", "ca.crt", f"https://127.0.0.1:{port}/preview"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert bare.returncode in {51, 60}, bare.stderr
    finally:
        server.shutdown()
        server.server_close()


AGENT = {"imagePuller": {"mode": "agent"}}
AGENT_OBJECTS = {
    f"{kind}/cw-copilot-webhook-agent"
    for kind in ("DaemonSet", "Service", "ServiceAccount", "ClusterRole", "ClusterRoleBinding")
}


def _server_settings(objects: dict[str, dict[str, Any]], name: str = "cw-copilot-webhook") -> Settings:
    return build_settings(yaml.safe_load(objects[f"ConfigMap/{name}"]["data"]["config.yaml"]))


def test_agent_mode_adds_the_node_agent_and_nothing_else() -> None:
    """Beside what socket mode renders: the agent's DaemonSet, its Service, and its own identity and roles."""
    assert set(render(AGENT)) - set(render()) == AGENT_OBJECTS
    assert set(render({**AGENT, "networkPolicy": {"enabled": True}})) - set(render(VARIANTS["network-policy"])) == {
        *AGENT_OBJECTS,
        "NetworkPolicy/cw-copilot-webhook-agent",
    }
    for version in K8S_VERSIONS:
        for key, obj in render(AGENT, version).items():
            if key in AGENT_OBJECTS:
                kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"imagePuller": {"mode": "socket"}},
        {"imagePuller": {"mode": "agent", "enabled": False}},
        {"imagePuller": {"mode": "socket"}, "tls": {"mode": "cert-manager"}, "networkPolicy": {"enabled": True}},
    ],
)
def test_without_agent_mode_there_is_no_agent_and_the_certificate_names_only_the_webhook(
    values: dict[str, Any],
) -> None:
    objects = render(values)
    assert [key for key in objects if "agent" in key] == []
    pod = objects["Deployment/cw-copilot-webhook"]["spec"]["template"]["spec"]
    args = [a for c in pod["containers"] + pod.get("initContainers", []) for a in c["args"]]
    assert [a for a in args if a.startswith(("--dns", "--certs-dns"))] == []
    if "Certificate/cw-copilot-webhook" in objects:
        assert objects["Certificate/cw-copilot-webhook"]["spec"]["dnsNames"] == service_dns_names(
            "cw-copilot-webhook", "flyte"
        )
    assert _server_settings(objects).image_puller.mode == values.get("imagePuller", {}).get("mode", "socket")
    assert "daemonset" not in notes(values)
    assert "hostPath" not in notes(values)


def test_the_agent_daemonset_holds_the_socket_and_nothing_more() -> None:
    objects = render(AGENT)
    daemonset = objects["DaemonSet/cw-copilot-webhook-agent"]
    assert daemonset["metadata"]["namespace"] == "flyte"
    assert daemonset["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "cw-copilot-webhook-agent"
    assert pod["tolerations"] == [{"operator": "Exists"}], "every node, whatever its taints"
    (agent,) = pod["containers"]
    assert "initContainers" not in pod
    assert agent["image"] == "ghcr.io/copilot-webhook/image-puller:0.1.0"
    assert agent["command"] == ["copilot-webhook-agent"]
    assert agent["args"] == [
        "--port=8444",
        "--tls-cert=/tls/tls.crt",
        "--tls-key=/tls/tls.key",
        "--audience=copilot-webhook-agent",
        "--node-name=$(NODE_NAME)",
        "--socket-directory=/host/run",
        "--max-connections=64",
        "--timeout=300",
    ]
    assert agent["env"] == [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    assert agent["ports"] == [{"name": "https", "containerPort": 8444, "protocol": "TCP"}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert agent[probe]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    # Root for the socket, and nothing else a root process could add.
    assert agent["securityContext"] == {
        "runAsUser": 0,
        "runAsNonRoot": False,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert "privileged" not in agent["securityContext"]
    assert [key for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)] == []
    assert agent["resources"]["limits"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    assert set(volumes) == set(mounts) == {"runtime", "tls"}
    assert volumes["runtime"]["hostPath"] == {"path": "/run", "type": "Directory"}
    assert [v for v in pod["volumes"] if "hostPath" in v] == [volumes["runtime"]], "the one hostPath"
    assert (mounts["runtime"]["mountPath"], mounts["runtime"]["readOnly"]) == ("/host/run", True)
    assert mounts["runtime"]["mountPropagation"] == "HostToContainer", "never pins what the node unmounts"
    assert volumes["tls"]["secret"]["secretName"] == "cw-copilot-webhook-tls", "the webhook's certificate"
    assert [i["key"] for i in volumes["tls"]["secret"]["items"]] == ["tls.crt", "tls.key"], "never the CA's key"
    assert (mounts["tls"]["mountPath"], mounts["tls"]["readOnly"]) == ("/tls", True)
    own = render(
        {
            "imagePuller": {"mode": "agent", "timeoutSeconds": 60, "agent": {"audience": "pullers", "image": "r/p:1"}},
            "nodeAgent": {
                "port": 9444,
                "socketDirectory": "/var/run",
                "maxConnections": 8,
                "tolerations": [],
                "nodeSelector": {"kubernetes.io/os": "linux"},
                "priorityClassName": "system-node-critical",
                "podAnnotations": {"example.com/owner": "platform"},
                "podLabels": {"team": "platform"},
                "updateStrategy": {"maxUnavailable": "10%"},
            },
            "tls": VARIANTS["secret"]["tls"],
        }
    )
    daemonset = own["DaemonSet/cw-copilot-webhook-agent"]
    template, pod = daemonset["spec"]["template"], daemonset["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert agent["image"] == "r/p:1"
    assert {"--port=9444", "--audience=pullers", "--max-connections=8", "--timeout=60"} <= set(agent["args"])
    assert agent["ports"][0]["containerPort"] == 9444
    assert pod["volumes"][0]["hostPath"]["path"] == "/var/run"
    assert "tolerations" not in pod
    assert (pod["nodeSelector"], pod["priorityClassName"]) == ({"kubernetes.io/os": "linux"}, "system-node-critical")
    assert template["metadata"]["annotations"] == {"example.com/owner": "platform"}
    assert template["metadata"]["labels"]["team"] == "platform"
    assert daemonset["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": "10%"}
    assert pod["volumes"][1]["secret"]["secretName"] == "my-tls"
    assert own["Service/cw-copilot-webhook-agent"]["spec"]["ports"][0]["port"] == 443
    for obj in own.values():
        if obj["kind"] not in CRDS:
            kubernetes_validate.validate(obj, "1.33.0", strict=True)


def test_the_agent_service_keeps_each_pod_on_its_own_node() -> None:
    objects = render(AGENT)
    service = objects["Service/cw-copilot-webhook-agent"]
    assert service["metadata"]["namespace"] == "flyte"
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert service["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"}]
    agent = objects["DaemonSet/cw-copilot-webhook-agent"]["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in agent["ports"]] == ["https"]


def test_the_agent_may_review_tokens_and_read_pods_and_nodes_only() -> None:
    objects = render(AGENT)
    role = objects["ClusterRole/cw-copilot-webhook-agent"]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        ("authentication.k8s.io", "tokenreviews", "create"),
        ("", "pods", "get"),
        ("", "nodes", "get"),
    }
    assert all("resourceNames" not in rule for rule in role["rules"])
    binding = objects["ClusterRoleBinding/cw-copilot-webhook-agent"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "cw-copilot-webhook-agent",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "cw-copilot-webhook-agent", "namespace": "flyte"}]
    account = objects["ServiceAccount/cw-copilot-webhook-agent"]
    assert account["metadata"]["namespace"] == "flyte"
    pod = objects["DaemonSet/cw-copilot-webhook-agent"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert account.get("automountServiceAccountToken", True), "its token makes the TokenReviews"
    # the webhook's own role is the same as in socket mode: the agent's rights are the agent's alone
    assert objects["ClusterRole/cw-copilot-webhook"] == render()["ClusterRole/cw-copilot-webhook"]


def _agent_labels(objects: dict[str, dict[str, Any]]) -> dict[str, str]:
    labels: dict[str, str] = objects["DaemonSet/cw-copilot-webhook-agent"]["spec"]["template"]["metadata"]["labels"]
    return labels


def test_the_webhook_s_and_the_agent_s_selectors_never_hold_each_other_s_pods() -> None:
    """The webhook's Service must not route admission reviews to an agent, nor the agent's Service a client's
    pull request to a webhook replica; each disruption budget and NetworkPolicy holds its own pods only."""
    objects = render({**AGENT, "networkPolicy": {"enabled": True}, "podLabels": {"team": "platform"}})
    webhook, agent = _pod_labels(objects), _agent_labels(objects)
    verify = objects["Pod/cw-copilot-webhook-verify"]["metadata"]["labels"]
    webhook_selectors = {
        "Service": {"matchLabels": objects["Service/cw-copilot-webhook"]["spec"]["selector"]},
        "Deployment": objects["Deployment/cw-copilot-webhook"]["spec"]["selector"],
        "PodDisruptionBudget": objects["PodDisruptionBudget/cw-copilot-webhook"]["spec"]["selector"],
        "NetworkPolicy": objects["NetworkPolicy/cw-copilot-webhook"]["spec"]["podSelector"],
    }
    agent_selectors = {
        "Service": {"matchLabels": objects["Service/cw-copilot-webhook-agent"]["spec"]["selector"]},
        "DaemonSet": objects["DaemonSet/cw-copilot-webhook-agent"]["spec"]["selector"],
        "NetworkPolicy": objects["NetworkPolicy/cw-copilot-webhook-agent"]["spec"]["podSelector"],
    }
    for kind, selector in webhook_selectors.items():
        assert _selects(selector, webhook), kind
        assert not _selects(selector, agent), f"the webhook's {kind} selects the agent's pods"
    for kind, selector in agent_selectors.items():
        assert _selects(selector, agent), kind
        assert not _selects(selector, webhook), f"the agent's {kind} selects the webhook's pods"
        assert not _selects(selector, verify), f"the agent's {kind} selects the helm test pod"
    assert not _selects(objects["NetworkPolicy/cw-copilot-webhook-hooks"]["spec"]["podSelector"], agent)
    assert agent["app.kubernetes.io/component"] == "agent"
    # never sent to the webhook, like its own pods (a release namespace that is not excluded stays safe)
    hook = _webhooks(AGENT)["image-puller.copilot-webhook.io"]
    assert not _selects(hook["objectSelector"], agent)


def test_the_agent_network_policy_admits_every_client_and_reaches_only_dns_and_the_api_server() -> None:
    objects = render({**AGENT, "networkPolicy": {"enabled": True}, "nodeAgent": {"port": 9444}})
    policy = objects["NetworkPolicy/cw-copilot-webhook-agent"]["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    # every pod's client calls it, from any namespace; the policy sees the port after the Service's 443 -> 9444
    assert policy["ingress"] == [{"ports": [{"port": 9444, "protocol": "TCP"}]}]
    assert [sorted(p["port"] for p in rule["ports"]) for rule in policy["egress"]] == [[53, 53], [443, 6443]]
    assert all("to" not in rule for rule in policy["egress"])
    assert "NetworkPolicy/cw-copilot-webhook-agent" not in render(AGENT)
    registries = {"registry.team.svc:5000": {}, "cache.team.svc": {"plainHttp": True}, "tls.team.svc": {}}
    pulled_here = render(
        {**AGENT, "networkPolicy": {"enabled": True}, "imagePuller": {**AGENT["imagePuller"], "registries": registries}}
    )
    egress = pulled_here["NetworkPolicy/cw-copilot-webhook-agent"]["spec"]["egress"]
    assert sorted(p["port"] for p in egress[-1]["ports"]) == [80, 443, 5000], "the registries it pulls from itself"


@pytest.mark.parametrize(
    ("values", "release", "agent"),
    [
        ({}, "cw", "cw-copilot-webhook-agent"),
        ({"fullnameOverride": "admission"}, "cw", "admission-agent"),
        ({"nameOverride": "ptrace-hook", "tls": {"mode": "cert-manager"}}, "cw", "cw-ptrace-hook-agent"),
        # a Service's name is a DNS label: at most 63 characters
        ({}, "r" * 60, "r" * 57 + "-agent"),
    ],
)
def test_the_server_is_told_the_agent_s_address_and_a_ca_it_holds(
    values: dict[str, Any], release: str, agent: str
) -> None:
    """The rendered configuration, read by the real settings model: mode agent, the address of the chart's
    agent Service (port 443, the Service's), and a CA file in a directory the webhook container mounts."""
    objects = render({**values, **AGENT}, name=release)
    fullname = _of_kind(objects, "Deployment")["metadata"]["name"]
    settings = _server_settings(objects, fullname).image_puller
    assert settings.mode == "agent"
    assert settings.agent.address == f"{agent}.flyte.svc:443"
    service = objects[f"Service/{agent}"]
    host, port = settings.agent.address.rsplit(":", 1)
    assert host == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    assert len(agent) <= 63
    assert settings.agent.ca_file == "/tls/ca.crt"
    webhook = _of_kind(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "/tls" in {m["mountPath"] for m in webhook["volumeMounts"]}
    # the agent's own keys as given, the others at their defaults
    given = {"address": "pullers.infra.svc:8443", "caFile": "/etc/ca/bundle.pem", "tokenSeconds": 3600}
    own = _server_settings(render({"imagePuller": {"mode": "agent", "agent": given}})).image_puller.agent
    assert (own.address, own.ca_file, own.token_seconds) == ("pullers.infra.svc:8443", "/etc/ca/bundle.pem", 3600)
    assert (own.audience, own.connect_timeout_seconds, own.run_as_user) == ("copilot-webhook-agent", 10, 65532)


def _handshake(names: list[str], host: str, tmp_path: Path) -> str | None:
    """None when a client that trusts the CA alone verifies `host` against a certificate issued for `names`;
    otherwise why not."""
    ca = generate_ca()
    serving = issue_serving(ca, names)
    (tmp_path / "tls.crt").write_bytes(serving.cert_pem)
    (tmp_path / "tls.key").write_bytes(serving.key_pem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def accept() -> None:
        try:
            connection, _ = listener.accept()
            with context.wrap_socket(connection, server_side=True):
                pass
        except (OSError, ssl.SSLError):
            pass
        finally:
            done.set()

    threading.Thread(target=accept, daemon=True).start()
    try:
        return handshake_verifies(listener.getsockname(), host, ca.cert_pem)
    finally:
        done.wait(10)
        listener.close()


def test_self_signed_mode_issues_a_certificate_the_agent_s_clients_verify(tmp_path: Path) -> None:
    """The agent serves the webhook's certificate: `certs ensure` and `serve`, parsed by the server's own
    command line, are given the agent Service's names, and a certificate for what they cover verifies the
    host the client dials."""
    objects = render(AGENT)
    pod = objects["Deployment/cw-copilot-webhook"]["spec"]["template"]["spec"]
    agent_names = ["cw-copilot-webhook-agent.flyte.svc", "cw-copilot-webhook-agent.flyte.svc.cluster.local"]
    ensure = _parser().parse_args(pod["initContainers"][0]["args"])
    serve = _parser().parse_args(pod["containers"][0]["args"])
    assert ensure.dns == serve.certs_dns == agent_names
    manager = CertificateManager(
        client.ApiClient(),
        ensure.secret,
        ensure.namespace,
        webhook_config=ensure.webhook_config,
        service=ensure.service,
        days=ensure.days,
        dns=ensure.dns,
    )
    assert set(service_dns_names("cw-copilot-webhook", "flyte")) | set(agent_names) == set(manager.names)
    host = _server_settings(objects).image_puller.agent.address.rsplit(":", 1)[0]
    assert _handshake(manager.names, host, tmp_path) is None
    assert _handshake(service_dns_names("cw-copilot-webhook", "flyte"), host, tmp_path) is not None, (
        "without the agent's names the client refuses it"
    )


def test_cert_manager_mode_issues_a_certificate_for_the_agent_s_service_too() -> None:
    objects = render(VARIANTS["agent-cert-manager"])
    names = objects["Certificate/cw-copilot-webhook"]["spec"]["dnsNames"]
    assert names == [
        *service_dns_names("cw-copilot-webhook", "flyte"),
        "cw-copilot-webhook-agent.flyte.svc",
        "cw-copilot-webhook-agent.flyte.svc.cluster.local",
    ]
    settings = _server_settings(objects).image_puller.agent
    assert settings.address.rsplit(":", 1)[0] in names
    # cert-manager's Secret holds ca.crt beside the pair: the webhook mounts all of it where caFile points
    webhook = objects["Deployment/cw-copilot-webhook"]["spec"]["template"]["spec"]
    tls = next(v for v in webhook["volumes"] if v["name"] == "tls")
    assert tls["secret"] == {"secretName": "cw-copilot-webhook-tls"}
    assert settings.ca_file == "/tls/ca.crt"
    agent = objects["DaemonSet/cw-copilot-webhook-agent"]["spec"]["template"]["spec"]
    served = next(v for v in agent["volumes"] if v["name"] == "tls")
    assert served["secret"]["secretName"] == tls["secret"]["secretName"]


def test_the_notes_say_the_agent_needs_a_namespace_that_admits_hostpath() -> None:
    text = notes(AGENT)
    assert "pod-security.kubernetes.io/enforce=privileged" in text
    assert "hostPath" in text
    assert "rollout status daemonset/cw-copilot-webhook-agent" in text
    (command,) = re.findall(r"kubectl -n flyte get pods -o wide -l (\S+)", text)
    selector = dict(pair.split("=", 1) for pair in command.split(","))
    assert _selects({"matchLabels": selector}, _agent_labels(render(AGENT)))
    assert not _selects({"matchLabels": selector}, _pod_labels(render(AGENT)))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"imagePuller": {"mode": "daemon"}}, "/imagePuller/mode"),
        ({"imagePuller": {"agent": {"address": "agent.svc"}}}, "/imagePuller/agent/address"),
        ({"imagePuller": {"agent": {"tokenSeconds": 60}}}, "at '/imagePuller/agent/tokenSeconds': minimum"),
        ({"imagePuller": {"agent": {"runAsUser": 0}}}, "at '/imagePuller/agent/runAsUser': minimum"),
        ({"imagePuller": {"agent": {"port": 8444}}}, "additional properties 'port' not allowed"),
        ({"nodeAgent": {"socketDirectory": "run"}}, "/nodeAgent/socketDirectory"),
        ({"nodeAgent": {"podLabels": {"app.kubernetes.io/name": "x"}}}, "'app.kubernetes.io/name'"),
        ({"nodeAgent": {"podLabels": {"app.kubernetes.io/component": "x"}}}, "'app.kubernetes.io/component'"),
        ({"nodeAgent": {"updateStrategy": {"maxUnavailable": 0}}}, "/nodeAgent/updateStrategy/maxUnavailable"),
        ({"nodeAgent": {"hostNetwork": True}}, "additional properties 'hostNetwork' not allowed"),
    ],
)
def test_bad_agent_values_fail_through_the_schema(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        render(values)


@pytest.mark.parametrize("dropped", [{"nodeAgent": None}, {"imagePuller": {"mode": "agent", "agent": None}}])
def test_agent_mode_with_the_values_of_an_older_chart_is_refused_by_name(dropped: dict[str, Any]) -> None:
    """`helm upgrade --reuse-values --set imagePuller.mode=agent` of a release an older chart installed renders
    with that chart's values, which lack the agent's keys (null deletes them here alike)."""
    with pytest.raises(helm.HelmRenderError, match=re.escape("upgrade with --reset-then-reuse-values")):
        render({"imagePuller": {"mode": "agent"}, **dropped})
    assert "DaemonSet/cw-copilot-webhook-agent" not in render({"nodeAgent": None}), "socket mode needs none"


def test_the_agent_pulls_the_pod_network_registries_as_the_socket_puller_does() -> None:
    """imagePuller.registries reach the agent's command line, read by the agent's own parser, with each CA
    in the variable its flag names."""
    from webhook.pull.agent import _parser

    ca = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    registries = {"registry.team.svc:5000": {"ca": ca}, "cache.team.svc": {"plainHttp": True, "skipVerify": True}}
    objects = render({"imagePuller": {"mode": "agent", "registries": registries}})
    container = objects["DaemonSet/cw-copilot-webhook-agent"]["spec"]["template"]["spec"]["containers"][0]
    args = _parser().parse_args(container["args"])
    assert sorted(args.pod_network_registry) == ["cache.team.svc", "registry.team.svc:5000"]
    assert args.registry_plain_http == ["cache.team.svc"]
    assert args.registry_skip_verify == ["cache.team.svc"]
    host, _, variable = args.registry_ca[0].partition("=")
    assert host == "registry.team.svc:5000"
    assert {e["name"]: e.get("value") for e in container["env"]}[variable] == ca


def test_the_serving_certificate_paths_are_absolute_and_the_same_everywhere() -> None:
    """The server's default certificate paths are where the chart mounts its Secret and what the image runs,
    never a path relative to wherever the process happens to start."""
    server = Settings().server
    config = yaml.safe_load(render()["ConfigMap/cw-copilot-webhook"]["data"]["config.yaml"])["server"]
    assert (config["tlsCert"], config["tlsKey"]) == (server.tls_cert, server.tls_key)
    assert all(Path(p).is_absolute() for p in (server.tls_cert, server.tls_key))
    dockerfile = (CHART.parents[2] / "Dockerfile").read_text()
    assert f'"--tls-cert", "{server.tls_cert}", "--tls-key", "{server.tls_key}"' in dockerfile
