"""The chart's CEL matchConditions, evaluated by a CEL library (cel-python) over every golden pod: the API
server must send each webhook every pod its endpoint would change, so the chart and the server cannot
disagree. What it does not prove: the Kubernetes CEL environment's cost limits and extension libraries
(the expressions use only core CEL: has, exists, startsWith, in)."""

from __future__ import annotations

import copy
import functools
from typing import Any

import celpy
import pytest
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

from scripts import flyte_source
from tests.helpers import GOLDEN, PODS, apply, load_yaml
from tests.test_chart import render
from webhook.config import build_settings
from webhook.mutation.facts import Facts, RequestFacts
from webhook.mutation.plan import PTRACE, PULLER, plan

HOOKS = {"ptrace.copilot-webhook.io": PTRACE, "image-puller.copilot-webhook.io": PULLER}
VALUES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "drop": {"ptrace": {"mode": "drop"}},
    "keep": {"ptrace": {"mode": "keep"}},
    "sidecar": {"ptrace": {"target": "sidecar"}},
    "override": {"ptrace": {"mode": "keep", "allowPodOverride": True}},
    "custom-prefix": {"copilot": {"namePrefix": "acme-copilot-", "imagePatterns": ["registry.acme.internal/*"]}},
}


def _pods() -> dict[str, dict[str, Any]]:
    pods = {f"pods/{p.name}": load_yaml(p) for p in sorted(PODS.glob("*.yaml"))}
    for path in sorted(GOLDEN.glob("*.yaml")):
        if not path.name.endswith((".mutated.yaml", ".answer.yaml", ".context.yaml")):
            pods[path.name] = load_yaml(path)
    for case, (pod, _header) in flyte_source.cases().items():
        pods[case] = pod
    return pods


PODS_BY_NAME = _pods()


@functools.cache
def _conditions(variant: str) -> dict[str, Any]:
    """hook name -> a compiled CEL program, or None where the hook has no matchConditions."""
    objects = render({**VALUES[variant], "webhook": {"matchConditions": True}})
    mwc = next(v for k, v in objects.items() if k.startswith("MutatingWebhookConfiguration/"))
    env = celpy.Environment()
    programs: dict[str, Any] = {}
    for hook in mwc["webhooks"]:
        conditions = hook.get("matchConditions", [])
        assert len(conditions) <= 1
        programs[hook["name"]] = env.program(env.compile(conditions[0]["expression"])) if conditions else None
    return programs


def _sent(program: Any, pod: dict[str, Any]) -> bool:
    if program is None:
        return True
    result = program.evaluate({"object": json_to_cel(pod)})
    assert isinstance(result, celpy.celtypes.BoolType), f"the expression must yield a boolean, got {result!r}"
    return bool(result)


@pytest.mark.parametrize("variant", sorted(VALUES))
def test_every_pod_the_server_would_change_is_sent(variant: str) -> None:
    settings = build_settings(VALUES[variant])
    programs = _conditions(variant)
    checked = 0
    for name, pod in PODS_BY_NAME.items():
        namespace = pod.get("metadata", {}).get("namespace", "default")
        for hook, kind in HOOKS.items():
            if hook not in programs:
                continue
            decided = plan(pod, Facts(RequestFacts(namespace)), settings, kinds=(kind,))
            if decided.changes or decided.undecided:
                checked += 1
                assert _sent(programs[hook], pod), f"{variant}: {hook} would change {name} but is not sent it"
    assert checked >= (1 if variant == "custom-prefix" else 40), "the pods exercise both hooks"


def test_pods_that_no_hook_would_change_are_not_all_sent() -> None:
    """The conditions do filter: plain pods are not sent to the SYS_PTRACE webhook."""
    programs = _conditions("defaults")
    assert not _sent(programs["ptrace.copilot-webhook.io"], PODS_BY_NAME["pods/plain.yaml"])
    flyte_none = flyte_source.flyte_pod("1.15", flyte_source.Task(inputs=False, outputs=False))
    assert _sent(programs["ptrace.copilot-webhook.io"], flyte_none), "a Flyte-owned pod reaches drop"
    assert not _sent(programs["image-puller.copilot-webhook.io"], flyte_none)


def test_the_flyte_owned_clauses_match_the_server_exactly() -> None:
    base = flyte_source.flyte_pod("1.15", flyte_source.Task(inputs=False, outputs=False))
    program = _conditions("drop")["ptrace.copilot-webhook.io"]
    settings = build_settings(VALUES["drop"])
    variants = {
        "FlyteWorkflow": {"apiVersion": "flyte.lyft.com/v1alpha1", "kind": "FlyteWorkflow", "name": "x", "uid": "u"},
        "FLYTEWORKFLOW": {"apiVersion": "flyte.lyft.com/v1alpha1", "kind": "FLYTEWORKFLOW", "name": "x", "uid": "u"},
        "TaskAction": {"apiVersion": "flyte.org/v1", "kind": "TaskAction", "name": "x", "uid": "u"},
        "other group": {"apiVersion": "flyte.example.com/v1", "kind": "flyteworkflow", "name": "x", "uid": "u"},
    }
    for labels in ({}, {"execution-id": "e"}, {"execution-id": "e", "node-id": "n"}):
        for owner in variants.values():
            pod = dict(base, metadata=dict(base["metadata"], labels=labels, ownerReferences=[owner]))
            changes = bool(plan(pod, Facts(RequestFacts("ns")), settings, kinds=(PTRACE,)).changes)
            assert _sent(program, pod) == changes, (labels, owner)


