"""What the webhook emits in the puller's agent mode (spec 1.3a), in process: a client Pod Security
`restricted` admits at every level, with no runtime guessed and no hostPath; and what it does without a
CA bundle to verify the agent. The API server's own verdict on these pods is tests/test_kube_agent.py's."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from certs.authority import generate_ca
from tests.helpers import apply, reasons
from webhook.config import build_settings
from webhook.mutation.facts import Facts, NodeFacts, RequestFacts, cluster_facts
from webhook.mutation.plan import PULLER, Plan, plan
from webhook.mutation.puller import AGENT_CA_ENV, PULLER_NAME, SECRETS_VOLUME, TOKEN_VOLUME

FLYTE_115 = Path(__file__).parent / "golden" / "pods" / "flyte-1.15.yaml"
# Pod Security `restricted`, as the chart's default runAsUser gives it to the client
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "privileged": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _pod() -> dict[str, Any]:
    pod: dict[str, Any] = yaml.safe_load(FLYTE_115.read_text())
    pod["spec"]["imagePullSecrets"] = [{"name": "team-registry"}]
    return pod


def _settings(tmp_path: Path, **agent: Any) -> Any:
    ca = tmp_path / "ca.crt"
    if not ca.exists():
        ca.write_bytes(generate_ca("agent CA").cert_pem)
    config = {"mode": "agent", "agent": {"caFile": str(ca), "address": "cw-agent.cw.svc:443"} | agent}
    return build_settings({"ptrace": {"mode": "drop"}, "imagePuller": config})


def _plan(pod: dict[str, Any], settings: Any, labels: dict[str, str] | None = None, **nodes: str) -> Plan:
    facts = {name: NodeFacts(flavour, None, None, {}) for name, flavour in nodes.items()}
    cluster = cluster_facts(labels or {}, facts or None)
    return plan(pod, Facts(RequestFacts("ns"), cluster), settings, kinds=(PULLER,))


def _mutated(pod: dict[str, Any], settings: Any) -> dict[str, Any]:
    """The pod with the puller's plan applied, as the API server would store it."""
    return apply(pod, [dict(c.op) for c in _plan(pod, settings).changes])


