"""Admission through the real chain: every golden pod created through the API server is stored exactly as
the server's /preview predicted (after the API server's own defaulting), dry-run creates agree, and a
second mutating webhook that changes the pod after ours gets ours reinvoked to a pod that is still right."""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import re
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from certs.authority import generate_files
from harness.controlplane import HOST_ADDRESS
from harness.kube_api import PRIVILEGED, ChartPods, Kube, Obj, mwc_path, release, started
from tests.test_kube_install import EXAMPLE, pod, ptrace_holders

# The golden pods and the pods Flyte's own code prints (tests/flyte/pods/).
GOLDEN_PODS = sorted((Path(__file__).parent / "golden" / "pods").glob("*.yaml")) + sorted(
    (Path(__file__).parent / "flyte" / "pods").glob("*/*.yaml")
)
NAMESPACE = "cwadm"
PLAIN = "admission-plain"  # opted out: the API server's own defaulting and nothing else
WEBHOOKED = "admission-webhooked"
PULLER = "copilot-webhook-image-puller"


@pytest.fixture(scope="module")
def server(kube_admin: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChartPods]:
    kube_admin.create_namespace(PLAIN, {"copilot-webhook.io/inject": "disabled"})
    kube_admin.create_namespace(WEBHOOKED, PRIVILEGED)
    work = tmp_path_factory.mktemp("admission")
    yield from started(release(kube_admin, NAMESPACE, work), work / "pods")


TOKEN_VOLUME = re.compile(r"kube-api-access-[a-z0-9]{5}")


def _comparable(pod: Obj) -> Obj:
    """What the API server sets per object (identity, time, managed fields, the token volume's random
    suffix) is left out; everything the pod author and the webhooks decide stays."""
    pod = copy.deepcopy(pod)
    metadata = pod["metadata"]
    for key in ("uid", "resourceVersion", "creationTimestamp", "managedFields", "namespace", "generation"):
        metadata.pop(key, None)
    pod.pop("status", None)
    result = json.loads(TOKEN_VOLUME.sub("kube-api-access-xxxxx", json.dumps(pod, sort_keys=True)))
    assert isinstance(result, dict)
    return result


@pytest.mark.parametrize("path", GOLDEN_PODS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_stored_exactly_as_preview_predicted(kube_admin: Kube, server: ChartPods, path: Path) -> None:
    name = f"g-{path.parent.name}-{path.stem}".replace(".", "-")[:50].rstrip("-")
    as_the_webhook_sees_it = kube_admin.create_pod(PLAIN, pod(path, name), dry_run=True)
    as_the_webhook_sees_it["metadata"]["namespace"] = WEBHOOKED
    answer = server.https("POST", f"/preview?namespace={WEBHOOKED}", json=as_the_webhook_sees_it)
    assert answer.status_code == 200, answer.text
    predicted = answer.json()["object"]
    predicted["metadata"]["namespace"] = PLAIN
    expected = kube_admin.create_pod(PLAIN, predicted, dry_run=True)  # the API server's defaulting of it
    dry = kube_admin.create_pod(WEBHOOKED, pod(path, name), dry_run=True)
    stored = kube_admin.create_pod(WEBHOOKED, pod(path, name))
    assert _comparable(stored) == _comparable(expected)
    assert _comparable(dry) == _comparable(stored)


class _LateSidecar(BaseHTTPRequestHandler):
    """A second mutating webhook, called after ours, that adds a container ours has not seen."""

    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        pod = review["request"]["object"]
        ops = []
        if not any(c["name"] == "late-sidecar" for c in pod["spec"]["containers"]):
            container = {"name": "late-sidecar", "image": "registry.example/late/sidecar:1.0"}
            ops.append({"op": "add", "path": "/spec/containers/-", "value": container})
        response: dict[str, Any] = {"uid": review["request"]["uid"], "allowed": True}
        if ops:
            response.update(patchType="JSONPatch", patch=base64.b64encode(json.dumps(ops).encode()).decode())
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _late_webhook(kube: Kube, tmp: Path) -> Iterator[None]:
    files, bundle = generate_files(tmp, "late", "tests", ips=[HOST_ADDRESS])
    httpd = ThreadingHTTPServer((HOST_ADDRESS, 0), _LateSidecar)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files["tls.crt"], files["tls.key"])
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    # Webhooks run in the order of their configurations' names: "zz-" comes after ours.
    kube.create(
        "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
        {
            "metadata": {"name": "zz-late-sidecar"},
            "webhooks": [
                {
                    "name": "late-sidecar.tests.example",
                    "admissionReviewVersions": ["v1"],
                    "sideEffects": "None",
                    "failurePolicy": "Fail",
                    "reinvocationPolicy": "Never",
                    # About something else than how a Service is reached: a url is fine here.
                    "clientConfig": {"url": f"https://{HOST_ADDRESS}:{httpd.server_port}/", "caBundle": bundle},
                    "rules": [
                        {"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}
                    ],
                    "namespaceSelector": {"matchLabels": {"late-sidecar": "yes"}},
                }
            ],
        },
    )
    try:
        yield
    finally:
        kube.delete(mwc_path("zz-late-sidecar"))
        httpd.shutdown()
        httpd.server_close()


def test_reinvoked_after_a_later_webhook_the_pod_is_still_right(
    kube_admin: Kube, server: ChartPods, tmp_path: Path
) -> None:
    kube_admin.create_namespace("reinvoked", {"late-sidecar": "yes", **PRIVILEGED})
    with _late_webhook(kube_admin, tmp_path):
        stored = kube_admin.create_pod("reinvoked", pod(EXAMPLE, "reinvoked"))
    assert [c["name"] for c in stored["spec"]["containers"]] == ["bq2m4-n1-0", "flyte-copilot-uploader", "late-sidecar"]
    assert ptrace_holders(stored) == ["bq2m4-n1-0"], "the late container is not ours to grant"
    assert [c["name"] for c in stored["spec"].get("initContainers", [])].count(PULLER) <= 1
    assert stored["spec"]["shareProcessNamespace"] is True
    # Ours, asked again about what it produced plus the late container, has nothing more to change.
    again = server.https("POST", "/preview?namespace=reinvoked&output=patch", json=stored)
    assert again.status_code == 200, again.text
    assert again.json() == []
