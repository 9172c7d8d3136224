"""Where a pod may run: every node-affinity operator and matchFields, as the scheduler reads them
(core/v1 NodeSelectorRequirement), against a small node table."""

from __future__ import annotations

from typing import Any

import pytest

from webhook.mutation.errors import PodShapeError
from webhook.mutation.facts import NodeFacts, node_snapshot
from webhook.mutation.pod import read_pod
from webhook.mutation.scheduling import candidate_nodes

NODES = node_snapshot(
    {
        "a": NodeFacts("containerd", None, None, {"zone": "z1", "gpus": "4", "pool": "gpu"}),
        "b": NodeFacts("containerd", None, None, {"zone": "z2", "gpus": "0"}),
        "c": NodeFacts("docker", None, None, {"zone": "z1", "gpus": "many"}),
    }
)


def _pod(*terms: dict[str, Any], selector: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "x"}]}
    if terms:
        required = {"nodeSelectorTerms": list(terms)}
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    if selector:
        spec["nodeSelector"] = selector
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


def _expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    expr: dict[str, Any] = {"key": key, "operator": operator}
    if values:
        expr["values"] = list(values)
    return expr


@pytest.mark.parametrize(
    ("terms", "expected"),
    [
        ([{"matchExpressions": [_expr("zone", "In", "z1")]}], ["a", "c"]),
        ([{"matchExpressions": [_expr("zone", "NotIn", "z1")]}], ["b"]),
        ([{"matchExpressions": [_expr("pool", "Exists")]}], ["a"]),
        ([{"matchExpressions": [_expr("pool", "DoesNotExist")]}], ["b", "c"]),
        ([{"matchExpressions": [_expr("gpus", "Gt", "1")]}], ["a"]),  # "many" is no integer: no match
        ([{"matchExpressions": [_expr("gpus", "Lt", "1")]}], ["b"]),
        ([{"matchFields": [_expr("metadata.name", "In", "b", "c")]}], ["b", "c"]),
        ([{"matchFields": [_expr("metadata.name", "NotIn", "a")]}], ["b", "c"]),
        # terms are ORed, expressions within a term ANDed
        (
            [{"matchExpressions": [_expr("zone", "In", "z2")]}, {"matchExpressions": [_expr("pool", "Exists")]}],
            ["a", "b"],
        ),
        ([{"matchExpressions": [_expr("zone", "In", "z1"), _expr("pool", "DoesNotExist")]}], ["c"]),
        ([{}], []),  # an empty term matches no node
    ],
)
def test_every_operator_selects_the_nodes_the_scheduler_would(terms: list[dict[str, Any]], expected: list[str]) -> None:
    assert sorted(candidate_nodes(read_pod(_pod(*terms)), NODES) or []) == expected


def test_a_node_selector_and_affinity_both_apply() -> None:
    pod = _pod({"matchExpressions": [_expr("gpus", "Gt", "-1")]}, selector={"zone": "z1"})
    assert candidate_nodes(read_pod(pod), NODES) == ["a"]


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        (_expr("zone", "Near", "z1"), "operator 'Near' is not one of"),
        ({"operator": "Exists"}, "must be an object with a string key"),
        ({"key": "zone", "operator": "In", "values": "z1"}, "values must be an array of strings"),
    ],
)
def test_a_malformed_requirement_is_named(expr: dict[str, Any], message: str) -> None:
    pod = _pod({"matchExpressions": [_expr("zone", "Exists"), expr]})
    with pytest.raises(PodShapeError, match=message):
        candidate_nodes(read_pod(pod), NODES)
