"""Services on the real node (harness/node.py): kube-proxy built from Kubernetes' module routes a Service's
ClusterIP to its endpoints, and the DaemonSet and EndpointSlice controllers of kube-controller-manager make
the pods and the endpoints, as a node agent behind a Service with `internalTrafficPolicy: Local` needs.

What a user relies on, from a pod on the node's CNI bridge and from one on the host network:

- a DaemonSet's pod, made by the DaemonSet controller and run by the kubelet, is reached through a Local
  Service by its DNS name (short and fully qualified, through the pod's own resolv.conf and the cluster
  DNS) and by its ClusterIP;
- a Local Service whose only endpoint is on another node is not reached from this node (kube-proxy drops
  the connection: it times out, where the namespace's loopback route would refuse it), while the same
  endpoint behind a Cluster Service is; once the endpoint is said to be on this node, the Local Service
  reaches it too.

The endpoint "on another node" is the DaemonSet's pod itself, in an EndpointSlice written by hand for a
Service without a selector, naming a node that does not exist: a listener that answers whenever kube-proxy
sends a connection to it, so only kube-proxy's decision tells the outcomes apart. Before a probe, the test
waits for kube-proxy's rules to name the Service's ClusterIP as it should be routed (the rules are read to
know when to probe, never as the outcome). The image is the session's stand-in base (Debian with python3,
harness/image_builds.py), imported into the node's containerd.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from harness.controlplane import ControlPlane
from harness.image_builds import ImageBuilder
from harness.kube_api import Kube, KubeError, Obj, describe_pod, pods_left, wait_for, wait_pod
from harness.node import BRIDGE_GATEWAY, Node
from harness.node_setup import import_images, running_node

NAMESPACE = "cwproxy"
OTHER_NODE = "cw-elsewhere"  # no kubelet and no Node object: only the EndpointSlice names it
PORT = 8080  # the agent's
SERVICE_PORT = 80

# The agent: each connection is answered with the pod's name, its node's and the peer's address.
SERVER = """
import os, socketserver
class Answer(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.sendall(f"{os.environ['POD_NAME']} {os.environ['NODE_NAME']} {self.client_address[0]}\\n".encode())
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("0.0.0.0", 8080), Answer).serve_forever()
"""

# A client: one line of JSON per `host:port` argument, the name resolved through the pod's resolv.conf.
PROBE = """
import json, socket, sys
for target in sys.argv[1:]:
    host, _, port = target.rpartition(":")
    seen = {"target": target}
    try:
        seen["address"] = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError as err:
        seen["outcome"] = f"unresolved: {err}"
    else:
        try:
            with socket.create_connection((seen["address"], int(port)), timeout=3) as connection:
                connection.settimeout(3)
                seen["answer"] = connection.recv(200).decode().strip()
                seen["outcome"] = "answered"
        except TimeoutError:
            seen["outcome"] = "timeout"
        except ConnectionRefusedError:
            seen["outcome"] = "refused"
        except OSError as err:
            seen["outcome"] = f"error: {err}"
    print(json.dumps(seen), flush=True)
"""


@pytest.fixture(scope="module")
def the_node(kube: ControlPlane) -> Iterator[Node]:
    yield from running_node(kube, "dockerd", "docker", "mmdebstrap")


@pytest.fixture(scope="module")
def image(the_node: Node, image_builder: ImageBuilder, tmp_path_factory: pytest.TempPathFactory) -> str:
    import_images(the_node, tmp_path_factory.mktemp("proxy-images"), image_builder, [image_builder.base])
    return image_builder.base


@dataclass(frozen=True)
class Agent:
    pod: str
    ip: str


@pytest.fixture(scope="module")
def agent(kube_admin: Kube, the_node: Node, image: str) -> Iterator[Agent]:
    """The DaemonSet `agent` and its one pod, on this node, ready (its port answers the kubelet's probe)."""
    kube_admin.create_namespace(NAMESPACE)
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    container = {
        "name": "agent",
        "image": image,
        "imagePullPolicy": "Never",
        "command": ["python3", "-c", SERVER],
        "env": env,
        "ports": [{"name": "http", "containerPort": PORT}],
        "readinessProbe": {"tcpSocket": {"port": PORT}, "periodSeconds": 1},
    }
    daemonset = {
        "metadata": {"name": "agent"},
        "spec": {
            "selector": {"matchLabels": {"app": "agent"}},
            "template": {
                "metadata": {"labels": {"app": "agent"}},
                "spec": {"terminationGracePeriodSeconds": 1, "containers": [container]},
            },
        },
    }
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets"
    kube_admin.create(path, daemonset)
    try:
        pods = _wait_daemonset_pods(kube_admin, the_node)
        (pod,) = pods
        yield Agent(pod["metadata"]["name"], pod["status"]["podIP"])
    finally:
        # No garbage collector runs here: the DaemonSet goes, then its pods by hand.
        with contextlib.suppress(KubeError):
            kube_admin.delete(f"{path}/agent")
        names = [p["metadata"]["name"] for p in kube_admin.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]]
        for name in names:
            with contextlib.suppress(KubeError):
                kube_admin.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}", {"gracePeriodSeconds": 1})
        left = pods_left(kube_admin, NAMESPACE, names)
    if left:
        pytest.fail(left)


