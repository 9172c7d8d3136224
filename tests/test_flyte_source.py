"""Pods as Flyte's own Go code builds them (tests/flyte_source.py), release line by line, through every way
a user reaches the webhook: /mutate, /mutate/ptrace and `copilot-webhook preview`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import flyte_source
from tests.asgi import post_json
from tests.support import GOLDEN, apply, decoded_patch, review, validate
from webhook.config import build_settings
from webhook.mutation.copilot import is_ptrace
from webhook.mutation.facts import Facts, RequestFacts
from webhook.mutation.plan import plan
from webhook.server import WebhookApp

CASES = flyte_source.cases()
APP = WebhookApp(build_settings({}))


def _ptrace_holders(pod: dict[str, Any]) -> set[str]:
    holders = set()
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for c in pod["spec"].get(key, []):
            caps = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
            if any(is_ptrace(name) for name in caps):
                holders.add(c["name"])
    return holders


def test_the_committed_cases_are_what_the_derivation_builds() -> None:
    for case, (pod, header) in CASES.items():
        path = GOLDEN / f"{case}.yaml"
        assert path.read_text() == flyte_source.render(pod, header), f"{path.name}: run python -m tests.flyte_source"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("path", ["/mutate", "/mutate/ptrace"])
def test_every_flyte_pod_through_the_server(case: str, path: str) -> None:
    pod = CASES[case][0]
    res = post_json(APP, path, review(pod))
    assert res.status_code == 200
    answer = res.json()["response"]
    assert answer["allowed"] is True
    assert not any("cannot decide" in w for w in answer.get("warnings", [])), answer
    mutated = apply(pod, decoded_patch(answer))
    validate(mutated)
    again = post_json(APP, path, review(mutated)).json()["response"]
    assert decoded_patch(again) == [], "re-running on our own output changes nothing"
    gained = _ptrace_holders(mutated) - _ptrace_holders(pod)
    assert not gained, f"the default configuration grants SYS_PTRACE Flyte did not give: {gained}"


def test_what_flyte_granted_is_kept_by_add_and_removed_by_drop() -> None:
    """add never re-grants what 1.16 and 2.0 removed; drop removes every grant of every line."""
    drop = build_settings({"ptrace": {"mode": "drop"}})
    for case, (pod, _header) in CASES.items():
        facts = Facts(RequestFacts("flytesnacks-development"))
        added = apply(pod, [c.op for c in plan(pod, facts, build_settings({})).changes])
        dropped = apply(pod, [c.op for c in plan(pod, facts, drop).changes])
        assert _ptrace_holders(added) == _ptrace_holders(pod), case
        assert _ptrace_holders(dropped) == set(), case
        line = flyte_source.LINES[case.removeprefix("flyte-src-").split("-")[0]]
        assert bool(_ptrace_holders(pod)) == line.ptrace, f"{case}: Flyte {line.tag} grants SYS_PTRACE: {line.ptrace}"


def test_the_preview_command_answers_every_flyte_pod(tmp_path: Path) -> None:
    names = sorted(CASES)
    path = tmp_path / "pods.yaml"
    path.write_text("---\n".join(yaml.safe_dump(CASES[name][0]) for name in names))
    done = subprocess.run(
        [sys.executable, "-m", "webhook", "preview", "-f", str(path)], capture_output=True, timeout=120, check=True
    )
    entries = orjson.loads(done.stdout)
    assert [e["name"] for e in entries] == [CASES[n][0]["metadata"]["name"] for n in names]
    for name, entry in zip(names, entries, strict=True):
        pod = CASES[name][0]
        assert entry["object"] == apply(pod, entry["patch"])
        validate(entry["object"])
        assert not _ptrace_holders(entry["object"]) - _ptrace_holders(pod), name


@pytest.mark.parametrize("line", ["1.15", "1.16.8"])
def test_flytes_secrets_webhook_running_after_ours_changes_nothing_we_would_redo(line: str) -> None:
    pod = flyte_source.flyte_pod(line, flyte_source.Task())
    ours = apply(pod, decoded_patch(post_json(APP, "/mutate", review(pod)).json()["response"]))
    flyte_source._inject_secrets(ours)  # the API server reinvokes us after the secrets webhook
    again = post_json(APP, "/mutate", review(ours)).json()["response"]
    assert decoded_patch(again) == []


def test_sidecar_target_moves_the_capability_to_the_watcher_alone() -> None:
    cfg = build_settings({"ptrace": {"target": "sidecar"}})
    for line in ("1.10", "1.13", "1.14", "1.15"):
        pod = flyte_source.flyte_pod(line, flyte_source.Task(extra_container=True))
        mutated = apply(pod, [c.op for c in plan(pod, Facts(RequestFacts("ns")), cfg).changes])
        watcher = "flyte-copilot-" + flyte_source.LINES[line].sidecar_name
        assert _ptrace_holders(mutated) == {watcher}, line
        assert mutated["spec"]["shareProcessNamespace"] is True


def test_flyte_2_default_image_is_a_copilot_without_configuration() -> None:
    pod = flyte_source.flyte_pod("2.0", flyte_source.Task())
    answer = post_json(APP, "/mutate/ptrace", review(pod)).json()["response"]
    assert answer["auditAnnotations"]["ptrace"] == "add:none(native-sidecar)"
    lookalike = flyte_source.flyte_pod("2.0", flyte_source.Task())
    for c in lookalike["spec"]["initContainers"]:
        c["command"] = ["/bin/sh"]
        c["image"] = "docker.io/someone/flyte-binary-v2-fork:latest"
    assert "auditAnnotations" not in post_json(APP, "/mutate/ptrace", review(lookalike)).json()["response"]


tasks = st.builds(
    flyte_source.Task,
    inputs=st.booleans(),
    outputs=st.booleans(),
    extra_container=st.booleans(),
    default_template=st.booleans(),
    primary_init_template=st.booleans(),
    secrets=st.sampled_from(["none", "before"]),
)
owned = st.sampled_from(["owner", "labels", "copilot-only"])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(line=st.sampled_from(sorted(flyte_source.LINES)), task=tasks, ownership=owned)
def test_drop_leaves_no_sys_ptrace_and_add_grants_only_to_legacy_watchers(
    line: str, task: flyte_source.Task, ownership: str
) -> None:
    pod = flyte_source.flyte_pod(line, task)
    if ownership != "owner":
        del pod["metadata"]["ownerReferences"]
    if ownership == "copilot-only":
        pod["metadata"]["labels"] = {}
    facts = Facts(RequestFacts("flytesnacks-development"))
    copilot_pod = task.inputs or task.outputs
    dropped = apply(pod, [c.op for c in plan(pod, facts, build_settings({"ptrace": {"mode": "drop"}})).changes])
    if copilot_pod or ownership != "copilot-only":
        assert _ptrace_holders(dropped) == set()
    for target in ("primary", "sidecar", "all"):
        decided = plan(pod, facts, build_settings({"ptrace": {"target": target}}))
        assert decided.undecided is None
        added = apply(pod, [c.op for c in decided.changes])
        legacy_watcher = task.outputs and not flyte_source.LINES[line].native_sidecar
        if not legacy_watcher:
            assert _ptrace_holders(added) <= _ptrace_holders(pod), "no grant without a legacy watcher"
        validate(added)
