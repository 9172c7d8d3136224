"""The part of the HTTP API people use by hand, through FastAPI: POST /preview with typed, validated query
parameters, the OpenAPI description at /openapi.json (documenting /mutate*, the probes and /metrics too),
and interactive docs at /docs from the package's own Swagger UI assets (fastapi-offline), so they work
without internet access.

Admission, health, readiness and metrics stay on the plain ASGI path (server.py): every admission would
pay the framework's own cost: FastAPI's no-op route costs about 220 µs of CPU more than ours under the
same uvicorn, half of a whole /mutate/ptrace (docs/performance.md). A preview's worker,
body limit and deadline are the gate's (middleware.py), in front of this app; the endpoint gets what the
gate admitted through a dependency. Errors keep the API's `{"error": "..."}` form and 4xx statuses.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException

from webhook import __version__
from webhook.errors import RequestError
from webhook.objects import JSONObject
from webhook.preview.render import Notes, PreviewQuery, query_error
from webhook.web.middleware import Admitted, admitted, error_response

PATHS = ("/preview", "/openapi.json", "/docs", "/docs/oauth2-redirect")
STATIC = "/static-offline-docs/"

PREVIEW_ANSWER = (
    "JSON (per object: decisions, patch, object, changes with reasons, notApplied, warnings, runtime), YAML, a "
    'JSON Patch or a unified diff, per `output`; in every form a `Warning: 299 - "..."` header per warning and '
    "per refusal, and a `Copilot-Webhook-Decision` header per object"
)


HEADER_BUDGET = 4096  # characters of text in one answer's Warning headers, as kube-apiserver bounds them,
# and as many again in its Copilot-Webhook-Decision headers
DECISION_HEADER = b"copilot-webhook-decision"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _plain(text: str) -> str:
    return _CONTROL.sub(" ", text)  # no header may hold a control character


def warning_header(text: str) -> bytes:
    """RFC 7234's `299 - "text"`, as kube-apiserver writes it: UTF-8, `"` and `\\` escaped; a control
    character becomes a space."""
    quoted = _plain(text).replace("\\", "\\\\").replace('"', '\\"')
    return f'299 - "{quoted}"'.encode()


def _budgeted(texts: Sequence[str], left_out: str) -> list[str]:
    """The texts up to HEADER_BUDGET characters; then `left_out`, with how many were left out."""
    kept: list[str] = []
    used = 0
    for text in texts:
        if used + len(text) > HEADER_BUDGET:
            return [*kept, left_out.format(len(texts) - len(kept))]
        kept.append(text)
        used += len(text)
    return kept


def notes_headers(notes: Notes) -> list[tuple[bytes, bytes]]:
    """A Warning header per refusal, then per warning, and a Copilot-Webhook-Decision header per object, each
    kind within HEADER_BUDGET (the JSON answer has them all)."""
    warnings = _budgeted(
        [*notes.refusals, *notes.warnings], "copilot-webhook: {} more warning(s) left out; output=json has them all"
    )
    decisions = _budgeted(notes.decisions, "{} more object(s) left out; output=json has each one's decisions")
    return [(b"warning", warning_header(text)) for text in warnings] + [
        (DECISION_HEADER, _plain(text).encode()) for text in decisions
    ]


def _invalid(request: Request, exc: Exception) -> JSONResponse:
    """A query FastAPI refused, worded as the command line's `preview` words it."""
    assert isinstance(exc, RequestValidationError)
    return error_response(400, query_error(exc.errors()))


def _request_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestError)
    return error_response(exc.status, exc.message)


def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        # Starlette names the route's methods, from a set (in no fixed order): sorted, so the answer is stable.
        allowed = (exc.headers or {}).get("Allow", "")
        allow = ", ".join(sorted(m.strip() for m in allowed.split(",") if m.strip())) or "GET, HEAD"
        return error_response(405, f"{request.url.path} takes {allow}, not {request.method}", {"allow": allow})
    return error_response(exc.status_code, str(exc.detail))


