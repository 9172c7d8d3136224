"""Tests that kill mutants `make mutation` found surviving in webhook/mutation/ (docs/testing.md): each
asserts what a user of the webhook would notice, the patch, the warnings, the audit annotation or the
metrics an operator scrapes."""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest

from tests.helpers import reasons
from webhook.cluster.nodes import project_node
from webhook.config import build_settings
from webhook.mutation.errors import PodShapeError
from webhook.mutation.facts import (
    ClusterFacts,
    Facts,
    NodeFacts,
    NodeSnapshot,
    RequestFacts,
    cluster_facts,
    node_snapshot,
)
from webhook.mutation.plan import KINDS, PTRACE, PULLER, Plan, plan
from webhook.mutation.pointer import join
from webhook.mutation.runtime import MICROK8S_SOCKET
from webhook.web.metrics import Metrics

FLYTE_IMAGE = "cr.flyte.org/flyteorg/flytecopilot:v1.15.0"
OUTPUTS = {"name": "flyte-outputs", "mountPath": "/var/flyte/outputs"}
PRIMARY = {"name": "main", "image": "python:3.11", "volumeMounts": [OUTPUTS]}
UPLOADER = {
    "name": "flyte-copilot-uploader",
    "image": FLYTE_IMAGE,
    "args": ["sidecar", "--from-local-dir", "/var/flyte/outputs"],
    "volumeMounts": [OUTPUTS],
}


def _pod(*containers: dict[str, Any], annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "p", "namespace": "ns"}
    if annotations is not None:
        metadata["annotations"] = annotations
    body = {"containers": [dict(c) for c in containers or (PRIMARY, UPLOADER)], **spec}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": body}


def _plan(pod: dict[str, Any], labels: dict[str, str] | None = None, **settings: Any) -> Plan:
    return plan(pod, Facts(RequestFacts("ns"), cluster_facts(labels)), build_settings(settings))


def _ptrace(pod: dict[str, Any], **settings: Any) -> Plan:
    return plan(pod, Facts(RequestFacts("ns")), build_settings(settings), kinds=(PTRACE,))


def _scraped(decided: Plan) -> str:
    """The plan's counters as an operator scrapes them from /metrics."""
    metrics = Metrics()
    metrics.count_plan(decided, "Fail")
    return metrics.render().decode()


def test_patch_paths_escape_slash_and_tilde_as_rfc_6901_says() -> None:
    """The API server reads each operation's path as a JSON Pointer: the `/` of an annotation key is `~1`."""
    assert join("metadata", "annotations", "copilot-webhook.io/mutated") == (
        "/metadata/annotations/copilot-webhook.io~1mutated"
    )
    assert join("spec", "a~/b", 0) == "/spec/a~0~1b/0"


@pytest.mark.parametrize(
    ("annotations", "labels", "reason"),
    [
        ({"copilot-webhook.io/inject": "false"}, None, "pod-opt-out"),
        (None, {"copilot-webhook.io/inject": "disabled"}, "namespace-opt-out"),
    ],
)
def test_an_opted_out_pod_is_counted_as_skipped_for_each_kind(
    annotations: dict[str, str] | None, labels: dict[str, str] | None, reason: str
) -> None:
    decided = _plan(_pod(annotations=annotations), labels)
    assert (decided.changes, decided.warnings, decided.audit) == ([], [], {})
    scraped = _scraped(decided)
    for kind in KINDS:
        assert f'copilot_webhook_skips_total{{kind="{kind}",reason="{reason}"}} 1.0' in scraped
    assert "copilot_webhook_mutations_total{" not in scraped


def _puller_plan(pod: dict[str, Any], nodes: dict[str, Any], **settings: Any) -> Plan:
    facts = Facts(RequestFacts("ns"), cluster_facts({}, nodes))
    return plan(pod, facts, build_settings(settings), kinds=(PULLER,))


def _node(name: str, runtime: str, labels: dict[str, Any], annotations: dict[str, str] | None = None) -> NodeFacts:
    """A node as the node cache holds it: projected from the API server's object, its labels shared."""
    metadata = {"name": name, "labels": labels, "annotations": annotations or {}}
    return project_node({"metadata": metadata, "status": {"nodeInfo": {"containerRuntimeVersion": runtime}}})


