"""Golden cases, Istio style: tests/golden/<case>.yaml (or the pod named by `input:` in <case>.context.yaml)
goes in; <case>.patch.json (the exact operations the API server receives), <case>.mutated.yaml (the pod
with the patch applied) and <case>.answer.yaml (allowed, warnings, audit annotations) come out.
REFRESH_GOLDEN=1 rewrites the outputs; read the diff before committing it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import GOLDEN, apply, decoded_patch, load_yaml, validate
from webhook.config import Settings, build_settings
from webhook.mutation.facts import Facts, RequestFacts, cluster_facts
from webhook.mutation.plan import KINDS, Plan, plan
from webhook.mutation.runtime import node_facts
from webhook.review import response

OUTPUTS = (".patch.json", ".mutated.yaml", ".answer.yaml")
DERIVED = (".mutated.yaml", ".answer.yaml", ".context.yaml")
REFRESH = os.environ.get("REFRESH_GOLDEN") == "1"


def _cases() -> list[str]:
    names = {p.name.removesuffix(".context.yaml") for p in GOLDEN.glob("*.context.yaml")}
    names |= {p.name.removesuffix(".yaml") for p in GOLDEN.glob("*.yaml") if not p.name.endswith(DERIVED)}
    return sorted(names)


def _case(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    context_path = GOLDEN / f"{name}.context.yaml"
    context = (load_yaml(context_path) or {}) if context_path.exists() else {}
    source = GOLDEN / context["input"] if "input" in context else GOLDEN / f"{name}.yaml"
    return load_yaml(source), context


def _run(obj: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    decided, settings = _plan(obj, context)
    return dict(response("golden", decided, settings))


def _plan(obj: dict[str, Any], context: dict[str, Any]) -> tuple[Plan, Settings]:
    """Context keys: settings, namespace, namespaceLabels, kinds, request (runtime, node what-ifs),
    nodes (the node cache: name, runtime, labels, annotations), nodeState (none, unsynced, synced)."""
    settings = build_settings(context.get("settings", {}))
    namespace = context.get("namespace") or obj["metadata"].get("namespace", "default")
    nodes = None
    if "nodes" in context:
        nodes = {
            n["name"]: node_facts(n.get("runtime"), n.get("labels", {}), n.get("annotations", {}))
            for n in context["nodes"]
        }
    cluster = cluster_facts(context.get("namespaceLabels"), nodes, context.get("nodeState"))
    request = RequestFacts(
        namespace, runtime=context.get("request", {}).get("runtime"), node=context.get("request", {}).get("node")
    )
    kinds = tuple(context.get("kinds", KINDS))
    return plan(obj, Facts(request, cluster), settings, kinds=kinds), settings


def _check(path: Path, actual: str) -> None:
    if REFRESH:
        path.write_text(actual)
        return
    assert path.exists(), f"{path.name} is missing: run with REFRESH_GOLDEN=1 and review the new file"
    assert actual == path.read_text(), f"{path.name} differs from what the webhook now produces"


def _dump(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=120)


def test_every_golden_output_has_a_case() -> None:
    cases = set(_cases())
    outputs = [p.name for p in GOLDEN.iterdir() if p.name.endswith(OUTPUTS)]
    stale = [p for p in outputs if next(p.removesuffix(s) for s in OUTPUTS if p.endswith(s)) not in cases]
    assert not stale, f"golden outputs without an input case: {stale}"
    assert len(cases) >= 30


@pytest.mark.parametrize("name", _cases())
def test_golden(name: str) -> None:
    obj, context = _case(name)
    answer = _run(obj, context)
    ops = decoded_patch(answer)
    mutated = apply(obj, ops)
    _check(GOLDEN / f"{name}.patch.json", json.dumps(ops, indent=2) + "\n")
    _check(GOLDEN / f"{name}.mutated.yaml", _dump(mutated))
    summary = {k: answer[k] for k in ("allowed", "status", "warnings", "auditAnnotations") if k in answer}
    _check(GOLDEN / f"{name}.answer.yaml", _dump(summary))

    validate(mutated)
    for warning in answer.get("warnings", []):
        assert len(warning) <= 120, f"the API server truncates warnings over 120 characters: {warning!r}"
    again = _run(mutated, context)
    assert decoded_patch(again) == [], "re-running the webhook on its own output must change nothing"


def test_every_reason_a_plan_gives_is_a_listed_one() -> None:
    """The skip reasons (metrics labels, audit annotations) are the Literals of mutation/reasons.py."""
    import typing

    from webhook.mutation import reasons

    listed = {v for alias in (reasons.PlanSkip, reasons.PtraceSkip, reasons.PullerSkip) for v in typing.get_args(alias)}
    seen = set()
    for name in _cases():
        decided, _settings = _plan(*_case(name))
        seen |= {o.reason for o in decided.outcomes.values() if not o.mutated}
    assert seen <= listed, seen - listed
    assert len(seen) >= 8, "the golden cases exercise most reasons"
