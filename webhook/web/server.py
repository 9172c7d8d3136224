"""The HTTP adapter: the routes of admission, the probes and metrics, in front of the pure core.

`at_head` tells the admission connection (admission.py) what to do with each request from its head: answer
a probe, read an admission body and `answer` it, refuse a wrong shape (404, 405, 413, 415), or relay it to
the human API. The same routes are also a plain ASGI application, which stock uvicorn serves behind the
connection for what it relays: /preview, /openapi.json and /docs go to the FastAPI app (api.py) behind the
gate that admits a preview (middleware.py), counted; anything else gets the answer the connection would
give. Admission stays off FastAPI: its routes are fixed, there is no request model to validate (the
envelope is checked by hand so the Pod is never round-tripped), and the framework's cost per request is
in docs/performance.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from typing import Any

import orjson

from webhook.config import Settings
from webhook.errors import ClientGone, RequestError
from webhook.mutation.plan import KINDS, PTRACE, PULLER
from webhook.preview.workers import FactsExport, Previewer, no_cluster_export
from webhook.review import (
    NamespaceFacts,
    decide,
    envelope,
    load_json,
    no_cluster,
    read_review,
    response,
)
from webhook.web.admission import RELAYED, Headers, Verdict, When
from webhook.web.api import PATHS as API_PATHS
from webhook.web.api import STATIC
from webhook.web.api import build as build_api
from webhook.web.bodies import BodyDeadlines, media_type, read_body
from webhook.web.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from webhook.web.metrics import Metrics
from webhook.web.middleware import PreviewGate

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]  # an ASGI event: http.request, http.disconnect, http.response.start or .body
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Callable[[MutableMapping[str, Any]], Awaitable[None]]], Awaitable[None]]
Readiness = Callable[[], str | None]  # None when ready, else why not

JSON = "application/json"
MUTATE_PATHS: dict[str, Sequence[str]] = {
    "/mutate": KINDS,
    "/mutate/ptrace": (PTRACE,),
    "/mutate/image-puller": (PULLER,),
}
ROUTES = {
    "/mutate": "POST",
    "/mutate/ptrace": "POST",
    "/mutate/image-puller": "POST",
    "/preview": "POST",
    "/healthz": "GET",
    "/readyz": "GET",
    "/metrics": "GET",
}
_RESULTS = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "timeout",
    413: "too_large",
    415: "unsupported_media_type",
    422: "worker_died",
    503: "busy",
}


_RETRY_AFTER = ((b"retry-after", b"1"),)


class Answer:
    __slots__ = ("body", "content_type", "headers", "result", "status")

    def __init__(
        self,
        status: int,
        body: bytes,
        content_type: str = JSON,
        *,
        result: str = "ok",
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        self.status, self.body, self.content_type, self.result, self.headers = (
            status,
            body,
            content_type,
            result,
            tuple(headers),
        )

    def header_list(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"content-type", self.content_type.encode()),
            (b"content-length", str(len(self.body)).encode()),
            *self.headers,
        ]


def error(status: int, message: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> Answer:
    return Answer(status, orjson.dumps({"error": message}), JSON, result=_RESULTS.get(status, "error"), headers=headers)


def refused(exc: RequestError) -> Answer:
    return error(exc.status, exc.message, _RETRY_AFTER if exc.status == 503 else ())


def internal_error(what: str) -> Answer:
    """A bug: logged with its traceback (call from an except block), answered 500 without it."""
    log.exception("unhandled error on %s", what)
    return error(500, "internal error; the server logged the details and keeps serving")


def _route_path(scope: Scope) -> str:
    """The path to route on: the target exactly as sent. A percent-encoded path (`/%6dutate`) or an
    absolute-form target is never what an API server sends; routing them as their decoded path would let
    one resource answer to many names, so they match no route."""
    raw = scope.get("raw_path")
    if raw is not None and (b"%" in raw or not raw.startswith(b"/")):
        return str(raw.decode("latin-1"))
    path: str = scope["path"]
    return path


class WebhookApp:
    """ASGI application. `settings` may be replaced at any time (configuration reload)."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        namespaces: NamespaceFacts = no_cluster,
        *,
        readiness: Sequence[Readiness] = (),
        facts_export: FactsExport = no_cluster_export,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.namespaces = namespaces
        self.readiness = list(readiness)
        self._latency = {path: self.metrics.latency.labels(path) for path in (*ROUTES, "/docs", "unknown")}
        self._deadlines = BodyDeadlines()
        # Sized once: preview.concurrency takes effect at the next start.
        self.previewer = Previewer(settings.preview.concurrency, facts_export)
        # /preview, /openapi.json and /docs: FastAPI, behind the gate that admits a preview (middleware.py).
        self.api: App = PreviewGate(
            build_api(),
            settings=lambda: self.settings,
            previewer=self.previewer,
            deadlines=self._deadlines,
            in_flight=self.metrics.previews_in_flight,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        started = time.perf_counter()
        path = _route_path(scope)
        if path in API_PATHS or path.startswith(STATIC):
            await self._served_by_api(scope, receive, send, path=path, started=started)
            return
        endpoint = path if path in ROUTES else "unknown"
        try:
            answer = await self._route(scope, receive, path)
        except RequestError as exc:
            answer = refused(exc)
        except ClientGone:
            self.finished(endpoint, "client_gone", None)
            return
        except Exception:
            answer = internal_error(f"{scope['method']} {path}")
        await _send(send, answer)
        self.finished(endpoint, answer.result, started)

    async def _served_by_api(self, scope: Scope, receive: Receive, send: Send, *, path: str, started: float) -> None:
        endpoint = path if path in ROUTES else "/docs"
        try:
            status = await _forward(self.api, scope, receive, send)
        except ClientGone:
            self.finished(endpoint, "client_gone", None)
            return
        self.finished(endpoint, "ok" if status == 200 else _RESULTS.get(status or 0, "error"), started)

    async def _route(self, scope: Scope, receive: Receive, path: str) -> Answer:
        refused = _refused_route(scope["method"], path)
        if refused is not None:
            return refused
        if ROUTES[path] == "GET":
            return self._get(path)
        return await self._mutate(scope, receive, MUTATE_PATHS[path])

    def _get(self, path: str) -> Answer:
        if path == "/healthz":
            return Answer(200, b'{"status":"ok"}')
        if path == "/readyz":
            return self._ready()
        return Answer(200, self.metrics.render(), METRICS_CONTENT_TYPE)

    def at_head(self, method: str, target: bytes, headers: Headers) -> Verdict:
        """admission.Site: what the connection does with a request, from its head. It answers the routes of
        this module itself, and relays the human API's (/preview, the docs) and any path it does not know."""
        if not target.startswith(b"/"):  # absolute-form or asterisk-form: never what an API server sends
            return Verdict(When.AFTER_BODY, answer=_no_endpoint(target.decode("latin-1")))
        raw = target.split(b"?", 1)[0] if b"?" in target else target
        path = raw.decode("latin-1")
        if path not in ROUTES or path in API_PATHS or b"%" in raw:
            return RELAYED
        refused = _refused_route(method, path)
        if refused is not None:
            return Verdict(When.AFTER_BODY, path, refused)
        if ROUTES[path] == "GET":
            return Verdict(When.NOW, path, self._get(path))
        return self._admission(path, headers)

    def _admission(self, path: str, headers: Headers) -> Verdict:
        """An admission POST: its media type (415) and declared length (413), then read under the limits."""
        content_type = _first(headers, b"content-type")
        media = content_type.split(b";", 1)[0].strip().lower().decode("latin-1") if content_type else ""
        if media != JSON:
            return Verdict(When.AFTER_BODY, path, _unsupported(media))
        server = self.settings.server
        declared = _first(headers, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > server.max_body_bytes:
            size = declared.decode()
            too_large = error(413, f"body of {size} bytes is over server.maxBodyBytes ({server.max_body_bytes})")
            return Verdict(When.NOW, path, too_large, close=True)
        return Verdict(When.READ, path, limit=server.max_body_bytes, seconds=server.deadline_seconds)

    def _ready(self) -> Answer:
        reasons = [r for r in (check() for check in self.readiness) if r]
        if reasons:
            return Answer(503, orjson.dumps({"status": "not ready", "reasons": reasons}), result="not_ready")
        return Answer(200, b'{"status":"ready"}')

    async def _mutate(self, scope: Scope, receive: Receive, kinds: Sequence[str]) -> Answer:
        content_type = media_type(scope)
        if content_type != JSON:
            return _unsupported(content_type)
        server = self.settings.server
        body = await read_body(
            scope,
            receive,
            self._deadlines,
            limit=server.max_body_bytes,
            limit_name="server.maxBodyBytes",
            seconds=server.deadline_seconds,
        )
        return self._admit(body, kinds)

    # admission.Site: an admission request is answered by the connection inside the read that completes its
    # body, without an ASGI cycle; the ASGI route above answers the same bytes (tests hold the two together).

    def answer(self, endpoint: str, body: bytes, started: float, write: Callable[[int, bytes], None]) -> None:
        """Answer a POST to `endpoint` (a key of MUTATE_PATHS) whose whole `body` arrived; `write` sends it."""
        try:
            answer = self._admit(body, MUTATE_PATHS[endpoint])
        except RequestError as exc:
            answer = refused(exc)
        except Exception:
            answer = internal_error(f"POST {endpoint}")
        write(answer.status, answer.body)
        self.finished(endpoint, answer.result, started)

    def finished(self, endpoint: str, result: str, started: float | None) -> None:
        """Count a request, answered or lost; `started` None: not timed (the client left)."""
        self.metrics.request(endpoint, result).inc()
        if started is not None:
            self._latency[endpoint].observe(time.perf_counter() - started)

    def _admit(self, body: bytes, kinds: Sequence[str]) -> Answer:
        review = read_review(load_json(body))
        settings = self.settings
        decided = decide(review.request, settings, self.namespaces, kinds=kinds)
        answer = response(review.uid, decided, settings)
        if decided is None:
            result = "not_applicable"
        else:
            self.metrics.count_plan(decided, settings.failure_policy)
            result = "patched" if "patch" in answer else ("denied" if not answer["allowed"] else "unchanged")
        return Answer(200, envelope(review.api_version, answer), result=result)


class MetricsApp:
    """GET /metrics and nothing else, for the plain-HTTP port (server.metricsPort): a scrape needs no client
    TLS, and neither admission nor previews are reachable without it. An ASGI application, and the
    admission.Site its connections answer from."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def at_head(self, method: str, target: bytes, headers: Headers) -> Verdict:
        raw = target.split(b"?", 1)[0] if b"?" in target else target
        path = raw.decode("latin-1")
        if raw != b"/metrics":
            return Verdict(
                When.AFTER_BODY, answer=error(404, f"no endpoint {path}; this port serves GET /metrics only")
            )
        if method not in ("GET", "HEAD"):
            refused = error(405, f"/metrics takes GET, HEAD, not {method}", [(b"allow", b"GET, HEAD")])
            return Verdict(When.AFTER_BODY, answer=refused)
        return Verdict(When.NOW, answer=Answer(200, self.metrics.render(), METRICS_CONTENT_TYPE))

    def answer(self, endpoint: str, body: bytes, started: float, write: Callable[[int, bytes], None]) -> None:
        raise AssertionError("the metrics port reads no body")  # at_head never says When.READ

    def finished(self, endpoint: str, result: str, started: float | None) -> None:
        pass  # scrapes are not counted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = _route_path(scope)
        if path != "/metrics":
            answer = error(404, f"no endpoint {path}; this port serves GET /metrics only")
        elif scope["method"] not in ("GET", "HEAD"):
            answer = error(405, f"/metrics takes GET, HEAD, not {scope['method']}", [(b"allow", b"GET, HEAD")])
        else:
            answer = Answer(200, self.metrics.render(), METRICS_CONTENT_TYPE)
        await _send(send, answer)


def _no_endpoint(path: str) -> Answer:
    return error(
        404,
        f"no endpoint {path}; endpoints: POST /mutate, /mutate/ptrace, /mutate/image-puller, /preview; "
        "GET /healthz, /readyz, /metrics",
    )


def _refused_route(method: str, path: str) -> Answer | None:
    """404 for a path with no route, 405 for a method the route does not take; None when it takes it."""
    allowed = ROUTES.get(path)
    if allowed is None:  # /preview, /openapi.json and /docs never come here (api.py)
        return _no_endpoint(path)
    if method != allowed and not (allowed == "GET" and method == "HEAD"):
        allow = "GET, HEAD" if allowed == "GET" else allowed
        return error(405, f"{path} takes {allow}, not {method}", [(b"allow", allow.encode())])
    return None


def _unsupported(content_type: str) -> Answer:
    return error(415, f"Content-Type must be {JSON} (an AdmissionReview), got {content_type or 'none'!r}")


def _first(headers: Headers, name: bytes) -> bytes | None:
    """The first value of a header, as the application reads it."""
    for key, value in headers:
        if key == name:
            return value
    return None


async def _send(send: Send, answer: Answer) -> None:
    await send({"type": "http.response.start", "status": answer.status, "headers": answer.header_list()})
    await send({"type": "http.response.body", "body": answer.body})


async def _forward(app: App, scope: Scope, receive: Receive, send: Send) -> int | None:
    """Let `app` answer; the status it sent, for the metrics (None: it sent none)."""
    status: list[int] = []

    async def sending(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        await send(dict(message))

    await app(scope, receive, sending)
    return status[0] if status else None