@pytest.mark.parametrize(
    ("labels", "socket"),
    [
        ({"kubernetes.io/hostname": "n1", "zone": "b"}, "containerd:/run/containerd/containerd.sock"),
        ({"node.kubernetes.io/microk8s-worker": "microk8s-worker"}, "containerd:" + MICROK8S_SOCKET),
    ],
)
def test_the_puller_uses_the_socket_of_the_distribution_the_cached_node_runs(
    labels: dict[str, str], socket: str
) -> None:
    decided = _puller_plan(_pod(), {"n1": _node("n1", "containerd://1.7.11", labels)})
    assert decided.audit == {PULLER: socket}
    puller = next(c.op["value"] for c in decided.changes if c.op["path"] == "/spec/initContainers")[0]
    assert f"--socket={socket.partition(':')[2]}" in puller["args"]


def test_a_pinned_pod_is_told_why_each_requirement_was_added() -> None:
    """/preview lists every operation with its reason; a pin names the runtime it pins to."""
    nodes = {
        "n1": _node("n1", "containerd://1.7.11", {}),
        "n2": _node("n2", "containerd://1.7.11", {}),
        "d1": _node("d1", "docker://24.0.7", {}),
    }
    decided = _puller_plan(_pod(), nodes, imagePuller={"heterogeneous": "pin"})
    pins = [c for c in decided.changes if c.op["path"].startswith("/spec/affinity")]
    assert [(c.op["path"], c.reason) for c in pins] == [
        ("/spec/affinity", "pin the pod to containerd nodes: the puller speaks containerd")
    ]


