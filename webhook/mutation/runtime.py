"""Which container runtime, and which socket, the pod's node will have. Pure.

The runtime of a node is the scheme of `status.nodeInfo.containerRuntimeVersion` (`containerd://1.7.7-k3s1.27`
is containerd); anything else, an empty value or `Unknown`, is not guessed. The socket comes from kubeadm's
`cri-socket` annotation when set, else from the distribution (k3s, microk8s), else from the flavour.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from webhook.config import FLAVOURS, ImagePullerSettings
from webhook.mutation.facts import ClusterFacts, Group, NodeFacts, NodeSnapshot, RequestFacts
from webhook.mutation.nodeindex import LabelIndex
from webhook.mutation.pod import PodView
from webhook.mutation.reasons import PullerSkip
from webhook.mutation.scheduling import candidate_nodes, selector_only

CRI_SOCKET_ANNOTATION = "kubeadm.alpha.kubernetes.io/cri-socket"
K3S_SOCKET = "/run/k3s/containerd/containerd.sock"
MICROK8S_SOCKET = "/var/snap/microk8s/common/run/containerd.sock"
K3S_LABEL = ("node.kubernetes.io/instance-type", "k3s")
MICROK8S_LABELS = ("node.kubernetes.io/microk8s-controlplane", "node.kubernetes.io/microk8s-worker")


def flavour_of(runtime_version: Any) -> str | None:
    if not isinstance(runtime_version, str) or "://" not in runtime_version:
        return None
    scheme = runtime_version.split("://", 1)[0].lower()
    return scheme if scheme in FLAVOURS else None


def node_group(runtime_version: Any, labels: Mapping[str, str], annotations: Mapping[str, str]) -> Group:
    """(flavour, cri socket, distribution): the runtime group of a node, the NodeFacts but its labels."""
    flavour = flavour_of(runtime_version)
    socket = annotations.get(CRI_SOCKET_ANNOTATION) or None
    if socket is not None:
        socket = socket.removeprefix("unix://")
    distro = None
    if (isinstance(runtime_version, str) and "-k3s" in runtime_version) or labels.get(K3S_LABEL[0]) == K3S_LABEL[1]:
        distro = "k3s"
    elif any(key in labels for key in MICROK8S_LABELS):
        distro = "microk8s"
    return (flavour, socket, distro)


def node_facts(runtime_version: Any, labels: Mapping[str, str], annotations: Mapping[str, str]) -> NodeFacts:
    return NodeFacts(*node_group(runtime_version, labels, annotations), labels)


class Runtime(NamedTuple):
    flavour: str
    socket: str
    client: str  # the API the puller speaks on the socket: "docker" (Docker Engine API) or "cri" (CRI gRPC)
    source: str  # which node or rule decided, for previews and audit


def socket_of(group: tuple[str | None, str | None, str | None], settings: ImagePullerSettings) -> tuple[str, str]:
    """(socket, client) for a node's runtime group (NodeFacts.group) of a known flavour."""
    flavour, cri_socket, distro = group
    assert flavour is not None
    if cri_socket:
        # With dockershim gone, a kubeadm docker node's CRI socket is cri-dockerd's: speak CRI to it.
        return cri_socket, "cri"
    if distro == "k3s" and flavour == "containerd":
        return K3S_SOCKET, "cri"
    if distro == "microk8s" and flavour == "containerd":
        return MICROK8S_SOCKET, "cri"
    return _default(flavour, settings)


def _default(flavour: str, settings: ImagePullerSettings) -> tuple[str, str]:
    """The configured socket of a flavour, and the client that speaks its API."""
    return settings.sockets.of(flavour), "docker" if flavour == "docker" else "cri"


def configured(flavour: str, settings: ImagePullerSettings, source: str) -> Runtime:
    return Runtime(flavour, *_default(flavour, settings), source)


# --- candidate nodes ---------------------------------------------------------------------------------


# --- the decision --------------------------------------------------------------------------------------


@dataclass(slots=True)
class RuntimeDecision:
    runtime: Runtime | None = None
    skip_reason: PullerSkip | None = None
    warning: str | None = None
    pin: str | None = None  # a flavour the pod must be pinned to (heterogeneous: pin)


def _describe(counts: Counter[str | None]) -> str:
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0] is None, kv[0] or ""))
    return ", ".join(f"{k or 'unknown'} on {n}" for k, n in ordered)


