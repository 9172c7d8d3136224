"""Flyte's pods (scripts/flyte_source.py): printed by Flyte's own Go code where its module resolves, derived by
hand from its source where it does not, release line by line, through every way a user reaches the
webhook: /mutate, /mutate/ptrace and `copilot-webhook preview`. What Flyte itself granted (SYS_PTRACE, a
shared process namespace, a legacy watcher or a native sidecar) is read from each generated pod."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.gotools import binary
from scripts import flyte_source
from tests.asgi import post_json
from tests.helpers import GOLDEN, apply, decoded_patch, review, validate
from webhook.config import build_settings
from webhook.mutation.copilot import is_ptrace
from webhook.mutation.facts import Facts, RequestFacts
from webhook.mutation.plan import plan
from webhook.web.server import WebhookApp

CASES = flyte_source.cases()
GENERATED = flyte_source.generated()
APP = WebhookApp(build_settings({}))
# The release lines the webhook supports: each comes from Flyte's code, or from our reading of it with the
# reason in docs/architecture.md.
SUPPORTED = ("1.10", "1.13", "1.14", "1.15", "1.16", "2.0")


def _ptrace_holders(pod: dict[str, Any]) -> set[str]:
    holders = set()
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for c in pod["spec"].get(key, []):
            caps = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
            if any(is_ptrace(name) for name in caps):
                holders.add(c["name"])
    return holders


def _shape(pod: dict[str, Any], prefix: str) -> dict[str, Any]:
    """What Flyte built, read from the pod: its copilot containers, its legacy watcher (an uploader or
    sidecar among the regular containers), its native sidecars, who holds SYS_PTRACE."""
    spec = pod["spec"]
    roles = {prefix + role for role in ("downloader", "uploader", "sidecar")}
    watchers = {prefix + "uploader", prefix + "sidecar"}
    init, regular = spec.get("initContainers", []), spec["containers"]
    return {
        "copilot": {c["name"] for c in [*init, *regular] if c["name"] in roles},
        "legacy": {c["name"] for c in regular if c["name"] in watchers},
        "native": {c["name"] for c in init if c["name"] in watchers and c.get("restartPolicy") == "Always"},
        "ptrace": _ptrace_holders(pod),
        "share": bool(spec.get("shareProcessNamespace")),
    }


def _cell_settings(case: str) -> dict[str, Any]:
    return flyte_source.CELL_SETTINGS.get(case.split("-", 3)[3], {}) if case in GENERATED else {}


def test_the_committed_cases_are_what_the_derivation_builds() -> None:
    for case, (pod, header) in flyte_source.derived().items():
        path = GOLDEN / f"{case}.yaml"
        assert path.read_text() == flyte_source.render(pod, header), f"{path.name}: run make flyte-pods"


@pytest.mark.parametrize("release", sorted(flyte_source.GENERATED))
def test_the_committed_pods_are_what_flytes_code_prints(release: str) -> None:
    """A Flyte upgrade (a new pin in tests/flyte/v<release>/go.mod) shows up here as a diff, not silence."""
    printed = flyte_source.printed(binary(flyte_source.GENERATED[release]))
    committed = flyte_source.committed(release)
    assert sorted(printed) == sorted(committed), "cells added or removed: run make flyte-pods"
    differ = [cell for cell in printed if printed[cell] != committed[cell]]
    assert not differ, f"Flyte's code now prints other pods for {differ}: run make flyte-pods and review the diff"


def test_every_generated_pod_has_its_golden_cases() -> None:
    for release in flyte_source.GENERATED:
        cells = flyte_source.committed(release)
        assert cells, f"no committed pods for Flyte {release}: run make flyte-pods"
        for cell in cells:
            for name, context in flyte_source.contexts(release, cell).items():
                path = GOLDEN / f"{name}.context.yaml"
                assert path.exists(), f"{path.name} is missing: run make flyte-pods"
                assert yaml.safe_load(path.read_text()) == context, f"{path.name} is stale: run make flyte-pods"


def test_every_supported_release_is_generated_or_says_why_not() -> None:
    hand = {name.rsplit(".", 1)[0] if name.count(".") == 2 else name for name in flyte_source.LINES}
    missing = [release for release in SUPPORTED if release not in flyte_source.GENERATED and release not in hand]
    assert not missing, f"no pods for Flyte {missing}"
    assert "1.16.8" not in flyte_source.LINES, "1.16's latest patch comes from Flyte's code"


def test_the_webhook_reads_each_generated_pod_as_flyte_built_it() -> None:
    """The expectations come from the pod Flyte's code printed: the audit names a native sidecar, a legacy
    watcher (whose primary gains SYS_PTRACE) or no watcher, and a pod without copilot has no decision."""
    seen = set()
    for case, (pod, _header) in GENERATED.items():
        settings = _cell_settings(case)
        shape = _shape(pod, settings.get("copilot", {}).get("namePrefix", "flyte-copilot-"))
        answer = post_json(WebhookApp(build_settings(settings)), "/mutate/ptrace", review(pod)).json()["response"]
        ptrace = answer.get("auditAnnotations", {}).get("ptrace")
        if not shape["copilot"]:
            expected = None
        elif shape["native"]:
            expected = "add:none(native-sidecar)"
        elif shape["legacy"]:
            expected = "add:primary"
        else:
            expected = "add:none(no-watcher)"
        assert ptrace == expected, (case, shape)
        # Flyte <= 1.15 shares the namespace with every copilot pod, uploader or not; 1.16 with none.
        assert shape["share"] == bool(shape["ptrace"]), f"{case}: Flyte shares the namespace where it grants SYS_PTRACE"
        seen.add(expected)
    assert {None, "add:none(native-sidecar)"} <= seen, "the generated pods include copilot and plain pods"


@pytest.mark.parametrize("variant", sorted(flyte_source.IO))
@pytest.mark.parametrize("release", ["1.14", "1.15"])
def test_flytes_legacy_code_grants_the_shape_the_derivation_has(release: str, variant: str) -> None:
    """flyteplugins v1.14.1 and v1.15.3 put SYS_PTRACE on the primary and share the process namespace in every
    copilot pod, uploader or not; the pod derived by hand from that tag has the same containers and grants."""
    generated = GENERATED[f"flyte-gen-{release}-{variant}"][0]
    derived = CASES[f"flyte-src-{release}-{variant}"][0]
    shapes = []
    for pod in (generated, derived):
        shape = _shape(pod, "flyte-copilot-")
        primary = pod["spec"]["containers"][0]["name"]
        shape["ptrace"] = {"primary" if name == primary else name for name in shape["ptrace"]}
        shapes.append(shape)
    assert shapes[0]["ptrace"] == {"primary"}
    assert shapes[0]["share"] is True
    assert shapes[0] == shapes[1]


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
    for case, (pod, _header) in CASES.items():
        facts = Facts(RequestFacts("flytesnacks-development"))
        settings = _cell_settings(case)
        drop = build_settings({**settings, "ptrace": {"mode": "drop"}})
        added = apply(pod, [c.op for c in plan(pod, facts, build_settings(settings)).changes])
        dropped = apply(pod, [c.op for c in plan(pod, facts, drop).changes])
        assert _ptrace_holders(added) == _ptrace_holders(pod), case
        assert _ptrace_holders(dropped) == set(), case
        if case in GENERATED:
            continue  # what Flyte grants is the pod itself
        line = flyte_source.LINES[case.removeprefix("flyte-src-").split("-")[0]]
        assert bool(_ptrace_holders(pod)) == line.ptrace, f"{case}: Flyte {line.tag} grants SYS_PTRACE: {line.ptrace}"


def test_the_preview_command_answers_every_flyte_pod(tmp_path: Path) -> None:
    names = sorted(CASES)
    path = tmp_path / "pods.yaml"
    path.write_text("---\n".join(yaml.safe_dump(CASES[name][0]) for name in names))
    done = subprocess.run(
        [sys.executable, "-m", "webhook", "preview", "-f", str(path)], capture_output=True, timeout=120, check=False
    )
    assert done.returncode == 1, done.stderr  # as kubectl diff: 1 when something would change
    entries = orjson.loads(done.stdout)
    assert [e["name"] for e in entries] == [CASES[n][0]["metadata"]["name"] for n in names]
    for name, entry in zip(names, entries, strict=True):
        pod = CASES[name][0]
        assert entry["object"] == apply(pod, entry["patch"])
        validate(entry["object"])
        assert not _ptrace_holders(entry["object"]) - _ptrace_holders(pod), name


@pytest.mark.parametrize("case", ["flyte-src-1.15-io", "flyte-gen-1.16-io"])
def test_flytes_secrets_webhook_running_after_ours_changes_nothing_we_would_redo(case: str) -> None:
    pod = CASES[case][0]
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


@pytest.mark.parametrize("case", sorted(GENERATED))
@pytest.mark.parametrize("ownership", ["owner", "labels", "copilot-only"])
def test_drop_and_add_on_every_generated_pod(case: str, ownership: str) -> None:
    pod = copy.deepcopy(GENERATED[case][0])
    if ownership != "owner":
        del pod["metadata"]["ownerReferences"]
    if ownership == "copilot-only":
        pod["metadata"]["labels"] = {}
    settings = _cell_settings(case)
    shape = _shape(pod, settings.get("copilot", {}).get("namePrefix", "flyte-copilot-"))
    facts = Facts(RequestFacts("flytesnacks-development"))
    dropped = apply(
        pod, [c.op for c in plan(pod, facts, build_settings({**settings, "ptrace": {"mode": "drop"}})).changes]
    )
    if shape["copilot"] or ownership != "copilot-only":
        assert _ptrace_holders(dropped) == set()
    validate(dropped)
    for target in ("primary", "sidecar", "all"):
        decided = plan(pod, facts, build_settings({**settings, "ptrace": {"target": target}}))
        assert decided.undecided is None
        added = apply(pod, [c.op for c in decided.changes])
        if not shape["legacy"]:
            assert _ptrace_holders(added) <= shape["ptrace"], "no grant without a legacy watcher"
        validate(added)