def _wait_daemonset_pods(kube: Kube, the_node: Node, timeout: float = 120) -> list[Obj]:
    """The DaemonSet's pods once it reports one ready (the controller's own count), else a failure with
    what the DaemonSet and its pods showed."""
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/agent"

    def ready() -> bool:
        status: Obj = kube.get(path).get("status", {})
        return (status.get("numberReady"), status.get("desiredNumberScheduled")) == (1, 1)

    if not wait_for(ready, timeout=timeout, interval=0.5):
        pods = kube.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        described = "\n".join(describe_pod(kube, NAMESPACE, p["metadata"]["name"], p) for p in pods) or "no pod"
        pytest.fail(
            f"DaemonSet agent not ready within {timeout:.0f} s: status {kube.get(path).get('status')}\n"
            f"{described}\n{the_node.logs()}"
        )
    items: list[Obj] = kube.get(f"/api/v1/namespaces/{NAMESPACE}/pods", labelSelector="app=agent")["items"]
    return items


# --- Services, EndpointSlices and what kube-proxy made of them --------------------------------------------


def _service(kube: Kube, name: str, policy: str, selector: dict[str, str] | None) -> str:
    """A Service of port 80 to the agent's port; its ClusterIP."""
    spec: Obj = {
        "internalTrafficPolicy": policy,
        "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": PORT, "protocol": "TCP"}],
    }
    if selector is not None:
        spec["selector"] = selector
    stored = kube.create(f"/api/v1/namespaces/{NAMESPACE}/services", {"metadata": {"name": name}, "spec": spec})
    cluster_ip = stored["spec"]["clusterIP"]
    assert isinstance(cluster_ip, str)
    return cluster_ip


def _endpoint_slice(kube: Kube, service: str, address: str, node_name: str) -> None:
    """A hand-written EndpointSlice for a Service without a selector: one ready endpoint on `node_name`."""
    kube.create(
        f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices",
        {
            "metadata": {
                "name": service,
                "labels": {"kubernetes.io/service-name": service, "endpointslice.kubernetes.io/managed-by": "test"},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [address], "nodeName": node_name, "conditions": {"ready": True}}],
            "ports": [{"name": "http", "port": PORT, "protocol": "TCP"}],
        },
    )


def _delete_services(kube: Kube, *names: str) -> None:
    for name in names:
        for path in (
            f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices/{name}",
            f"/api/v1/namespaces/{NAMESPACE}/services/{name}",
        ):
            with contextlib.suppress(KubeError):
                kube.delete(path)


def _routed(rules: str, cluster_ip: str) -> bool:
    """kube-proxy sends the ClusterIP's connections to its endpoints (the nat rule of a Service with
    endpoints to use from this node)."""
    return any(
        line.startswith("-A KUBE-SERVICES") and f"-d {cluster_ip}/32" in line and " -j KUBE-SV" in line
        for line in rules.splitlines()
    )


def _dropped(rules: str, cluster_ip: str) -> bool:
    """kube-proxy drops the ClusterIP's connections: a Local Service with endpoints, none on this node."""
    return any(f"-d {cluster_ip}/32" in line and line.endswith("-j DROP") for line in rules.splitlines())


def _wait_rules(the_node: Node, what: str, check: Callable[[str], bool], timeout: float = 60) -> None:
    if not wait_for(lambda: check(the_node.iptables_rules()), timeout=timeout, interval=0.5):
        proxy = next(p for p in the_node.processes if p.name == "kube-proxy")
        pytest.fail(
            f"kube-proxy's rules did not show {what} within {timeout:.0f} s:\n{the_node.iptables_rules()}\n"
            f"kube-proxy's log:\n{proxy.log.read_text(errors='replace')[-4000:]}"
        )


# --- clients -----------------------------------------------------------------------------------------------


def _probe(
    kube: Kube, the_node: Node, image: str, name: str, targets: list[str], *, host_network: bool
) -> dict[str, Obj]:
    """What a pod of the node saw of each `host:port` (its outcome, address and answer), by target, each
    with the pod's own address (`pod`)."""
    spec: Obj = {
        "nodeName": the_node.name,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {"name": "probe", "image": image, "imagePullPolicy": "Never", "command": ["python3", "-c", PROBE, *targets]}
        ],
    }
    if host_network:
        spec.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    kube.create_pod(NAMESPACE, {"metadata": {"name": name}, "spec": spec})
    try:
        done = wait_pod(
            kube,
            NAMESPACE,
            name,
            lambda p: p.get("status", {}).get("phase") in ("Succeeded", "Failed"),
            "Succeeded or Failed",
            timeout=120,
            more=the_node.logs,
        )
        log = the_node.container_log(NAMESPACE, name, "probe")
        assert done["status"]["phase"] == "Succeeded", f"{describe_pod(kube, NAMESPACE, name, done)}\n{log}"
        seen = [json.loads(line.split(" ", 3)[3]) for line in log.splitlines() if " stdout " in line]
        return {s["target"]: {**s, "pod": done["status"]["podIP"]} for s in seen}
    finally:
        with contextlib.suppress(KubeError):
            kube.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}", {"gracePeriodSeconds": 0})


