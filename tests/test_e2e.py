"""End to end: the real server, started the way `copilot-webhook serve` starts it, with freshly made
certificates, talked to as the API server does (TLS verified against the CA bundle)."""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from certs.authority import generate_ca, generate_files, issue_serving, write_files
from harness.environment import eventually
from harness.fake_apiserver import TOKEN, FakeAPIServer, namespace, node, write_kubeconfig
from harness.server_process import Server, client_context, free_port, running_server
from tests.helpers import apply, decoded_patch, pod, review, validate

CONFIG = "server:\n  maxBodyBytes: 65536\n  deadlineSeconds: 0.5\n"


@pytest.fixture(scope="module")
def server(tls_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tls_dir, tmp_path_factory.mktemp("e2e"), config=CONFIG) as running:
        yield running


def _review_bytes(obj: dict[str, object] | None = None, **request: Any) -> bytes:
    return orjson.dumps(review(obj or pod("flyte-1.15-bare.yaml"), **request))


def test_mutate_over_verified_tls(server: Server) -> None:
    obj = pod("flyte-1.15-bare.yaml")
    with server.client() as client:
        res = client.post("/mutate", content=orjson.dumps(review(obj)), headers={"content-type": "application/json"})
    assert res.status_code == 200
    answer = res.json()["response"]
    mutated = apply(obj, decoded_patch(answer))
    validate(mutated)
    assert mutated["spec"]["containers"][0]["securityContext"]["capabilities"] == {"add": ["SYS_PTRACE"]}
    summary = "ptrace=add:primary;image-puller=containerd:/run/containerd/containerd.sock"
    assert mutated["metadata"]["annotations"]["copilot-webhook.io/mutated"] == summary
    puller = mutated["spec"]["initContainers"][0]
    assert puller["name"] == "copilot-webhook-image-puller"
    socket = {"name": "copilot-webhook-runtime-socket", "mountPath": "/run/containerd/containerd.sock"}
    assert puller["volumeMounts"] == [socket]


def test_tls_is_http1_only(server: Server) -> None:
    context = client_context(server.ca)
    context.set_alpn_protocols(["h2", "http/1.1"])
    with (
        socket.create_connection(("127.0.0.1", server.port)) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        assert tls.selected_alpn_protocol() == "http/1.1"
        assert tls.version() in ("TLSv1.2", "TLSv1.3")


def test_tls_min_version_is_enforced(tls_dir: Path, tmp_path: Path) -> None:
    with running_server(tls_dir, tmp_path / "srv", config="server:\n  tlsMinVersion: '1.3'\n") as server:
        tls12 = client_context(server.ca)
        tls12.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(httpx.ConnectError), httpx.Client(verify=tls12) as client:
            client.get(server.url + "/healthz")
        with server.client() as client:
            assert client.get("/healthz").status_code == 200


def test_an_untrusted_ca_fails_verification(server: Server, tmp_path: Path) -> None:
    generate_files(tmp_path, "other", "other", dns=["localhost"], ips=["127.0.0.1"])
    with pytest.raises(httpx.ConnectError), httpx.Client(verify=client_context(tmp_path / "ca.crt")) as client:
        client.get(server.url + "/healthz")


def test_bad_input_gets_4xx_json_and_the_server_keeps_serving(server: Server) -> None:
    cases = [
        (b"not json", "application/json", 400, "not valid JSON"),
        (b'{"kind": "AdmissionReview"}', "application/json", 400, "expected kind AdmissionReview"),
        (
            orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}),
            "application/json",
            400,
            "uid",
        ),
        (_review_bytes(), "text/xml", 415, "Content-Type"),
        (b"{" + b" " * 70000 + b"}", "application/json", 413, "maxBodyBytes (65536)"),
        (_review_bytes(spec="x"), "application/json", 200, ""),
    ]
    bad_pod = review({"spec": {"containers": "nope"}})
    cases.append((orjson.dumps(bad_pod), "application/json", 400, "spec.containers must be an array"))
    with server.client() as client:
        for body, content_type, status, message in cases:
            res = client.post("/mutate", content=body, headers={"content-type": content_type})
            assert res.status_code == status, res.text
            if status != 200:
                assert message in res.json()["error"]
            assert "Traceback" not in res.text
        assert (
            client.post("/mutate", content=_review_bytes(), headers={"content-type": "application/json"}).status_code
            == 200
        )
    assert "Traceback" not in server.output()


