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
        # Gt and Lt are strict, and a node without the label matches neither
        ([{"matchExpressions": [_expr("gpus", "Gt", "4")]}], []),
        ([{"matchExpressions": [_expr("gpus", "Lt", "0")]}], []),
        ([{"matchExpressions": [_expr("pool", "Lt", "100")]}], []),
        # In: values no node carries select nothing, and do not stop the others from selecting
        ([{"matchExpressions": [_expr("zone", "In", "z9")]}], []),
        ([{"matchExpressions": [_expr("zone", "In", "z9", "z2")]}], ["b"]),
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
        (_expr("gpus", "Gt", "1", "2"), "operator 'Gt' is not one of"),
        (_expr("gpus", "Lt"), "operator 'Lt' is not one of"),
        ({"key": "zone", "operator": ["In"], "values": ["z1"]}, r"operator \['In'\] is not one of"),
    ],
)
def test_a_malformed_requirement_is_named(expr: dict[str, Any], message: str) -> None:
    pod = _pod({"matchExpressions": [_expr("zone", "Exists"), expr]})
    with pytest.raises(PodShapeError, match=message):
        candidate_nodes(read_pod(pod), NODES)


@pytest.mark.parametrize(
    ("terms", "message"),
    [
        (["zone"], r"nodeSelectorTerms\[0\] must be an object$"),
        (
            [{"matchExpressions": _expr("zone", "Exists")}],
            r"nodeSelectorTerms\[0\].matchExpressions and matchFields must be arrays",
        ),
        (
            [{}, {"matchExpressions": [_expr("zone", "Exists"), {"key": "zone", "operator": "In", "values": "z1"}]}],
            r"nodeSelectorTerms\[1\].matchExpressions\[1\].values must be an array of strings",
        ),
        (
            [{"matchFields": [{"key": "metadata.name", "operator": "Near"}]}],
            r"nodeSelectorTerms\[0\].matchFields\[0\].operator 'Near' is not one of",
        ),
    ],
)
def test_an_unreadable_term_is_named_by_its_place_in_the_pod(terms: list[Any], message: str) -> None:
    """What /preview answers (400) and what the warning of an undecidable pod says: the field at fault."""
    with pytest.raises(PodShapeError, match=r"^spec.affinity.nodeAffinity.requiredDuringScheduling\w*." + message):
        candidate_nodes(read_pod(_pod(*terms)), NODES)


def _memo(snapshot: Any) -> dict[Any, Any]:
    from webhook.mutation.nodeindex import LabelIndex

    assert isinstance(snapshot.by_label, LabelIndex)
    return snapshot.by_label.memo


def test_a_node_pools_runtimes_are_kept_per_snapshot_and_follow_every_change() -> None:
    """Pods of a node pool all ask the same: the counted runtimes are kept with the snapshot's label index
    (new with every change of the nodes), only for selectors that match nodes, and at most MEMO_LIMIT."""
    from webhook.config import build_settings
    from webhook.mutation.facts import ClusterFacts, RequestFacts
    from webhook.mutation.runtime import MEMO_LIMIT, decide_runtime

    settings = build_settings({}).image_puller

    def runtime(snapshot: Any, selector: dict[str, str]) -> str | None:
        cluster = ClusterFacts(None, snapshot, "synced")
        decided = decide_runtime(read_pod(_pod(selector=selector)), RequestFacts("ns"), cluster, settings=settings)
        return None if decided.runtime is None else f"{decided.runtime.flavour} ({decided.runtime.source})"

    nodes = {f"n{i}": NodeFacts("containerd", None, None, {"pool": "p1", "zone": f"z{i % 2}"}) for i in range(6)}
    before = node_snapshot(nodes)
    assert runtime(before, {"pool": "p1"}) == "containerd (6 candidate nodes)"
    assert runtime(before, {"pool": "p1"}) == "containerd (6 candidate nodes)"  # kept
    assert runtime(before, {"zone": "z1", "pool": "p1"}) == "containerd (3 candidate nodes)"
    assert runtime(before, {"pool": "made-up"}) is None
    assert len(_memo(before)) == 2, "the selectors that match nodes are kept, the made-up one not"

    nodes["n0"] = NodeFacts("docker", None, None, {"pool": "p1", "zone": "z0"})
    nodes["n1"] = NodeFacts("docker", None, None, {"pool": "p2", "zone": "z1"})
    after = node_snapshot(nodes, before, changed=["n0", "n1"])
    assert runtime(after, {"pool": "p1"}) is None, "5 nodes, two runtimes: heterogeneous, skipped by default"
    assert runtime(after, {"zone": "z1", "pool": "p1"}) == "containerd (2 candidate nodes)"
    assert runtime(before, {"pool": "p1"}) == "containerd (6 candidate nodes)", "a snapshot in use keeps its answers"

    for i in range(MEMO_LIMIT + 10):
        nodes[f"m{i}"] = NodeFacts("containerd", None, None, {"own": f"v{i}"})
    many = node_snapshot(nodes)
    for i in range(MEMO_LIMIT + 10):
        assert runtime(many, {"own": f"v{i}"}) == f"containerd (node m{i})"
    assert len(_memo(many)) == MEMO_LIMIT


def test_a_node_selector_on_the_hostname_selects_that_node_alone() -> None:
    """The index answers a pair whose value is the node's own name without a posting of its own."""
    nodes = node_snapshot(
        {
            name: NodeFacts("containerd", None, None, {"kubernetes.io/hostname": name, "zone": "z1"})
            for name in ("n1", "n2", "n3")
        }
    )
    pod = _pod(selector={"kubernetes.io/hostname": "n2", "zone": "z1"})
    assert candidate_nodes(read_pod(pod), nodes) == ["n2"]
    assert candidate_nodes(read_pod(_pod(selector={"kubernetes.io/hostname": "n2"})), nodes) == ["n2"]


def test_a_pool_relabelled_at_once_is_selected_as_a_fresh_snapshot_selects_it() -> None:
    """An update that moves more than 64 nodes in or out of a label pair takes the index's bulk path (and
    stays an update, not a rebuild, up to a sixteenth of the nodes)."""
    nodes = {f"n{i:04}": NodeFacts("containerd", None, None, {"pool": "p1"}) for i in range(1100)}
    before = node_snapshot(nodes)
    moved = [f"n{i:04}" for i in range(0, 660, 10)]  # 66 nodes
    for name in moved:
        nodes[name] = NodeFacts("containerd", None, None, {"pool": "p2"})
    after = node_snapshot(nodes, before, changed=moved)
    relisted = node_snapshot(nodes, before, changed=None)  # a relist says nothing of what changed
    for pool, expected in (("p2", moved), ("p1", sorted(set(nodes) - set(moved)))):
        for snapshot in (after, relisted, node_snapshot(nodes)):
            assert candidate_nodes(read_pod(_pod(selector={"pool": pool})), snapshot) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"nodeSelector": {"zone": 1}}, r"^spec.nodeSelector must be an object of strings$"),
        ({"nodeSelector": ["zone=z1"]}, r"^spec.nodeSelector must be an object of strings$"),
        (
            {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}},
            r"^spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution must be an object, not array$",
        ),
        (
            {
                "affinity": {
                    "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": {}}}
                }
            },
            r"^spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
            r" must be an array$",
        ),
    ],
)
def test_an_unreadable_node_selection_is_named(spec: dict[str, Any], message: str) -> None:
    pod = _pod()
    pod["spec"].update(spec)
    with pytest.raises(PodShapeError, match=message):
        candidate_nodes(read_pod(pod), NODES)
