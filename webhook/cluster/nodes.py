"""The node cache: per node only (flavour, cri-socket annotation, distribution, labels)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from webhook.cluster.informer import Informer, ListCall
from webhook.mutation.facts import NodeFacts, NodeSnapshot, node_snapshot
from webhook.mutation.runtime import CRI_SOCKET_ANNOTATION, node_facts


def project_node(obj: dict[str, Any]) -> NodeFacts:
    metadata = obj.get("metadata") or {}
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    if not isinstance(labels, dict) or not isinstance(annotations, dict):
        raise TypeError("node labels and annotations must be objects")
    node_info = (obj.get("status") or {}).get("nodeInfo") or {}
    version = node_info.get("containerRuntimeVersion") if isinstance(node_info, dict) else None
    # Only the one annotation the rules read is kept; labels are kept whole (node selectors read any).
    kept = {CRI_SOCKET_ANNOTATION: annotations[CRI_SOCKET_ANNOTATION]} if CRI_SOCKET_ANNOTATION in annotations else {}
    return node_facts(version, {str(k): str(v) for k, v in labels.items()}, kept)


class NodeCache:
    def __init__(self, list_call: ListCall, **informer_options: Any) -> None:
        self.snapshot: NodeSnapshot = node_snapshot({})
        self.version = 0  # counts snapshots, so a preview worker is sent the table only when it changed
        self.listeners: list[Callable[[Mapping[str, NodeFacts]], None]] = []
        self.informer: Informer[NodeFacts] = Informer(
            "node", list_call, project_node, self._changed, **informer_options
        )

    def _changed(self, items: Mapping[str, NodeFacts]) -> None:
        self.snapshot = node_snapshot(items)
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