PTRACE_ADDED = {"securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}}


@pytest.mark.parametrize(
    ("ptrace", "primary", "expected"),
    [
        (
            {"target": "primary"},
            PRIMARY,
            [
                (
                    "/spec/containers/0/securityContext",
                    "main: the primary container gets SYS_PTRACE (ptrace.target primary)",
                ),
                ("/spec/shareProcessNamespace", "the copilot watches the primary process"),
            ],
        ),
        (
            {"target": "sidecar"},
            {**PRIMARY, **PTRACE_ADDED},
            [
                (
                    "/spec/containers/1/securityContext",
                    "flyte-copilot-uploader: the copilot watcher gets SYS_PTRACE (ptrace.target sidecar)",
                ),
                (
                    "/spec/containers/0/securityContext/capabilities/add/0",
                    "main: ptrace.target sidecar grants SYS_PTRACE to the copilot watcher alone",
                ),
                ("/spec/shareProcessNamespace", "the copilot watches the primary process"),
            ],
        ),
        (
            {"mode": "drop"},
            {**PRIMARY, **PTRACE_ADDED},
            [("/spec/containers/0/securityContext/capabilities/add/0", "main: ptrace.mode drop removes SYS_PTRACE")],
        ),
        (
            {"mode": "drop"},
            {**PRIMARY, "securityContext": {"capabilities": {"add": ["ALL"]}}},
            [
                (
                    "/spec/containers/0/securityContext/capabilities/drop",
                    "main: adds ALL capabilities; SYS_PTRACE is dropped explicitly",
                )
            ],
        ),
    ],
)
def test_each_ptrace_operation_is_listed_with_why(
    ptrace: dict[str, str], primary: dict[str, Any], expected: list[tuple[str, str]]
) -> None:
    decided = _ptrace(_pod(primary, UPLOADER), ptrace=ptrace)
    assert reasons(decided)[:-1] == expected  # the last records what the webhook did


@pytest.mark.parametrize(
    ("containers", "undecided"),
    [
        # the uploader names no directory after its flag: no data volume, so no primary
        (
            ({**PRIMARY}, {**UPLOADER, "args": ["sidecar", "--from-local-dir"]}),
            "no single primary container: mounting the copilot's volumes: none",
        ),
        # two regular containers mount the data volume; their names are cut to keep the warning short
        (
            ({**PRIMARY, "name": "m" * 40}, {**PRIMARY, "name": "n" * 40}, UPLOADER),
            "no single primary container: mounting the copilot's volumes: " + "m" * 40 + ", " + "n" * 18,
        ),
    ],
)
def test_a_pod_without_a_single_primary_is_undecided_and_says_why(
    containers: tuple[dict[str, Any], ...], undecided: str
) -> None:
    decided = _ptrace(_pod(*containers), ptrace={"target": "primary"})
    assert decided.undecided == undecided
    assert decided.changes == []


def test_a_downloader_without_arguments_does_not_hide_the_uploaders_data_volume() -> None:
    pod = _pod(PRIMARY, UPLOADER)
    pod["spec"]["initContainers"] = [{"name": "flyte-copilot-downloader", "image": FLYTE_IMAGE}]
    decided = _ptrace(pod, ptrace={"target": "primary"})
    assert decided.undecided is None
    assert (
        "/spec/containers/0/securityContext",
        "main: the primary container gets SYS_PTRACE (ptrace.target primary)",
    ) in (reasons(decided))


def test_an_uploader_run_as_a_plain_init_container_is_no_native_sidecar() -> None:
    """Only an init container with restartPolicy Always is the native sidecar of Flyte 1.16; the audit
    annotation says which reason left the pod without SYS_PTRACE."""
    pod = _pod(PRIMARY)
    pod["spec"]["initContainers"] = [dict(UPLOADER)]
    assert _ptrace(pod).audit[PTRACE] == "add:none(no-watcher)"
    pod["spec"]["initContainers"][0]["restartPolicy"] = "Always"
    assert _ptrace(pod).audit[PTRACE] == "add:none(native-sidecar)"


def test_mutations_are_counted_by_what_was_applied() -> None:
    nodes = {"n1": _node("n1", "containerd://1.7.11", {})}
    decided = plan(_pod(), Facts(RequestFacts("ns"), cluster_facts({}, nodes)), build_settings({}))
    assert decided.audit == {PTRACE: "add:primary", PULLER: "containerd:/run/containerd/containerd.sock"}
    scraped = _scraped(decided)
    assert 'copilot_webhook_mutations_total{kind="ptrace",mode="enforce",reason="add"} 1.0' in scraped
    assert 'copilot_webhook_mutations_total{kind="image-puller",mode="enforce",reason="containerd"} 1.0' in scraped


@pytest.mark.parametrize("socket", [None, "/run/containerd/a=b.sock"])
def test_a_pod_reviewed_again_after_both_mutations_is_left_as_it_is(socket: str | None) -> None:
    """The API server may call the webhooks again (reinvocationPolicy: IfNeeded): our own puller, recorded in
    the mutated annotation, is ours, never a name clash, whatever the socket's path holds."""
    settings = build_settings({"imagePuller": {"sockets": {"containerd": socket}}} if socket else {})
    facts = Facts(RequestFacts("ns", runtime="containerd"))
    pod = _pod(imagePullSecrets=[{"name": "regcred"}])
    first = plan(pod, facts, settings)
    assert first.outcomes[PULLER].mutated
    again = plan(jsonpatch.apply_patch(pod, [c.op for c in first.changes]), facts, settings)
    assert (again.undecided, again.changes, again.warnings) == (None, [], [])
    assert again.outcomes[PULLER].reason == "already-injected"


def test_the_mutated_annotation_keeps_what_others_wrote_there_after_ours() -> None:
    """Parts another writer put in `copilot-webhook.io/mutated` stay, after ours; text that is no part is dropped."""
    pod = _pod(annotations={"copilot-webhook.io/mutated": "zz=1;junk"})
    decided = _ptrace(pod)
    assert reasons(decided)[-1] == ("/metadata/annotations/copilot-webhook.io~1mutated", "record what the webhook did")
    assert decided.changes[-1].op["value"] == "ptrace=add:primary;zz=1"


def test_a_pod_without_metadata_or_annotations_gains_them_with_the_mutated_annotation() -> None:
    pod = _pod()
    assert reasons(_ptrace(pod))[-1] == ("/metadata/annotations", "record what the webhook did")
    del pod["metadata"]
    decided = _ptrace(pod)
    assert reasons(decided)[-1] == ("/metadata", "record what the webhook did")
    assert decided.changes[-1].op["value"] == {"annotations": {"copilot-webhook.io/mutated": "ptrace=add:primary"}}


def test_a_pod_annotated_with_the_clusters_own_mode_is_not_warned() -> None:
    assert _ptrace(_pod(annotations={"copilot-webhook.io/ptrace": "add"})).warnings == []


def test_an_unknown_ptrace_annotation_is_quoted_cut_to_20_characters() -> None:
    decided = _ptrace(_pod(annotations={"copilot-webhook.io/ptrace": "a" * 30}))
    assert decided.warnings == [f"copilot-webhook.io/ptrace={'a' * 20!r} ignored: expected add, drop or keep"]


@pytest.mark.parametrize(
    ("level", "namespace", "expected"),
    [
        ("baseline", None, ["SYS_PTRACE not added: Pod Security 'baseline' (what-if) forbids it"]),
        ("privileged", "restricted", []),
    ],
)
def test_a_preview_asking_what_if_a_pod_security_level_is_in_force_gets_that_level(
    level: str, namespace: str | None, expected: list[str]
) -> None:
    labels = {"pod-security.kubernetes.io/enforce": namespace} if namespace else None
    facts = Facts(RequestFacts("ns", pod_security=level), cluster_facts(labels))
    decided = plan(_pod(), facts, build_settings({}), kinds=(PTRACE,))
    assert decided.warnings == expected
    assert decided.outcomes[PTRACE].mutated is not bool(expected)


def test_a_pod_undecided_for_both_kinds_is_told_both_reasons() -> None:
    socket = {"name": "copilot-webhook-runtime-socket", "emptyDir": {}}
    pod = _pod({**PRIMARY, "volumeMounts": []}, UPLOADER, volumes=[socket])
    decided = plan(pod, Facts(RequestFacts("ns", runtime="containerd")), build_settings({}))
    assert decided.undecided == (
        "no single primary container: mounting the copilot's volumes: none; "
        "the name copilot-webhook-runtime-socket is already used by the pod"
    )


def test_an_object_that_is_no_pod_is_a_bad_request_naming_its_type() -> None:
    with pytest.raises(PodShapeError, match=r"^pod must be an object, not array$"):
        _ptrace([])  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [None, 1])
