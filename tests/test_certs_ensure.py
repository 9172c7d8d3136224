"""certs ensure and the in-server keeper, with the real kubernetes client against a server that speaks
the API for Secrets and MutatingWebhookConfigurations (create, get, JSON patch with a resourceVersion
test, list and watch narrowed by a metadata.name field selector)."""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from certs.authority import generate_ca, generate_files
from certs.rotation import load_bundle
from harness.environment import child_env, eventually
from harness.fake_apiserver import FakeAPIServer
from harness.server_process import Server, free_port, running_server
from webhook.cluster.access import api_client
from webhook.cluster.certificates import POLICY_ANNOTATION, CertificateManager
from webhook.cluster.keeper import AdmissionKeeper
from webhook.config import ClusterSettings

MWC = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/cw"
SECRET = "/api/v1/namespaces/flyte/secrets/cw-tls"
SERVICE_NAME = "cw.flyte.svc"


@pytest.fixture
def cluster(api: FakeAPIServer) -> FakeAPIServer:
    api.store[MWC] = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "cw", "resourceVersion": "1"},
        "webhooks": [
            {"name": "ptrace.copilot-webhook.io", "clientConfig": {"service": {"name": "cw", "namespace": "flyte"}}},
            {
                "name": "image-puller.copilot-webhook.io",
                "clientConfig": {"service": {"name": "cw", "namespace": "flyte"}},
            },
        ],
    }
    return api


