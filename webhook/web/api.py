"""The part of the HTTP API people use by hand, through FastAPI: POST /preview with typed, validated query
parameters, the OpenAPI description at /openapi.json (documenting /mutate*, the probes and /metrics too),
interactive docs at /docs from the package's own Swagger UI assets (fastapi-offline), so they work
without internet access, and GET / pointing at both.

The description documents every status an operation can answer, each with the shape of its body (a test
holds real answers to it): refusals are `{"error": "..."}`, never FastAPI's validation error. Its request
examples are a Flyte 1.15 pod, in JSON and YAML, which "Try it out" sends as they are.

Admission, health, readiness and metrics never reach FastAPI (admission.py and server.py answer them), so
that no admission pays the framework's own cost, which is a large share of a whole /mutate/ptrace
(docs/performance.md has the measure). A preview's worker, body limit and deadline are the gate's
(middleware.py), in front of this app; the endpoint gets what the gate admitted through a dependency.
Errors keep the API's `{"error": "..."}` form and 4xx statuses.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated

import yaml
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
from webhook.web.middleware import JSON, YAML_TYPES, Admitted, admitted, error_response

PATHS = ("/", "/preview", "/openapi.json", "/docs", "/docs/oauth2-redirect")
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
        responses=_PREVIEW_RESPONSES,  # 422 among them: FastAPI adds its own validation error only without one
        openapi_extra={"requestBody": _PREVIEW_BODY},
    )
    async def preview(
        query: Annotated[PreviewQuery, Query()], entry: Annotated[Admitted, Depends(admitted)]
    ) -> Response:
        previewed = await entry.run(query)
        response = Response(previewed.content, media_type=previewed.media_type)
        response.raw_headers.extend(notes_headers(previewed.notes))
        return response

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # described in _PLAIN_PATHS
    async def index() -> JSONResponse:
        return JSONResponse(index_of(app.openapi()))

    def openapi() -> JSONObject:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema["paths"].update(_PLAIN_PATHS)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMAS)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def index_of(spec: JSONObject) -> JSONObject:
    """GET /: where a person starts. The endpoints are read from the OpenAPI description, so they are the
    ones it documents."""
    endpoints = {
        f"{method.upper()} {path}": operation.get("summary", "")
        for path, operations in spec["paths"].items()
        if path != "/"
        for method, operation in operations.items()
    }
    return {
        "name": spec["info"]["title"],
        "version": spec["info"]["version"],
        "docs": "/docs",
        "openapi": "/openapi.json",
        "endpoints": {"GET /docs": "Interactive docs (Swagger UI)", "GET /openapi.json": "This API's description"}
        | endpoints,
    }


def _schema(name: str) -> JSONObject:
    return {"$ref": f"#/components/schemas/{name}"}


def _refusal(description: str) -> JSONObject:
    """A documented error answer: the API's `{"error": "..."}`."""
    return {"description": description, "content": {JSON: {"schema": _schema("Error")}}}


_BUSY = _refusal(
    "preview.concurrency previews are running, the preview outlived preview.timeoutSeconds, or its worker stopped "
    "for a cause not shown to be the document; retry after a second"
)
_BUSY["headers"] = {
    "Retry-After": {
        "description": "Seconds to wait before trying again",
        "required": True,
        "schema": {"type": "integer"},
    }
}

