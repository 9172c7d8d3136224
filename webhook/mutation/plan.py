"""plan(pod, facts, settings) -> Plan: every decision of the webhook, as a pure function.

The plan carries the RFC 6902 operations with a reason each, the warnings for the user, the audit
annotations, and per kind of mutation what was decided (for metrics). It never raises for a well-formed
pod: a pod it cannot read raises PodShapeError (a bad request), a pod it cannot decide sets `undecided`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from webhook.config import Settings
from webhook.mutation.copilot import Copilot, PtraceResult, find_copilot, flyte_owned, plan_ptrace
from webhook.mutation.errors import Undecidable
from webhook.mutation.facts import INJECT_LABEL, MODE_LABEL, ClusterFacts, Facts
from webhook.mutation.pod import PodView, read_pod
from webhook.mutation.podsecurity import Level, level_in_force
from webhook.mutation.pointer import Operation, add, join
from webhook.mutation.puller import PullerResult, plan_puller
from webhook.mutation.reasons import PlanSkip
from webhook.mutation.runtime import Runtime
from webhook.mutation.vocabulary import INJECT, MUTATED, Ignored, check, switch

Kind = Literal["ptrace", "image-puller"]  # the two kinds of mutation, each with its own webhook path
PTRACE: Kind = "ptrace"
PULLER: Kind = "image-puller"
KINDS: tuple[Kind, ...] = (PTRACE, PULLER)
INJECT_ANNOTATION = INJECT
MUTATED_ANNOTATION = MUTATED
_SUMMARY_ORDER: dict[str, int] = {PTRACE: 0, PULLER: 1}
_MUTATED_PATH = join("metadata", "annotations", MUTATED_ANNOTATION)


@dataclass(slots=True)
class Change:
    op: Operation
    reason: str


@dataclass(slots=True)
class Outcome:
    mutated: bool
    reason: str  # the mode applied when mutated, else why nothing was done


@dataclass(slots=True)
class Plan:
    changes: list[Change] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    audit: dict[str, str] = field(default_factory=dict)  # kind -> what the audit annotation says
    outcomes: dict[str, Outcome] = field(default_factory=dict)  # kind -> mutated or not, and why
    shadow: bool = False
    undecided: str | None = None
    runtime: Runtime | None = None  # the image puller's runtime decision, when it got that far
    runtime_note: str = ""  # why there is no runtime decision
    ignored: list[Ignored] = field(default_factory=list)  # values of ours not understood (each also a warning)


def _skip_all(kinds: Collection[str], reason: PlanSkip, warnings: list[str] | None = None) -> Plan:
    return Plan(warnings=warnings or [], outcomes={k: Outcome(mutated=False, reason=reason) for k in kinds})


def parse_summary(value: str | None) -> dict[str, str]:
    parts: dict[str, str] = {}
    for item in (value or "").split(";"):
        key, sep, rest = item.partition("=")
        if sep and key:
            parts[key] = rest
    return parts


def summary_change(view: PodView, parts: Mapping[str, str]) -> Change | None:
    """Record what was done in the pod's `copilot-webhook.io/mutated` annotation, keeping the parts that
    another of our webhooks (there are two: ptrace and image-puller) wrote before."""
    current = view.annotation(MUTATED_ANNOTATION)
    merged = parse_summary(current) if current else {}
    merged.update(parts)
    # One canonical order, so the value does not depend on which of our webhooks ran first.
    order = sorted(merged, key=lambda k: (_SUMMARY_ORDER.get(k, len(_SUMMARY_ORDER)), k)) if len(merged) > 1 else merged
    value = ";".join(f"{k}={merged[k]}" for k in order)
    if value == current:
        return None
    why = "record what the webhook did"
    if view.metadata is None:
        return Change(add("/metadata", {"annotations": {MUTATED_ANNOTATION: value}}), why)
    if view.annotations is None:
        return Change(add("/metadata/annotations", {MUTATED_ANNOTATION: value}), why)
    return Change(add(_MUTATED_PATH, value), why)


def _opted_out(view: PodView, cluster: ClusterFacts, settings: Settings) -> PlanSkip | None:
    """The pod's and its namespace's switch (vocabulary.py). In opt-in mode a namespace the webhook knows
    is served only when labelled on; one it does not know (no cluster access, not cached yet) was chosen
    by the API server's namespaceSelector, which asks the same."""
    if switch(view.annotation(INJECT_ANNOTATION)) is False:
        return "pod-opt-out"
    namespace = switch(cluster.label(INJECT_LABEL))
    if namespace is False:
        return "namespace-opt-out"
    if settings.inject == "opt-in" and namespace is None and cluster.namespace_labels is not None:
        return "namespace-not-opted-in"
    return None


