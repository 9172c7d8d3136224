"""The node agent (spec 1.3a) and the client the webhook injects, against the real API server (its
TokenReview, tokens bound to real pod objects, RBAC as the chart grants it), a real containerd and the
distribution registry. The agent runs as its own process with the service account the chart gives it;
the client is the container the webhook generates, run as a process with its args and environment.

Who may ask is proven by refusal: no token, a token of another audience, one bound to no pod, one whose
pod runs on another node or is gone, and an image its pod does not name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from certs.authority import generate_ca, issue_serving
from harness.controlplane import ControlPlane
from harness.daemons import (
    TOOLS,
    Containerd,
    Registry,
    build_image,
    containerd,
    hanging_server,
    registry,
    require,
    trickling_registry,
)
from harness.environment import child_env
from harness.kube_api import Kube, wait_for
from harness.server_process import free_port, stop_process
from tests.test_pull_daemons import Run  # the puller's lines, read as the socket mode's tests read them
from webhook.config import build_settings
from webhook.mutation.puller import SECRETS_PATH, TOKEN_PATH, agent_container

ROOT = Path(__file__).parent.parent
NODE = "agent-test-node"
OTHER_NODE = "agent-other-node"
POD_NETWORK_REGISTRY = "registry.podnet.test"  # a name only the agent pod's resolver knows
AUDIENCE = "copilot-webhook-agent"
SYSTEM = "cw-agent-system"
APPS = "cw-agent-apps"
AGENT_RULES = [
    {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["get"]},
]


@dataclass
class Cluster:
    kube: Kube
    plane: ControlPlane
    work: Path
    containerd: Containerd
    plain: Registry
    app: str  # an image on the plain registry
    big: str  # a larger one, served slowly by `slow`
    slow: str  # the registry host that trickles `big`
    ca_pem: str
    tls: tuple[Path, Path]
    agent_token: Path


@pytest.fixture(scope="module")
def cluster(kube: ControlPlane, kube_admin: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require(*TOOLS)
    work = tmp_path_factory.mktemp("agent")
    layout = work / "oci"
    build_image(layout, "v1", "one")
    build_image(layout, "big", os.urandom(96 * 1024).hex())
    ca = generate_ca("agent test CA")
    leaf = issue_serving(ca, ["agent.test"], ["127.0.0.1"])
    (work / "tls.crt").write_bytes(leaf.cert_pem)
    (work / "tls.key").write_bytes(leaf.key_pem)
    _node(kube_admin, NODE, "containerd://1.6.20")
    _node(kube_admin, OTHER_NODE, "containerd://1.6.20")
    for namespace in (SYSTEM, APPS):
        kube_admin.create_namespace(namespace)
    kube_admin.create(f"/api/v1/namespaces/{SYSTEM}/serviceaccounts", {"metadata": {"name": "agent"}})
    kube_admin.create(f"/api/v1/namespaces/{APPS}/serviceaccounts", {"metadata": {"name": "app"}})
    role = {"metadata": {"name": "cw-agent-test"}, "rules": AGENT_RULES}
    kube_admin.create("/apis/rbac.authorization.k8s.io/v1/clusterroles", role)
    binding = {
        "metadata": {"name": "cw-agent-test"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cw-agent-test"},
        "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": SYSTEM}],
    }
    kube_admin.create("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding)
    agent_token = work / "agent-token"
    agent_token.write_text(kube_admin.token(SYSTEM, "agent"))
    with (
        containerd(work / "containerd") as ctd,
        registry(work / "plain") as plain,
        trickling_registry(plain.port, rate=16384) as slow_port,
    ):
        slow = f"127.0.0.1:{slow_port}"
        ctd.trust(plain.host, plain_http=True)
        ctd.trust(slow, plain_http=True)
        app = plain.push(layout, "v1", "team/app")
        big = plain.push(layout, "big", "team/big").replace(plain.host, slow)
        yield Cluster(
            kube_admin,
            kube,
            work,
            ctd,
            plain,
            app,
            big,
            slow,
            ca.cert_pem.decode(),
            (work / "tls.crt", work / "tls.key"),
            agent_token,
        )
    for path in ("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/cw-agent-test",
                 "/apis/rbac.authorization.k8s.io/v1/clusterroles/cw-agent-test",
                 f"/api/v1/nodes/{NODE}", f"/api/v1/nodes/{OTHER_NODE}"):  # fmt: skip
        kube_admin.delete(path)


def _node(kube: Kube, name: str, runtime: str) -> None:
    kube.create("/api/v1/nodes", {"metadata": {"name": name}})
    kube.request(
        "PATCH",
        f"/api/v1/nodes/{name}/status",
        {"status": {"nodeInfo": {"containerRuntimeVersion": runtime}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )


@dataclass
class Agent:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    def health(self, ca_pem: str) -> dict[str, Any]:
        with httpx.Client(verify=ssl.create_default_context(cadata=ca_pem), timeout=10) as client:
            answer = client.get(f"https://127.0.0.1:{self.port}/healthz")
        assert answer.status_code == 200, answer.text
        health: dict[str, Any] = answer.json()
        return health


def _start_agent(cluster: Cluster, *extra: str, hosts: Path | None = None) -> Agent:
    """The agent as its own process; with `hosts`, in a mount namespace whose /etc/hosts is that file: names
    its pod's resolver knows and the node's runtime does not."""
    port = free_port()
    log = cluster.work / f"agent-{port}.log"
    command = [
        sys.executable, "-m", "webhook.pull.agent",
        f"--port={port}", "--host=127.0.0.1",
        f"--tls-cert={cluster.tls[0]}", f"--tls-key={cluster.tls[1]}",
        f"--audience={AUDIENCE}", f"--node-name={NODE}",
        f"--socket-directory={Path(cluster.containerd.socket).parent}",
        f"--api-server={cluster.plane.url.removeprefix('https://')}",
        f"--api-ca-file={cluster.plane.ca_path}", f"--api-token-file={cluster.agent_token}",
        *extra,
    ]  # fmt: skip
    if hosts is not None:
        script = f'mount --make-rprivate / && mount --bind {hosts} /etc/hosts && exec "$@"'
        command = ["unshare", "--mount", "--", "sh", "-c", script, "sh", *command]
    env = child_env(PATH=os.environ["PATH"], PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=out, env=env)
    agent = Agent(process, port, log)

    def up() -> bool:
        assert process.poll() is None, f"the agent exited {process.returncode}:\n{log.read_text()}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return False
        return True

    assert wait_for(up, timeout=30), log.read_text()
    return agent


@pytest.fixture(scope="module")
def agent(cluster: Cluster) -> Iterator[Agent]:
    started = _start_agent(cluster)
    yield started
    stop_process(started.process)


def _pod(cluster: Cluster, name: str, images: list[str], node: str = NODE) -> dict[str, Any]:
    """A pod object bound to the node (nobody runs it: the agent reads it, as it reads a running one)."""
    pod = {
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "serviceAccountName": "app",
            "containers": [{"name": f"c{i}", "image": image} for i, image in enumerate(images)],
        },
    }
    return cluster.kube.create_pod(APPS, pod)


def _bound_token(cluster: Cluster, pod: dict[str, Any], audience: str = AUDIENCE) -> str:
    """What the kubelet projects into the pod: a token of the audience, bound to the pod."""
    meta = pod["metadata"]
    spec = {
        "audiences": [audience],
        "expirationSeconds": 600,
        "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]},
    }
    answer = cluster.kube.create(f"/api/v1/namespaces/{APPS}/serviceaccounts/app/token", {"spec": spec})
    token: str = answer["status"]["token"]
    return token


def _unbound_token(cluster: Cluster) -> str:
    spec = {"audiences": [AUDIENCE], "expirationSeconds": 600}
    answer = cluster.kube.create(f"/api/v1/namespaces/{APPS}/serviceaccounts/app/token", {"spec": spec})
    token: str = answer["status"]["token"]
    return token


def _client(
    cluster: Cluster, agent_port: int, images: list[str], token: str, tmp: Path, **settings: Any
) -> tuple[list[str], dict[str, str]]:
    """The init container the webhook generates in agent mode, as a command line and its environment."""
    config = {"mode": "agent", "agent": {"address": f"127.0.0.1:{agent_port}"}} | settings
    container = agent_container(
        images, build_settings({"imagePuller": config}).image_puller, cluster.ca_pem, secrets=False
    )
    (tmp / "token").mkdir(exist_ok=True)
    (tmp / "token" / "token").write_text(token)
    args = [
        a.replace(TOKEN_PATH, str(tmp / "token")).replace(SECRETS_PATH, str(tmp / "secrets")) for a in container["args"]
    ]
    env = child_env(PATH=os.environ["PATH"], PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    env.update({e["name"]: e["value"] for e in container["env"]})
    return [sys.executable, "-m", "webhook.pull", *args], env


def _run(command: list[str], env: dict[str, str], timeout: float = 120) -> Run:
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr + done.stdout
    return Run(done.returncode, done.stdout.splitlines(), time.monotonic() - started)


def _ask(cluster: Cluster, agent: Agent, body: Any, token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    with httpx.Client(verify=ssl.create_default_context(cadata=cluster.ca_pem), timeout=60) as client:
        return client.post(f"https://127.0.0.1:{agent.port}/v1/pull", json=body, headers=headers)


# --- a pod's own images, pulled through its node's agent ----------------------------------------------


def test_a_pod_pulls_the_images_it_names_through_its_nodes_agent(
    cluster: Cluster, agent: Agent, tmp_path: Path
) -> None:
    cluster.containerd.remove(cluster.app)
    pod = _pod(cluster, "pulls", [cluster.app])
    command, env = _client(cluster, agent.port, [cluster.app], _bound_token(cluster, pod), tmp_path)
    first = _run(command, env)
    assert first.code == 0, first.lines
    assert first.result(cluster.app)["result"] == "pulled", first.lines
    assert cluster.app in cluster.containerd.images(), "in the k8s.io namespace, where the kubelet's CRI looks"
    again = _run(command, env)
    assert again.result(cluster.app)["result"] == "present", again.lines
    health = agent.health(cluster.ca_pem)
    assert health["node"] == NODE
    assert health["runtime"] == f"containerd:{cluster.containerd.socket}", "the node's runtime, found by the agent"


def test_concurrent_requests_for_one_image_are_one_pull(cluster: Cluster, agent: Agent, tmp_path: Path) -> None:
    cluster.containerd.remove(cluster.big)
    pods = [_pod(cluster, f"together-{i}", [cluster.big]) for i in range(4)]
    before = agent.health(cluster.ca_pem)["pulls"]
    answers: list[httpx.Response] = []
    threads = [
        threading.Thread(
            target=lambda p=p: answers.append(_ask(cluster, agent, {"images": [cluster.big]}, _bound_token(cluster, p)))
        )
        for p in pods
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    results = [a.json()["results"][0]["result"] for a in answers]
    assert set(results) <= {"pulled", "present"}, results
    assert "pulled" in results, results
    assert agent.health(cluster.ca_pem)["pulls"] - before == 1, "four pods asked at once: one pull"


# --- who may ask --------------------------------------------------------------------------------------


def test_only_a_pod_on_this_node_may_ask_and_only_for_its_own_images(cluster: Cluster, agent: Agent) -> None:
    pod = _pod(cluster, "asker", [cluster.app])
    body = {"images": [cluster.app]}
    cases = {
        "no token": (None, body, 401, "bearer token"),
        "garbage": ("not-a-token", body, 401, "not valid"),
        "another audience": (_bound_token(cluster, pod, audience="someone-else"), body, 401, "not valid"),
        "the API server's audience": (cluster.kube.token(APPS, "app"), body, 401, "not valid"),
        "bound to no pod": (_unbound_token(cluster), body, 403, "not a service account token bound to a pod"),
        "an image the pod does not name": (
            _bound_token(cluster, pod), {"images": [f"{cluster.plain.host}/team/other:v1"]}, 403, "does not name",
        ),
        "one of two images not named": (
            _bound_token(cluster, pod), {"images": [cluster.app, "busybox"]}, 403, "does not name the image busybox",
        ),
    }  # fmt: skip
    elsewhere = _pod(cluster, "elsewhere", [cluster.app], node=OTHER_NODE)
    cases["a pod on another node"] = (_bound_token(cluster, elsewhere), body, 403, f"runs on node {OTHER_NODE}")
    gone = _pod(cluster, "gone", [cluster.app])
    gone_token = _bound_token(cluster, gone)
    cluster.kube.request("DELETE", f"/api/v1/namespaces/{APPS}/pods/gone", {"gracePeriodSeconds": 0})
    _pod(cluster, "gone", [cluster.app])  # the same name again: another pod
    cases["a pod that is gone"] = (gone_token, body, 401, "not valid")
    before = agent.health(cluster.ca_pem)["pulls"]
    seen = {}
    for what, (token, request, status, words) in cases.items():
        answer = _ask(cluster, agent, request, token)
        seen[what] = (answer.status_code, answer.json().get("error", ""))
        assert seen[what][0] == status, (what, seen[what])
        assert words in seen[what][1], (what, seen[what])
    assert agent.health(cluster.ca_pem)["pulls"] == before, f"a refused request pulled something: {seen}"


def test_bad_requests_are_refused_by_name(cluster: Cluster, agent: Agent) -> None:
    pod = _pod(cluster, "bad-requests", [cluster.app])
    token = _bound_token(cluster, pod)
    for body, words in (
        ([1, 2], "JSON object"),
        ({"images": []}, "non-empty array"),
        ({"images": ["-rf"]}, "images:"),
        ({"images": [cluster.app], "timeoutSeconds": "soon"}, "timeoutSeconds"),
        ({"images": [cluster.app], "pullSecrets": ["x"]}, "pullSecrets"),
    ):
        answer = _ask(cluster, agent, body, token)
        assert answer.status_code == 400, (body, answer.text)
        assert words in answer.json()["error"], (body, answer.text)
    context = ssl.create_default_context(cadata=cluster.ca_pem)
    with httpx.Client(verify=context, timeout=30) as client:
        url = f"https://127.0.0.1:{agent.port}/v1/pull"
        huge = client.post(url, content=b"x" * (5 * 1024 * 1024), headers={"Content-Type": "application/json"})
        assert huge.status_code == 413, huge.text
        typed = client.post(url, content=b"{}", headers={"Content-Type": "text/plain"})
        assert typed.status_code == 415, typed.text
        bad_head = client.get(f"https://127.0.0.1:{agent.port}/nowhere")
        assert bad_head.status_code == 404
        assert "POST /v1/pull" in bad_head.json()["error"]


# --- failures the pod survives ------------------------------------------------------------------------


def test_an_agent_killed_mid_pull_fails_the_pull_as_the_policy_says(cluster: Cluster, tmp_path: Path) -> None:
    with hanging_server() as port:
        hanging = f"127.0.0.1:{port}/team/app:v1"
        cluster.containerd.trust(f"127.0.0.1:{port}", plain_http=True)
        pod = _pod(cluster, "killed", [hanging])
        token = _bound_token(cluster, pod)
        for policy, code in (("Ignore", 0), ("Fail", 1)):
            agent = _start_agent(cluster)
            try:
                command, env = _client(cluster, agent.port, [hanging], token, tmp_path, failurePolicy=policy)
                client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                # The pull is in flight once the agent has started it: the registry never answers.
                assert wait_for(partial(_pulls_started, agent, cluster), timeout=30), agent.log.read_text()
                assert client.poll() is None, "the client must still be waiting on the agent"
                agent.process.send_signal(signal.SIGKILL)
                out, err = client.communicate(timeout=30)
            finally:
                stop_process(agent.process)
            assert "Traceback" not in err, err
            assert client.returncode == code, (policy, out)
            assert f"image={hanging} result=failed" in out, out
            assert "node agent:" in out, out
            tail = "the kubelet pulls the rest as usual" if policy == "Ignore" else "failing (failure policy Fail)"
            assert tail in out.splitlines()[-1], out


def test_a_missing_agent_costs_the_connect_timeout_at_most(cluster: Cluster, tmp_path: Path) -> None:
    with hanging_server() as port:  # accepts, never completes a TLS handshake: an agent that hangs
        pod = _pod(cluster, "missing", [cluster.app])
        command, env = _client(
            cluster,
            port,
            [cluster.app],
            _bound_token(cluster, pod),
            tmp_path,
            agent={"address": f"127.0.0.1:{port}", "connectTimeoutSeconds": 2},
        )
        run = _run(command, env)
    assert run.code == 0, run.lines
    assert run.result(cluster.app)["result"] == "failed"
    assert run.seconds < 15, f"the client waited {run.seconds:.1f} s for an agent that never answers"
    closed = free_port()
    command, env = _client(cluster, closed, [cluster.app], "token", tmp_path)
    refused = _run(command, env)
    assert refused.code == 0, refused.lines
    assert "cannot be reached" in "\n".join(refused.lines), refused.lines


def test_a_client_that_does_not_trust_the_agent_sends_it_nothing(
    cluster: Cluster, agent: Agent, tmp_path: Path
) -> None:
    other = generate_ca("someone else's CA").cert_pem.decode()
    pod = _pod(cluster, "distrust", [cluster.app])
    command, env = _client(cluster, agent.port, [cluster.app], _bound_token(cluster, pod), tmp_path)
    env["COPILOT_WEBHOOK_AGENT_CA"] = other
    before = agent.health(cluster.ca_pem)["pulls"]
    run = _run(command, env)
    assert run.code == 0, run.lines
    assert "is not trusted" in "\n".join(run.lines), run.lines
    assert agent.health(cluster.ca_pem)["pulls"] == before


# --- hostile connections ------------------------------------------------------------------------------


def test_a_trickled_request_is_cut_and_the_agent_keeps_serving(cluster: Cluster) -> None:
    agent = _start_agent(cluster, "--request-timeout=1", "--max-connections=4")
    try:
        context = ssl.create_default_context(cadata=cluster.ca_pem)
        raw = socket.create_connection(("127.0.0.1", agent.port))
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as trickler:
            trickler.settimeout(10)
            started = time.monotonic()
            closed_after = None
            try:
                for byte in b"POST /v1/pull HTTP/1.1\r\nHost: x\r\n" * 4:
                    trickler.send(bytes([byte]))
                    time.sleep(0.1)
            except OSError:
                closed_after = time.monotonic() - started
        assert closed_after is not None, "a request trickled past its bound was not cut"
        assert closed_after < 5, f"cut only after {closed_after:.1f} s"
        idle = [socket.create_connection(("127.0.0.1", agent.port)) for _ in range(4)]
        try:
            with socket.create_connection(("127.0.0.1", agent.port)) as extra:
                extra.settimeout(5)
                assert extra.recv(1) == b"", "a connection past --max-connections is closed at once"
        finally:
            for sock in idle:
                sock.close()
        assert wait_for(lambda: _healthy(agent, cluster), timeout=10), "the agent serves again once they are gone"
    finally:
        stop_process(agent.process)
    assert "Traceback" not in agent.log.read_text()


def _pulls_started(agent: Agent, cluster: Cluster) -> bool:
    return bool(agent.health(cluster.ca_pem)["pulls"] == 1)


def _healthy(agent: Agent, cluster: Cluster) -> bool:
    try:
        return bool(agent.health(cluster.ca_pem)["status"] == "ok")
    except (httpx.HTTPError, AssertionError):
        return False


def test_the_agent_refuses_to_start_without_its_nodes_runtime(cluster: Cluster, tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "webhook.pull.agent", "--port=1", "--host=127.0.0.1",
        f"--tls-cert={cluster.tls[0]}", f"--tls-key={cluster.tls[1]}", f"--audience={AUDIENCE}",
        f"--node-name={NODE}", f"--socket-directory={tmp_path}",
        f"--api-server={cluster.plane.url.removeprefix('https://')}",
        f"--api-ca-file={cluster.plane.ca_path}", f"--api-token-file={cluster.agent_token}",
    ]  # fmt: skip
    env = child_env(PATH=os.environ["PATH"], PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1
    assert "the node runs containerd, and none of" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_registry_only_the_pod_network_reaches_is_pulled_from_the_agents_pod(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A registry named by what only the agent pod's resolver knows: through the runtime (the CRI) the pull
    fails; routed to containerd's own client in the agent's pod, it lands in the runtime's store."""
    layout = tmp_path / "oci"
    build_image(layout, "v1", "pod network")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 {POD_NETWORK_REGISTRY}\n")
    with registry(tmp_path / "podnet") as podnet:
        host = f"{POD_NETWORK_REGISTRY}:{podnet.port}"
        image = podnet.push(layout, "v1", "team/podnet").replace(podnet.host, host)
        pod = _pod(cluster, "podnet", [image])
        token = _bound_token(cluster, pod)
        through_cri = _start_agent(cluster, hosts=hosts)
        try:
            failed = _ask(cluster, through_cri, {"images": [image]}, token).json()["results"][0]
        finally:
            stop_process(through_cri.process)
        assert failed["result"] == "failed", failed
        routed = _start_agent(cluster, f"--pod-network-registry={host}", f"--registry-plain-http={host}", hosts=hosts)
        try:
            command, env = _client(cluster, routed.port, [image], token, tmp_path)
            run = _run(command, env)
        finally:
            stop_process(routed.process)
    assert run.code == 0, run.lines
    assert run.result(image)["result"] == "pulled", run.lines
    assert image in cluster.containerd.images(), "in the k8s.io namespace, where the kubelet's CRI looks"