def build() -> FastAPI:
    """The FastAPI app; POST /preview answers only behind PreviewGate (middleware.py), which admits it."""
    app = FastAPIOffline(
        title="copilot-webhook",
        version=__version__,
        description=(
            "Preview what the webhook would change, without changing anything: POST a Pod, a workload with a pod"
            " template, an AdmissionReview or a List (JSON or YAML) to /preview for the JSON Patch, the mutated"
            " object, a reason for each operation and the warnings, or a diff. The endpoints the Kubernetes API"
            " server calls (/mutate, /mutate/ptrace, /mutate/image-puller), the probes (/healthz, /readyz) and"
            " /metrics are described here too; a refused preview answers a JSON object with an `error` message."
        ),
        redoc_url=None,
        static_url=STATIC.rstrip("/"),
    )
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(HTTPException, _http_error)

    @app.post(
        "/preview",
        summary="What the webhook would do to an object, without creating it",
        response_class=Response,
        responses={
            200: {
                "description": PREVIEW_ANSWER,
                "headers": {
                    "Warning": {
                        "description": 'One per warning and per refusal, as kube-apiserver sends them: 299 - "text"',
                        "schema": {"type": "string"},
                    },
                    "Copilot-Webhook-Decision": {
                        "description": "One per object: Kind/name: ptrace=<decision>;image-puller=<decision>",
                        "schema": {"type": "string"},
                    },
                },
            },
            400: {"description": "Not a Pod, workload, AdmissionReview or List; or a bad query parameter"},
            404: {"description": "preview.enabled is false"},
            408: {"description": "The body did not arrive within server.deadlineSeconds"},
            413: {"description": "Over preview.maxBodyBytes"},
            415: {"description": "Not application/json or application/yaml"},
            422: {"description": "The document made the preview worker die twice; sending it again will do the same"},
            503: {
                "description": "preview.concurrency previews are running, the preview outlived preview.timeoutSeconds, "
                "or its worker stopped for a cause not shown to be the document; retry after a second"
            },
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/yaml": {"schema": {"type": "string"}},
                    "application/json": {"schema": {"type": "object"}},
                },
            }
        },
    )
    async def preview(
        query: Annotated[PreviewQuery, Query()], entry: Annotated[Admitted, Depends(admitted)]
    ) -> Response:
        previewed = await entry.run(query)
        response = Response(previewed.content, media_type=previewed.media_type)
        response.raw_headers.extend(notes_headers(previewed.notes))
        return response

    def openapi() -> JSONObject:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema["paths"].update(_PLAIN_PATHS)
            schema.setdefault("components", {}).setdefault("schemas", {})["AdmissionReview"] = _ADMISSION_REVIEW
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _review(summary: str, description: str) -> JSONObject:
    return {
        "post": {
            "summary": summary,
            "description": description,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/AdmissionReview"}}},
            },
            "responses": {
                "200": {
                    "description": "The AdmissionReview with its response: uid echoed, allowed, a base64 JSON "
                    "Patch when there are operations, warnings and audit annotations",
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/AdmissionReview"}}},
                },
                "400": {"description": "Not an AdmissionReview (v1 or v1beta1) with a request uid"},
                "408": {"description": "The body did not arrive within server.deadlineSeconds"},
                "413": {"description": "Over server.maxBodyBytes"},
                "415": {"description": "Not application/json"},
            },
        }
    }


def _probe(summary: str, content_type: str = "application/json") -> JSONObject:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK", "content": {content_type: {}}}}}}


# The paths served on the plain ASGI path, described here so that /docs shows the whole API.
_PLAIN_PATHS: JSONObject = {
    "/mutate": _review("Admission: the SYS_PTRACE policy and the image puller", "For both webhooks at once."),
    "/mutate/ptrace": _review("Admission: the SYS_PTRACE policy alone", "The ptrace.copilot-webhook.io webhook."),
    "/mutate/image-puller": _review(
        "Admission: the image puller alone", "The image-puller.copilot-webhook.io webhook."
    ),
    "/healthz": _probe("The process is alive"),
    "/readyz": _probe("200 once the certificate is valid and the caches have listed; 503 with reasons"),
    "/metrics": _probe("Prometheus metrics", "text/plain"),
}

_ADMISSION_REVIEW: JSONObject = {
    "type": "object",
    "description": "admission.k8s.io/v1 (or v1beta1) AdmissionReview; the API server sends `request`, the "
    "webhook answers with `response`.",
    "required": ["apiVersion", "kind"],
    "properties": {
        "apiVersion": {"type": "string", "enum": ["admission.k8s.io/v1", "admission.k8s.io/v1beta1"]},
        "kind": {"type": "string", "enum": ["AdmissionReview"]},
        "request": {
            "type": "object",
            "required": ["uid"],
            "properties": {
                "uid": {"type": "string"},
                "kind": {"type": "object"},
                "resource": {"type": "object"},
                "namespace": {"type": "string"},
                "operation": {"type": "string"},
                "object": {"type": "object", "description": "the Pod"},
                "dryRun": {"type": "boolean"},
            },
        },
        "response": {
            "type": "object",
            "required": ["uid", "allowed"],
            "properties": {
                "uid": {"type": "string"},
                "allowed": {"type": "boolean"},
                "patchType": {"type": "string", "enum": ["JSONPatch"]},
                "patch": {"type": "string", "format": "byte"},
                "warnings": {"type": "array", "items": {"type": "string"}},
                "auditAnnotations": {"type": "object", "additionalProperties": {"type": "string"}},
                "status": {"type": "object"},
            },
        },
    },
}