def test_cel_library_is_real() -> None:
    """A check that can fail: an expression over a missing field errors rather than matching."""
    env = celpy.Environment()
    program = env.program(env.compile("object.spec.nodeName == 'n1'"))
    assert bool(program.evaluate({"object": json_to_cel({"spec": {"nodeName": "n1"}})}))
    with pytest.raises(CELEvalError):
        program.evaluate({"object": json_to_cel({"spec": {}})})


# --- the ValidatingAdmissionPolicy behind ptrace.mode=drop --------------------------------------------------
POLICY_VALUES: dict[str, dict[str, Any]] = {
    "drop": {"ptrace": {"mode": "drop"}},
    "drop-override": {"ptrace": {"mode": "drop", "allowPodOverride": True}},
    "drop-custom": {
        "ptrace": {"mode": "drop"},
        "copilot": {"namePrefix": "acme-copilot-", "imagePatterns": ["registry.acme.internal/*", "*/copilot?:*"]},
    },
}


@functools.cache
def _policy(variant: str) -> tuple[list[Any], list[tuple[str, Any]], Any]:
    """(matchConditions, variables, validation) of the rendered policy, each compiled by the CEL library."""
    values = {**POLICY_VALUES[variant], "webhook": {"ptrace": {"validatingPolicy": True}}}
    policy = render(values)["ValidatingAdmissionPolicy/cw-copilot-webhook-ptrace-drop"]["spec"]
    env = celpy.Environment()

    def compiled(text: str) -> Any:
        return env.program(env.compile(text))

    conditions = [compiled(c["expression"]) for c in policy["matchConditions"]]
    variables = [(v["name"], compiled(v["expression"])) for v in policy["variables"]]
    (validation,) = policy["validations"]
    env.compile(validation["messageExpression"])  # parses (join is Kubernetes' strings library, not core CEL)
    return conditions, variables, compiled(validation["expression"])


def _denied(variant: str, pod: dict[str, Any]) -> bool:
    """What the API server does with the policy: evaluate matchConditions; if all hold, the variables in
    order, then the validation; deny when it is false."""
    conditions, variables, validation = _policy(variant)
    activation: dict[str, Any] = {"object": json_to_cel(pod)}
    if not all(bool(c.evaluate(activation)) for c in conditions):
        return False
    bound: dict[Any, Any] = {}
    for name, program in variables:
        activation["variables"] = celpy.celtypes.MapType(bound)
        bound[celpy.celtypes.StringType(name)] = program.evaluate(activation)
    activation["variables"] = celpy.celtypes.MapType(bound)
    return not bool(validation.evaluate(activation))


@pytest.mark.parametrize("variant", sorted(POLICY_VALUES))
def test_the_drop_policy_rejects_exactly_what_the_webhook_would_change_and_nothing_it_emits(variant: str) -> None:
    """Over every golden pod: the policy denies a pod before the webhook exactly when the webhook's drop
    would change it (so it holds the line while the webhook fails open), and never denies what the webhook
    emits (so a working webhook never has a pod refused)."""
    settings = build_settings(POLICY_VALUES[variant])
    denied_before = 0
    for name, pod in PODS_BY_NAME.items():
        namespace = pod.get("metadata", {}).get("namespace", "default")
        decided = plan(pod, Facts(RequestFacts(namespace)), settings, kinds=(PTRACE,))
        if decided.undecided:
            continue
        after = apply(pod, [c.op for c in decided.changes]) if decided.changes else pod
        assert not _denied(variant, after), f"{variant}: the policy denies what the webhook emits for {name}"
        denied = _denied(variant, pod)
        assert denied == bool(decided.changes), f"{variant}: {name}: denied {denied}, webhook changes {decided.changes}"
        denied_before += denied
    assert denied_before >= (1 if variant == "drop-custom" else 20), "the golden pods exercise the policy"


def test_the_drop_policy_reads_capability_names_as_the_runtimes_do() -> None:
    base = flyte_source.flyte_pod("1.15", flyte_source.Task(inputs=True, outputs=True))
    settings = build_settings(POLICY_VALUES["drop"])
    for capabilities, held in [
        ({"add": ["sys_ptrace"]}, True),
        ({"add": ["CAP_SYS_PTRACE"]}, True),
        ({"add": ["ALL"]}, True),
        ({"add": ["all"], "drop": ["cap_sys_ptrace"]}, False),
        ({"add": ["NET_ADMIN"]}, False),
        ({"add": ["SYS_PTRACEX"]}, False),
    ]:
        pod = copy.deepcopy(base)
        for container in pod["spec"]["containers"]:
            container["securityContext"] = {"capabilities": capabilities}
        changes = bool(plan(pod, Facts(RequestFacts("ns")), settings, kinds=(PTRACE,)).changes)
        assert _denied("drop", pod) == held == changes, capabilities
    opted_out = copy.deepcopy(base)
    opted_out["metadata"].setdefault("annotations", {})["copilot-webhook.io/inject"] = "false"
    for container in opted_out["spec"]["containers"]:
        container["securityContext"] = {"capabilities": {"add": ["SYS_PTRACE"]}}
    assert not _denied("drop", opted_out), "a pod the webhook is told to leave alone is not held to the policy"
    overridden = copy.deepcopy(opted_out)
    overridden["metadata"]["annotations"] = {"copilot-webhook.io/ptrace": "keep"}
    assert _denied("drop", overridden), "the annotation grants nothing unless allowPodOverride"
    assert not _denied("drop-override", overridden)
