"""Unit rules of copilot detection and the SYS_PTRACE policy; the golden cases show whole pods."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from webhook.config import CopilotSettings, build_settings
from webhook.mutation.copilot import copilot_role, find_copilot, is_ptrace
from webhook.mutation.errors import PodShapeError
from webhook.mutation.facts import Facts, RequestFacts, cluster_facts
from webhook.mutation.plan import PTRACE, Plan, plan
from webhook.mutation.pod import read_pod
from webhook.mutation.pointer import Operation

FLYTE_IMAGE = "cr.flyte.org/flyteorg/flytecopilot:v1.15.0"


def _pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = (), **annotations: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = list(init)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "annotations": annotations}, "spec": spec}


def _role(container: dict[str, Any], settings: CopilotSettings | None = None) -> str | None:
    view = read_pod(_pod(container))
    return copilot_role(view.containers[0], settings or CopilotSettings())


@pytest.mark.parametrize(
    ("container", "role"),
    [
        ({"name": "flyte-copilot-uploader", "image": FLYTE_IMAGE}, "uploader"),
        ({"name": "flyte-copilot-sidecar", "image": "x", "command": ["/bin/flyte-copilot"]}, "sidecar"),
        ({"name": "flyte-copilot-downloader", "image": "ghcr.io/flyteorg/flytecopilot@sha256:abc"}, "downloader"),
        ({"name": "flyte-copilot-uploader", "image": "busybox"}, None),  # the name alone never qualifies
        ({"name": "flyte-copilot-uploader", "image": "busybox", "command": ["/bin/sh"]}, None),
        ({"name": "flyte-copilot-helper", "image": FLYTE_IMAGE}, None),  # not a copilot role
        ({"name": "my-flyte-copilot-uploader", "image": FLYTE_IMAGE}, None),
        ({"name": "flyte-copilot-uploader", "image": "evil.io/flyteorg/flytecopilot-x:1"}, None),
        ({"name": "flyte-copilot-uploader", "image": "x", "command": []}, None),
        ({"name": "flyte-copilot-uploader", "image": "x", "command": "/bin/flyte-copilot"}, None),
    ],
)
def test_copilot_role(container: dict[str, Any], role: str | None) -> None:
    assert _role(container) == role


def test_detection_follows_configuration() -> None:
    settings = CopilotSettings(name_prefix="acme-", commands=(), image_patterns=("registry.acme/*",))
    assert _role({"name": "acme-uploader", "image": "registry.acme/copilot:1"}, settings) == "uploader"
    assert _role({"name": "flyte-copilot-uploader", "image": FLYTE_IMAGE}, settings) is None


def test_ephemeral_containers_are_never_copilots() -> None:
    pod = _pod({"name": "main", "image": "x"})
    pod["spec"]["ephemeralContainers"] = [{"name": "flyte-copilot-uploader", "image": FLYTE_IMAGE}]
    assert find_copilot(read_pod(pod), CopilotSettings()) is None


@pytest.mark.parametrize("name", ["SYS_PTRACE", "sys_ptrace", "CAP_SYS_PTRACE", "cap_Sys_Ptrace"])
def test_capability_spellings_the_kubelet_treats_alike(name: str) -> None:
    assert is_ptrace(name)


@pytest.mark.parametrize("name", ["SYS_ADMIN", "PTRACE", "CAP_CAP_SYS_PTRACE", "ALL", ""])
def test_other_capabilities(name: str) -> None:
    assert not is_ptrace(name)


def _decide(pod: dict[str, Any], labels: dict[str, str] | None = None, **settings: Any) -> Plan:
    return plan(pod, Facts(RequestFacts("ns"), cluster_facts(labels)), build_settings(settings), kinds=(PTRACE,))


def _ops(decided: Plan) -> list[Operation]:
    return [c.op for c in decided.changes]


OUTPUTS = {"name": "flyte-outputs", "mountPath": "/var/flyte/outputs"}
UPLOADER = {
    "name": "flyte-copilot-uploader",
    "image": FLYTE_IMAGE,
    "args": ["sidecar", "--from-local-dir", "/var/flyte/outputs"],
    "volumeMounts": [OUTPUTS],
}
LEGACY = (
    {
        "name": "main",
        "image": "python",
        "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}},
        "volumeMounts": [OUTPUTS],
    },
    UPLOADER,
)


@pytest.mark.parametrize(
    ("cluster", "wanted", "allow", "applied", "refused"),
    [
        ("add", "drop", False, "drop", False),
        ("add", "keep", False, "keep", False),
        ("keep", "drop", False, "drop", False),
        ("keep", "add", False, "keep", True),
        ("drop", "keep", False, "drop", True),
        ("drop", "add", False, "drop", True),
        ("drop", "add", True, "add:primary", False),
        ("drop", "keep", True, "keep", False),
    ],
)
def test_pod_override_never_escalates_unless_allowed(
    cluster: str, wanted: str, allow: bool, applied: str, refused: bool
) -> None:
    pod = _pod(*LEGACY)
    pod["metadata"]["annotations"] = {"copilot-webhook.io/ptrace": wanted}
    result = _decide(pod, ptrace={"mode": cluster, "allowPodOverride": allow})
    assert result.audit["ptrace"] == applied
    assert any("refused" in w for w in result.warnings) is refused


def test_psa_restricted_namespace_gets_no_ptrace() -> None:
    pod = _pod({"name": "main", "image": "python", "volumeMounts": [OUTPUTS]}, UPLOADER)
    result = _decide(pod, labels={"pod-security.kubernetes.io/enforce": "restricted"})
    assert _ops(result) == []
    assert "restricted" in result.warnings[0]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.update(spec=[]), "pod.spec must be an object, not array"),
        (lambda p: p.update(spec=None), "pod.spec must be an object, not null"),
        # YAML sent to /preview reads `2024-01-01` as a date, a type JSON has no name for
        (lambda p: p.update(spec=datetime.date(2024, 1, 1)), "pod.spec must be an object, not date$"),
        (lambda p: p["spec"].update(containers={}), "pod.spec.containers must be an array, not object"),
        (lambda p: p["spec"].pop("containers"), "pod.spec.containers is required"),
        (lambda p: p["spec"]["containers"].append("x"), r"pod.spec.containers\[2\] must be an object, not string"),
        (lambda p: p["spec"]["containers"][0].pop("name"), r"pod.spec.containers\[0\].name must be a string"),
        (lambda p: p.update(metadata="x"), "pod.metadata must be an object, not string"),
        (lambda p: p["metadata"].update(annotations={"a": 1}), "annotations values must be strings"),
        (lambda p: p["metadata"].update(annotations="a=1"), "pod.metadata.annotations must be an object, not string"),
        (
            lambda p: p["spec"]["containers"][0].update(securityContext={"capabilities": {"add": "SYS_PTRACE"}}),
            r"spec.containers\[0\].securityContext.capabilities.add must be an array of strings",
        ),
        (
            lambda p: p["spec"]["containers"][0].update(securityContext={"capabilities": {"drop": "ALL"}}),
            r"spec.containers\[0\].securityContext.capabilities.drop must be an array of strings",
        ),
        (
            lambda p: p["spec"]["containers"][0].update(securityContext={"capabilities": []}),
            r"spec.containers\[0\].securityContext.capabilities must be an object, not array",
        ),
        (
            lambda p: p["spec"]["containers"][0].update(securityContext="privileged"),
            r"spec.containers\[0\].securityContext must be an object, not string",
        ),
    ],
)
def test_unreadable_pods_are_named(mutate: Any, message: str) -> None:
    pod = _pod(*[dict(c) for c in LEGACY])
    pod["spec"]["containers"][0] = dict(pod["spec"]["containers"][0])
    mutate(pod)
    with pytest.raises(PodShapeError, match=message):
        _decide(pod, ptrace={"target": "all"})


def test_the_primary_is_the_one_regular_container_mounting_the_copilots_data_volume() -> None:
    secret = {"name": "api-token", "mountPath": "/etc/flyte/secrets"}
    main = {"name": "main", "image": "python", "volumeMounts": [OUTPUTS, secret]}
    forwarder = {"name": "log-forwarder", "image": "fluent-bit", "volumeMounts": [secret]}
    uploader = dict(UPLOADER, volumeMounts=[OUTPUTS, secret])
    result = _decide(_pod(main, forwarder, uploader))
    assert [op["path"] for op in _ops(result)][:1] == ["/spec/containers/0/securityContext"]
    assert not any("/containers/1/" in op["path"] for op in _ops(result)), "a shared secret mount is not a data volume"


def test_two_containers_mounting_the_data_volume_are_undecidable_never_both() -> None:
    first = {"name": "a", "image": "python", "volumeMounts": [OUTPUTS]}
    second = {"name": "b", "image": "python", "volumeMounts": [OUTPUTS]}
    result = _decide(_pod(first, second, UPLOADER))
    assert _ops(result) == []
    assert result.undecided is not None
    assert "a, b" in result.undecided


def test_the_annotation_names_the_primary_when_present() -> None:
    pod = _pod({"name": "a", "image": "x"}, {"name": "b", "image": "x"}, UPLOADER, primary_container_name="b")
    result = _decide(pod)
    assert next(op["path"] for op in _ops(result)) == "/spec/containers/1/securityContext"


def test_a_downloader_alone_gets_no_capability() -> None:
    downloader = {
        "name": "flyte-copilot-downloader",
        "image": FLYTE_IMAGE,
        "args": ["download", "--to-local-dir", "/var/flyte/inputs"],
        "volumeMounts": [{"name": "flyte-inputs", "mountPath": "/var/flyte/inputs"}],
    }
    main = {"name": "main", "image": "python", "volumeMounts": [{"name": "flyte-inputs", "mountPath": "/in"}]}
    result = _decide(_pod(main, init=(downloader,)))
    assert _ops(result) == []
    assert result.audit["ptrace"] == "add:none(no-watcher)"


@pytest.mark.parametrize(
    ("metadata", "owned"),
    [
        ({"ownerReferences": [{"apiVersion": "flyte.lyft.com/v1alpha1", "kind": "flyteworkflow", "name": "x"}]}, True),
        ({"ownerReferences": [{"apiVersion": "flyte.lyft.com/v1alpha1", "kind": "FlyteWorkflow", "name": "x"}]}, True),
        ({"ownerReferences": [{"apiVersion": "flyte.org/v1", "kind": "TaskAction", "name": "x"}]}, True),
        ({"labels": {"execution-id": "e", "node-id": "n0"}}, True),
        ({"labels": {"execution-id": "e"}}, False),
        ({"ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "x"}]}, False),
        ({"ownerReferences": "junk"}, False),
        # what the API server would refuse after admission is read as no owner, never a failed review
        ({"ownerReferences": ["flyte.lyft.com/v1alpha1"]}, False),
        ({"ownerReferences": [{"apiVersion": 1, "kind": "FlyteWorkflow", "name": "x"}]}, False),
    ],
)
def test_flyte_owned_pods_get_drop_without_a_copilot(metadata: dict[str, Any], owned: bool) -> None:
    pod = _pod({"name": "main", "image": "python", "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}})
    pod["metadata"].update(metadata)
    dropped = _decide(pod, ptrace={"mode": "drop"})
    assert bool(_ops(dropped)) is owned
    added = _decide(pod)
    assert _ops(added) == [], "add never reaches a pod without a copilot"
    assert "ptrace" not in added.audit
