"""Call the ASGI application in-process, as uvicorn would, for tests that need no socket."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from webhook.web.server import WebhookApp


def call(app: WebhookApp, method: str, path: str, body: bytes = b"", **headers: str) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type] # httpx's ASGI type wants MutableMapping
        async with httpx.AsyncClient(transport=transport, base_url="https://webhook") as client:
            hdrs = {k.replace("_", "-"): v for k, v in headers.items()}
            return await client.request(method, path, content=body, headers=hdrs)

    return asyncio.run(run())


def post_json(app: WebhookApp, path: str, data: Any) -> httpx.Response:
    import orjson

    return call(app, "POST", path, orjson.dumps(data), content_type="application/json")
