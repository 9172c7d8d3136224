"""`certs ensure` against the cluster (spec 3; TLS mode self-signed): keep the CA and serving certificate
in our Secret and the caBundle of our webhook configuration in step, safely when replicas race.

Every write is conditional: a Secret is created only if absent (409: another replica won; read theirs),
replaced only at the resourceVersion we read (409: read again), and the webhook configuration is
JSON-patched with a `test` of its resourceVersion (422: read again). What to write is decided by
`certs.rotation.next_state`, which never lets the served certificate and the caBundle disagree.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from certs.authority import service_dns_names, write_atomic
from certs.rotation import BUNDLE, TLS_CERT, TLS_KEY, State, next_state

log = logging.getLogger(__name__)

NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
JSON_PATCH = "application/json-patch+json"
FIRST_CHECK_SECONDS = 3.0


class EnsureError(RuntimeError):
    pass


def own_namespace() -> str | None:
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return NAMESPACE_FILE.read_text().strip() or None
    except OSError:
        return None


def _raw(response: Any) -> dict[str, Any]:
    try:
        data: dict[str, Any] = orjson.loads(response.data)
        return data
    finally:
        response.release_conn()


class CertificateManager:
    def __init__(
        self, api: client.ApiClient, secret: str, namespace: str, webhook_config: str, service: str, days: int
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.admission = client.AdmissionregistrationV1Api(api)
        self.secret, self.namespace, self.webhook_config = secret, namespace, webhook_config
        self.names = service_dns_names(service, namespace)
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

    def read_webhook_config(self) -> dict[str, Any]:
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
        metadata = client.V1ObjectMeta(
            name=self.secret,
            namespace=self.namespace,
            labels={"app.kubernetes.io/name": "copilot-webhook"},
            resource_version=resource_version,
        )
        data: dict[str, bytes | str] = {k: base64.b64encode(v).decode() for k, v in sorted(state.data.items())}
        body = client.V1Secret(api_version="v1", kind="Secret", type="Opaque", metadata=metadata, data=data)
        try:
            if resource_version is None:
                _raw(self.core.create_namespaced_secret(self.namespace, body, _preload_content=False))
            else:
                _raw(self.core.replace_namespaced_secret(self.secret, self.namespace, body, _preload_content=False))
        except ApiException as exc:
            if exc.status == 409:
                return False  # another replica wrote first: read again
            raise
        return True

    def _patch_bundle(self, config: Mapping[str, Any], bundle: bytes) -> bool:
        encoded = base64.b64encode(bundle).decode()
        ops: list[dict[str, Any]] = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": config["metadata"]["resourceVersion"]}
        ]
        for i, hook in enumerate(config.get("webhooks") or ()):
            if (hook.get("clientConfig") or {}).get("caBundle") != encoded:
                ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": encoded})
        if len(ops) == 1:
            return True
        try:
            response = self.admission.patch_mutating_webhook_configuration(
                self.webhook_config, ops, _content_type=JSON_PATCH, _preload_content=False
            )
            _raw(response)
        except ApiException as exc:
            if exc.status in (409, 422):
                return False
            raise
        return True

    # --- the whole step -------------------------------------------------------------------------------
    def ensure(self, out: Path | None = None, now: datetime | None = None, attempts: int = 8) -> State:
        for _ in range(attempts):
            secret, version = self.read_secret()
            config = self.read_webhook_config()
            state = next_state(secret, self.published(config), self.names, now or datetime.now(UTC), self.days)
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


def handshake_verifies(address: tuple[str, int], server_name: str, bundle: bytes, timeout: float = 5.0) -> str | None:
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


class CertificateKeeper:
    """In the server (self-signed mode): renew through `ensure` every `renew_every` seconds, writing the
    files the TLS reloader picks up, and check every `check_every` seconds that a handshake with our own
    Service verifies against the caBundle actually stored in the webhook configuration."""

    def __init__(
        self,
        manager: CertificateManager,
        out: Path,
        report: Any,
        check_address: tuple[str, int] | None = None,
        renew_every: float = 600.0,
        check_every: float = 300.0,
    ) -> None:
        self.manager, self.out, self.report = manager, out, report
        service_name = manager.names[2]  # <svc>.<ns>.svc, the name the API server dials
        self.server_name = service_name
        self.check_address = check_address or (service_name, 443)
        self.renew_every, self.check_every = renew_every, check_every
        self.stop = threading.Event()

    def renew(self) -> None:
        try:
            state = self.manager.ensure(self.out)
        except Exception as exc:  # the served certificate stays; try again next round
            log.error("certificate renewal failed: %s", exc)
            self.report.renewal("failed")
            return
        self.report.renewal("renewed" if state.changed else "current")
        if state.changed:
            log.info("certificate: %s", state.note)

    def check(self) -> str | None:
        try:
            bundle = self.manager.published(self.manager.read_webhook_config())
        except Exception as exc:
            why: str | None = f"cannot read the webhook configuration: {exc}"
        else:
            why = (
                "the webhook configuration has no caBundle"
                if not bundle
                else handshake_verifies(self.check_address, self.server_name, bundle)
            )
            if bundle:
                self.report.bundle_expiry(bundle)
        self.report.self_check(why)
        if why:
            log.warning("TLS self-check against the published caBundle failed: %s", why)
        return why

    def run(self) -> None:
        # The first renewal ran before the server started; the first check waits for it to listen.
        next_renew = time.monotonic() + self.renew_every
        next_check = time.monotonic() + FIRST_CHECK_SECONDS
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_renew:
                self.renew()
                next_renew = now + self.renew_every
            if now >= next_check:
                self.check()
                next_check = now + self.check_every
            self.stop.wait(max(0.05, min(next_renew, next_check) - time.monotonic()))

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="certificate-keeper", daemon=True)
        thread.start()
        return thread
