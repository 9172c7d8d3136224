"""The gate in front of the FastAPI app (api.py): what POST /preview passes before FastAPI sees it.

In order: the endpoint enabled (else 404), a media type the preview reads (415), a free worker process
(503 with Retry-After, so a busy server refuses before reading a byte of the body), then the body under
`preview.maxBodyBytes` (413) and `server.deadlineSeconds` (408), read as admission reads its own
(bodies.py). The endpoint then gets all of it as one `Admitted`, through the `admitted` dependency, and
runs the preview in the reserved worker (preview/workers.py) while admission reviews are answered. The
worker is given back when the answer has been sent.

Refusals are the API's `{"error": "..."}`; a client gone mid-body raises ClientGone to the server, which
counts it. Every other request passes through untouched.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from webhook.config import Settings
from webhook.errors import PreviewFailed, RequestError
from webhook.preview.render import Previewed, PreviewQuery
from webhook.preview.workers import Previewer, Worker
from webhook.web.bodies import BodyDeadlines, media_type, read_body

PATH = "/preview"
JSON = "application/json"
YAML_TYPES = ("application/yaml", "text/yaml", "application/x-yaml")
_STATE = "preview"  # the request state's attribute holding the Admitted: set and read in this module only


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A refusal in the API's form; a 503 says when to retry."""
    if status == 503:
        headers = {**(headers or {}), "retry-after": "1"}
    return JSONResponse({"error": message}, status_code=status, headers=headers)


@dataclass(frozen=True, slots=True)
class Admitted:
    """A preview let in by the gate: its body and media type, the settings it arrived under and the worker
    reserved for it."""

    body: bytes
    content_type: str
    settings: Settings
    worker: Worker
    previewer: Previewer
    waits: ThreadPoolExecutor  # threads that wait on the workers, so the event loop does not

    async def run(self, query: PreviewQuery) -> Previewed:
        """The preview's answer, computed in the reserved worker process."""
        work = functools.partial(
            self.previewer.run, self.worker, self.body, self.content_type, query=query, settings=self.settings
        )
        try:
            return await asyncio.get_running_loop().run_in_executor(self.waits, work)
        except PreviewFailed as exc:
            raise RequestError(exc.status, exc.message) from None


async def admitted(request: Request) -> Admitted:
    """The preview the gate let in: a dependency of the FastAPI endpoint (async, so no thread runs it)."""
    found = getattr(request.state, _STATE, None)
    if not isinstance(found, Admitted):
        raise RuntimeError(f"POST {PATH} reached the FastAPI app without passing PreviewGate")
    return found


class PreviewGate:
    """ASGI middleware around the FastAPI app. `settings` is called once per request: the server's settings
    may be replaced at any time (configuration reload), and one preview sees one version of them."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        settings: Callable[[], Settings],
        previewer: Previewer,
        deadlines: BodyDeadlines,
        in_flight: Gauge,
    ) -> None:
        self.app = app
        self._settings = settings
        self._previewer = previewer
        self._deadlines = deadlines
        self._in_flight = in_flight
        self._waits = ThreadPoolExecutor(previewer.slots, thread_name_prefix="preview")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        settings = self._settings()
        try:
            if not settings.preview.enabled:
                raise RequestError(404, f"no endpoint {PATH}: preview.enabled is false")
            if scope["method"] != "POST":
                await self.app(scope, receive, send)  # FastAPI's 405 names the methods
                return
            await self._preview(scope, receive, send, settings=settings)
        except RequestError as exc:  # refused before FastAPI saw the request
            await error_response(exc.status, exc.message)(scope, receive, send)

    async def _preview(self, scope: Scope, receive: Receive, send: Send, *, settings: Settings) -> None:
        content_type = media_type(scope)
        if content_type != JSON and content_type not in YAML_TYPES:
            also = ", ".join(YAML_TYPES[1:])
            raise RequestError(
                415, f"Content-Type must be {JSON} or {YAML_TYPES[0]} (or {also}), got {content_type or 'none'!r}"
            )
        worker = self._previewer.take()
        if worker is None:
            raise RequestError(503, "previews are busy (preview.concurrency); try again in a second")
        self._in_flight.inc()
        try:
            body = await read_body(
                scope,
                receive,
                self._deadlines,
                limit=settings.preview.max_body_bytes,
                limit_name="preview.maxBodyBytes",
                seconds=settings.server.deadline_seconds,
            )
            entry = Admitted(body, content_type, settings, worker, self._previewer, self._waits)
            state: dict[str, Any] = {**scope.get("state", {}), _STATE: entry}
            await self.app({**scope, "state": state}, functools.partial(_replay, body), send)
        finally:
            self._previewer.give_back(worker)
            self._in_flight.dec()


async def _replay(body: bytes) -> Message:
    """The body, already read, for the app behind the gate: it reads from memory, not the connection."""
    return {"type": "http.request", "body": body, "more_body": False}
