"""The node cache reads nodes as the API server's Table rendering and keeps them compactly; these tests
prove that changes nothing a decision reads: the golden node sets, read as full Node objects and as Table
rows, give the same facts, the same label-index answers and the same runtime decisions; the cache fed by
Table lists and watches equals the one fed by full objects; an incremental snapshot equals a full build.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.environment import eventually
from harness.fake_apiserver import NODE_COLUMNS, FakeAPIServer, node, node_row
from tests.helpers import GOLDEN, load_yaml
from tests.test_golden import _case, _run
from webhook.cluster import decoding
from webhook.cluster.access import api_client
from webhook.cluster.nodes import NodeCache, node_from_row, project_node
from webhook.config import ClusterSettings
from webhook.mutation.facts import NodeFacts, NodeSnapshot, node_snapshot
from webhook.mutation.nodeindex import IdTable, LabelIndex, LabelShapes, NodeLabels

NODES = "/api/v1/nodes"
COLUMNS: list[str] = [str(c["name"]) for c in NODE_COLUMNS]


def _golden_node_sets() -> dict[str, list[dict[str, Any]]]:
    sets = {}
    for path in sorted(GOLDEN.glob("*.context.yaml")):
        context = load_yaml(path) or {}
        if context.get("nodes"):
            sets[path.name.removesuffix(".context.yaml")] = context["nodes"]
    return sets


GOLDEN_SETS = _golden_node_sets()


def _full(spec: dict[str, Any]) -> dict[str, Any]:
    """The golden node as the API server stores it (images, conditions and all)."""
    obj = node(spec["name"], spec.get("runtime") or "", spec.get("labels"), spec.get("annotations"))
    obj["metadata"]["labels"] = dict(spec.get("labels") or {})  # exactly the golden labels
    return obj


def _via_table(obj: dict[str, Any]) -> dict[str, Any]:
    """What the cache reads of `obj` from a Table list: the row, through JSON, then read back."""
    row = json.loads(json.dumps(node_row(obj)))
    read = node_from_row(row, COLUMNS)
    assert read is not None
    return read


def _index(snapshot: NodeSnapshot) -> dict[tuple[str, str], set[str]]:
    return {pair: set(names) for pair, names in snapshot.by_label.items()}


def test_golden_sets_exist() -> None:
    assert len(GOLDEN_SETS) >= 10
    runtimes = {n.get("runtime") for nodes in GOLDEN_SETS.values() for n in nodes}
    assert {"", "containerd://1.7.11", "docker://24.0.7"} <= runtimes


@pytest.mark.parametrize("case", sorted(GOLDEN_SETS))
def test_full_objects_and_table_rows_give_the_same_facts_and_decisions(case: str) -> None:
    full = [_full(spec) for spec in GOLDEN_SETS[case]]
    shared = LabelShapes()
    old = {o["metadata"]["name"]: project_node(o) for o in full}
    new = {o["metadata"]["name"]: project_node(_via_table(o), shared) for o in full}
    assert old == new
    old_snapshot, new_snapshot = node_snapshot(old), node_snapshot(new)
    assert dict(old_snapshot.groups) == dict(new_snapshot.groups)
    assert _index(old_snapshot) == _index(new_snapshot)

    # The same review, decided with each, answers the same.
    obj, context = _case(case)
    spec_by_name = {n["name"]: n for n in context["nodes"]}
    assert set(spec_by_name) == set(new)
    answer = _run(obj, context)
    table_context = dict(
        context,
        nodes=[
            {
                "name": name,
                "runtime": _via_table(_full(spec))["status"]["nodeInfo"]["containerRuntimeVersion"] or "",
                "labels": dict(new[name].labels),
                "annotations": spec.get("annotations", {}),
            }
            for name, spec in spec_by_name.items()
        ],
    )
    assert _run(obj, table_context) == answer


def test_an_empty_runtime_is_unknown_either_way() -> None:
    obj = node("bare", "")
    row = node_row(obj)
    assert row["cells"][COLUMNS.index("Container-Runtime")] == "<unknown>"  # printNode's rendering
    assert project_node(_via_table(obj)) == project_node(obj)
    assert project_node(obj).flavour is None


def test_a_row_without_the_runtime_column_is_unreadable() -> None:
    row = node_row(node("n"))
    assert node_from_row(row, [c for c in COLUMNS if c != "Container-Runtime"]) is None
    assert node_from_row({"cells": row["cells"]}, COLUMNS) is None


def test_nodes_alike_share_their_labels_and_the_hostname_stays_their_own() -> None:
    shapes = LabelShapes()
    a = project_node(_via_table(node("a", labels={"zone": "eu-west-1a"})), shapes)
    b = project_node(_via_table(node("b", labels={"zone": "eu-west-1a"})), shapes)
    c = project_node(_via_table(node("c", labels={"zone": "eu-west-1b"})), shapes)
    assert isinstance(a.labels, NodeLabels)
    assert isinstance(b.labels, NodeLabels)
    assert isinstance(c.labels, NodeLabels)
    assert a.labels.shared_values is b.labels.shared_values  # one tuple for both: only the hostname differs
    assert a.labels.shared_values is not c.labels.shared_values
    assert a.labels["kubernetes.io/hostname"] == "a"
    assert b.labels["kubernetes.io/hostname"] == "b"
    assert sorted(a.labels.values()) == ["a", "eu-west-1a", "linux"]
    assert dict(a.labels) == {"kubernetes.io/hostname": "a", "kubernetes.io/os": "linux", "zone": "eu-west-1a"}
    assert a.labels == dict(a.labels)
    assert a.labels != dict(b.labels)
    assert a.labels != {**a.labels, "x": "y"}
    assert pickle.loads(pickle.dumps(a)) == a  # as a preview worker receives it


def test_label_values_that_are_not_strings_are_refused_and_shapes_keep_one_copy() -> None:
    shapes = LabelShapes()
    for bad in (None, ["a"], {"a": "b"}, 1):
        with pytest.raises(TypeError):
            shapes("n1", {"zone": bad})  # a null would otherwise read back as the node's own name
    first = shapes("n1", {"zone": "z" * 3, "id": "i-1"})
    cached = next(iter(shapes._values))
    assert cached is shapes._values[cached] is first.shared_values  # the key is the shared copy itself
    assert shapes("n2", {"zone": "z" * 3, "id": "i-2"}).shared_values[0] is first.shared_values[0]


def test_shapes_start_over_once_mostly_unused() -> None:
    shapes = LabelShapes()
    for i in range(3000):
        shapes(f"n{i}", {"id": f"v{i}"})
    shapes.trim(live=10)
    again = shapes("n0", {"id": "v0"})
    assert again == {"id": "v0"}
    assert len(shapes._values) == 1


def test_table_pages_and_events_are_read_without_managed_fields_to_the_same_facts() -> None:
    rows = [node_row(node(f"n{i}", labels={"zone": "a", "pool": f"p{i}"})) for i in range(3)]
    page = {"kind": "Table", "columnDefinitions": NODE_COLUMNS, "metadata": {"resourceVersion": "7"}, "rows": rows}
    data = orjson.dumps(page)
    read = decoding.table_page(data)
    assert "managedFields" in orjson.loads(data)["rows"][0]["object"]["metadata"]
    assert "managedFields" not in read["rows"][0]["object"]["metadata"]
    assert read["metadata"] == {"resourceVersion": "7"}
    whole = [project_node(_read(row)) for row in orjson.loads(data)["rows"]]
    assert [project_node(_read(row)) for row in read["rows"]] == whole
    event = orjson.dumps({"type": "MODIFIED", "object": page})
    assert [project_node(_read(r)) for r in decoding.table_event(event)["object"]["rows"]] == whole

    # What does not fit (a row's object not an object; an event's object a string) is parsed whole.
    page["rows"] = [*rows, {"cells": [], "object": "x"}]
    assert decoding.table_page(orjson.dumps(page))["rows"][-1] == {"cells": [], "object": "x"}
    assert decoding.table_event(b'{"type": "ERROR", "object": "gone"}') == {"type": "ERROR", "object": "gone"}
    with pytest.raises(orjson.JSONDecodeError):
        decoding.table_page(b'{"rows": [')
    deep = b'{"type": "ADDED", "object": {"metadata": {"labels": {"a": ' + b"[" * 5000 + b"]" * 5000 + b"}}}}"
    with pytest.raises(orjson.JSONDecodeError):  # past msgspec's depth: parsed whole, refused as malformed
        decoding.table_event(deep)


def _read(row: dict[str, Any]) -> dict[str, Any]:
    read = node_from_row(row, COLUMNS)
    assert read is not None
    return read


def test_unchanged_nodes_keep_their_objects() -> None:
    obj = node("a", labels={"zone": "z"})
    held = {"a": project_node(obj, LabelShapes())}
    again = project_node(_via_table(obj), LabelShapes(), held)
    assert again is held["a"]
    relabelled = node("a", labels={"zone": "y"})
    assert project_node(_via_table(relabelled), LabelShapes(), held).labels["zone"] == "y"
    # The same labels, but what the runtime rules read besides them changed: new facts, not the held ones.
    for changed, facts in (
        (node("a", "docker://24.0.7", labels={"zone": "z"}), ("docker", None, None)),
        (node("a", "containerd://1.7.7-k3s1", labels={"zone": "z"}), ("containerd", None, "k3s")),
        (
            node("a", labels={"zone": "z"}, annotations={"kubeadm.alpha.kubernetes.io/cri-socket": "unix:///c.sock"}),
            ("containerd", "/c.sock", None),
        ),
    ):
        projected = project_node(_via_table(changed), LabelShapes(), held)
        assert projected is not held["a"]
        assert projected.group == facts
        assert projected.labels == held["a"].labels


LABEL_KEYS = st.sampled_from(["kubernetes.io/hostname", "zone", "pool", "a"])
LABEL_VALUES = st.sampled_from(["n1", "n2", "eu-west-1a", "p"])


@settings(max_examples=300, deadline=None)
@given(
    labels=st.dictionaries(LABEL_KEYS, LABEL_VALUES),
    other=st.dictionaries(LABEL_KEYS, st.one_of(LABEL_VALUES, st.integers(0, 2), st.none())),
    reverse=st.booleans(),
)
def test_held_labels_equal_a_mapping_exactly_when_it_has_their_pairs(
    labels: dict[str, str], other: dict[str, Any], reverse: bool
) -> None:
    """Equal whatever the order of the keys (a relist's labels are compared position by position when they
    come in the order held), and the node's name stands in for its own value ("n1" here) either way."""
    held = LabelShapes()("n1", labels)
    for candidate in (other, dict(reversed(labels.items())) if reverse else dict(labels)):
        assert (held == candidate) is (labels == candidate)
        assert (candidate == held) is (labels == candidate)
        assert (held == _Plain(candidate)) is (labels == candidate)