def _client(mutated: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = mutated["spec"]["initContainers"][0]
    assert container["name"] == PULLER_NAME
    return container


def test_the_client_is_restricted_and_holds_no_socket(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    out = _plan(_pod(), settings, {"pod-security.kubernetes.io/enforce": "restricted"})
    mutated = apply(_pod(), [dict(c.op) for c in out.changes])
    client = _client(mutated)
    assert client["securityContext"] == RESTRICTED
    volumes = {v["name"]: v for v in mutated["spec"]["volumes"]}
    assert not [v for v in volumes.values() if "hostPath" in v], "no hostPath anywhere in the pod"
    assert volumes[TOKEN_VOLUME]["projected"]["sources"] == [
        {"serviceAccountToken": {"audience": "copilot-webhook-agent", "expirationSeconds": 600, "path": "token"}}
    ]
    secrets = volumes["copilot-webhook-pull-secrets"]["projected"]
    assert secrets["defaultMode"] == 0o444, "the client is not root: it must read the pull secrets"
    assert client["args"][:4] == [
        "--agent=https://cw-agent.cw.svc:443",
        f"--agent-ca-env={AGENT_CA_ENV}",
        "--token=/var/run/copilot-webhook/agent-token/token",
        "--connect-timeout=10",
    ]
    assert "--pull-secrets=/var/run/copilot-webhook/pull-secrets" in client["args"]
    assert client["env"] == [{"name": AGENT_CA_ENV, "value": (tmp_path / "ca.crt").read_text()}]
    assert client["image"] not in client["args"], "its own image is never pre-pulled"
    assert out.audit[PULLER] == "agent:cw-agent.cw.svc:443"


def test_no_runtime_is_guessed_and_disagreeing_nodes_need_no_pin(tmp_path: Path) -> None:
    pod = _pod()
    pod["spec"].pop("nodeName", None)
    out = _plan(pod, _settings(tmp_path), a="docker", b="containerd")
    ops = [dict(c.op) for c in out.changes]
    assert ops, out.warnings
    assert not [op for op in ops if "affinity" in str(op["path"])], "the node's agent knows its runtime: no pin"
    assert not [w for w in out.warnings if "pinned" in w or "disagree" in w], out.warnings


def test_without_a_ca_bundle_there_is_no_puller_and_the_pod_is_told_why(tmp_path: Path) -> None:
    settings = _settings(tmp_path, caFile=str(tmp_path / "absent.crt"))
    out = _plan(_pod(), settings)
    assert out.changes == []
    assert out.outcomes[PULLER].reason == "agent-untrusted"
    assert any("no CA bundle to verify the node agent" in w and "absent.crt" in w for w in out.warnings), out.warnings


def test_a_rotated_ca_bundle_reaches_the_next_pod(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    first = _client(_mutated(_pod(), settings))
    rotated = generate_ca("the next agent CA").cert_pem
    (tmp_path / "ca.crt").write_bytes(rotated)
    second = _client(_mutated(_pod(), settings))
    assert first["env"] != second["env"]
    assert second["env"][0]["value"] == rotated.decode()


def test_the_webhook_leaves_its_own_output_alone(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    once = _mutated(_pod(), settings)
    again = _plan(copy.deepcopy(once), settings)
    assert again.changes == [], "the API server may reinvoke the webhook on its own output"
    assert again.outcomes[PULLER].reason == "already-injected"


def test_the_client_container_is_exactly_the_restricted_agent_client(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    client = _client(_mutated(_pod(), settings))
    assert client == {
        "name": PULLER_NAME,
        "image": "ghcr.io/copilot-webhook/image-puller:0.1.0",
        "imagePullPolicy": "IfNotPresent",
        "command": ["copilot-webhook-pull"],
        "args": [
            "--agent=https://cw-agent.cw.svc:443",
            f"--agent-ca-env={AGENT_CA_ENV}",
            "--token=/var/run/copilot-webhook/agent-token/token",
            "--connect-timeout=10",
            "--pull-secrets=/var/run/copilot-webhook/pull-secrets",
            "--timeout=300",
            "--failure-policy=Ignore",
            "--",
            "cr.flyte.org/flyteorg/flytecopilot:v1.15.0",
            "ghcr.io/flyteorg/rawcontainers-shell:v2",
        ],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"cpu": "500m", "memory": "128Mi"}},
        "securityContext": RESTRICTED,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "env": [{"name": AGENT_CA_ENV, "value": (tmp_path / "ca.crt").read_text()}],
        "volumeMounts": [
            {"name": TOKEN_VOLUME, "mountPath": "/var/run/copilot-webhook/agent-token", "readOnly": True},
            {"name": SECRETS_VOLUME, "mountPath": "/var/run/copilot-webhook/pull-secrets", "readOnly": True},
        ],
    }


def test_the_client_mounts_its_token_and_pull_secrets_read_only_where_its_args_say(tmp_path: Path) -> None:
    # Every mount names a volume of the pod, and each path the client reads lies under one of its mounts.
    mutated = _mutated(_pod(), _settings(tmp_path))
    client = _client(mutated)
    volumes = {v["name"] for v in mutated["spec"]["volumes"]}
    mounts = {m["name"]: m for m in client["volumeMounts"]}
    assert set(mounts) == {TOKEN_VOLUME, SECRETS_VOLUME} <= volumes
    assert all(m["readOnly"] is True for m in mounts.values()), mounts
    args = dict(a.split("=", 1) for a in client["args"] if a.startswith(("--token=", "--pull-secrets=")))
    assert args["--token"] == mounts[TOKEN_VOLUME]["mountPath"] + "/token"
    assert args["--pull-secrets"] == mounts[SECRETS_VOLUME]["mountPath"]


def test_a_pod_without_pull_secrets_mounts_the_token_alone(tmp_path: Path) -> None:
    pod = _pod()
    del pod["spec"]["imagePullSecrets"]
    client = _client(_mutated(pod, _settings(tmp_path)))
    assert client["volumeMounts"] == [
        {"name": TOKEN_VOLUME, "mountPath": "/var/run/copilot-webhook/agent-token", "readOnly": True}
    ]
    assert not [a for a in client["args"] if a.startswith("--pull-secrets")], client["args"]


def test_preview_gives_each_agent_mode_operation_its_reason(tmp_path: Path) -> None:
    out = _plan(_pod(), _settings(tmp_path))
    assert reasons(out)[:-1] == [
        ("/spec/initContainers/0", "ask the node agent to pull 2 image(s) before the other containers start"),
        ("/spec/volumes/-", "a token of audience copilot-webhook-agent for the puller only"),
        ("/spec/volumes/-", "the pod's image pull secrets, for the puller only"),
    ]


def test_a_pod_with_nothing_to_pre_pull_is_skipped_as_no_images(tmp_path: Path) -> None:
    # The kubelet pulls an `Always` image whatever is present: pre-pulling it gains nothing.
    pod = _pod()
    for field in ("initContainers", "containers"):
        for container in pod["spec"][field]:
            container["imagePullPolicy"] = "Always"
    out = _plan(pod, _settings(tmp_path))
    assert out.changes == []
    assert out.outcomes[PULLER].reason == "no-images"
    assert out.audit[PULLER] == "skipped(no-images)"


def test_without_a_ca_file_set_the_warning_says_none_is_set() -> None:
    settings = build_settings({"ptrace": {"mode": "drop"}, "imagePuller": {"mode": "agent"}})
    out = _plan(_pod(), settings)
    assert out.changes == []
    assert out.outcomes[PULLER].reason == "agent-untrusted"
    assert out.warnings == ["no image puller: no CA bundle to verify the node agent (caFile: none set)"]


def test_a_pod_volume_named_like_the_agent_token_is_a_clash_named_in_the_answer(tmp_path: Path) -> None:
    pod = _pod()
    pod["spec"]["volumes"].append({"name": TOKEN_VOLUME, "emptyDir": {}})
    out = _plan(pod, _settings(tmp_path))
    assert out.changes == []
    assert out.outcomes[PULLER].reason == "undecided"
    assert out.undecided == f"the name {TOKEN_VOLUME} is already used by the pod"