def decide_runtime(
    view: PodView, request: RequestFacts, cluster: ClusterFacts, *, settings: ImagePullerSettings
) -> RuntimeDecision:
    if request.runtime is not None:
        return RuntimeDecision(configured(request.runtime, settings, "query"))
    if settings.runtime != "auto":
        return RuntimeDecision(configured(settings.runtime, settings, "imagePuller.runtime"))
    snapshot = cluster.nodes
    if cluster.node_state == "none" or snapshot is None:
        if request.node is not None:
            source = f"imagePuller.defaultRuntime (node {request.node} unknown without cluster access)"
        else:
            source = "imagePuller.defaultRuntime"
        return RuntimeDecision(configured(settings.default_runtime, settings, source))
    if cluster.node_state == "unsynced":
        return RuntimeDecision(
            skip_reason="cache-unsynced", warning="no image puller: the node cache has not synced yet"
        )
    runtimes, source = _candidate_runtimes(view, request, snapshot, settings=settings)
    return _from_runtimes(runtimes, source, settings)


RuntimeKey = tuple[str, str, str] | None  # (flavour, socket, client), or None for an unknown runtime


Groups = Counter[tuple[str | None, str | None, str | None] | None]
MEMO_LIMIT = 1024  # node selectors whose candidates' runtimes are kept per node snapshot


def _candidate_groups(view: PodView, request: RequestFacts, snapshot: NodeSnapshot) -> tuple[Groups, str]:
    """The candidate nodes' runtime groups, counted, and a word on which nodes those were."""
    names = [request.node] if request.node is not None else candidate_nodes(view, snapshot)
    groups: Groups
    if names is None:
        groups = Counter(snapshot.groups)
        return groups, f"all {sum(groups.values())} nodes"
    nodes = snapshot.nodes
    groups = Counter(nodes[n].group if n in nodes else None for n in names)
    return groups, f"node {names[0]}" if len(names) == 1 else f"{len(names)} candidate nodes"


def _kept_groups(view: PodView, request: RequestFacts, snapshot: NodeSnapshot) -> tuple[Groups, str]:
    """_candidate_groups, kept with the snapshot's label index for a pod that only a nodeSelector restricts:
    the pods of a node pool all ask the same, so the candidates are counted once per snapshot and selector,
    not per admission (docs/performance.md has the measure).
    Only selectors that match nodes are kept, so a pod author's made-up labels take no room."""
    index = snapshot.by_label
    key = selector_only(view) if request.node is None else None
    if key is None or not isinstance(index, LabelIndex) or index.nodes is not snapshot.nodes:
        return _candidate_groups(view, request, snapshot)
    found: tuple[Groups, str] | None = index.memo.get(key)
    if found is None:
        found = _candidate_groups(view, request, snapshot)
        if found[0] and len(index.memo) < MEMO_LIMIT:
            index.memo[key] = found
    return found


def _candidate_runtimes(
    view: PodView, request: RequestFacts, snapshot: NodeSnapshot, *, settings: ImagePullerSettings
) -> tuple[Counter[RuntimeKey], str]:
    """Every candidate node's runtime, counted, and a word on which nodes those were."""
    groups, source = _kept_groups(view, request, snapshot)
    runtimes: Counter[RuntimeKey] = Counter()
    for group, count in groups.items():
        runtimes[(group[0], *socket_of(group, settings)) if group and group[0] else None] += count
    return runtimes, source


def _from_runtimes(runtimes: Counter[RuntimeKey], source: str, settings: ImagePullerSettings) -> RuntimeDecision:
    if not runtimes:
        return RuntimeDecision(
            skip_reason="no-candidate-nodes", warning="no image puller: no node matches the pod's node selection"
        )
    if len(runtimes) == 1:
        (only,) = runtimes
        if only is None:
            return RuntimeDecision(
                skip_reason="unknown-runtime", warning=f"no image puller: the runtime of {source} is unknown"
            )
        return RuntimeDecision(Runtime(*only, source))
    return _heterogeneous(runtimes, settings)


def _heterogeneous(runtimes: Counter[RuntimeKey], settings: ImagePullerSettings) -> RuntimeDecision:
    """Candidates disagree: skip, or pin the pod to the runtime most of them run."""
    flavours: Counter[str | None] = Counter()
    for key, count in runtimes.items():
        flavours[key[0] if key else None] += count
    what = f"candidate nodes disagree ({_describe(flavours)})"
    if settings.heterogeneous == "skip":
        return RuntimeDecision(skip_reason="heterogeneous", warning=f"no image puller: {what}")
    known = [(count, flavour) for flavour, count in flavours.items() if flavour is not None]
    if not known:
        return RuntimeDecision(skip_reason="unknown-runtime", warning=f"no image puller: {what}")
    best = min(known, key=lambda cf: (-cf[0], cf[1]))[1]  # most nodes; a tie goes to the first by name
    sockets = {key for key in runtimes if key and key[0] == best}
    if len(sockets) > 1:
        return RuntimeDecision(
            skip_reason="heterogeneous-sockets", warning=f"no image puller: {best} nodes use different sockets"
        )
    ((flavour, socket, client),) = sockets
    return RuntimeDecision(Runtime(flavour, socket, client, f"pinned to {flavour} ({what})"), pin=flavour)