class _Plain(dict[str, Any]):
    """A mapping that is not exactly a dict: compared key by key, not position by position."""


# --- the cache end to end: Table lists and watches against full objects ------------------------------------


def _cache(api: FakeAPIServer, tmp_path: Path, table: bool) -> NodeCache:
    client = api_client(ClusterSettings(kubeconfig=str(api.kubeconfig(tmp_path / "kc"))))
    assert client is not None
    from kubernetes.client import CoreV1Api

    options: dict[str, Any] = {"watch_seconds": 2, "backoff": (0.05, 0.2), "page_size": 7}
    if not table:
        options["table"] = None
    return NodeCache(CoreV1Api(client).list_node, **options)


def test_a_cache_fed_table_rows_equals_one_fed_full_objects(api: FakeAPIServer, tmp_path: Path) -> None:
    specs = [spec for nodes in GOLDEN_SETS.values() for spec in nodes]
    unique = {spec["name"]: spec for spec in specs}
    api.put_many(NODES, [_full(spec) for spec in unique.values()])
    table, full = _cache(api, tmp_path, True), _cache(api, tmp_path, False)
    for cache in (table, full):
        cache.informer.start()
        assert cache.informer.wait_synced(10)
    assert api.sent.get(f"{NODES} as Table")
    assert api.sent.get(NODES)

    # Watch events of every kind, each one seen through both.
    first = sorted(unique)[0]
    api.put(NODES, node("added", "docker://24.0.7", labels={"zone": "b"}))
    api.put(NODES, node(first, "containerd://1.7.11", labels={"zone": "relabelled"}))
    api.bookmark(NODES)
    api.put(NODES, node("added", "docker://24.0.7", labels={"zone": "b"}))  # status only: nothing changes
    api.delete(NODES, sorted(unique)[1])

    def same() -> bool:
        return dict(table.snapshot.nodes) == dict(full.snapshot.nodes) and "added" in table.snapshot.nodes

    try:
        assert eventually(same)
        assert _index(table.snapshot) == _index(full.snapshot)
        assert dict(table.snapshot.groups) == dict(full.snapshot.groups)
        assert table.snapshot.nodes[first].labels == {"zone": "relabelled", "kubernetes.io/hostname": first,
                                                      "kubernetes.io/os": "linux"}  # fmt: skip
        assert table.informer.skipped_events == 0
        # The watch sent column definitions with its first event only, as the API server does.
        assert _index(table.snapshot) == _index(node_snapshot(dict(table.snapshot.nodes)))
    finally:
        table.informer.stopping.set()
        full.informer.stopping.set()


