"""Where a pod may run: its nodeName, nodeSelector and required node affinity, read strictly,
matched against the node cache's label index and labels. The runtime rules (runtime.py) count the
runtimes of the nodes this returns."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from webhook import objects
from webhook.mutation.errors import PodShapeError
from webhook.mutation.facts import NodeSnapshot
from webhook.mutation.pod import PodView, type_name


def _strings(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PodShapeError(f"{where} must be an array of strings")
    return value


def _numeric(have: str | None, values: list[str], greater: bool) -> bool:
    if have is None:
        return False
    try:
        have_n, want = int(have), int(values[0])
    except ValueError:
        return False
    return have_n > want if greater else have_n < want


# What each operator asks of a node's value for the key (None: the node has no such label) and the values.
_OPERATORS: dict[str, Callable[[str | None, list[str]], bool]] = {
    "In": lambda have, values: have is not None and have in values,
    "NotIn": lambda have, values: have is None or have not in values,
    "Exists": lambda have, _values: have is not None,
    "DoesNotExist": lambda have, _values: have is None,
    "Gt": lambda have, values: _numeric(have, values, greater=True),
    "Lt": lambda have, values: _numeric(have, values, greater=False),
}


def _expression_matches(expr: Any, labels: Mapping[str, str], where: str) -> bool:
    if not isinstance(expr, dict) or not isinstance(expr.get("key"), str):
        raise PodShapeError(f"{where} must be an object with a string key")
    key, op = expr["key"], expr.get("operator")
    values = _strings(expr.get("values"), f"{where}.values")
    test = _OPERATORS.get(op) if isinstance(op, str) else None
    if test is None or (op in ("Gt", "Lt") and len(values) != 1):
        raise PodShapeError(f"{where}.operator {op!r} is not one of In, NotIn, Exists, DoesNotExist, Gt, Lt")
    return test(labels.get(key), values)


def _term_matches(term: Any, name: str, labels: Mapping[str, str], *, where: str) -> bool:
    if not isinstance(term, dict):
        raise PodShapeError(f"{where} must be an object")
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not isinstance(expressions, list) or not isinstance(fields, list):
        raise PodShapeError(f"{where}.matchExpressions and matchFields must be arrays")
    if not expressions and not fields:
        return False  # an empty term matches no node (core/v1 NodeSelectorTerm)
    fields_as_labels = {"metadata.name": name}
    return all(
        _expression_matches(e, labels, f"{where}.matchExpressions[{i}]") for i, e in enumerate(expressions)
    ) and all(_expression_matches(f, fields_as_labels, f"{where}.matchFields[{i}]") for i, f in enumerate(fields))


def required_terms(spec: objects.PodSpec) -> list[Any] | None:
    """The pod's required node-affinity terms (ORed), or None when it has none."""
    affinity = spec.get("affinity")
    node_affinity = affinity.get("nodeAffinity") if isinstance(affinity, dict) else None
    required = (
        node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") if isinstance(node_affinity, dict) else None
    )
    if required is None:
        return None
    where = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    if not isinstance(required, dict):
        raise PodShapeError(f"{where} must be an object, not {type_name(required)}")
    terms = required.get("nodeSelectorTerms")
    if not isinstance(terms, list):
        raise PodShapeError(f"{where}.nodeSelectorTerms must be an array")
    return terms


def _by_selector(snapshot: NodeSnapshot, selector: Mapping[str, str]) -> list[str]:
    """The nodes carrying every nodeSelector pair, exactly."""
    sets: list[Collection[str]] = [snapshot.by_label.get((k, v), ()) for k, v in selector.items()]
    sizes = [len(names) for names in sets]
    common = set(sets[sizes.index(min(sizes))])  # start from the smallest: a hostname's is one name
    for names in sets:
        common.intersection_update(names)
    return sorted(common)


def _by_first_in(snapshot: NodeSnapshot, term: objects.NodeSelectorTerm) -> list[str] | None:
    """The nodes carrying one of the values of the term's first `In` expression; None without one."""
    expressions = term.get("matchExpressions")
    for expr in expressions if isinstance(expressions, list) else ():  # a malformed term is refused later
        if isinstance(expr, dict) and expr.get("operator") == "In" and isinstance(expr.get("values"), list):
            found: set[str] = set()
            for value in expr["values"]:
                found.update(snapshot.by_label.get((str(expr.get("key")), str(value)), ()))
            return sorted(found)
    return None


def _indexed(snapshot: NodeSnapshot, selector: Mapping[str, str] | None, terms: list[Any] | None) -> Iterable[str]:
    """A superset of the candidates from the label index, so a request does not walk thousands of nodes:
    the nodes carrying every nodeSelector pair, or, with one required term, its first `In` values."""
    if selector:
        return _by_selector(snapshot, selector)
    if terms is not None and len(terms) == 1 and isinstance(terms[0], dict):
        found = _by_first_in(snapshot, terms[0])
        if found is not None:
            return found
    return snapshot.nodes


def _node_selector(spec: objects.PodSpec) -> dict[str, str] | None:
    selector = spec.get("nodeSelector")
    if selector is not None and (
        not isinstance(selector, dict) or not all(isinstance(v, str) for v in selector.values())
    ):
        raise PodShapeError("spec.nodeSelector must be an object of strings")
    return selector


_TERMS = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"


def _allowed(name: str, labels: Mapping[str, str], selector: Mapping[str, str] | None, *, terms: list[Any]) -> bool:
    """The node carries every nodeSelector pair and matches one of the required terms."""
    if selector and any(labels.get(k) != v for k, v in selector.items()):
        return False
    return any(_term_matches(t, name, labels, where=f"{_TERMS}[{i}]") for i, t in enumerate(terms))


def selector_only(view: PodView) -> tuple[tuple[str, str], ...] | None:
    """The nodeSelector's pairs, sorted, when they alone restrict the pod (no nodeName, no required node
    affinity): the candidates then depend on the pairs and the nodes only."""
    spec = view.spec
    if spec.get("nodeName") or required_terms(spec) is not None:
        return None
    selector = _node_selector(spec)
    return tuple(sorted(selector.items())) if selector else None


def candidate_nodes(view: PodView, snapshot: NodeSnapshot) -> list[str] | None:
    """The nodes the pod may land on: its nodeName, else those its nodeSelector and required node
    affinity allow; None when nothing restricts it (every node)."""
    spec = view.spec
    node_name = spec.get("nodeName")
    if isinstance(node_name, str) and node_name:
        return [node_name]
    selector = _node_selector(spec)
    terms = required_terms(spec)
    if terms is None:
        # Without required terms the index answers a nodeSelector exactly; without either, every node.
        return list(_indexed(snapshot, selector, None)) if selector else None
    nodes = snapshot.nodes
    return [
        name
        for name in _indexed(snapshot, selector, terms)
        if _allowed(name, nodes[name].labels, selector, terms=terms)
    ]