# --- the adversary: who may ask -----------------------------------------------------------------------


def _token_bound_to(cluster: Cluster, kind: str, name: str, uid: str, api_version: str = "v1") -> str:
    spec = {
        "audiences": [AUDIENCE],
        "expirationSeconds": 600,
        "boundObjectRef": {"kind": kind, "apiVersion": api_version, "name": name, "uid": uid},
    }
    answer = cluster.kube.create(f"/api/v1/namespaces/{APPS}/serviceaccounts/app/token", {"spec": spec})
    token: str = answer["status"]["token"]
    return token


def test_a_token_bound_to_a_secret_or_a_node_is_no_pods(cluster: Cluster, agent: Agent) -> None:
    secret = cluster.kube.create(f"/api/v1/namespaces/{APPS}/secrets", {"metadata": {"name": "bound-to"}})
    node = cluster.kube.get(f"/api/v1/nodes/{NODE}")
    before = agent.health(cluster.ca_pem)["pulls"]
    for kind, obj in (("Secret", secret), ("Node", node)):
        token = _token_bound_to(cluster, kind, obj["metadata"]["name"], obj["metadata"]["uid"])
        answer = _ask(cluster, agent, {"images": [cluster.app]}, token)
        assert answer.status_code == 403, (kind, answer.text)
        assert "bound to a pod" in answer.json()["error"], (kind, answer.text)
    assert agent.health(cluster.ca_pem)["pulls"] == before