def test_a_node_label_value_that_is_no_string_is_refused_saying_so(value: Any) -> None:
    """The node cache skips such a node and logs this message with it."""
    with pytest.raises(TypeError, match=r"^node label values must be strings$"):
        _node("n1", "containerd://1.7.11", {"zone": value})


@pytest.mark.parametrize(
    ("nodes", "warning"),
    [
        # a tie is told in the order of the runtimes' names, whichever node came first
        ({"d1": ("docker://24.0.7", {}), "c1": ("containerd://1.7.11", {})}, "containerd on 1, docker on 1"),
        # nodes of one runtime on different sockets (k3s's own) are counted together
        (
            {
                "c1": ("containerd://1.7.11", {}),
                "k1": ("containerd://1.7.11-k3s1", {}),
                "d1": ("docker://24.0.7", {}),
            },
            "containerd on 2, docker on 1",
        ),
    ],
)
def test_disagreeing_nodes_are_counted_by_runtime_in_the_warning(
    nodes: dict[str, tuple[str, dict[str, str]]], warning: str
) -> None:
    decided = _puller_plan(_pod(), {name: _node(name, *node) for name, node in nodes.items()})
    assert decided.warnings == [f"no image puller: candidate nodes disagree ({warning})"]


def test_a_pin_to_a_runtime_on_different_sockets_is_skipped_and_audited_so() -> None:
    nodes = {
        "c1": _node("c1", "containerd://1.7.11", {}),
        "k1": _node("k1", "containerd://1.7.11-k3s1", {}),
        "d1": _node("d1", "docker://24.0.7", {}),
    }
    decided = _puller_plan(_pod(), nodes, imagePuller={"heterogeneous": "pin"})
    assert decided.changes == []
    assert decided.warnings == ["no image puller: containerd nodes use different sockets"]
    assert decided.audit == {PULLER: "skipped(heterogeneous-sockets)"}


