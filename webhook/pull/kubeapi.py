"""The node agent's calls to the API server: a TokenReview, and reads of one pod and one node.

Written on the standard library rather than with the `kubernetes` client: the agent runs in the puller
image, which holds the standard library and grpcio only, and these are three fixed requests.

In a pod it uses the service account's files, re-reading the token at every call (the kubelet rotates
it); elsewhere it is given a server, a CA file and a token file. Every call has a timeout, and an
answer is read only to a bound.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
ANSWER_LIMIT = 8 * 1024 * 1024  # a pod object is at most the API server's 3 MiB request limit
TIMEOUT = 10.0


class APIError(Exception):
    """A call that did not get the answer it asked for; `status` is the HTTP status, 0 when none came."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class KubeAPI:
    host: str
    port: int
    ca_file: str
    token_file: str

    @classmethod
    def in_cluster(cls) -> KubeAPI:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not port.isdigit():
            raise APIError("not in a pod: KUBERNETES_SERVICE_HOST and _PORT are not set (give --api-server)")
        return cls(host, int(port), f"{SERVICE_ACCOUNT}/ca.crt", f"{SERVICE_ACCOUNT}/token")

    def _context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            with open(self.token_file, encoding="ascii") as handle:
                token = handle.read(64 * 1024).strip()
            context = self._context()
        except (OSError, UnicodeDecodeError, ssl.SSLError) as exc:
            raise APIError(f"cannot read the service account's token or CA: {exc}") from None
        connection = http.client.HTTPSConnection(self.host, self.port, context=context, timeout=TIMEOUT)
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            raw = response.read(ANSWER_LIMIT + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise APIError(f"the API server did not answer {method} {path}: {exc}") from None
        finally:
            connection.close()
        if len(raw) > ANSWER_LIMIT:
            raise APIError(f"the answer to {method} {path} is larger than {ANSWER_LIMIT} bytes")
        try:
            answer = json.loads(raw)
        except ValueError:
            raise APIError(
                f"the answer to {method} {path} is not JSON (HTTP {response.status})", response.status
            ) from None
        if response.status >= 300 or not isinstance(answer, dict):
            message = answer.get("message", "") if isinstance(answer, dict) else ""
            raise APIError(f"{method} {path}: HTTP {response.status} {message}".strip(), response.status)
        return answer

    def review_token(self, token: str, audience: str) -> dict[str, Any]:
        """The TokenReview's status for the token, asked for the audience."""
        review = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]},
        }
        status = self.call("POST", "/apis/authentication.k8s.io/v1/tokenreviews", review).get("status")
        return status if isinstance(status, dict) else {}

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self.call("GET", f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}")

    def node(self, name: str) -> dict[str, Any]:
        return self.call("GET", f"/api/v1/nodes/{quote(name, safe='')}")