def test_a_relist_that_finds_nothing_new_publishes_nothing(api: FakeAPIServer, tmp_path: Path) -> None:
    api.put_many(NODES, [node(f"n{i}", labels={"pool": f"p{i % 3}"}) for i in range(30)])
    cache = _cache(api, tmp_path, True)
    cache.informer.list_once()
    snapshot, version = cache.snapshot, cache.version
    cache.informer.list_once()
    assert cache.snapshot is snapshot
    assert cache.version == version


# --- the incremental snapshot --------------------------------------------------------------------------------

# Values include node names: a label equal to its own node's name (a hostname) is answered from the node.
LABELS = st.dictionaries(
    st.sampled_from(["zone", "pool", "kubernetes.io/hostname"]), st.sampled_from(["a", "b", "n1", "n2"]), max_size=3
)
FACTS = st.builds(
    NodeFacts,
    st.sampled_from([None, "containerd", "docker"]),
    st.sampled_from([None, "/run/cri.sock"]),
    st.sampled_from([None, "k3s"]),
    LABELS,
)
NAMES = st.sampled_from([f"n{i}" for i in range(12)])


@settings(max_examples=150, deadline=None)
@given(
    start=st.dictionaries(NAMES, FACTS, max_size=12),
    steps=st.lists(st.tuples(NAMES, st.one_of(st.none(), FACTS)), max_size=20),
)
def test_an_incremental_snapshot_equals_a_full_build(
    start: dict[str, NodeFacts], steps: list[tuple[str, NodeFacts | None]]
) -> None:
    shapes = LabelShapes()

    def compact(name: str, facts: NodeFacts) -> NodeFacts:  # as the cache holds them, every other node
        return facts._replace(labels=shapes(name, facts.labels)) if int(name[1:]) % 2 else facts

    nodes = {name: compact(name, facts) for name, facts in start.items()}
    snapshot = node_snapshot(nodes)
    kept = [snapshot]
    for name, facts in steps:
        if facts is None:
            nodes.pop(name, None)
        else:
            nodes[name] = compact(name, facts)
        snapshot = node_snapshot(dict(nodes), snapshot, frozenset((name,)))
        kept.append(snapshot)
        full = node_snapshot(dict(nodes))
        assert dict(snapshot.nodes) == dict(full.nodes)
        assert dict(snapshot.groups) == dict(full.groups)
        assert _index(snapshot) == _index(full) == _brute_index(nodes)
        for pair in _brute_index(nodes):
            assert all(n in snapshot.by_label[pair] for n in _brute_index(nodes)[pair])
        assert ("zone", "nowhere") not in snapshot.by_label
        assert "n0" not in snapshot.by_label.get(("zone", "x"), ())
    assert _index(kept[0]) == _brute_index({n: compact(n, f) for n, f in start.items()})  # older ones unchanged