def _manager(api: FakeAPIServer, tmp_path: Path, days: int = 90) -> CertificateManager:
    client = api_client(ClusterSettings(kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig"))))
    assert client is not None
    return CertificateManager(client, "cw-tls", "flyte", webhook_config="cw", service="cw", days=days)


def _bundles(api: FakeAPIServer) -> list[bytes]:
    return [base64.b64decode(w["clientConfig"]["caBundle"]) for w in api.store[MWC]["webhooks"]]


def _verifies(leaf_pem: bytes, bundle: bytes) -> bool:
    """Would the API server accept this serving certificate for the Service, given this caBundle?"""
    leaf = x509.load_pem_x509_certificate(leaf_pem)
    roots = load_bundle(bundle)
    for root in roots:
        with contextlib.suppress(Exception):
            leaf.verify_directly_issued_by(root)
            sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            return SERVICE_NAME in sans.get_values_for_type(x509.DNSName)
    return False


def test_first_install_creates_the_secret_patches_every_webhook_and_writes_files(
    cluster: FakeAPIServer, tmp_path: Path
) -> None:
    state = _manager(cluster, tmp_path).ensure(tmp_path / "tls")
    assert state.note == "new CA, new serving certificate"
    assert cluster.writes == [f"create {SECRET}", f"patch {MWC}"]
    bundles = _bundles(cluster)
    assert bundles[0] == bundles[1]
    leaf = (tmp_path / "tls" / "tls.crt").read_bytes()
    assert _verifies(leaf, bundles[0])
    assert (tmp_path / "tls" / "ca.crt").read_bytes() == bundles[0]
    assert (tmp_path / "tls" / "tls.key").stat().st_mode & 0o777 == 0o600
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "tls" / "tls.crt", tmp_path / "tls" / "tls.key")  # a pair that loads


def test_a_second_run_changes_nothing(cluster: FakeAPIServer, tmp_path: Path) -> None:
    manager = _manager(cluster, tmp_path)
    manager.ensure()
    writes = list(cluster.writes)
    assert manager.ensure().note == "nothing to do"
    assert cluster.writes == writes


def test_renewal_at_two_thirds_keeps_the_ca_and_the_bundle(cluster: FakeAPIServer, tmp_path: Path) -> None:
    manager = _manager(cluster, tmp_path)
    first = manager.ensure()
    later = datetime.now(UTC) + timedelta(days=59)
    assert manager.ensure(now=later).note == "nothing to do"
    renewed = manager.ensure(now=datetime.now(UTC) + timedelta(days=61))
    assert renewed.note == "new serving certificate"
    assert renewed.data["tls.crt"] != first.data["tls.crt"]
    assert renewed.bundle == first.bundle
    assert cluster.writes[-1] == f"patch {SECRET}", "the caBundle did not change: no patch"


def test_ca_rotation_never_serves_a_certificate_the_published_bundle_does_not_trust(
    cluster: FakeAPIServer, tmp_path: Path
) -> None:
    manager = _manager(cluster, tmp_path)
    start = datetime.now(UTC)
    manager.ensure(now=start)
    old_ca = load_bundle(_bundles(cluster)[0])[0]
    ca_life = old_ca.not_valid_after_utc - old_ca.not_valid_before_utc
    moment = old_ca.not_valid_before_utc + ca_life * 2 / 3 + timedelta(days=1)
    notes = []
    for step in range(3):
        state = manager.ensure(tmp_path / "tls", now=moment + timedelta(minutes=step))
        notes.append(state.note)
        served = (tmp_path / "tls" / "tls.crt").read_bytes()
        assert _verifies(served, _bundles(cluster)[0]), f"step {step}: served certificate not trusted by the caBundle"
    assert notes[0].startswith("next CA joins the bundle")
    assert notes[1].startswith("next CA promoted")
    assert notes[2] == "nothing to do"
    issuer = x509.load_pem_x509_certificate((tmp_path / "tls" / "tls.crt").read_bytes()).issuer
    assert issuer == load_bundle(_bundles(cluster)[0])[-1].subject
    assert len(load_bundle(_bundles(cluster)[0])) == 2, "the old CA stays trusted until it expires"


def test_replicas_racing_on_a_fresh_install_agree(cluster: FakeAPIServer, tmp_path: Path) -> None:
    results: list[Any] = []
    barrier = threading.Barrier(4)

    def replica(n: int) -> None:
        manager = _manager(cluster, tmp_path / f"r{n}")
        barrier.wait()
        results.append(manager.ensure(tmp_path / f"out{n}"))

    for n in range(4):
        (tmp_path / f"r{n}").mkdir()
    threads = [threading.Thread(target=replica, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    assert sum(w == f"create {SECRET}" for w in cluster.writes) == 1
    served = {(tmp_path / f"out{n}" / "tls.crt").read_bytes() for n in range(4)}
    assert len(served) == 1, "every replica serves the certificate stored in the Secret"
    assert _verifies(served.pop(), _bundles(cluster)[0])


def test_a_conflicting_update_is_retried(cluster: FakeAPIServer, tmp_path: Path) -> None:
    manager = _manager(cluster, tmp_path)
    manager.ensure()
    original = manager.read_secret

    calls = [0]

    def stale() -> tuple[dict[str, bytes] | None, str | None]:
        data, version = original()
        calls[0] += 1
        return data, (str(int(version) - 1) if calls[0] == 1 and version else version)

    manager.read_secret = stale  # type: ignore[method-assign]
    state = manager.ensure(now=datetime.now(UTC) + timedelta(days=61))
    assert state.note == "new serving certificate"
    assert calls[0] == 2, "the 409 on the stale resourceVersion made it read again"


def _cli(api: FakeAPIServer, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = child_env(COPILOT_WEBHOOK_CLUSTER__KUBECONFIG=str(api.kubeconfig(tmp_path / "kc")))
    return subprocess.run(
        [sys.executable, "-m", "webhook", "certs", "ensure", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_certs_ensure_command(cluster: FakeAPIServer, tmp_path: Path) -> None:
    args = ("--secret", "cw-tls", "--webhook-config", "cw", "--namespace", "flyte", "--out", str(tmp_path / "out"))
    result = _cli(cluster, tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cw-tls: new CA, new serving certificate"
    assert _cli(cluster, tmp_path, *args).stdout.strip() == "cw-tls: nothing to do"
    missing = _cli(cluster, tmp_path, "--secret", "x", "--webhook-config", "nope", "--namespace", "flyte")
    assert missing.returncode == 1
    assert "MutatingWebhookConfiguration nope not found" in missing.stderr
    assert "Traceback" not in missing.stderr


class Report:
    def __init__(self) -> None:
        self.checks: list[str | None] = []

    def self_check(self, why: str | None) -> None:
        self.checks.append(why)

    def bundle_expiry(self, bundle: bytes) -> None:
        pass

    def renewal(self, result: str) -> None:
        pass

    def bundle_repair(self) -> None:
        pass


@contextlib.contextmanager
def _serving(cluster: FakeAPIServer, tmp_path: Path, *args: str, name: str = "srv") -> Iterator[Server]:
    """`serve` as the chart runs it: POD_NAMESPACE and POD_IP from the downward API, no self-check address."""
    port = free_port()
    config = f"cluster:\n  kubeconfig: {cluster.kubeconfig(tmp_path / 'kc')}\n"
    tls = tmp_path / f"placeholder-{name}"  # one each: replicas start in parallel threads
    generate_files(tls, "placeholder", "x", dns=["localhost"])  # overwritten by the server's own
    env = {"POD_NAMESPACE": "flyte", "POD_IP": "127.0.0.1"}
    with running_server(tls, tmp_path / name, *args, config=config, env=env, port=port) as server:
        yield server


def _ours(cluster: FakeAPIServer, tmp_path: Path) -> Path:
    path = tmp_path / "bundle.crt"
    path.write_bytes(_bundles(cluster)[0])
    return path


def test_serve_keeps_its_own_certificate_and_checks_its_own_listener(cluster: FakeAPIServer, tmp_path: Path) -> None:
    """self-signed mode end to end: the server ensures its certificate before serving, serves it, and its
    self-check (a handshake with its own pod IP for the Service name, verified against the caBundle read
    back from the webhook configuration) passes."""
    with _serving(cluster, tmp_path, "--certs-secret", "cw-tls", "--webhook-config", "cw") as server:
        ca = _ours(cluster, tmp_path)
        assert eventually(lambda: "copilot_webhook_tls_self_check 1.0" in _metrics(server.port, ca))
        assert 'copilot_webhook_certificate_renewals_total{result="renewed"} 1.0' in _metrics(server.port, ca)
        assert (server.workdir / "tls.crt").read_bytes() == base64.b64decode(cluster.store[SECRET]["data"]["tls.crt"])

        # The same check, run here, must fail once the published caBundle no longer signs what is served.
        report = Report()
        listening = threading.Event()
        listening.set()
        keeper = AdmissionKeeper(_manager(cluster, tmp_path), report, ("127.0.0.1", server.port), listening=listening)
        assert keeper.check() is None
        foreign = base64.b64encode(generate_ca("someone else").cert_pem).decode()
        for hook in cluster.store[MWC]["webhooks"]:  # behind the server's back: no watch event
            hook["clientConfig"]["caBundle"] = foreign
        failure = keeper.check()
        assert failure is not None
        assert "CERTIFICATE_VERIFY_FAILED" in failure
        assert report.checks == [None, failure]


def _blank(config: dict[str, Any]) -> None:
    for hook in config["webhooks"]:
        hook["clientConfig"].pop("caBundle", None)


def _foreign(config: dict[str, Any]) -> None:
    foreign = base64.b64encode(generate_ca("someone else").cert_pem).decode()
    for hook in config["webhooks"]:
        hook["clientConfig"]["caBundle"] = foreign


def _new_webhook(config: dict[str, Any]) -> None:
    config["webhooks"].append(
        {"name": "third.copilot-webhook.io", "clientConfig": {"service": {"name": "cw", "namespace": "flyte"}}}
    )


def test_a_blanked_or_foreign_ca_bundle_is_repaired_within_seconds(cluster: FakeAPIServer, tmp_path: Path) -> None:
    """Someone (an old chart's upgrade, a GitOps sync, kubectl apply) overwrites the caBundle: the watch sees
    it and the server re-asserts its own, without waiting for the next renewal."""
    with _serving(cluster, tmp_path, "--certs-secret", "cw-tls", "--webhook-config", "cw") as server:
        ours = base64.b64encode(_bundles(cluster)[0]).decode()
        ca = _ours(cluster, tmp_path)
        assert eventually(lambda: "copilot_webhook_tls_self_check 1.0" in _metrics(server.port, ca))
        took = []
        for change in (_blank, _foreign, _new_webhook):
            time.sleep(1.1)  # repairs closer than a second apart back off; these are separate incidents
            cluster.edit(MWC, change)
            start = time.monotonic()
            assert eventually(
                lambda: all(w["clientConfig"].get("caBundle") == ours for w in cluster.store[MWC]["webhooks"]),
                timeout=5,
            ), f"{change.__name__}: not repaired; log:\n{server.output()}"
            took.append(time.monotonic() - start)
        assert max(took) < 3, took
        assert "copilot_webhook_ca_bundle_repairs_total 3.0" in _metrics(server.port, ca)
        assert "copilot_webhook_tls_self_check 1.0" in _metrics(server.port, ca)


def _policies(cluster: FakeAPIServer) -> dict[str, str]:
    return {w["name"]: w.get("failurePolicy", "") for w in cluster.store[MWC]["webhooks"]}


def test_a_fresh_install_fails_open_until_its_bundle_verifies(cluster: FakeAPIServer, tmp_path: Path) -> None:
    """The chart renders Ignore and declares Fail in the annotation: the init container's `certs ensure`
    publishes the bundle but leaves the policy; the server patches Fail in only after its own listener
    verified against that bundle."""
    declared = {"ptrace.copilot-webhook.io": "Fail", "image-puller.copilot-webhook.io": "Ignore"}
    config = cluster.store[MWC]
    config["metadata"]["annotations"] = {POLICY_ANNOTATION: json.dumps(declared)}
    for hook in config["webhooks"]:
        hook["failurePolicy"] = "Ignore"
    args = ("--secret", "cw-tls", "--webhook-config", "cw", "--namespace", "flyte", "--out", str(tmp_path / "out"))
    assert _cli(cluster, tmp_path, *args).returncode == 0
    assert _bundles(cluster)[0]
    assert _policies(cluster) == {"ptrace.copilot-webhook.io": "Ignore", "image-puller.copilot-webhook.io": "Ignore"}
    with _serving(cluster, tmp_path, "--certs-secret", "cw-tls", "--webhook-config", "cw") as server:
        assert eventually(lambda: _policies(cluster) == declared, timeout=10), server.output()
        assert eventually(lambda: "failure policies now ptrace.copilot-webhook.io=Fail" in server.output())


def test_cert_manager_mode_promotes_the_policy_only_once_the_injected_bundle_verifies(
    cluster: FakeAPIServer, tmp_path: Path, tls_dir: Path
) -> None:
    """No Secret of ours: the server only watches, checks and promotes. Until cert-manager's injector puts a
    caBundle in, the webhook stays Ignore; a bundle that does not sign what we serve does not count."""
    declared = {"ptrace.copilot-webhook.io": "Fail", "image-puller.copilot-webhook.io": "Fail"}
    config = cluster.store[MWC]
    config["metadata"]["annotations"] = {POLICY_ANNOTATION: json.dumps(declared)}
    for hook in config["webhooks"]:
        hook["failurePolicy"] = "Ignore"
    names = ["cw", "cw.flyte", "cw.flyte.svc", "cw.flyte.svc.cluster.local"]
    generate_files(tmp_path / "issued", "cw", "flyte", dns=names)
    port = free_port()
    kubeconfig = f"cluster:\n  kubeconfig: {cluster.kubeconfig(tmp_path / 'kc')}\n"
    env = {"POD_NAMESPACE": "flyte", "POD_IP": "127.0.0.1"}
    with running_server(
        tmp_path / "issued", tmp_path / "srv", "--webhook-config", "cw", config=kubeconfig, env=env, port=port
    ) as server:
        assert eventually(lambda: "no caBundle" in server.output(), timeout=10)
        cluster.edit(MWC, _foreign)
        time.sleep(1.5)
        assert _policies(cluster) == {
            "ptrace.copilot-webhook.io": "Ignore",
            "image-puller.copilot-webhook.io": "Ignore",
        }
        injected = base64.b64encode((tmp_path / "issued" / "ca.crt").read_bytes()).decode()

        def inject(config: dict[str, Any]) -> None:
            for hook in config["webhooks"]:
                hook["clientConfig"]["caBundle"] = injected

        cluster.edit(MWC, inject)
        assert eventually(lambda: _policies(cluster) == declared, timeout=5), server.output()


def test_two_replicas_starting_at_once_serve_the_chart_owned_secret(cluster: FakeAPIServer, tmp_path: Path) -> None:
    """The chart makes the Secret (empty, with Helm's ownership labels); two replicas start together: one
    certificate, kept in that Secret, its labels and annotations intact, served by both."""
    cluster.store[SECRET] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": "cw-tls",
            "namespace": "flyte",
            "resourceVersion": "2",
            "labels": {"app.kubernetes.io/managed-by": "Helm"},
            "annotations": {"meta.helm.sh/release-name": "cw", "meta.helm.sh/release-namespace": "flyte"},
        },
    }
    args = ("--certs-secret", "cw-tls", "--webhook-config", "cw")
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(stack.enter_context, _serving(cluster, tmp_path, *args, name=f"r{n}")) for n in (0, 1)]
        servers = [f.result(timeout=60) for f in starting]
        secret = cluster.store[SECRET]
        assert secret["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "Helm"}
        assert secret["metadata"]["annotations"]["meta.helm.sh/release-name"] == "cw"
        assert not any(w.startswith("create") for w in cluster.writes)
        served = {(s.workdir / "tls.crt").read_bytes() for s in servers}
        assert served == {base64.b64decode(secret["data"]["tls.crt"])}
        ca = _ours(cluster, tmp_path)
        for server in servers:
            assert eventually(functools.partial(_self_check_passes, server.port, ca))


def _self_check_passes(port: int, ca: Path) -> bool:
    return "copilot_webhook_tls_self_check 1.0" in _metrics(port, ca)


def _metrics(port: int, ca: Path) -> str:
    """GET /metrics verifying the certificate for the Service name, as the API server would."""
    import socket

    context = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port)) as raw,
        context.wrap_socket(raw, server_hostname=SERVICE_NAME) as tls,
    ):
        tls.sendall(b"GET /metrics HTTP/1.1\r\nHost: cw\r\nConnection: close\r\n\r\n")
        chunks = []
        while chunk := tls.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def test_a_failed_self_check_repairs_at_once(cluster: FakeAPIServer, tmp_path: Path) -> None:
    """The files the server serves no longer match the Secret (say a stale volume): the self-check after
    the next change of the configuration fails, the keeper rewrites the files, the server reloads them
    and the check passes again."""
    with _serving(cluster, tmp_path, "--certs-secret", "cw-tls", "--webhook-config", "cw") as server:
        ca = _ours(cluster, tmp_path)
        assert eventually(lambda: "copilot_webhook_tls_self_check 1.0" in _metrics(server.port, ca))
        stale = tmp_path / "stale"
        generate_files(stale, "cw", "flyte")  # the right names, another CA
        for name in ("tls.key", "tls.crt"):
            (server.workdir / name).write_bytes((stale / name).read_bytes())
        time.sleep(1.5)  # reloaded: now serving what the published bundle does not sign
        cluster.edit(MWC, lambda config: config["metadata"].setdefault("annotations", {}).update(touched="1"))
        secret_leaf = base64.b64decode(cluster.store[SECRET]["data"]["tls.crt"])
        assert eventually(lambda: (server.workdir / "tls.crt").read_bytes() == secret_leaf, timeout=5)
        assert eventually(lambda: "the self-check failed" in server.output())

        def verified_and_passing() -> bool:
            try:
                return "copilot_webhook_tls_self_check 1.0" in _metrics(server.port, ca)
            except ssl.SSLError:
                return False  # still the stale pair, for a moment

        assert eventually(verified_and_passing, timeout=10)


@pytest.mark.parametrize(
    "annotation",
    ["not json", '["Fail"]', '{"ptrace.copilot-webhook.io": "fail"}', '{"ptrace.copilot-webhook.io": 1}'],
)
def test_a_garbled_policy_annotation_promotes_nothing(cluster: FakeAPIServer, tmp_path: Path, annotation: str) -> None:
    """The annotation is the chart's; whatever is written there, only Ignore or Fail is ever patched in."""
    manager = _manager(cluster, tmp_path)
    manager.ensure()
    config = cluster.store[MWC]
    config["metadata"]["annotations"] = {POLICY_ANNOTATION: annotation}
    assert manager.declared_policies(config) == {}
    assert manager.promote_policies() == []
    assert all("failurePolicy" not in hook for hook in cluster.store[MWC]["webhooks"])