def _probes(kube: Kube, the_node: Node, image: str, name: str, targets: list[str]) -> dict[str, dict[str, Obj]]:
    """`_probe` from a pod on the bridge and from one on the host network, by network."""
    return {
        network: _probe(kube, the_node, image, f"{name}-{network}", targets, host_network=network == "host")
        for network in ("bridge", "host")
    }


def _outcomes(seen: dict[str, dict[str, Obj]]) -> dict[str, dict[str, str]]:
    """network -> target -> "answered by <pod>", or the outcome that was no answer."""

    def outcome(s: Obj) -> str:
        return f"answered by {s['answer'].split()[0]}" if s["outcome"] == "answered" else str(s["outcome"])

    return {network: {target: outcome(s) for target, s in by_target.items()} for network, by_target in seen.items()}


# --- the tests -----------------------------------------------------------------------------------------------


def test_a_daemonset_pod_is_reached_through_a_local_service_by_name_and_cluster_ip(
    kube_admin: Kube, the_node: Node, image: str, agent: Agent
) -> None:
    pod = kube_admin.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{agent.pod}")
    owners = [(o["kind"], o["name"]) for o in pod["metadata"]["ownerReferences"] if o.get("controller")]
    assert owners == [("DaemonSet", "agent")]
    assert pod["spec"]["nodeName"] == the_node.name
    cluster_ip = _service(kube_admin, "agent", "Local", {"app": "agent"})
    try:
        # The EndpointSlice controller publishes the pod, on this node, ready.
        def published() -> list[Obj]:
            slices = kube_admin.get(
                f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices",
                labelSelector="kubernetes.io/service-name=agent",
            )["items"]
            return [e for s in slices for e in s.get("endpoints") or [] if e["conditions"].get("ready")]

        assert wait_for(lambda: bool(published()), timeout=60), f"no ready endpoint of agent: {published()}"
        assert [(e["addresses"], e.get("nodeName")) for e in published()] == [([agent.ip], the_node.name)]
        _wait_rules(the_node, f"agent's ClusterIP {cluster_ip} routed", lambda r: _routed(r, cluster_ip))

        name = f"agent.{NAMESPACE}.svc.cluster.local"
        targets = [f"agent:{SERVICE_PORT}", f"{name}:{SERVICE_PORT}", f"{cluster_ip}:{SERVICE_PORT}"]
        seen = _probes(kube_admin, the_node, image, "to-agent", targets)

        answered = f"answered by {agent.pod}"
        assert _outcomes(seen) == {network: dict.fromkeys(targets, answered) for network in seen}, seen
        assert {s["address"] for by_target in seen.values() for s in by_target.values()} == {cluster_ip}
        assert name in the_node.dns.queries
        # A pod of the bridge reaches the agent from its own address (the cluster CIDR's traffic is not
        # masqueraded), unless kube-proxy masquerades every Service connection on this machine.
        peers = {s["answer"].split()[2] for s in seen["bridge"].values()}
        clients = {s["pod"] for s in seen["bridge"].values()}
        assert peers == ({BRIDGE_GATEWAY} if the_node.masquerades_pods else clients), seen
    finally:
        _delete_services(kube_admin, "agent")


def test_a_local_service_with_its_endpoint_on_another_node_is_not_reached_where_a_cluster_one_is(
    kube_admin: Kube, the_node: Node, image: str, agent: Agent
) -> None:
    local = _service(kube_admin, "elsewhere-local", "Local", None)
    cluster = _service(kube_admin, "elsewhere-cluster", "Cluster", None)
    try:
        _endpoint_slice(kube_admin, "elsewhere-local", agent.ip, OTHER_NODE)
        _endpoint_slice(kube_admin, "elsewhere-cluster", agent.ip, OTHER_NODE)
        _wait_rules(
            the_node,
            f"the Local {local} dropped and the Cluster {cluster} routed",
            lambda r: _dropped(r, local) and _routed(r, cluster),
        )
        targets = [f"{local}:{SERVICE_PORT}", f"{cluster}:{SERVICE_PORT}"]
        seen = _probes(kube_admin, the_node, image, "elsewhere", targets)
        expected = {targets[0]: "timeout", targets[1]: f"answered by {agent.pod}"}
        assert _outcomes(seen) == {"bridge": expected, "host": expected}, seen

        # The same endpoint, said to be on this node: the Local Service reaches it.
        kube_admin.patch(
            f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices/elsewhere-local",
            {"endpoints": [{"addresses": [agent.ip], "nodeName": the_node.name, "conditions": {"ready": True}}]},
        )
        _wait_rules(the_node, f"the Local {local} routed", lambda r: _routed(r, local))
        seen = _probes(kube_admin, the_node, image, "here", targets[:1])
        assert _outcomes(seen) == {network: {targets[0]: f"answered by {agent.pod}"} for network in seen}, seen
    finally:
        _delete_services(kube_admin, "elsewhere-local", "elsewhere-cluster")