def test_node_ids_are_found_by_name_and_never_reused() -> None:
    table = IdTable(["n3", "n1", "n2"])
    assert [table.get(n) for n in ("n1", "n2", "n3")] == [0, 1, 2]  # the build's names, sorted
    assert [table.get(n) for n in ("n0", "n9", "")] == [None, None, None]
    assert table.add("n2") == 1  # known: its id
    assert table.add("n0") == 3  # new, though it sorts first: appended, after every id in use
    assert (table.add("n0"), table.get("n0"), len(table)) == (3, 3, 4)
    assert table.names[3] == "n0"


def test_a_full_build_indexes_nodes_of_shared_and_own_labels_alike() -> None:
    shapes = LabelShapes()
    nodes: dict[str, NodeFacts] = {}
    for i in range(40):
        labels = {"pool": f"p{i % 3}", "zone": f"z{i % 2}", "kubernetes.io/hostname": f"n{i:02}"}
        facts = NodeFacts("containerd", None, None, labels)
        nodes[f"n{i:02}"] = facts._replace(labels=shapes(f"n{i:02}", labels)) if i % 4 else facts
    index = LabelIndex.build(nodes)
    assert _index(node_snapshot(nodes)) == {p: set(n) for p, n in index.items()} == _brute_index(nodes)
    assert sorted(index[("pool", "p1")]) == [f"n{i:02}" for i in range(40) if i % 3 == 1]
    assert "n01" in index[("pool", "p1")]
    assert "n02" not in index[("pool", "p1")]


def _brute_index(nodes: dict[str, NodeFacts]) -> dict[tuple[str, str], set[str]]:
    index: dict[tuple[str, str], set[str]] = {}
    for name, facts in nodes.items():
        for pair in facts.labels.items():
            index.setdefault(pair, set()).add(name)
    return index