_PREVIEW_RESPONSES: dict[int | str, JSONObject] = {
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
        "content": {
            JSON: {
                "schema": {
                    "description": "output=json (the default): one object's preview, or a list of them, in order, "
                    "for a List or several YAML documents",
                    "anyOf": [_schema("PreviewObject"), {"type": "array", "items": _schema("PreviewObject")}],
                }
            },
            "application/json-patch+json": {
                "schema": {
                    "description": "output=patch: the JSON Patch an API server would apply (paths relative to the "
                    "object sent), or a list of them",
                    "anyOf": [_schema("JsonPatch"), {"type": "array", "items": _schema("JsonPatch")}],
                }
            },
            "application/yaml": {
                "schema": {"type": "string", "description": "output=yaml: the objects as admitted, `---` between"}
            },
            "text/x-diff": {
                "schema": {
                    "type": "string",
                    "description": "output=diff: a unified diff of each changed object's YAML; empty when none changes",
                }
            },
        },
    },
    400: _refusal(
        "Not a Pod, workload, AdmissionReview or List (the message names the field); or a bad query parameter"
    ),
    404: _refusal("preview.enabled is false"),
    408: _refusal("The body did not arrive within server.deadlineSeconds"),
    413: _refusal("Over preview.maxBodyBytes"),
    415: _refusal(f"Not {JSON} or YAML ({', '.join(YAML_TYPES)})"),
    422: _refusal("The document made the preview worker die twice; sending it again will do the same"),
    503: _BUSY,
}


def _review(summary: str, description: str) -> JSONObject:
    return {
        "post": {
            "summary": summary,
            "description": description,
            "requestBody": {
                "required": True,
                "content": {JSON: {"schema": _schema("AdmissionReview")}},
            },
            "responses": {
                "200": {
                    "description": "The AdmissionReview with its response: uid echoed, allowed, a base64 JSON "
                    "Patch when there are operations, warnings and audit annotations",
                    "content": {JSON: {"schema": _schema("AdmissionReview")}},
                },
                "400": _refusal("Not an AdmissionReview (v1 or v1beta1) with a request uid"),
                "408": _refusal("The body did not arrive within server.deadlineSeconds"),
                "413": _refusal("Over server.maxBodyBytes"),
                "415": _refusal(f"Not {JSON}"),
            },
        }
    }


def _probe(summary: str, answers: dict[str, JSONObject]) -> JSONObject:
    return {"get": {"summary": summary, "responses": answers}}


def _status(description: str, *values: str) -> JSONObject:
    properties: JSONObject = {"status": {"type": "string", "enum": list(values)}}
    if "not ready" in values:
        properties["reasons"] = {"type": "array", "items": {"type": "string"}}
    schema = {"type": "object", "required": ["status"], "additionalProperties": False, "properties": properties}
    return {"description": description, "content": {JSON: {"schema": schema}}}


