"""Facts the plan reads besides the pod: the request and what the caches know of the cluster.

Named tuples rather than frozen dataclasses: equally immutable, and cheaper to build on every request (a
frozen dataclass sets each field through object.__setattr__).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Literal, NamedTuple

from webhook.mutation.nodeindex import LabelIndex
from webhook.mutation.vocabulary import INJECT, MODE

INJECT_LABEL = INJECT
MODE_LABEL = MODE
PSA_ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
NAMESPACE_LABELS = (INJECT_LABEL, MODE_LABEL, PSA_ENFORCE_LABEL)  # all the namespace cache keeps

NodeState = Literal["none", "unsynced", "synced"]


class RequestFacts(NamedTuple):
    namespace: str
    runtime: str | None = None  # a preview's what-if: this flavour, whatever the nodes say
    node: str | None = None  # a preview's what-if: the pod lands on this node
    pod_security: str | None = None  # a preview's what-if: this Pod Security level is in force


class NodeFacts(NamedTuple):
    """The little the runtime rules read of a Node; the cache keeps nothing else."""

    flavour: str | None  # docker, containerd, cri-o; None when the runtime is unknown
    cri_socket: str | None  # kubeadm's cri-socket annotation, unix:// stripped
    distro: str | None  # k3s, microk8s or None
    labels: Mapping[str, str]

    @property
    def group(self) -> tuple[str | None, str | None, str | None]:
        return (self.flavour, self.cri_socket, self.distro)


class NodeSnapshot(NamedTuple):
    """An immutable view of the node cache: the nodes, and how many share each runtime (for pods that
    may land anywhere, so a request never walks thousands of nodes)."""

    nodes: Mapping[str, NodeFacts]
    groups: Mapping[tuple[str | None, str | None, str | None], int]
    # (key, value) -> the names of the nodes carrying it, for node selectors (nodeindex.LabelIndex)
    by_label: Mapping[tuple[str, str], Collection[str]]


Group = tuple[str | None, str | None, str | None]


def node_snapshot(
    nodes: Mapping[str, NodeFacts], previous: NodeSnapshot | None = None, changed: Collection[str] | None = None
) -> NodeSnapshot:
    """The snapshot of `nodes`. Given the previous snapshot and the names that changed since, only their
    entries are redone (the label index is updated for them, not rebuilt); the result is the same as a
    full build. A mapping that is already read-only is kept, not copied."""
    frozen_nodes = nodes if isinstance(nodes, MappingProxyType) else MappingProxyType(dict(nodes))
    index = previous.by_label if previous is not None else None
    if (
        previous is not None
        and changed is not None
        and isinstance(index, LabelIndex)
        and not index.stale()
        and len(changed) <= max(64, len(nodes) // 16)
    ):
        return _updated(frozen_nodes, previous, index, changed=changed)
    groups: dict[Group, int] = {}
    for facts in nodes.values():
        groups[facts.group] = groups.get(facts.group, 0) + 1
    return NodeSnapshot(frozen_nodes, MappingProxyType(groups), LabelIndex.build(frozen_nodes))


def _updated(
    nodes: Mapping[str, NodeFacts], previous: NodeSnapshot, index: LabelIndex, *, changed: Collection[str]
) -> NodeSnapshot:
    groups = dict(previous.groups)
    for name in changed:
        for facts, step in ((previous.nodes.get(name), -1), (nodes.get(name), 1)):
            if facts is None:
                continue
            groups[facts.group] = groups.get(facts.group, 0) + step
            if not groups[facts.group]:
                del groups[facts.group]
    return NodeSnapshot(nodes, MappingProxyType(groups), index.updated(nodes, previous.nodes, changed))


class ClusterFacts(NamedTuple):
    """What is known of the cluster. `namespace_labels` is None when the namespace is not known (no
    cluster access); `node_state` says whether there is a node cache and whether it has synced."""

    namespace_labels: Mapping[str, str] | None = None
    nodes: NodeSnapshot | None = None
    node_state: NodeState = "none"

    def label(self, key: str) -> str | None:
        return None if self.namespace_labels is None else self.namespace_labels.get(key)


NO_CLUSTER = ClusterFacts()


def cluster_facts(
    namespace_labels: Mapping[str, str] | None,
    nodes: Mapping[str, NodeFacts] | None = None,
    node_state: NodeState | None = None,
) -> ClusterFacts:
    if namespace_labels is None and nodes is None and node_state is None:
        return NO_CLUSTER
    labels = None if namespace_labels is None else MappingProxyType(dict(namespace_labels))
    snapshot = None if nodes is None else node_snapshot(nodes)
    state: NodeState = node_state or ("synced" if nodes is not None else "none")
    return ClusterFacts(labels, snapshot, state)


class Facts(NamedTuple):
    request: RequestFacts
    cluster: ClusterFacts = NO_CLUSTER


class ExportedFacts(NamedTuple):
    """The cluster facts as plain, picklable data, for a preview worker process: the namespaces' labels
    (None without cluster access) and the node snapshot's runtime groups; the worker asks for the nodes
    and label-index entries a pod needs (webhook/preview/workers.py), rather than holding a copy of every node."""

    namespaces: dict[str, dict[str, str]] | None
    node_state: NodeState
    groups: dict[Group, int]
    node_count: int


NO_FACTS = ExportedFacts(None, "none", {}, 0)