def test_a_pod_on_a_named_node_is_decided_by_that_node_even_after_its_pools_answer_was_kept() -> None:
    nodes = {
        "c1": _node("c1", "containerd://1.7.11", {"pool": "p"}),
        "c2": _node("c2", "containerd://1.7.11", {"pool": "p"}),
        "d1": _node("d1", "docker://24.0.7", {"pool": "p"}),
    }
    facts = Facts(RequestFacts("ns"), cluster_facts({}, nodes))
    settings = build_settings({"imagePuller": {"heterogeneous": "pin"}})
    pooled = plan(_pod(nodeSelector={"pool": "p"}), facts, settings, kinds=(PULLER,))
    assert pooled.runtime is not None
    assert pooled.runtime.source == "pinned to containerd (candidate nodes disagree (containerd on 2, docker on 1))"
    named = plan(_pod(nodeSelector={"pool": "p"}, nodeName="d1"), facts, settings, kinds=(PULLER,))
    assert named.audit == {PULLER: "docker:/var/run/docker.sock"}
    other = plan(_pod(nodeName="c1"), facts, settings, kinds=(PULLER,))
    assert other.audit == {PULLER: "containerd:/run/containerd/containerd.sock"}
    what_if = Facts(RequestFacts("ns", node="d1"), facts.cluster)
    previewed = plan(_pod(nodeSelector={"pool": "p"}), what_if, settings, kinds=(PULLER,))
    assert previewed.audit == {PULLER: "docker:/var/run/docker.sock"}


@pytest.mark.parametrize(
    ("spec", "warning", "audit"),
    [
        ({"nodeName": "ghost"}, "no image puller: the runtime of node ghost is unknown", "skipped(unknown-runtime)"),
        (
            {"nodeSelector": {"pool": "none"}},
            "no image puller: no node matches the pod's node selection",
            "skipped(no-candidate-nodes)",
        ),
    ],
)
def test_a_pod_whose_nodes_say_nothing_of_their_runtime_gets_no_puller(
    spec: dict[str, Any], warning: str, audit: str
) -> None:
    decided = _puller_plan(_pod(**spec), {"c1": _node("c1", "containerd://1.7.11", {})})
    assert (decided.changes, decided.warnings, decided.audit) == ([], [warning], {PULLER: audit})


def test_nodes_of_one_runtime_and_socket_are_counted_together_however_the_socket_was_found() -> None:
    annotated = {"kubeadm.alpha.kubernetes.io/cri-socket": "unix:///run/containerd/containerd.sock"}
    nodes = {
        "c1": _node("c1", "containerd://1.7.11", {}),
        "c2": _node("c2", "containerd://1.7.11", {}, annotated),
        "d1": _node("d1", "docker://24.0.7", {}),
    }
    decided = _puller_plan(_pod(), nodes)
    assert decided.warnings == ["no image puller: candidate nodes disagree (containerd on 2, docker on 1)"]


def _puller(decided: Plan) -> dict[str, Any]:
    """The puller container the patch inserts."""
    inserted: list[dict[str, Any]] = next(
        c.op["value"] for c in decided.changes if c.op["path"] == "/spec/initContainers"
    )
    return inserted[0]


def test_only_named_pull_secrets_are_mounted_in_the_puller() -> None:
    pod = _pod(imagePullSecrets=[{"name": ""}, {"name": 5}, {"name": "regcred"}, {"name": "regcred"}])
    decided = plan(pod, Facts(RequestFacts("ns", runtime="containerd")), build_settings({}), kinds=(PULLER,))
    volume = next(c.op["value"] for c in decided.changes if c.op["path"] == "/spec/volumes")[1]
    assert [s["secret"]["name"] for s in volume["projected"]["sources"]] == ["regcred"]