def test_a_pod_that_has_finished_or_is_being_deleted_may_not_ask(cluster: Cluster, agent: Agent) -> None:
    """Its init containers are long over (or never run again): its token, still valid, must not pull."""
    before = agent.health(cluster.ca_pem)["pulls"]
    seen = {}
    for phase in ("Succeeded", "Failed"):
        pod = _pod(cluster, f"finished-{phase.lower()}", [cluster.app])
        token = _bound_token(cluster, pod)
        cluster.kube.request(
            "PATCH",
            f"/api/v1/namespaces/{APPS}/pods/{pod['metadata']['name']}/status",
            {"status": {"phase": phase}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        seen[phase] = _ask(cluster, agent, {"images": [cluster.app]}, token)
    pod = _pod(cluster, "deleting", [cluster.app])
    token = _bound_token(cluster, pod)
    cluster.kube.delete(f"/api/v1/namespaces/{APPS}/pods/deleting")  # no kubelet: it stays, terminating
    assert cluster.kube.get(f"/api/v1/namespaces/{APPS}/pods/deleting")["metadata"].get("deletionTimestamp")
    seen["deleting"] = _ask(cluster, agent, {"images": [cluster.app]}, token)
    statuses = {what: (a.status_code, a.json().get("error", "")) for what, a in seen.items()}
    assert all(code == 403 for code, _ in statuses.values()), statuses
    assert "has finished" in statuses["Succeeded"][1], statuses
    assert "is being deleted" in statuses["deleting"][1], statuses
    assert agent.health(cluster.ca_pem)["pulls"] == before


def test_only_the_images_named_in_the_spec_however_spelled(cluster: Cluster, agent: Agent) -> None:
    """Equal references are one image (normalised); any other spelling of another image is refused: a
    digest for a tag, a tag for a digest, another registry's case, and an ephemeral container's image (the
    init container asks before any exists). Malformed spellings are refused before the token is read."""
    digest = "sha256:" + "a" * 64
    host = cluster.plain.host
    pod = _pod(cluster, "spellings", [cluster.app, f"{host}/team/pinned@{digest}"])
    token = _bound_token(cluster, pod)
    ephemeral = {"name": "debug", "image": f"{host}/team/debug:v1", "targetContainerName": "c0"}
    cluster.kube.request(
        "PATCH",
        f"/api/v1/namespaces/{APPS}/pods/spellings/ephemeralcontainers",
        {"spec": {"ephemeralContainers": [ephemeral]}},
        headers={"Content-Type": "application/strategic-merge-patch+json"},
    )
    before = agent.health(cluster.ca_pem)["pulls"]
    for image, status in (
        (f"{host}/team/app", 403),  # :latest, not :v1
        (f"{host}/team/app@{digest}", 403),
        (f"{host}/team/app:v1@{digest}", 403),
        (f"{host}/team/pinned:v1", 403),
        (f"{host}/team/pinned:latest@{digest}", 403),
        (f"{host}/team/debug:v1", 403),
        (f"{host}/team/App:v1", 400),
        (f" {cluster.app}", 400),
        (f"{cluster.app} ", 400),
        (f"{cluster.app}\t", 400),
    ):
        answer = _ask(cluster, agent, {"images": [image]}, token)
        assert answer.status_code == status, (image, answer.text)
    assert agent.health(cluster.ca_pem)["pulls"] == before
    same = _ask(cluster, agent, {"images": [cluster.app] * 256}, token)
    assert same.status_code == 200, same.text
    results = same.json()["results"]
    assert len(results) == 256
    assert {r["result"] for r in results} <= {"present", "pulled"}, results[:2]
    assert agent.health(cluster.ca_pem)["pulls"] - before <= 1, "one image asked 256 times: one pull at most"


# --- the adversary: the HTTP layer --------------------------------------------------------------------


def _raw(cluster: Cluster, port: int, data: bytes, timeout: float = 20) -> bytes:
    """Bytes sent as they are over TLS; whatever comes back until the agent closes."""
    context = ssl.create_default_context(cadata=cluster.ca_pem)
    with context.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1") as sock:
        sock.settimeout(timeout)
        with contextlib.suppress(OSError):
            sock.sendall(data)
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


def _head(length: str, *more: str, body: bytes = b"{}") -> bytes:
    lines = ["POST /v1/pull HTTP/1.1", "Host: agent", "Content-Type: application/json", *more]
    if length:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def test_malformed_heads_are_answered_by_status_and_never_break_the_agent(cluster: Cluster, agent: Agent) -> None:
    cases: dict[str, tuple[bytes, bytes]] = {
        "101 header lines": (_head("2", *[f"X-{i}: y" for i in range(101)]), b"HTTP/1.1 431"),
        "a 64 KiB request line": (b"POST /" + b"a" * 65536 + b" HTTP/1.1\r\n\r\n", b"HTTP/1.1 414"),
        "a negative Content-Length": (_head("-1"), b"HTTP/1.1 411"),
        "a Content-Length of other digits": (_head("\u00b2"), b"HTTP/1.1 411"),  # '²'.isdigit(), int() refuses it
        "a huge Content-Length": (_head("9" * 40), b"HTTP/1.1 413"),
        "a chunked body": (_head("", "Transfer-Encoding: chunked", body=b"2\r\n{}\r\n0\r\n\r\n"), b"HTTP/1.1 411"),
        "chunked with a length": (_head("7", "Transfer-Encoding: chunked", body=b"2\r\n{}\r\n"), b"HTTP/1.1 411"),
        "Expect: 100-continue": (_head("2", "Expect: 100-continue"), b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 401"),
        "another method": (b"PUT /v1/pull HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", b"HTTP/1.1 501"),
        "HTTP/2's preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"HTTP/1.1 505"),
        "not HTTP": (b"\x00\x01\x02garbage\r\n\r\n", b"HTTP/1.1 400"),
    }
    seen = {what: _raw(cluster, agent.port, data)[:60] for what, (data, _) in cases.items()}
    wrong = {what: seen[what] for what, (_, start) in cases.items() if not seen[what].startswith(start)}
    assert not wrong, wrong
    with socket.create_connection(("127.0.0.1", agent.port), timeout=10) as plain:  # HTTP to the TLS port
        plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        with contextlib.suppress(OSError):
            assert not plain.recv(100).startswith(b"HTTP/1.1 200")
    assert _healthy(agent, cluster)
    assert "Traceback" not in agent.log.read_text(), agent.log.read_text()[-3000:]


# --- the adversary: one pull per image and credentials ------------------------------------------------


def _ask_in_background(cluster: Cluster, agent: Agent, body: Any, token: str) -> tuple[threading.Thread, list[Any]]:
    """The answer (a Response, or the exception) lands in the list when it comes."""
    answers: list[Any] = []

    def ask() -> None:
        try:
            answers.append(_ask(cluster, agent, body, token))
        except Exception as exc:
            answers.append(exc)

    thread = threading.Thread(target=ask)
    thread.start()
    return thread, answers


def _result(answers: list[Any]) -> dict[str, Any]:
    assert answers, "no answer"
    assert isinstance(answers[0], httpx.Response), answers
    assert answers[0].status_code == 200, answers[0].text
    result: dict[str, Any] = answers[0].json()["results"][0]
    return result


def test_a_later_deadline_joining_a_flight_is_answered_by_its_own_deadline(cluster: Cluster, agent: Agent) -> None:
    """The first asker gives the pull 1 s, the second 60 s: the second must not inherit the first's end."""
    _remove_now(cluster, cluster.big)
    short, long = (_pod(cluster, f"deadline-{what}", [cluster.big]) for what in ("short", "long"))
    before = agent.health(cluster.ca_pem)["pulls"]
    first, first_answer = _ask_in_background(
        cluster, agent, {"images": [cluster.big], "timeoutSeconds": 1}, _bound_token(cluster, short)
    )
    assert wait_for(lambda: agent.health(cluster.ca_pem)["pulls"] > before, timeout=10)
    second, second_answer = _ask_in_background(
        cluster, agent, {"images": [cluster.big], "timeoutSeconds": 60}, _bound_token(cluster, long)
    )
    first.join(60)
    second.join(90)
    assert _result(first_answer)["result"] == "failed", first_answer
    assert _result(second_answer)["result"] == "pulled", second_answer[0].text
    assert agent.health(cluster.ca_pem)["pulls"] - before == 1, "the second joined the first's pull"


def _remove_now(cluster: Cluster, image: str) -> None:
    """The image under every name the CRI gave it (its tag, repo digest and id), and its content: a pull
    of it fetches it all again."""
    ctr = ["ctr", "--address", cluster.containerd.socket, "--namespace", "k8s.io", "images"]
    listing = subprocess.run([*ctr, "ls"], capture_output=True, text=True, timeout=30, check=True).stdout
    rows = [line.split() for line in listing.splitlines()[1:]]
    targets = {row[2] for row in rows if row[0] == image}
    names = [row[0] for row in rows if row[2] in targets]
    if names:
        subprocess.run([*ctr, "rm", "--sync", *names], capture_output=True, timeout=30, check=True)


def test_other_credentials_never_join_a_flight(cluster: Cluster, agent: Agent) -> None:
    _remove_now(cluster, cluster.big)
    pods = [_pod(cluster, f"credentials-{i}", [cluster.big]) for i in range(2)]
    before = agent.health(cluster.ca_pem)["pulls"]
    asks = []
    for i, pod in enumerate(pods):
        secret = {"auths": {cluster.slow: {"username": f"user{i}", "password": "secret"}}}
        body = {"images": [cluster.big], "pullSecrets": {"s": json.dumps(secret)}}
        asks.append(_ask_in_background(cluster, agent, body, _bound_token(cluster, pod)))
    for thread, _ in asks:
        thread.join(120)
    assert {_result(answers)["result"] for _, answers in asks} <= {"pulled", "present"}
    assert agent.health(cluster.ca_pem)["pulls"] - before == 2, "two credentials: two pulls"


def test_a_pods_slow_pulls_do_not_starve_another_pods_request(cluster: Cluster, tmp_path: Path) -> None:
    """Pod A's pull hangs, with as many images as the agent pulls at once; pod B's image is on the node:
    B is answered at once, not 'timed out waiting' behind A."""
    agent = _start_agent(cluster, "--workers=1")
    try:
        with hanging_server() as port:
            cluster.containerd.trust(f"127.0.0.1:{port}", plain_http=True)
            hanging = f"127.0.0.1:{port}/team/app:v1"
            a, b = _pod(cluster, "starver", [hanging]), _pod(cluster, "starved", [cluster.app])
            token_b = _bound_token(cluster, b)
            assert _result([_ask(cluster, agent, {"images": [cluster.app]}, token_b)])["result"] in (
                "present",
                "pulled",
            )
            thread, _ = _ask_in_background(
                cluster, agent, {"images": [hanging], "timeoutSeconds": 30}, _bound_token(cluster, a)
            )
            assert wait_for(lambda: agent.health(cluster.ca_pem)["pulls"] == 2, timeout=10)
            started = time.monotonic()
            answer = _ask(cluster, agent, {"images": [cluster.app], "timeoutSeconds": 10}, token_b)
            took = time.monotonic() - started
            assert _result([answer])["result"] == "present", answer.text
            assert took < 5, f"B waited {took:.1f} s behind A's pull"
            stop_process(agent.process)
            thread.join(30)
    finally:
        stop_process(agent.process)
    assert "Traceback" not in agent.log.read_text(), agent.log.read_text()[-3000:]


# --- the adversary: holding on, and stopping ----------------------------------------------------------


def test_a_client_that_never_reads_its_answer_does_not_keep_its_slot(cluster: Cluster) -> None:
    """An answer of 256 long results to a client whose receive window is tiny and that never reads: the
    slot comes back (the answer is bounded by --request-timeout, as the request is)."""
    agent = _start_agent(cluster, "--request-timeout=2", "--max-connections=1")
    try:
        images = [f"{cluster.plain.host}/team/{'n' * 200}{i:03d}:v1" for i in range(256)]  # none exist
        pod = cluster.kube.create_pod(
            APPS,
            {
                "metadata": {"name": "never-reads"},
                "spec": {
                    "nodeName": NODE,
                    "serviceAccountName": "app",
                    "containers": [{"name": f"c{i}", "image": image} for i, image in enumerate(images)],
                },
            },
        )
        body = json.dumps({"images": images, "timeoutSeconds": 60}).encode()
        head = _head(str(len(body)), f"Authorization: Bearer {_bound_token(cluster, pod)}", body=body)
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        raw.connect(("127.0.0.1", agent.port))
        context = ssl.create_default_context(cadata=cluster.ca_pem)
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            sock.sendall(head)
            started = time.monotonic()
            # health is refused while the request holds the one slot; it is back once the answer is cut
            assert wait_for(lambda: _healthy(agent, cluster), timeout=60), "the slot never came back"
            assert time.monotonic() - started < 30
    finally:
        stop_process(agent.process)
    assert "Traceback" not in agent.log.read_text(), agent.log.read_text()[-3000:]


def test_sigterm_answers_the_requests_in_flight_and_exits_at_once(cluster: Cluster, tmp_path: Path) -> None:
    with hanging_server() as port:
        cluster.containerd.trust(f"127.0.0.1:{port}", plain_http=True)
        hanging = f"127.0.0.1:{port}/team/app:v1"
        pod = _pod(cluster, "stopped", [hanging])
        agent = _start_agent(cluster)
        try:
            command, env = _client(
                cluster, agent.port, [hanging], _bound_token(cluster, pod), tmp_path, failurePolicy="Fail"
            )
            client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            assert wait_for(partial(_pulls_started, agent, cluster), timeout=30), agent.log.read_text()
            context = ssl.create_default_context(cadata=cluster.ca_pem)
            arriving = context.wrap_socket(
                socket.create_connection(("127.0.0.1", agent.port)), server_hostname="127.0.0.1"
            )
            arriving.sendall(b"POST /v1/pull HTTP/1.1\r\n")  # a head still arriving: cut, not waited for
            started = time.monotonic()
            agent.process.send_signal(signal.SIGTERM)
            code = agent.process.wait(timeout=30)
            took = time.monotonic() - started
            out, err = client.communicate(timeout=30)
            arriving.close()
        finally:
            stop_process(agent.process)
    log = agent.log.read_text()
    assert "Traceback" not in log + err, log + err
    assert code == 0, log
    assert took < 10, f"the agent took {took:.1f} s to stop"
    assert f"image={hanging} result=cancelled" in out, out
    assert client.returncode == 1, out


# --- the adversary: the client against an agent that misbehaves ---------------------------------------


class _FakeAgent:
    """A TLS server with the agent's certificate that answers each connection with `behaviour`."""

    def __init__(self, cluster: Cluster, behaviour: Any) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(*cluster.tls)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.behaviour = behaviour
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(sock,), daemon=True).start()

    def _one(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError), self.context.wrap_socket(sock, server_side=True) as tls:
            tls.settimeout(30)
            request = b""
            while b"\r\n\r\n" not in request:
                request += tls.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(head.lower().partition(b"content-length:")[2].split(b"\r\n")[0])
            while len(body) < length:  # all of it: closing with bytes unread would reset the connection
                body += tls.recv(65536)
            self.behaviour(tls, self.stop)
            with contextlib.suppress(OSError):
                tls.unwrap()

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def _answer(body: bytes, status: str = "200 OK", length: int | None = None) -> Any:
    def behave(tls: ssl.SSLSocket, _stop: threading.Event) -> None:
        size = len(body) if length is None else length
        tls.sendall(f"HTTP/1.1 {status}\r\nContent-Length: {size}\r\n\r\n".encode() + body)

    return behave


def _drip(tls: ssl.SSLSocket, stop: threading.Event) -> None:
    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    while not stop.wait(0.2):
        tls.sendall(b" ")


def _silent(_tls: ssl.SSLSocket, stop: threading.Event) -> None:
    stop.wait(120)


def test_the_client_survives_any_answer_within_its_deadline(cluster: Cluster, tmp_path: Path) -> None:
    image = cluster.app
    result = {"image": image, "result": "pulled", "attempts": 1, "seconds": 1.0, "error": ""}
    behaviours: dict[str, tuple[Any, str]] = {
        "garbage": (_answer(b"\x00garbage"), "that is not JSON"),
        "a refusal without JSON": (_answer(b"<html>", "502 Bad Gateway"), "HTTP 502 that is not JSON"),
        "no result": (_answer(json.dumps({"results": []}).encode()), "without one result per image"),
        "two results": (_answer(json.dumps({"results": [result, result]}).encode()), "without one result per image"),
        "an unknown result": (_answer(json.dumps({"results": [result | {"result": "ok"}]}).encode()), "none of"),
        "seconds past a float": (_answer(b'{"results": [{"result": "pulled", "seconds": 1' + b"0" * 400 + b"}]}"), ""),
        "attempts of every type": (_answer(json.dumps({"results": [result | {"attempts": [1]}]}).encode()), ""),
        "a huge answer": (_answer(b" " * (5 * 1024 * 1024)), "more than"),
        "an answer shorter than its length": (_answer(b"{}", length=100), "cannot be reached"),
        "silence": (_silent, "did not answer in time"),
        "a slow drip": (_drip, "did not answer in time"),
    }
    seen = {}
    for what, (behaviour, words) in behaviours.items():
        fake = _FakeAgent(cluster, behaviour)
        try:
            command, env = _client(  # a timeout under the connect timeout (10 s): legal settings
                cluster, fake.port, [image], "token", tmp_path, timeoutSeconds=4, failurePolicy="Fail"
            )
            run = _run(command, env, timeout=60)
        finally:
            fake.close()
        seen[what] = run
        assert run.seconds < 10, (what, run.seconds, run.lines)
        assert words in "\n".join(run.lines), (what, run.lines)
        assert run.lines[-1].startswith("summary "), (what, run.lines)
    assert seen["seconds past a float"].code == 0, seen["seconds past a float"].lines
    assert seen["garbage"].code == 1, seen["garbage"].lines


def test_the_client_without_its_token_or_ca_or_stopped_says_so_and_follows_the_policy(
    cluster: Cluster, tmp_path: Path
) -> None:
    image = cluster.app
    fake = _FakeAgent(cluster, _silent)
    try:
        command, env = _client(cluster, fake.port, [image], "token", tmp_path, failurePolicy="Fail")
        (tmp_path / "token" / "token").unlink()
        missing = _run(command, env)
        assert missing.code == 1, missing.lines
        assert "cannot read the token" in "\n".join(missing.lines), missing.lines
        (tmp_path / "token" / "token").write_text("token")
        for garbage in ("", "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n", "\u00e9" * 10):
            broken = _run(command, env | {"COPILOT_WEBHOOK_AGENT_CA": garbage})
            assert broken.code == 1, (garbage, broken.lines)
            assert f"image={image} result=failed" in "\n".join(broken.lines), (garbage, broken.lines)
        client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        time.sleep(2)  # connected, waiting for the answer
        client.send_signal(signal.SIGTERM)
        out, err = client.communicate(timeout=10)
    finally:
        fake.close()
    assert "Traceback" not in err, err
    assert client.returncode == 1, out
    assert "SIGTERM: stopping" in out, out
    assert f"image={image} result=cancelled" in out, out


def test_broken_pull_secrets_cost_the_log_a_few_lines(cluster: Cluster, agent: Agent) -> None:
    pod = _pod(cluster, "broken-secrets", [cluster.app])
    auths = {f"host{i}:99999": {"auth": "x"} for i in range(20000)}  # a port past 65535: each one skipped
    body = {"images": [cluster.app], "pullSecrets": {"s": json.dumps({"auths": auths}), "t": "not json"}}
    before = len(agent.log.read_text().splitlines())
    answer = _ask(cluster, agent, body, _bound_token(cluster, pod))
    assert answer.status_code == 200, answer.text
    lines = [line for line in agent.log.read_text().splitlines()[before:] if "/broken-secrets" in line]
    assert len(lines) < 20, f"{len(lines)} lines logged for one request"
    assert any("19996 more problems" in line for line in lines), lines
