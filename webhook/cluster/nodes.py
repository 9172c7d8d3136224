"""The node cache: per node only (flavour, cri-socket annotation, distribution, labels).

Nodes are listed and watched as the API server's Table rendering (see informer.py): its
`Container-Runtime` column is `status.nodeInfo.containerRuntimeVersion` ("<unknown>" when empty;
kubernetes pkg/printers/internalversion/printers.go, printNode), and each row carries the node's
metadata. A 65,000-node relist is then a few tens of megabytes instead of most of a gigabyte.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from webhook import objects
from webhook.cluster.informer import Informer, ListCall
from webhook.mutation.facts import NodeFacts, NodeSnapshot, node_snapshot
from webhook.mutation.nodeindex import LabelShapes
from webhook.mutation.runtime import CRI_SOCKET_ANNOTATION, node_facts, node_group

NO_ANNOTATIONS: Mapping[str, str] = MappingProxyType({})


def _runtime_version(obj: objects.Node) -> Any:
    node_info = (obj.get("status") or {}).get("nodeInfo") or {}
    return node_info.get("containerRuntimeVersion") if isinstance(node_info, dict) else None


def _held_unchanged(
    held: Mapping[str, NodeFacts] | None,
    name: Any,
    labels: objects.JSONObject,
    *,
    version: Any,
    kept: Mapping[str, str],
) -> NodeFacts | None:
    """The facts held for the node when projecting it again would give equal facts, else None."""
    old = held.get(name) if held is not None and isinstance(name, str) else None
    if old is not None and old.labels == labels and node_group(version, labels, kept) == old.group:
        return old
    return None


def project_node(
    obj: objects.Node, shapes: LabelShapes | None = None, held: Mapping[str, NodeFacts] | None = None
) -> NodeFacts:
    """`shapes` makes the node's labels, sharing what nodes have in common (nodeindex.py). `held`: the
    facts already cached; a node whose facts are unchanged (a status update, most of a relist) gets the
    very object held, without making its labels again."""
    metadata = obj.get("metadata") or {}
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    if not isinstance(labels, dict) or not isinstance(annotations, dict):
        raise TypeError("node labels and annotations must be objects")
    if not isinstance(annotations.get(CRI_SOCKET_ANNOTATION) or "", str):  # the rules read it as a path
        raise TypeError(f"the node's {CRI_SOCKET_ANNOTATION} annotation must be a string")
    version = _runtime_version(obj)
    # Only the one annotation the rules read is kept; labels are kept whole (node selectors read any).
    kept = (
        {CRI_SOCKET_ANNOTATION: annotations[CRI_SOCKET_ANNOTATION]}
        if CRI_SOCKET_ANNOTATION in annotations
        else NO_ANNOTATIONS
    )
    name = metadata.get("name")
    old = _held_unchanged(held, name, labels, version=version, kept=kept)
    if old is not None:
        return old
    return node_facts(version, (shapes or LabelShapes())(name if isinstance(name, str) else "", labels), kept)


RUNTIME_COLUMN = "Container-Runtime"


def node_from_row(row: objects.TableRow, columns: list[str]) -> objects.Node | None:
    """A Table row as the little of a Node that project_node reads; None when the row cannot say."""
    obj, cells = row.get("object"), row.get("cells")
    if not isinstance(obj, dict) or not isinstance(cells, list) or RUNTIME_COLUMN not in columns:
        return None
    index = columns.index(RUNTIME_COLUMN)
    runtime = cells[index] if index < len(cells) else None
    if not isinstance(runtime, str) or runtime == "<unknown>":
        runtime = None
    return {"metadata": obj.get("metadata"), "status": {"nodeInfo": {"containerRuntimeVersion": runtime}}}


class NodeCache:
    def __init__(self, list_call: ListCall, **informer_options: Any) -> None:
        informer_options.setdefault("table", node_from_row)
        self.shapes = LabelShapes()
        self.snapshot: NodeSnapshot = node_snapshot({})
        self.version = 0  # counts snapshots, so a preview worker is sent the table only when it changed
        self.listeners: list[Callable[[Mapping[str, NodeFacts]], None]] = []
        self.informer: Informer[NodeFacts] = Informer(
            "node",
            list_call,
            lambda obj: project_node(obj, self.shapes, self.informer.items),
            on_change=self._changed,
            **informer_options,
        )

    def _changed(self, items: Mapping[str, NodeFacts], changed: frozenset[str] | None) -> None:
        self.snapshot = node_snapshot(items, self.snapshot, changed)
        self.shapes.trim(len(items))
        self.version += 1
        for listener in self.listeners:
            listener(items)

    @property
    def synced(self) -> bool:
        return self.informer.synced.is_set()

    def by_runtime(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for (flavour, _socket, _distro), n in self.snapshot.groups.items():
            counts[flavour or "unknown"] = counts.get(flavour or "unknown", 0) + n
        return counts