@pytest.mark.parametrize(("runtime", "pod_network"), [("containerd", True), ("cri-o", False)])
def test_only_containerd_is_given_the_registries_reached_over_the_pod_network(runtime: str, pod_network: bool) -> None:
    settings = build_settings({"imagePuller": {"registries": {"registry.local:5000": {"plainHttp": True}}}})
    decided = plan(_pod(), Facts(RequestFacts("ns", runtime=runtime)), settings, kinds=(PULLER,))
    args = _puller(decided)["args"]
    assert ("--pod-network-registry=registry.local:5000" in args) is pod_network
    assert decided.runtime is not None
    assert decided.runtime.source == "query"


def test_a_snapshot_whose_label_index_is_a_plain_mapping_answers_a_node_selector() -> None:
    """A preview worker's snapshot asks the server for label entries one at a time: no LabelIndex, no kept
    answers, the same decision."""
    nodes = {"c1": _node("c1", "containerd://1.7.11", {"pool": "p"}), "d1": _node("d1", "docker://24.0.7", {})}
    full = node_snapshot(nodes)
    plain = NodeSnapshot(full.nodes, full.groups, {pair: tuple(full.by_label[pair]) for pair in full.by_label})
    facts = Facts(RequestFacts("ns"), ClusterFacts(None, plain, "synced"))
    decided = plan(_pod(nodeSelector={"pool": "p"}), facts, build_settings({}), kinds=(PULLER,))
    assert decided.audit == {PULLER: "containerd:/run/containerd/containerd.sock"}


ONE, TWO = "registry-one.example.internal:5000", "registry-two.example.internal:5000"


@pytest.mark.parametrize(
    ("runtime", "warning"),
    [
        ("containerd", f"{f'{ONE}, {TWO}'[:50]}: pulled without TLS verification (registries opt-in)"),
        ("cri-o", f"{f'{ONE}, {TWO}'[:40]}: the cri-o runtime pulls; no pod-network path"),
    ],
)
def test_registries_pulled_without_verification_or_out_of_reach_are_warned_of(runtime: str, warning: str) -> None:
    registries = {ONE: {"plainHttp": True}, TWO: {"skipVerify": True}, "registry-three.local": {}}
    settings = build_settings({"imagePuller": {"registries": registries}})
    images = [
        {"name": f"c{i}", "image": f"{host}/team/app:1"} for i, host in enumerate((ONE, TWO, "registry-three.local"))
    ]
    decided = plan(
        _pod(PRIMARY, UPLOADER, *images), Facts(RequestFacts("ns", runtime=runtime)), settings, kinds=(PULLER,)
    )
    assert decided.warnings == [warning]
    args = _puller(decided)["args"]
    assert (f"--registry-plain-http={ONE}" in args, f"--registry-skip-verify={TWO}" in args) == (
        (True, True) if runtime == "containerd" else (False, False)
    )


def test_each_puller_operation_is_listed_with_why() -> None:
    pod = _pod(imagePullSecrets=[{"name": "regcred"}], volumes=[{"name": "scratch", "emptyDir": {}}])
    decided = plan(pod, Facts(RequestFacts("ns", runtime="containerd")), build_settings({}), kinds=(PULLER,))
    assert reasons(decided)[:-1] == [
        ("/spec/initContainers", "pull 2 image(s) through the containerd socket before the other containers start"),
        ("/spec/volumes/-", "the containerd socket /run/containerd/containerd.sock, mounted in the puller only"),
        ("/spec/volumes/-", "the pod's image pull secrets, for the puller only"),
    ]
    del pod["spec"]["volumes"]
    decided = plan(pod, Facts(RequestFacts("ns", runtime="containerd")), build_settings({}), kinds=(PULLER,))
    assert reasons(decided)[1] == (
        "/spec/volumes",
        "the containerd socket /run/containerd/containerd.sock, mounted in the puller only",
    )


