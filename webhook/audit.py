"""`copilot-webhook audit`: which running pods the SYS_PTRACE policy would change, before and after a switch.

An operator moving a Flyte cluster to Pod Security `baseline` switches `ptrace.mode` to `drop`. Pods
admitted before the switch keep their spec; this lists them: the pods still holding SYS_PTRACE that
`drop` would take it from, or the legacy copilot pods lacking what `add` would give, grouped by
namespace and owner. It reads pods and namespaces with paged lists (no watch) and plans each pod with
the same pure function the webhook uses, so its answer is the webhook's answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from webhook.config import Settings
from webhook.mutation.copilot import is_ptrace
from webhook.mutation.errors import PodShapeError
from webhook.mutation.facts import Facts, RequestFacts, cluster_facts
from webhook.mutation.plan import PTRACE, plan
from webhook.mutation.pod import CONTAINER_LISTS
from webhook.objects import JSONObject, Pod


@dataclass(frozen=True)
class Finding:
    namespace: str
    owner: str  # "Kind/name" of the controlling owner, or "-"
    pod: str
    holding: tuple[str, ...]  # containers whose capabilities.add has SYS_PTRACE now
    decision: str  # what the policy decides for this pod (the audit annotation it would get)
    changes: tuple[str, ...]  # one reason per patch operation
    undecided: str | None = None

    def as_json(self) -> JSONObject:
        data = asdict(self)
        data["holding"], data["changes"] = list(self.holding), list(self.changes)
        return data


def _owner(metadata: Mapping[str, Any]) -> str:
    owners = metadata.get("ownerReferences")
    if not isinstance(owners, list) or not owners:
        return "-"
    chosen = next((o for o in owners if isinstance(o, dict) and o.get("controller")), owners[0])
    return f"{chosen.get('kind', '?')}/{chosen.get('name', '?')}" if isinstance(chosen, dict) else "-"


def holding_ptrace(pod: Mapping[str, Any]) -> tuple[str, ...]:
    spec = pod.get("spec")
    found: list[str] = []
    for key in CONTAINER_LISTS:
        containers = spec.get(key) if isinstance(spec, dict) else None
        for c in containers if isinstance(containers, list) else ():
            context = c.get("securityContext") if isinstance(c, dict) else None
            caps = context.get("capabilities") if isinstance(context, dict) else None
            added = caps.get("add") if isinstance(caps, dict) else None
            if isinstance(added, list) and any(isinstance(a, str) and is_ptrace(a) for a in added):
                found.append(str(c.get("name")))
    return tuple(found)


def audit(pods: Iterable[Pod], namespace_labels: Mapping[str, Mapping[str, str]], settings: Settings) -> list[Finding]:
    """The pods whose spec the SYS_PTRACE policy in `settings` would change, sorted by namespace, owner, pod."""
    findings: list[Finding] = []
    for pod in pods:
        raw = pod.get("metadata")
        metadata: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
        namespace = str(metadata.get("namespace") or "default")
        facts = Facts(RequestFacts(namespace), cluster_facts(namespace_labels.get(namespace, {})))
        changes: tuple[str, ...] = ()
        decision = "-"
        try:
            decided = plan(pod, facts, settings, kinds=(PTRACE,))
        except PodShapeError as exc:
            undecided: str | None = f"unreadable: {exc}"
        else:
            undecided = decided.undecided
            # The spec changes only; the record annotation comes with any of them.
            changes = tuple(c.reason for c in decided.changes if not c.op["path"].startswith("/metadata"))
            decision = decided.audit.get(PTRACE, "-")
        if changes or undecided is not None:
            name = str(metadata.get("name") or "?")
            findings.append(
                Finding(namespace, _owner(metadata), name, holding_ptrace(pod), decision, changes, undecided)
            )
    return sorted(findings, key=lambda f: (f.namespace, f.owner, f.pod))


def table(findings: list[Finding]) -> str:
    rows = [("NAMESPACE", "OWNER", "POD", "HOLDS SYS_PTRACE", "POLICY", "WOULD")]
    for f in findings:
        would = "; ".join(f.changes) if f.changes else f"undecided: {f.undecided}"
        rows.append((f.namespace, f.owner, f.pod, ",".join(f.holding) or "-", f.decision, would))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in rows]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def summary(findings: list[Finding], pods_seen: int) -> str:
    holding = sum(1 for f in findings if f.holding)
    groups = len({(f.namespace, f.owner) for f in findings})
    return (
        f"{len(findings)} of {pods_seen} pod(s) would change ({holding} holding SYS_PTRACE), "
        f"in {groups} namespace/owner group(s)"
    )
