"""`copilot-webhook audit` against the fake API server (real `kubernetes` client, paged lists), with pods of
every Flyte line as Flyte's source builds them: before and after switching to drop."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.fake_apiserver import FakeAPIServer, namespace
from scripts import flyte_source
from tests.helpers import pod


def _cluster(api: FakeAPIServer) -> dict[str, dict[str, Any]]:
    pods: dict[str, dict[str, Any]] = {}
    for case, (obj, _header) in flyte_source.cases().items():
        obj = copy.deepcopy(obj)
        obj["metadata"]["name"] = case.removeprefix("flyte-src-").replace(".", "-")
        pods[obj["metadata"]["name"]] = obj
    bare = pod("flyte-1.15-bare.yaml")  # a legacy pod another admission step stripped: add would grant
    bare["metadata"]["name"] = "stripped-legacy"
    pods["stripped-legacy"] = bare
    plain = pod("plain.yaml")
    plain["metadata"]["name"], plain["metadata"]["namespace"] = "web", "apps"
    pods["web"] = plain
    opted_out = copy.deepcopy(pods["1-15-io"])
    opted_out["metadata"]["name"], opted_out["metadata"]["namespace"] = "ignored", "legacy-team"
    pods["ignored"] = opted_out
    api.put_many("/api/v1/pods", list(pods.values()))
    api.put_many(
        "/api/v1/namespaces",
        [
            namespace("flytesnacks-development"),
            namespace("apps"),
            namespace("legacy-team", {"copilot-webhook.io/inject": "disabled"}),
        ],
    )
    return pods


def _audit(
    api: FakeAPIServer, tmp_path: Path, *args: str, config: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COPILOT_WEBHOOK_")}
    env["KUBECONFIG"] = str(api.kubeconfig(tmp_path / "kubeconfig"))
    command = [sys.executable, "-m", "webhook", "audit", *args]
    if config is not None:
        (tmp_path / "config.yaml").write_text(config)
        command += ["--config", str(tmp_path / "config.yaml")]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_before_the_switch_only_a_stripped_legacy_pod_would_change(api: FakeAPIServer, tmp_path: Path) -> None:
    pods = _cluster(api)
    done = _audit(api, tmp_path)
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["NAMESPACE", "OWNER", "POD", "HOLDS", "SYS_PTRACE", "POLICY", "WOULD"]
    assert len(lines) == 3, done.stdout
    assert "stripped-legacy" in lines[1]
    assert "the primary container gets SYS_PTRACE" in lines[1]
    assert f"1 of {len(pods)} pod(s) would change (0 holding SYS_PTRACE)" in lines[2]


def test_what_if_drop_lists_every_pod_flyte_gave_sys_ptrace(api: FakeAPIServer, tmp_path: Path) -> None:
    pods = _cluster(api)
    done = _audit(api, tmp_path, "-o", "json", config="ptrace:\n  mode: drop\n")
    assert done.returncode == 3, done.stderr
    report = json.loads(done.stdout)
    assert report["ptrace"] == {"mode": "drop", "target": "primary"}
    assert report["podsSeen"] == len(pods)
    found = {p["pod"]: p for p in report["pods"]}
    flyte = {name for name, obj in pods.items() if obj["metadata"]["namespace"] == "flytesnacks-development"}
    holding = {name for name in flyte if _holds(pods[name])}
    assert set(found) == holding, "drop changes the Flyte pods holding SYS_PTRACE; not opted-out or non-Flyte ones"
    assert _holds(pods["web"]), "a non-Flyte pod holding SYS_PTRACE is not ours to change"
    lines = {"-".join(name.removeprefix("flyte-gen-").split("-")[:2]) for name in found}
    assert lines == {"1-10", "1-13", "1-14", "1-15"}
    none = found["1-15-none"]
    assert none["owner"] == "flyteworkflow/f7a9c2e4b1"
    assert none["holding"] == ["f7a9c2e4b1-n0-0"]
    assert none["decision"] == "drop"
    assert none["changes"] == ["f7a9c2e4b1-n0-0: ptrace.mode drop removes SYS_PTRACE"]


def test_after_the_switch_and_a_restart_of_the_pods_nothing_is_left(api: FakeAPIServer, tmp_path: Path) -> None:
    """The walk-through's last step: the pods recreated under drop hold nothing, so the audit is clean."""
    from tests.helpers import apply
    from webhook.config import build_settings
    from webhook.mutation.facts import Facts, RequestFacts
    from webhook.mutation.plan import plan

    drop = build_settings({"ptrace": {"mode": "drop"}})
    recreated = []
    for case, (obj, _header) in flyte_source.cases().items():
        obj = apply(obj, [c.op for c in plan(obj, Facts(RequestFacts("ns")), drop).changes])
        obj["metadata"]["name"] = case.removeprefix("flyte-src-").replace(".", "-")
        recreated.append(obj)
    api.put_many("/api/v1/pods", recreated)
    api.put_many("/api/v1/namespaces", [namespace("flytesnacks-development")])
    done = _audit(api, tmp_path, config="ptrace:\n  mode: drop\n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == (
        f"ptrace.mode drop, target primary: 0 of {len(recreated)} pod(s) would change (0 holding SYS_PTRACE), "
        "in 0 namespace/owner group(s)"
    )


def test_one_namespace_and_paged_lists(api: FakeAPIServer, tmp_path: Path) -> None:
    _cluster(api)
    done = _audit(api, tmp_path, "-n", "apps")
    assert done.returncode == 0, done.stderr
    assert "0 of 1 pod(s)" in done.stdout
    assert any("/api/v1/namespaces/apps/pods" in r and "limit=500" in r for r in api.requests)


def test_no_cluster_access_is_a_clear_failure(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COPILOT_WEBHOOK_") and k != "KUBECONFIG"}
    env["HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "webhook", "audit"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 1
    assert "no cluster access" in done.stderr
    assert "Traceback" not in done.stderr


def _holds(obj: dict[str, Any]) -> bool:
    from webhook.audit import holding_ptrace

    return bool(holding_ptrace(obj))


@pytest.fixture(autouse=True)
def _no_stray_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COPILOT_WEBHOOK_CONFIG", raising=False)