@pytest.mark.parametrize(
    ("settings", "request_facts", "source"),
    [
        ({"imagePuller": {"runtime": "docker"}}, RequestFacts("ns"), "imagePuller.runtime"),
        ({}, RequestFacts("ns"), "imagePuller.defaultRuntime"),
        ({}, RequestFacts("ns", node="n1"), "imagePuller.defaultRuntime (node n1 unknown without cluster access)"),
    ],
)
def test_a_preview_says_where_the_runtime_came_from(
    settings: dict[str, Any], request_facts: RequestFacts, source: str
) -> None:
    decided = plan(_pod(), Facts(request_facts), build_settings(settings), kinds=(PULLER,))
    assert decided.runtime is not None
    assert decided.runtime.source == source


def test_the_puller_pulls_no_image_of_an_ephemeral_container_nor_one_that_is_no_string() -> None:
    pod = _pod(PRIMARY, UPLOADER, {"name": "odd", "image": 5})
    pod["spec"]["ephemeralContainers"] = [{"name": "debug", "image": "busybox:1.36"}]
    decided = plan(pod, Facts(RequestFacts("ns", runtime="containerd")), build_settings({}), kinds=(PULLER,))
    assert _puller(decided)["args"][-2:] == ["docker.io/library/python:3.11", FLYTE_IMAGE]


RECORDED = {"copilot-webhook.io/mutated": "image-puller=containerd:/run/containerd/containerd.sock"}


@pytest.mark.parametrize(
    ("annotations", "volume"),
    [
        (RECORDED, "copilot-webhook-runtime-socket"),  # recorded, but the puller container is gone
        (RECORDED, "copilot-webhook-pull-secrets"),
        (None, "copilot-webhook-pull-secrets"),
    ],
)
def test_a_volume_of_ours_without_our_puller_is_a_clash_never_reused(
    annotations: dict[str, str] | None, volume: str
) -> None:
    pod = _pod(annotations=annotations, volumes=[{"name": volume, "emptyDir": {}}])
    decided = plan(pod, Facts(RequestFacts("ns", runtime="containerd")), build_settings({}), kinds=(PULLER,))
    assert decided.undecided == f"the name {volume} is already used by the pod"
    assert decided.changes == []


@pytest.mark.parametrize(
    ("volumes", "error"), [({"name": "scratch"}, "spec.volumes must be an array"), (["scratch", {"name": 5}], None)]
)
def test_volumes_the_puller_cannot_read_are_named_or_left_to_the_api_server(volumes: Any, error: str | None) -> None:
    pod = _pod(volumes=volumes)
    facts = Facts(RequestFacts("ns", runtime="containerd"))
    if error is None:
        assert plan(pod, facts, build_settings({}), kinds=(PULLER,)).outcomes[PULLER].mutated
        return
    with pytest.raises(PodShapeError, match=f"^{error}$"):
        plan(pod, facts, build_settings({}), kinds=(PULLER,))


def test_a_pod_whose_images_the_kubelet_pulls_anyway_is_audited_as_having_none() -> None:
    always = [{**c, "imagePullPolicy": "Always"} for c in (PRIMARY, UPLOADER)]
    decided = plan(_pod(*always), Facts(RequestFacts("ns", runtime="containerd")), build_settings({}), kinds=(PULLER,))
    assert (decided.changes, decided.audit) == ([], {PULLER: "skipped(no-images)"})


@pytest.mark.parametrize(("spec", "source"), [({}, "all 2 nodes"), ({"nodeName": ""}, "all 2 nodes")])
def test_a_pod_free_to_land_anywhere_is_decided_by_every_node(spec: dict[str, Any], source: str) -> None:
    """An empty nodeName is no node name, as the scheduler reads it."""
    nodes = {name: _node(name, "containerd://1.7.11", {}) for name in ("c1", "c2")}
    decided = _puller_plan(_pod(**spec), nodes)
    assert decided.runtime is not None
    assert (decided.runtime.flavour, decided.runtime.source) == ("containerd", source)


