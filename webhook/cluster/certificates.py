"""`certs ensure` against the cluster (TLS mode self-signed): keep the CA and serving certificate
in our Secret and the caBundle of our webhook configuration in step, safely when replicas race.

Every write is conditional: a Secret is created only if absent (409: another replica won; read theirs),
its data replaced by a JSON patch that tests the resourceVersion we read (so the labels and annotations
the chart set stay), and the webhook configuration is JSON-patched with the same test (409/422: read
again). What to write is decided by `certs.rotation.next_state`, which never lets the served certificate
and the caBundle disagree.

Fail open until trusted: the chart renders `failurePolicy: Ignore` until the webhook configuration holds
a caBundle, with the declared policies in the `copilot-webhook.io/failure-policies` annotation. The
server patches them in (`promote_policies`) only after a handshake with its own listener verified against
the published bundle, so a fresh install never rejects a pod because the API server cannot reach us yet.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import ssl
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from certs.authority import service_dns_names, write_atomic
from certs.rotation import BUNDLE, TLS_CERT, TLS_KEY, State, next_state
from webhook import objects
from webhook.cluster.errors import EnsureError

log = logging.getLogger(__name__)

NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
JSON_PATCH = "application/json-patch+json"
POLICY_ANNOTATION = "copilot-webhook.io/failure-policies"
POLICIES = ("Ignore", "Fail")


def own_namespace() -> str | None:
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return NAMESPACE_FILE.read_text().strip() or None
    except OSError:
        return None


def _raw(response: Any) -> objects.JSONObject:
    """The object an API call answered (a Secret, the webhook configuration), read as raw JSON."""
    try:
        data: objects.JSONObject = orjson.loads(response.data)
        return data
    finally:
        response.release_conn()


class CertificateManager:
    def __init__(
        self,
        api: client.ApiClient,
        secret: str,
        namespace: str,
        *,
        webhook_config: str,
        service: str,
        days: int,
        dns: Sequence[str] = (),
    ) -> None:
        """`dns`: more names the certificate covers (the node agent's Service, which serves with it)."""
        self.core = client.CoreV1Api(api)
        self.admission = client.AdmissionregistrationV1Api(api)
        self.secret, self.namespace, self.webhook_config = secret, namespace, webhook_config
        self.names = [*service_dns_names(service, namespace), *(n for n in dns if n)]
        self.days = days

    # --- reads ----------------------------------------------------------------------------------------
    def read_secret(self) -> tuple[dict[str, bytes] | None, str | None]:
        try:
            obj = _raw(self.core.read_namespaced_secret(self.secret, self.namespace, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                return None, None
            raise
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        return data, obj["metadata"]["resourceVersion"]

    def read_webhook_config(self) -> objects.WebhookConfiguration:
        try:
            return _raw(self.admission.read_mutating_webhook_configuration(self.webhook_config, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                raise EnsureError(f"MutatingWebhookConfiguration {self.webhook_config} not found") from None
            raise

    @staticmethod
    def published(config: Mapping[str, Any]) -> bytes | None:
        for hook in config.get("webhooks") or ():
            bundle = (hook.get("clientConfig") or {}).get("caBundle")
            if bundle:
                return base64.b64decode(bundle)
        return None

    # --- writes ---------------------------------------------------------------------------------------
    def _write_secret(self, state: State, resource_version: str | None) -> bool:
        data: dict[str, bytes | str] = {k: base64.b64encode(v).decode() for k, v in sorted(state.data.items())}
        try:
            if resource_version is None:  # no chart made it (`certs ensure` on its own): create it
                metadata = client.V1ObjectMeta(
                    name=self.secret, namespace=self.namespace, labels={"app.kubernetes.io/name": "copilot-webhook"}
                )
                body = client.V1Secret(api_version="v1", kind="Secret", type="Opaque", metadata=metadata, data=data)
                _raw(self.core.create_namespaced_secret(self.namespace, body, _preload_content=False))
            else:
                ops: list[objects.PatchOperation] = [
                    {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
                    {"op": "add", "path": "/data", "value": data},
                ]
                _raw(
                    self.core.patch_namespaced_secret(
                        self.secret, self.namespace, ops, _content_type=JSON_PATCH, _preload_content=False
                    )
                )
        except ApiException as exc:
            if exc.status in (409, 422):
                return False  # another replica wrote first: read again
            raise
        return True

    def _patch_config(self, config: Mapping[str, Any], ops: list[objects.PatchOperation]) -> bool:
        """JSON-patch the webhook configuration as it was read; False when it changed since (read again)."""
        version = {"op": "test", "path": "/metadata/resourceVersion", "value": config["metadata"]["resourceVersion"]}
        try:
            _raw(
                self.admission.patch_mutating_webhook_configuration(
                    self.webhook_config, [version, *ops], _content_type=JSON_PATCH, _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status in (409, 422):
                return False
            raise
        return True

    def _patch_bundle(self, config: Mapping[str, Any], bundle: bytes) -> bool:
        encoded = base64.b64encode(bundle).decode()
        ops = [
            {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": encoded}
            for i, hook in enumerate(config.get("webhooks") or ())
            if (hook.get("clientConfig") or {}).get("caBundle") != encoded
        ]
        return not ops or self._patch_config(config, ops)

    @staticmethod
    def declared_policies(config: Mapping[str, Any]) -> dict[str, str]:
        """The failure policies the chart declared, by webhook name (the annotation; {} without one)."""
        raw = ((config.get("metadata") or {}).get("annotations") or {}).get(POLICY_ANNOTATION)
        try:
            declared = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            declared = None
        if not isinstance(declared, dict) or not all(v in POLICIES for v in declared.values()):
            log.warning(
                "ignoring the %s annotation: not a JSON object of Ignore or Fail: %.200r", POLICY_ANNOTATION, raw
            )
            return {}
        return declared

    def pending_policies(self, config: Mapping[str, Any]) -> list[tuple[int, str]]:
        """(index, policy) of each webhook holding a caBundle whose failurePolicy is not yet the declared one."""
        declared = self.declared_policies(config)
        return [
            (i, declared[hook.get("name")])
            for i, hook in enumerate(config.get("webhooks") or ())
            if hook.get("name") in declared
            and (hook.get("clientConfig") or {}).get("caBundle")
            and hook.get("failurePolicy") != declared[hook.get("name")]
        ]

    def promote_policies(self) -> list[str]:
        """Patch in the declared failure policies (call once our listener verified against the published
        bundle). The names of the webhooks changed; [] when nothing was pending or another replica won."""
        config = self.read_webhook_config()
        pending = self.pending_policies(config)
        if not pending:
            return []
        ops = [{"op": "add", "path": f"/webhooks/{i}/failurePolicy", "value": policy} for i, policy in pending]
        if not self._patch_config(config, ops):
            return []
        return [f"{config['webhooks'][i]['name']}={policy}" for i, policy in pending]

    # --- the whole step -------------------------------------------------------------------------------
    def ensure(self, out: Path | None = None, now: datetime | None = None, attempts: int = 8) -> State:
        for _ in range(attempts):
            secret, version = self.read_secret()
            config = self.read_webhook_config()
            state = next_state(secret, self.published(config), self.names, now=now or datetime.now(UTC), days=self.days)
            if state.changed and not self._write_secret(state, version):
                continue
            if not self._patch_bundle(config, state.bundle):
                continue
            if out is not None:
                write_files(out, state)
            return state
        raise EnsureError(f"gave up after {attempts} conflicting writes to {self.secret} and {self.webhook_config}")


def write_files(out: Path, state: State) -> None:
    """tls.key, tls.crt and ca.crt (the bundle) where the server reads them; each replaced atomically, key
    first, so a server that reloads in between refuses the mismatched pair and keeps the previous one."""
    out.mkdir(parents=True, exist_ok=True)
    for name, data, mode in (
        (TLS_KEY, state.data[TLS_KEY], 0o600),
        (TLS_CERT, state.data[TLS_CERT], 0o644),
        ("ca.crt", state.data[BUNDLE], 0o644),
    ):
        if not (out / name).exists() or (out / name).read_bytes() != data:
            write_atomic(out / name, data, mode)


def handshake_verifies(
    address: tuple[str, int], server_name: str, bundle: bytes, *, timeout: float = 5.0
) -> str | None:
    """None when a TLS handshake with `address` verifies `server_name` against `bundle` (what the API
    server does); otherwise why not."""
    context = ssl.create_default_context(cadata=bundle.decode())
    try:
        with (
            socket.create_connection(address, timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=server_name),
        ):
            return None
    except (OSError, ssl.SSLError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
