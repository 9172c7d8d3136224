"""What the chart's hooks run: `unregister` (helm uninstall, before anything else goes) and `verify`
(helm test: a preview and a review sent through the Service, trusted only through the published caBundle).
"""

from __future__ import annotations

import base64
import http.client
import socket
import ssl
from dataclasses import dataclass
from typing import Any

import orjson
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from webhook import objects
from webhook.cluster.errors import plainly

# A pod as Flyte <= 1.15 builds a raw-container task (flyteplugins' copilot.go): the copilot's downloader,
# its sidecar watcher as a regular container, and the primary sharing the data volume.
SAMPLE_POD: objects.Pod = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "copilot-webhook-verify", "namespace": "default"},
    "spec": {
        "shareProcessNamespace": True,
        "initContainers": [
            {
                "name": "flyte-copilot-downloader",
                "image": "cr.flyte.org/flyteorg/flytecopilot:v1.15.3",
                "command": ["/bin/flyte-copilot", "--"],
                "args": ["download", "--to-local-dir", "/var/flyte/inputs"],
                "volumeMounts": [{"name": "flyte-inputs", "mountPath": "/var/flyte/inputs"}],
            }
        ],
        "containers": [
            {
                "name": "main",
                "image": "ghcr.io/example/task:1",
                "volumeMounts": [{"name": "flyte-inputs", "mountPath": "/var/flyte/inputs"}],
            },
            {
                "name": "flyte-copilot-sidecar",
                "image": "cr.flyte.org/flyteorg/flytecopilot:v1.15.3",
                "command": ["/bin/flyte-copilot", "--"],
                "args": ["sidecar", "--from-local-dir", "/var/flyte/outputs"],
                "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}},
            },
        ],
        "volumes": [{"name": "flyte-inputs", "emptyDir": {}}],
    },
}


def unregister(api: client.ApiClient, name: str) -> str:
    """Delete our MutatingWebhookConfiguration; one already gone counts as done."""
    try:
        client.AdmissionregistrationV1Api(api).delete_mutating_webhook_configuration(name, _preload_content=False)
    except ApiException as exc:
        if exc.status == 404:
            return f"MutatingWebhookConfiguration {name}: already gone"
        raise
    return f"MutatingWebhookConfiguration {name}: deleted"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _post(address: tuple[str, int], server_name: str, bundle: bytes, *, path: str, body: bytes, kind: str) -> Any:
    context = ssl.create_default_context(cadata=bundle.decode())
    connection = http.client.HTTPSConnection(server_name, address[1], timeout=10, context=context)
    # Dial the given address, verify the certificate for the Service's name (what the API server does).
    connection.sock = context.wrap_socket(socket.create_connection(address, timeout=10), server_hostname=server_name)
    try:
        connection.request("POST", path, body, {"Content-Type": kind, "Host": server_name})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def verify(api: client.ApiClient, name: str, address: tuple[str, int] | None = None) -> list[Check]:
    """Each webhook of our configuration answers a dry-run review through its Service over TLS verified
    against the published caBundle; /preview answers (or is switched off). `address` replaces the
    Service's address (the server name stays the Service's DNS name)."""
    try:
        response: Any = client.AdmissionregistrationV1Api(api).read_mutating_webhook_configuration(
            name, _preload_content=False
        )
        config = orjson.loads(response.data)
    except ApiException as exc:
        return [Check("webhook configuration", ok=False, detail=f"cannot read {name}: {exc.status} {exc.reason}")]
    checks: list[Check] = []
    target = None
    for hook in config.get("webhooks") or ():
        check, reached = _hook_check(hook, address)
        checks.append(check)
        target = reached or target
    if target is not None:
        checks.append(_preview_check(*target))
    return checks


_REVIEW: objects.AdmissionReview = {
    "apiVersion": "admission.k8s.io/v1",
    "kind": "AdmissionReview",
    "request": {
        "uid": "copilot-webhook-verify",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": "default",
        "operation": "CREATE",
        "dryRun": True,
        "object": SAMPLE_POD,
    },
}


def _hook_check(
    hook: objects.MutatingWebhook, address: tuple[str, int] | None
) -> tuple[Check, tuple[tuple[str, int], str, bytes] | None]:
    """One webhook's dry-run review, and where its server is reached (None without a caBundle)."""
    service = (hook.get("clientConfig") or {}).get("service") or {}
    bundle = base64.b64decode((hook.get("clientConfig") or {}).get("caBundle") or "")
    server_name = f"{service.get('name')}.{service.get('namespace')}.svc"
    dial = address or (server_name, int(service.get("port") or 443))
    if not bundle:
        return Check(hook["name"], ok=False, detail="no caBundle published: the API server cannot call it"), None
    check = _review_check(
        hook["name"], dial, server_name, bundle=bundle, path=service.get("path") or "/", review=_REVIEW
    )
    return check, (dial, server_name, bundle)


def _review_check(
    name: str, dial: tuple[str, int], server_name: str, *, bundle: bytes, path: str, review: objects.AdmissionReview
) -> Check:
    try:
        status, body = _post(dial, server_name, bundle, path=path, body=orjson.dumps(review), kind="application/json")
        response = orjson.loads(body).get("response") or {}
    except (OSError, ssl.SSLError, orjson.JSONDecodeError, http.client.HTTPException, AttributeError) as exc:
        return Check(name, ok=False, detail=f"https://{server_name}{path}: {plainly(exc)}")
    if status != 200 or response.get("uid") != "copilot-webhook-verify" or response.get("allowed") is not True:
        return Check(name, ok=False, detail=f"https://{server_name}{path}: HTTP {status}: {body[:300]!r}")
    patched = "a patch" if response.get("patch") else "no patch"
    return Check(name, ok=True, detail=f"https://{server_name}{path} answered the review ({patched}), TLS verified")


def _preview_check(dial: tuple[str, int], server_name: str, bundle: bytes) -> Check:
    try:
        status, body = _post(
            dial, server_name, bundle, path="/preview", body=orjson.dumps(SAMPLE_POD), kind="application/json"
        )
    except (OSError, ssl.SSLError, http.client.HTTPException) as exc:
        return Check("preview", ok=False, detail=f"https://{server_name}/preview: {plainly(exc)}")
    if status == 404:
        return Check("preview", ok=True, detail="preview.enabled is false: /preview answers 404")
    if status != 200:
        return Check("preview", ok=False, detail=f"https://{server_name}/preview: HTTP {status}: {body[:300]!r}")
    return Check("preview", ok=True, detail=f"https://{server_name}/preview answered ({len(body)} bytes)")
