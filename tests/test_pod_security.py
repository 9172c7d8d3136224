"""The Pod Security level in force, decided as the API server's PodSecurity admission decides it: exempt
namespaces and runtime classes, then the namespace's label (an invalid value is restricted), then the
cluster's default, which also covers a namespace the cache has not seen. The real API server's verdicts
on the pods that follow from it are in tests/test_kube_pod_security.py."""

from __future__ import annotations

from typing import Any

import pytest

from webhook.config import build_settings
from webhook.errors import ConfigError
from webhook.mutation.facts import Facts, RequestFacts, cluster_facts
from webhook.mutation.plan import plan
from webhook.mutation.pod import read_pod
from webhook.mutation.podsecurity import level_in_force
from webhook.mutation.runtime import node_facts

LABEL = "pod-security.kubernetes.io/enforce"
UPLOADER = {"name": "flyte-copilot-uploader", "image": "cr.flyte.org/flyteorg/flytecopilot:v1.15.2"}
PRIMARY = {"name": "main", "image": "python", "volumeMounts": [{"name": "flyte-outputs", "mountPath": "/out"}]}


def _pod(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ml"}, "spec": {"containers": [PRIMARY, UPLOADER], **spec}}


def _level(
    labels: dict[str, str] | None,
    *,
    namespace: str = "ml",
    pod: dict[str, Any] | None = None,
    security: dict[str, Any] | None = None,
) -> tuple[str, str]:
    settings = build_settings({"podSecurity": security or {}})
    facts = Facts(RequestFacts(namespace), cluster_facts(labels))
    found = level_in_force(read_pod(pod or _pod()), facts, settings.pod_security)
    return found.name, found.source


@pytest.mark.parametrize(
    ("labels", "default", "expected"),
    [
        ({LABEL: "baseline"}, "privileged", ("baseline", "namespace label")),
        ({LABEL: "privileged"}, "restricted", ("privileged", "namespace label")),
        ({"team": "ml"}, "baseline", ("baseline", "cluster default")),
        ({}, "restricted", ("restricted", "cluster default")),
        # a namespace the cache has not seen, or no cluster access: the cluster's default, never unrestricted
        (None, "baseline", ("baseline", "cluster default")),
        (None, "privileged", ("privileged", "cluster default")),
        # k8s.io/pod-security-admission ParseLevel: anything but the three levels, spelt exactly, is restricted
        ({LABEL: "Privileged"}, "privileged", ("restricted", "namespace label")),
        ({LABEL: ""}, "privileged", ("restricted", "namespace label")),
        ({LABEL: "none"}, "privileged", ("restricted", "namespace label")),
    ],
)
def test_label_then_cluster_default(labels: dict[str, str] | None, default: str, expected: tuple[str, str]) -> None:
    assert _level(labels, security={"defaults": {"enforce": default}}) == expected


def test_exempt_namespace_overrides_its_label() -> None:
    exempt = {"defaults": {"enforce": "restricted"}, "exemptions": {"namespaces": ["ml"]}}
    assert _level({LABEL: "restricted"}, security=exempt) == ("privileged", "exempt namespace")
    assert _level({LABEL: "restricted"}, namespace="other", security=exempt) == ("restricted", "namespace label")


def test_exempt_runtime_class_is_read_from_the_pod() -> None:
    exempt = {"defaults": {"enforce": "baseline"}, "exemptions": {"runtimeClasses": ["gvisor"]}}
    gvisor, kata, listed = (_pod(runtimeClassName=name) for name in ("gvisor", "kata", ["gvisor"]))
    assert _level(None, pod=gvisor, security=exempt) == ("privileged", "exempt runtime class")
    assert _level(None, pod=kata, security=exempt) == ("baseline", "cluster default")
    assert _level(None, pod=listed, security=exempt) == ("baseline", "cluster default")


def test_a_baseline_default_leaves_out_the_puller_and_the_added_capability() -> None:
    settings = build_settings({"podSecurity": {"defaults": {"enforce": "baseline"}}})
    nodes = {"n1": node_facts("containerd://1.7.11", {}, {})}
    decided = plan(_pod(), Facts(RequestFacts("ml"), cluster_facts(None, nodes)), settings)
    assert decided.changes == []
    assert decided.audit == {"ptrace": "add:skipped(pod-security=baseline)", "image-puller": "skipped(pod-security)"}
    assert all("(cluster default)" in warning for warning in decided.warnings), decided.warnings
    privileged = plan(_pod(), Facts(RequestFacts("ml"), cluster_facts({LABEL: "privileged"}, nodes)), settings)
    assert privileged.audit["image-puller"] == "containerd:/run/containerd/containerd.sock"


def test_drop_still_applies_under_any_level() -> None:
    pod = _pod()
    pod["spec"]["containers"][0] = {**PRIMARY, "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}}
    settings = build_settings({"ptrace": {"mode": "drop"}, "podSecurity": {"defaults": {"enforce": "restricted"}}})
    decided = plan(pod, Facts(RequestFacts("ml"), cluster_facts(None)), settings)
    assert decided.audit["ptrace"] == "drop"
    assert [change.op["op"] for change in decided.changes if "capabilities" in change.op["path"]] == ["remove"]


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"defaults": {"enforce": "strict"}}, "podSecurity.defaults.enforce: 'strict' is not allowed"),
        ({"defaults": {"enforce-version": "latest"}}, "podSecurity.defaults.enforce-version: unknown key"),
        ({"exemptions": {"usernames": ["x"]}}, "podSecurity.exemptions.usernames: unknown key"),
    ],
)
def test_bad_configuration_is_named(document: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_settings({"podSecurity": document})