# The paths served on the plain ASGI path, and GET /, described here so that /docs shows the whole API.
_PLAIN_PATHS: JSONObject = {
    "/": {
        "get": {
            "summary": "Where to start: the docs, the OpenAPI description and the endpoints (also HEAD)",
            "operationId": "index",
            "responses": {"200": {"description": "OK", "content": {JSON: {"schema": _schema("Index")}}}},
        }
    },
    "/mutate": _review("Admission: the SYS_PTRACE policy and the image puller", "For both webhooks at once."),
    "/mutate/ptrace": _review("Admission: the SYS_PTRACE policy alone", "The ptrace.copilot-webhook.io webhook."),
    "/mutate/image-puller": _review(
        "Admission: the image puller alone", "The image-puller.copilot-webhook.io webhook."
    ),
    "/healthz": _probe("The process is alive (also HEAD)", {"200": _status("OK", "ok")}),
    "/readyz": _probe(
        "200 once the certificate is valid and the caches have listed; 503 with reasons (also HEAD)",
        {"200": _status("Ready", "ready"), "503": _status("Not ready: why not", "not ready")},
    ),
    "/metrics": _probe(
        "Prometheus metrics (also HEAD)",
        {"200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}},
    ),
}

_CHANGE: JSONObject = {
    "type": "object",
    "required": ["op", "path", "reason"],
    "additionalProperties": False,
    "properties": {"op": {"type": "string"}, "path": {"type": "string"}, "reason": {"type": "string"}},
}
_NULLABLE_STRING: JSONObject = {"anyOf": [{"type": "string"}, {"type": "null"}]}

_PREVIEW_OBJECT: JSONObject = {
    "type": "object",
    "description": "What admission would do to one object",
    "required": [
        "kind", "name", "allowed", "decisions", "patch", "object", "changes", "notApplied", "warnings", "runtime"
    ],
    "additionalProperties": False,
    "properties": {
        "kind": {"type": "string"},
        "name": {"type": "string", "description": "metadata.name (or generateName); empty when it has none"},
        "allowed": {"type": "boolean", "description": "false: admission would refuse the object"},
        "decisions": {
            "type": "object",
            "description": "Per mutation, what /mutate audits (e.g. `ptrace: add:primary`), or skipped(<reason>)",
            "required": ["ptrace", "image-puller"],
            "additionalProperties": {"type": "string"},
        },
        "patch": _schema("JsonPatch"),
        "object": {"type": "object", "description": "The object as it would be admitted"},
        "changes": {"type": "array", "items": _CHANGE, "description": "One per operation of `patch`, with why"},
        "notApplied": {
            "type": "array",
            "items": _CHANGE,
            "description": "Computed but not in `patch`: shadow mode, or the object refused",
        },
        "warnings": {"type": "array", "items": {"type": "string"}, "description": "Then the refusal, if any"},
        "runtime": {
            "type": "object",
            "description": "The runtime the image puller would speak to, and what decided it",
            "required": ["flavour", "socket", "source"],
            "additionalProperties": False,
            "properties": {"flavour": _NULLABLE_STRING, "socket": _NULLABLE_STRING, "source": {"type": "string"}},
        },
    },
}  # fmt: skip

_JSON_PATCH: JSONObject = {
    "type": "array",
    "description": "RFC 6902 JSON Patch",
    "items": {
        "type": "object",
        "required": ["op", "path"],
        "properties": {
            "op": {"type": "string", "enum": ["add", "remove", "replace", "move", "copy", "test"]},
            "path": {"type": "string"},
            "from": {"type": "string"},
            "value": {},
        },
    },
}

_INDEX: JSONObject = {
    "type": "object",
    "required": ["name", "version", "docs", "openapi", "endpoints"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string"},
        "version": {"type": "string"},
        "docs": {"type": "string", "description": "Interactive docs (Swagger UI), served without internet access"},
        "openapi": {"type": "string", "description": "This API's OpenAPI description"},
        "endpoints": {
            "type": "object",
            "description": "`METHOD /path`: what it does",
            "additionalProperties": {"type": "string"},
        },
    },
}

_ERROR: JSONObject = {
    "type": "object",
    "description": "A refused request: what is wrong and what was expected",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {"error": {"type": "string"}},
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

_SCHEMAS: JSONObject = {
    "AdmissionReview": _ADMISSION_REVIEW,
    "Error": _ERROR,
    "Index": _INDEX,
    "JsonPatch": _JSON_PATCH,
    "PreviewObject": _PREVIEW_OBJECT,
}

# A pod as flytepropeller 1.15 creates it for a raw-container task: the copilot's downloader and uploader,
# shareProcessNamespace and SYS_PTRACE on the task's container (examples/flyte-1.15-pod.yaml, which a test
# holds it to). The request body's example, in YAML and as JSON.
FLYTE_POD_YAML = """\
apiVersion: v1
kind: Pod
metadata:
  name: f7a9c2e4b1-n0-0
  namespace: flytesnacks-development
  labels:
    domain: development
    execution-id: f7a9c2e4b1
    interruptible: 'false'
    node-id: n0
    project: flytesnacks
    shard-key: '21'
    task-name: ellipse-area
    workflow-name: flytesnacks-workflows-raw-container-wf
  annotations:
    cluster-autoscaler.kubernetes.io/safe-to-evict: 'false'
  ownerReferences:
  - apiVersion: flyte.lyft.com/v1alpha1
    kind: flyteworkflow
    name: f7a9c2e4b1
    uid: 3b0d6c3e-8f2a-4f0e-9a8b-4c7d2e1f0a9b
    controller: true
    blockOwnerDeletion: true
spec:
  restartPolicy: Never
  containers:
  - name: f7a9c2e4b1-n0-0
    image: ghcr.io/flyteorg/rawcontainers-shell:v2
    command:
    - ./calculate-ellipse-area.sh
    - /var/flyte/inputs
    - /var/flyte/outputs
    resources:
      limits:
        cpu: '1'
        memory: 1Gi
      requests:
        cpu: '1'
        memory: 1Gi
    terminationMessagePolicy: FallbackToLogsOnError
    env:
    - name: FLYTE_INTERNAL_EXECUTION_ID
      value: f7a9c2e4b1
    securityContext:
      capabilities:
        add:
        - SYS_PTRACE
    volumeMounts:
    - name: flyte-inputs
      mountPath: /var/flyte/inputs
    - name: flyte-outputs
      mountPath: /var/flyte/outputs
  - name: flyte-copilot-uploader
    image: cr.flyte.org/flyteorg/flytecopilot:v0.0.15
    command:
    - /bin/flyte-copilot
    - --storage.limits.maxDownloadMBs=0
    - --storage.container=my-s3-bucket
    - --storage.type=stow
    - --storage.stow.config
    - region=us-east-2
    - --storage.stow.kind=s3
    args:
    - sidecar
    - --start-timeout
    - 1m40s
    - --to-raw-output
    - s3://my-s3-bucket/data/raw/f7a9c2e4b1
    - --to-output-prefix
    - s3://my-s3-bucket/metadata/propeller/f7a9c2e4b1/n0/data/0
    - --from-local-dir
    - /var/flyte/outputs
    - --interface
    - b3V0cHV0czogYXJlYSAoZmxvYXQp
    workingDir: /
    resources:
      limits:
        cpu: 500m
        memory: 128Mi
      requests:
        cpu: 500m
        memory: 128Mi
    volumeMounts:
    - name: flyte-outputs
      mountPath: /var/flyte/outputs
    terminationMessagePolicy: FallbackToLogsOnError
    imagePullPolicy: IfNotPresent
  shareProcessNamespace: true
  volumes:
  - name: flyte-inputs
    emptyDir: {}
  - name: flyte-outputs
    emptyDir: {}
  initContainers:
  - name: flyte-copilot-downloader
    image: cr.flyte.org/flyteorg/flytecopilot:v0.0.15
    command:
    - /bin/flyte-copilot
    - --storage.limits.maxDownloadMBs=0
    - --storage.container=my-s3-bucket
    - --storage.type=stow
    - --storage.stow.config
    - region=us-east-2
    - --storage.stow.kind=s3
    args:
    - download
    - --from-remote
    - s3://my-s3-bucket/metadata/propeller/f7a9c2e4b1/n0/data/inputs.pb
    - --to-output-prefix
    - s3://my-s3-bucket/metadata/propeller/f7a9c2e4b1/n0/data/0
    - --to-local-dir
    - /var/flyte/inputs
    - --format
    - JSON
    - --input-interface
    - aW5wdXRzOiBhLCBiIChmbG9hdCk=
    workingDir: /
    resources:
      limits:
        cpu: 500m
        memory: 128Mi
      requests:
        cpu: 500m
        memory: 128Mi
    volumeMounts:
    - name: flyte-inputs
      mountPath: /var/flyte/inputs
    terminationMessagePolicy: FallbackToLogsOnError
    imagePullPolicy: IfNotPresent
"""
FLYTE_POD: JSONObject = yaml.safe_load(FLYTE_POD_YAML)

_EXAMPLE = "A Flyte 1.15 raw-container task's pod: it asks for SYS_PTRACE and gets the image puller"
_PREVIEW_BODY: JSONObject = {
    "required": True,
    "description": "A Pod, a workload with a pod template, an AdmissionReview or a List; in YAML, several "
    "documents too",
    "content": {
        JSON: {"schema": {"type": "object"}, "examples": {"flyte-1.15": {"summary": _EXAMPLE, "value": FLYTE_POD}}},
        **{
            media: {
                "schema": {"type": "string"},
                "examples": {"flyte-1.15": {"summary": _EXAMPLE, "value": FLYTE_POD_YAML}},
            }
            for media in YAML_TYPES
        },
    },
}