def test_a_stalled_body_is_answered_408_within_the_deadline(server: Server) -> None:
    context = client_context(server.ca)
    with (
        socket.create_connection(("127.0.0.1", server.port)) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(
            b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{"
        )
        started = time.monotonic()
        tls.settimeout(5)
        answer = tls.recv(4096)
        waited = time.monotonic() - started
        while not answer.endswith(b"}"):
            answer += tls.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408")
    assert b"body not received within server.deadlineSeconds (0.5 s)" in answer
    assert 0.4 < waited < 2.5


def test_concurrent_reviews_each_get_their_own_uid(server: Server) -> None:
    results: dict[str, str] = {}

    def worker(n: int) -> None:
        with server.client() as client:
            for i in range(20):
                uid = f"u-{n}-{i}"
                res = client.post(
                    "/mutate", content=_review_bytes(uid=uid), headers={"content-type": "application/json"}
                )
                results[uid] = res.json()["response"]["uid"]

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 80
    assert all(k == v for k, v in results.items())


def test_certificate_rotation_without_restart_or_failed_requests(tls_dir: Path, tmp_path: Path) -> None:
    with running_server(tls_dir, tmp_path / "srv") as server:
        failures: list[str] = []
        stop = threading.Event()
        done = [0]

        def load() -> None:
            # One keep-alive connection made before the rotation, trusting the old CA: it must keep working.
            with server.client() as client:
                while not stop.is_set():
                    res = client.post("/mutate", content=_review_bytes(), headers={"content-type": "application/json"})
                    if res.status_code != 200:
                        failures.append(res.text)
                    done[0] += 1

        thread = threading.Thread(target=load)
        thread.start()
        time.sleep(0.3)
        new_ca = generate_ca("rotated CA")
        new_leaf = issue_serving(new_ca, ["localhost"], ["127.0.0.1"])
        new_dir = tmp_path / "new"
        write_files(new_dir, new_ca, new_leaf)
        write_files(server.workdir, new_ca, new_leaf)  # atomic renames, as a Secret update would do
        deadline = time.monotonic() + 10
        rotated = False
        while time.monotonic() < deadline and not rotated:
            try:
                with httpx.Client(verify=client_context(new_dir / "ca.crt")) as fresh:
                    rotated = fresh.get(server.url + "/healthz").status_code == 200
            except httpx.ConnectError:
                time.sleep(0.2)
        stop.set()
        thread.join()
        assert rotated, "new connections must be served with the new certificate"
        assert failures == []
        assert done[0] > 10
        with pytest.raises(httpx.ConnectError), httpx.Client(verify=client_context(tls_dir / "ca.crt")) as stale:
            stale.get(server.url + "/healthz")  # a client that trusts only the old CA no longer connects
        metrics = httpx.get(server.url + "/metrics", verify=client_context(new_dir / "ca.crt")).text
        assert 'copilot_webhook_certificate_reloads_total{result="ok"}' in metrics


def test_client_certificates_are_required_with_client_ca(tls_dir: Path, tmp_path: Path) -> None:
    client_ca = generate_ca("api server client CA")
    client = issue_serving(client_ca, ["kube-apiserver"], usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    (tmp_path / "client-ca.crt").write_bytes(client_ca.cert_pem)
    (tmp_path / "client.crt").write_bytes(client.cert_pem)
    (tmp_path / "client.key").write_bytes(client.key_pem)
    with running_server(tls_dir, tmp_path / "srv", "--client-ca", str(tmp_path / "client-ca.crt")) as server:
        trusted = client_context(server.ca, tmp_path / "client.crt", tmp_path / "client.key")
        with httpx.Client(verify=trusted) as good:
            assert good.get(server.url + "/healthz").status_code == 200
        with (
            pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)),
            httpx.Client(verify=client_context(server.ca)) as anonymous,
        ):
            anonymous.get(server.url + "/healthz")


def test_configuration_reload_without_restart(tls_dir: Path, tmp_path: Path) -> None:
    with (
        running_server(tls_dir, tmp_path / "srv", config="ptrace:\n  mode: add\n") as server,
        server.client() as client,
    ):

        def post() -> httpx.Response:
            body = _review_bytes(pod("flyte-1.15.yaml"))
            return client.post("/mutate/ptrace", content=body, headers={"content-type": "application/json"})

        assert "patch" not in post().json()["response"]  # Flyte 1.15 already has what add wants
        config = server.workdir / "config.yaml"
        staged = server.workdir / "config.new"
        staged.write_text("ptrace:\n  mode: drop\n")
        staged.replace(config)
        assert eventually(lambda: post().json()["response"].get("auditAnnotations", {}).get("ptrace") == "drop")
        staged.write_text("ptrace:\n  mode: maybe\n")
        staged.replace(config)
        assert eventually(lambda: "refused" in server.output())
        assert post().json()["response"]["auditAnnotations"]["ptrace"] == "drop", "the last good configuration stays"
        assert "ptrace.mode: 'maybe' is not allowed" in server.output()


def test_sigterm_stops_cleanly(tls_dir: Path, tmp_path: Path) -> None:
    with running_server(tls_dir, tmp_path / "srv") as server:
        process = server.process
    # What is in flight finishes, then the process exits by the signal, so the exit status says why it stopped.
    assert process.returncode == -signal.SIGTERM
    assert "Finished server process" in server.output()
    assert "Traceback" not in server.output()


def test_ctrl_c_stops_cleanly(tls_dir: Path, tmp_path: Path) -> None:
    """Ctrl-C in a terminal: the same drain and an exit by SIGINT, not a KeyboardInterrupt traceback."""
    with running_server(tls_dir, tmp_path / "srv") as server:
        server.process.send_signal(signal.SIGINT)
        server.process.wait(timeout=30)
    assert server.process.returncode == -signal.SIGINT
    assert "SIGINT: draining" in server.output()
    assert "Traceback" not in server.output()


def test_serve_with_cluster_facts(tls_dir: Path, tmp_path: Path, api: FakeAPIServer) -> None:
    """The real server with cluster access: readiness waits for the caches, answers follow the nodes and
    namespaces it watches, and /metrics counts nodes by runtime."""
    api.put_many("/api/v1/nodes", [node("k1", "containerd://1.7.7-k3s1.27"), node("k2", "containerd://1.7.7-k3s1.27")])
    api.put_many(
        "/api/v1/namespaces",
        [namespace("flytesnacks-development"), namespace("opted-out", {"copilot-webhook.io/inject": "disabled"})],
    )
    config = f"cluster:\n  enabled: true\n  kubeconfig: {api.kubeconfig(tmp_path / 'kubeconfig')}\n"
    with running_server(tls_dir, tmp_path / "srv", config=config) as server, server.client() as client:
        assert eventually(lambda: client.get("/readyz").status_code == 200)
        res = client.post("/mutate", content=_review_bytes(), headers={"content-type": "application/json"})
        answer = res.json()["response"]
        assert answer["auditAnnotations"]["image-puller"] == "containerd:/run/k3s/containerd/containerd.sock"
        opted_out = pod("flyte-1.15-bare.yaml")
        opted_out["metadata"]["namespace"] = "opted-out"
        res = client.post(
            "/mutate", content=orjson.dumps(review(opted_out)), headers={"content-type": "application/json"}
        )
        assert res.json()["response"] == {"uid": "a1b2c3", "allowed": True}
        api.put("/api/v1/nodes", node("d1", "docker://24.0.7"))
        assert eventually(lambda: 'copilot_webhook_nodes{runtime="docker"} 1.0' in client.get("/metrics").text)
        res = client.post("/mutate", content=_review_bytes(), headers={"content-type": "application/json"})
        warnings = res.json()["response"]["warnings"]
        assert any("candidate nodes disagree (containerd on 2, docker on 1)" in w for w in warnings)


@pytest.mark.parametrize("case", ["port in use", "no such host", "no private directory"])
def test_a_server_that_cannot_listen_exits_1_with_one_line_saying_why(tls_dir: Path, tmp_path: Path, case: str) -> None:
    """Exit codes as documented (docs/command-line.md): 1 for a failure other than usage or configuration,
    with one ERROR line naming what is wrong and no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COPILOT_WEBHOOK_") and k != "KUBECONFIG"}
    env["HOME"] = str(tmp_path)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1] if case == "port in use" else free_port()
    if case == "no private directory":
        env["TMPDIR"] = str(tmp_path / "missing")
    host = "no-such-host.invalid" if case == "no such host" else "127.0.0.1"  # .invalid never resolves (RFC 6761)
    command = [sys.executable, "-m", "webhook", "serve", "--host", host, "--port", str(port)]
    command += ["--tls-cert", str(tls_dir / "tls.crt"), "--tls-key", str(tls_dir / "tls.key")]
    with taken:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert done.returncode == 1, done.stderr
    expected = {
        "port in use": f"cannot listen on 127.0.0.1:{port}: address already in use",
        "no such host": f"cannot listen on {host}:{port}: {host} does not resolve (",
        "no private directory": "TMPDIR=",
    }[case]
    assert len(errors) == 1, done.stderr
    assert expected in errors[0]
    assert "Traceback" not in done.stderr


CACHES = {"node": "nodes", "namespace": "namespaces"}  # each cache and what it lists
KEEPER = ("--webhook-config", "cw", "--service", "cw")  # and the webhook configuration's, as in a cluster


def _cache_warnings(output: str, caches: dict[str, str] = CACHES) -> dict[str, list[str]]:
    lines = [line for line in output.splitlines() if " WARNING webhook.cluster.informer: " in line]
    return {name: [line for line in lines if f": {name} cache: " in line] for name in caches}


def _back_off_steps(seconds: float, first: float = 0.5) -> float:
    """How many back-off steps can fit in `seconds`: each waits at least 0.8 times `first` * 2**(step - 1)."""
    return math.log2(seconds / (0.8 * first) + 1) + 1


@pytest.mark.parametrize("args", [(), KEEPER], ids=["caches", "caches and keeper"])
def test_an_unreachable_api_server_is_one_plain_line_per_cache_and_back_off_step(
    tls_dir: Path, tmp_path: Path, args: tuple[str, ...]
) -> None:
    """What a user sees starting serve with a kubeconfig whose API server refuses connections: where the
    access comes from, once, then one line per cache and retry naming the server, the reason and the delay;
    no traceback, no retries of the HTTP client's own, a number of lines that grows with the back-off."""
    server_url = f"https://127.0.0.1:{free_port()}"  # a loopback port nothing listens on
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server_url)
    env = {"KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": "flyte"}
    caches = {**CACHES, **({"webhook-configuration": "the MutatingWebhookConfiguration cw"} if args else {})}
    started = time.monotonic()
    with running_server(tls_dir, tmp_path / "srv", *args, env=env) as server:
        time.sleep(3)
    elapsed = time.monotonic() - started
    output = server.output()
    said = f"cluster access: kubeconfig {kubeconfig} ($KUBECONFIG), context fake, API server {server_url}"
    assert output.count(said) == 1, output
    assert "Traceback" not in output
    assert "Retrying (Retry" not in output
    assert TOKEN not in output  # the kubeconfig's token
    for name, lines in _cache_warnings(output, caches).items():
        line = re.compile(
            rf".* WARNING webhook\.cluster\.informer: {name} cache: cannot list {caches[name]} from "
            rf"{re.escape(server_url)}: connection refused; retrying in \d+\.\d s"
        )
        assert 2 <= len(lines) <= _back_off_steps(elapsed), output
        assert all(line.fullmatch(text) for text in lines), output
    others = [line for line in output.splitlines() if " webhook.cluster.informer: " not in line]
    # The access, serving, the drain, uvicorn's start and stop; with the keeper, its self-check (in plain words).
    assert len(others) <= 8, output
    if args:
        check = f"TLS self-check of cw.flyte.svc:443 failed: cannot read the webhook configuration from {server_url}"
        assert f"{check}: connection refused" in output