@pytest.mark.parametrize(
    ("labels", "served"),
    [
        ({"copilot-webhook.io/inject": "enabled"}, True),
        ({}, False),
        (None, True),  # a namespace the webhook does not know was chosen by the API server's namespaceSelector
    ],
)
def test_opt_in_serves_only_namespaces_switched_on_and_counts_the_others_as_skipped(
    labels: dict[str, str] | None, served: bool
) -> None:
    decided = _plan(_pod(), labels, inject="opt-in")
    assert bool(decided.changes) is served
    scraped = _scraped(decided)
    for kind in KINDS:
        skipped = f'copilot_webhook_skips_total{{kind="{kind}",reason="namespace-not-opted-in"}} 1.0'
        assert (skipped in scraped) is not served


INJECT_NOT_UNDERSTOOD = "copilot-webhook.io/inject='yes' ignored: expected enabled, true, disabled or false"
IGNORED_METRIC = "copilot_webhook_ignored_values_total"


def test_a_namespace_label_not_understood_is_warned_of_and_counted_while_the_pod_is_mutated() -> None:
    decided = _plan(_pod(), {"copilot-webhook.io/inject": "yes"})
    assert decided.outcomes[PTRACE].mutated
    assert decided.warnings[0] == f"namespace label {INJECT_NOT_UNDERSTOOD}"
    assert f'{IGNORED_METRIC}{{key="inject",source="namespace"}} 1.0' in _scraped(decided)


PULLER_NOT_UNDERSTOOD = "copilot-webhook.io/image-puller='yes' ignored: expected enabled, true, disabled or false"


@pytest.mark.parametrize(
    ("annotations", "labels", "warning", "counted"),
    [
        # the pod's own switch off, and a namespace label not understood
        (
            {"copilot-webhook.io/inject": "false"},
            {"copilot-webhook.io/inject": "yes"},
            f"namespace label {INJECT_NOT_UNDERSTOOD}",
            '{key="inject",source="namespace"}',
        ),
        # the namespace's switch off, and a pod annotation not understood
        (
            {"copilot-webhook.io/image-puller": "yes"},
            {"copilot-webhook.io/inject": "disabled"},
            PULLER_NOT_UNDERSTOOD,
            '{key="image-puller",source="pod"}',
        ),
    ],
)
def test_an_opted_out_pod_is_still_warned_of_values_not_understood(
    annotations: dict[str, str], labels: dict[str, str], warning: str, counted: str
) -> None:
    decided = _plan(_pod(annotations=annotations), labels)
    assert (decided.changes, decided.warnings) == ([], [warning])
    assert f"{IGNORED_METRIC}{counted} 1.0" in _scraped(decided)


def test_only_the_image_puller_webhook_warns_of_an_image_puller_annotation_not_understood() -> None:
    pod = _pod(annotations={"copilot-webhook.io/image-puller": "yes"})
    facts = Facts(RequestFacts("ns", runtime="containerd"))
    assert plan(pod, facts, build_settings({}), kinds=(PULLER,)).warnings == [PULLER_NOT_UNDERSTOOD]
    assert plan(pod, facts, build_settings({}), kinds=(PTRACE,)).warnings == []
    both = plan(pod, facts, build_settings({}))
    assert both.warnings == [PULLER_NOT_UNDERSTOOD]
    assert f'{IGNORED_METRIC}{{key="image-puller",source="pod"}} 1.0' in _scraped(both)


@pytest.mark.parametrize(
    "mount",
    [{"mountPath": "/var/flyte/outputs"}, {"name": 5, "mountPath": "/var/flyte/outputs"}, {"name": "flyte-outputs"}],
)
def test_a_mount_without_a_string_name_and_path_mounts_nothing_and_the_primary_is_still_found(
    mount: dict[str, Any],
) -> None:
    """The API server refuses such a mount after admission; until then the copilot's data volume and the
    primary container are read from the mounts that have both."""
    uploader = {**UPLOADER, "volumeMounts": [mount, OUTPUTS]}
    other = {"name": "other", "image": "busybox:1.36", "volumeMounts": [mount]}
    decided = _ptrace(_pod(PRIMARY, other, uploader), ptrace={"target": "primary"})
    assert decided.undecided is None
    assert reasons(decided)[0] == (
        "/spec/containers/0/securityContext",
        "main: the primary container gets SYS_PTRACE (ptrace.target primary)",
    )
