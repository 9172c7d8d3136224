"""What the chart's hooks and probes run, against the real server over TLS and the fake API server:
`verify` (helm test), `unregister` (helm's pre-delete hook), and the plain-HTTP metrics port."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from certs.authority import generate_ca, generate_files
from harness.environment import child_env
from harness.fake_apiserver import FakeAPIServer
from harness.server_process import free_port, running_server

MWC = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/cw"


@pytest.fixture
def service_tls(tmp_path: Path) -> Path:
    """A certificate for the Service's DNS names (what the API server dials), not for 127.0.0.1."""
    out = tmp_path / "service-tls"
    generate_files(out, "cw", "flyte")
    return out


def _register(api: FakeAPIServer, bundle: bytes | None) -> None:
    client_config: dict[str, Any] = {"service": {"name": "cw", "namespace": "flyte", "port": 443}}
    if bundle is not None:
        client_config["caBundle"] = base64.b64encode(bundle).decode()
    api.store[MWC] = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "cw", "resourceVersion": "1"},
        "webhooks": [
            {"name": name, "clientConfig": {**client_config, "service": {**client_config["service"], "path": path}}}
            for name, path in (
                ("ptrace.copilot-webhook.io", "/mutate/ptrace"),
                ("image-puller.copilot-webhook.io", "/mutate/image-puller"),
            )
        ],
    }


def _run(api: FakeAPIServer, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = child_env(COPILOT_WEBHOOK_CLUSTER__KUBECONFIG=str(api.kubeconfig(tmp_path / "kc")))
    return subprocess.run(
        [sys.executable, "-m", "webhook", *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def test_verify_sends_a_review_to_each_webhook_and_a_preview_trusting_only_the_published_bundle(
    api: FakeAPIServer, tmp_path: Path, service_tls: Path
) -> None:
    _register(api, (service_tls / "ca.crt").read_bytes())
    with running_server(service_tls, tmp_path / "srv") as server:
        result = _run(api, tmp_path, "verify", "--webhook-config", "cw", "--address", f"127.0.0.1:{server.port}")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "ok    ptrace.copilot-webhook.io",
        "ok    image-puller.copilot-webhook.io",
        "ok    preview",
    ]
    assert "https://cw.flyte.svc/mutate/ptrace answered the review (a patch), TLS verified" in lines[0]


def test_verify_fails_on_a_bundle_that_does_not_sign_the_served_certificate(
    api: FakeAPIServer, tmp_path: Path, service_tls: Path
) -> None:
    _register(api, generate_ca("someone else").cert_pem)
    with running_server(service_tls, tmp_path / "srv") as server:
        result = _run(api, tmp_path, "verify", "--webhook-config", "cw", "--address", f"127.0.0.1:{server.port}")
    assert result.returncode == 1
    assert [line[:4] for line in result.stdout.splitlines()] == ["FAIL"] * 3
    assert "TLS verification failed: unable to get local issuer certificate" in result.stdout
    assert "Traceback" not in result.stderr


def test_verify_says_what_is_missing(api: FakeAPIServer, tmp_path: Path) -> None:
    _register(api, None)
    result = _run(api, tmp_path, "verify", "--webhook-config", "cw")
    assert result.returncode == 1
    assert "FAIL  ptrace.copilot-webhook.io: no caBundle published: the API server cannot call it" in result.stdout
    absent = _run(api, tmp_path, "verify", "--webhook-config", "nope")
    assert absent.returncode == 1
    assert "cannot read nope: 404" in absent.stdout


def test_verify_accepts_a_switched_off_preview(api: FakeAPIServer, tmp_path: Path, service_tls: Path) -> None:
    _register(api, (service_tls / "ca.crt").read_bytes())
    with running_server(service_tls, tmp_path / "srv", config="preview:\n  enabled: false\n") as server:
        result = _run(api, tmp_path, "verify", "--webhook-config", "cw", "--address", f"127.0.0.1:{server.port}")
    assert result.returncode == 0, result.stdout
    assert "ok    preview: preview.enabled is false" in result.stdout


def test_unregister_deletes_the_webhook_configuration_once(api: FakeAPIServer, tmp_path: Path) -> None:
    _register(api, None)
    first = _run(api, tmp_path, "unregister", "--webhook-config", "cw")
    assert (first.returncode, first.stdout.strip()) == (0, "MutatingWebhookConfiguration cw: deleted")
    assert MWC not in api.store
    again = _run(api, tmp_path, "unregister", "--webhook-config", "cw")
    assert (again.returncode, again.stdout.strip()) == (0, "MutatingWebhookConfiguration cw: already gone")


def test_metrics_on_a_plain_http_port_of_their_own(tmp_path: Path, tls_dir: Path) -> None:
    """A scrape needs no client TLS; nothing but /metrics is reachable there."""
    metrics_port = free_port()
    config = f"server:\n  metricsPort: {metrics_port}\n"
    with running_server(tls_dir, tmp_path / "srv", config=config) as server:
        with server.client() as tls:
            assert tls.get("/healthz").status_code == 200
        plain = httpx.Client(base_url=f"http://127.0.0.1:{metrics_port}", timeout=5)
        scraped = plain.get("/metrics")
        assert scraped.status_code == 200
        assert 'copilot_webhook_requests_total{path="/healthz",result="ok"} 1.0' in scraped.text
        assert plain.post("/metrics").status_code == 405
        refused = plain.post("/mutate", json={})
        assert refused.status_code == 404
        assert refused.json() == {"error": "no endpoint /mutate; this port serves GET /metrics only"}
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5)  # the admission port is TLS only
    with pytest.raises(httpx.ConnectError):
        plain.get("/metrics")  # stopped with the server