def test_credentials_the_api_server_refuses_are_said_401_unauthorized(
    tls_dir: Path, tmp_path: Path, api: FakeAPIServer
) -> None:
    api.refuse = 401
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    with running_server(tls_dir, tmp_path / "srv", env={"KUBECONFIG": str(kubeconfig)}) as server:
        assert eventually(lambda: all(_cache_warnings(server.output()).values())), server.output()
    output = server.output()
    for name, lines in _cache_warnings(output).items():
        assert all(
            f"{name} cache: cannot list {name}s from {api.url}: 401 Unauthorized; retrying in" in x for x in lines
        )
    assert "Traceback" not in output


@pytest.mark.parametrize("case", ["not a kubeconfig", "no certificate from the cluster"])
def test_cluster_access_it_cannot_have_exits_1_with_one_line_saying_why(
    tls_dir: Path, tmp_path: Path, case: str
) -> None:
    """Cluster access it was told to use and cannot have (docs/command-line.md): exit 1, one ERROR line
    saying why in plain words, no traceback."""
    kubeconfig = tmp_path / "kubeconfig"
    if case == "not a kubeconfig":
        kubeconfig.write_text("a kubeconfig this is not\n")
        args, expected = [], f"webhook.web.serve: the kubeconfig {kubeconfig} is not a kubeconfig"
    else:  # the serving certificate is kept in a Secret of a cluster that refuses connections
        write_kubeconfig(kubeconfig, f"https://127.0.0.1:{free_port()}")
        args = [*KEEPER, "--certs-secret", "cw-tls"]
        expected = "webhook.web.serve: cannot ensure the serving certificate in cw-tls: connection refused"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COPILOT_WEBHOOK_")}
    env.update(HOME=str(tmp_path), KUBECONFIG=str(kubeconfig), POD_NAMESPACE="flyte")
    command = [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", str(free_port()), *args]
    command += ["--tls-cert", str(tmp_path / "tls.crt"), "--tls-key", str(tmp_path / "tls.key")]
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_bytes((tls_dir / name).read_bytes())
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert [line.split(" ERROR ", 1)[1] for line in done.stderr.splitlines() if " ERROR " in line] == [expected]
    assert "Traceback" not in done.stderr
    assert "Retrying (Retry" not in done.stderr