def _record(out: Plan, view: PodView) -> None:
    """The mutated annotation for the kinds that mutated, and shadow mode's warning."""
    summary = {kind: out.audit[kind] for kind, outcome in out.outcomes.items() if outcome.mutated}
    if summary:
        recorded_change = summary_change(view, summary)
        if recorded_change is not None:
            out.changes.append(recorded_change)
    if out.shadow and out.changes:
        out.warnings.append(f"shadow mode: {len(out.changes)} patch operation(s) computed but not applied")


def plan(pod: Any, facts: Facts, settings: Settings, *, kinds: Collection[str] = KINDS) -> Plan:
    view = read_pod(pod)
    cluster = facts.cluster
    ignored = check(view.annotations, cluster.namespace_labels, ptrace=PTRACE in kinds, puller=PULLER in kinds)
    opted_out = _opted_out(view, cluster, settings)
    if opted_out is not None:
        skipped = _skip_all(kinds, opted_out, [i.warning for i in ignored])
        skipped.ignored = ignored
        return skipped
    shadow = settings.mode == "shadow" or cluster.label(MODE_LABEL) == "shadow"

    out = Plan(shadow=shadow, warnings=[i.warning for i in ignored], ignored=ignored)
    undecided: list[str] = []
    copilot = find_copilot(view, settings.copilot)
    level = level_in_force(view, facts, settings.pod_security)

    # Each kind's operations are computed against the pod as sent; the ptrace operations come first
    # because the puller inserts an init container at index 0, which would shift the paths after it.
    if PTRACE in kinds:
        _plan_ptrace(out, undecided, view, copilot=copilot, settings=settings, level=level)
    if PULLER in kinds:
        _plan_puller(out, undecided, view, is_copilot=copilot is not None, facts=facts, settings=settings, level=level)

    _record(out, view)
    out.undecided = "; ".join(undecided) or None
    return out


def _plan_ptrace(
    out: Plan, undecided: list[str], view: PodView, *, copilot: Copilot | None, settings: Settings, level: Level
) -> None:
    if copilot is None and not flyte_owned(view):
        out.outcomes[PTRACE] = Outcome(mutated=False, reason="not-copilot")
        return
    try:
        result = plan_ptrace(view, copilot, settings.ptrace, level=level)
    except Undecidable as exc:
        undecided.append(str(exc))
        out.outcomes[PTRACE] = Outcome(mutated=False, reason="undecided")
        return
    _absorb(out, PTRACE, result, applied=result.decision.split(":")[0], audited=result.skip_reason != "not-copilot")


def _plan_puller(
    out: Plan, undecided: list[str], view: PodView, *, is_copilot: bool, facts: Facts, settings: Settings, level: Level
) -> None:
    recorded = PULLER in parse_summary(view.annotation(MUTATED_ANNOTATION))
    try:
        pulled = plan_puller(view, is_copilot, facts, settings=settings.image_puller, recorded=recorded, level=level)
    except Undecidable as exc:
        undecided.append(str(exc))
        out.outcomes[PULLER] = Outcome(mutated=False, reason="undecided")
        return
    flavour = pulled.runtime.flavour if pulled.runtime else ""
    _absorb(out, PULLER, pulled, applied=flavour, audited=pulled.skip_reason not in ("disabled", "not-copilot"))
    out.runtime, out.runtime_note = pulled.runtime, pulled.decision


def _absorb(out: Plan, kind: str, result: PtraceResult | PullerResult, *, applied: str, audited: bool) -> None:
    """Fold one kind's result into the plan; `applied` is the metrics reason when it changed the pod."""
    out.changes += [Change(op, why) for op, why in result.ops]
    out.warnings += result.warnings
    if audited or result.ops:
        out.audit[kind] = result.decision
    out.outcomes[kind] = Outcome(mutated=bool(result.ops), reason=applied if result.ops else str(result.skip_reason))
