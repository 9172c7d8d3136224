"""The FastAPI part of the HTTP API: /preview's typed parameters and error contract, the OpenAPI
description (the whole API, /mutate* included) held to what the server answers, GET /, and /docs rendered
and used ("Try it out") by a real headless browser (Debian's Chromium) with every host but the server's shut
out, so a page that needed a CDN would stay blank."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import select
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NamedTuple

import jsonschema
import orjson
import pytest
import yaml

from harness.daemons import require
from harness.server_process import Server, running_server
from tests.asgi import call, post_json
from tests.helpers import PODS, load_yaml, review
from webhook.config import build_settings
from webhook.errors import PreviewFailed
from webhook.web.api import FLYTE_POD, FLYTE_POD_YAML
from webhook.web.middleware import JSON, YAML_TYPES
from webhook.web.server import WebhookApp

APP = WebhookApp(build_settings({}))
POD_YAML = (PODS / "flyte-1.15-bare.yaml").read_bytes()
YAML_BODY = {"Content-Type": "application/yaml"}


def _openapi() -> dict[str, Any]:
    res = call(APP, "GET", "/openapi.json")
    assert res.status_code == 200
    spec: dict[str, Any] = res.json()
    return spec


def test_the_openapi_description_covers_the_whole_api() -> None:
    spec = _openapi()
    assert spec["openapi"].startswith("3.")
    assert set(spec["paths"]) >= {"/", "/preview", "/mutate", "/mutate/ptrace", "/mutate/image-puller", "/healthz",
                                  "/readyz", "/metrics"}  # fmt: skip
    parameters = {p["name"]: p for p in spec["paths"]["/preview"]["post"]["parameters"]}
    assert set(parameters) == {"output", "runtime", "node", "namespace", "podSecurity"}
    schemas = spec["components"]["schemas"]
    output = schemas[parameters["output"]["schema"]["$ref"].rsplit("/", 1)[1]]
    assert output["enum"] == ["json", "yaml", "patch", "diff"]
    assert "pattern" in str(parameters["node"]["schema"])
    review = spec["paths"]["/mutate/ptrace"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert review == {"$ref": "#/components/schemas/AdmissionReview"}
    assert schemas["AdmissionReview"]["properties"]["request"]["required"] == ["uid"]
    answered = spec["paths"]["/preview"]["post"]["responses"]["200"]
    assert set(answered["headers"]) == {"Warning", "Copilot-Webhook-Decision"}


def test_preview_keeps_its_error_contract_under_fastapi() -> None:
    bad = call(APP, "POST", "/preview?output=xml", POD_YAML, content_type="application/yaml")
    assert (bad.status_code, bad.json()) == (
        400,
        {"error": "output='xml' is not allowed; expected one of json, yaml, patch, diff"},
    )
    unknown = call(APP, "POST", "/preview?outptu=yaml", POD_YAML, content_type="application/yaml")
    assert unknown.status_code == 400
    assert "unknown query parameter(s) outptu" in unknown.json()["error"]
    wrong_method = call(APP, "GET", "/preview")
    assert wrong_method.status_code == 405
    assert wrong_method.json() == {"error": "/preview takes POST, not GET"}
    assert wrong_method.headers["allow"] == "POST"
    node = call(APP, "POST", "/preview?node=Not_A_Node", POD_YAML, content_type="application/yaml")
    assert (node.status_code, node.json()["error"]) == (
        400,
        "node='Not_A_Node' is not a valid node name (a DNS subdomain)",
    )
    good = call(APP, "POST", "/preview?output=patch&runtime=cri-o", POD_YAML, content_type="application/yaml")
    assert good.status_code == 200
    assert good.headers["content-type"] == "application/json-patch+json"


def test_no_phantom_validation_error_is_documented() -> None:
    """FastAPI documents a 422 "Validation Error" of its own on an operation with parameters; /preview answers
    a bad parameter 400 and its 422 in the `{"error": ...}` form, as documented."""
    spec = _openapi()
    assert not {"HTTPValidationError", "ValidationError"} & set(spec["components"]["schemas"])
    assert "ValidationError" not in json.dumps(spec)
    refused = spec["paths"]["/preview"]["post"]["responses"]["422"]
    assert refused["content"] == {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}
    bad = call(APP, "POST", "/preview?podSecurity=none", POD_YAML, content_type="application/yaml")
    assert (bad.status_code, list(bad.json())) == (400, ["error"])


# --- every documented answer, given by the server in its documented shape -----------------------------------


class Answer(NamedTuple):
    status: int
    media_type: str
    headers: dict[str, str]
    body: bytes


def _answer(res: Any) -> Answer:
    media = res.headers.get("content-type", "").split(";")[0].strip()
    return Answer(res.status_code, media, dict(res.headers), res.content)


def _raw(app: WebhookApp, path: str, receive: Any, content_type: str = JSON) -> Answer:
    """POST straight through the ASGI app with this receive (a body that never comes)."""
    scope = {
        "type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": [(b"content-type", content_type.encode())],
    }  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start, body = sent
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return Answer(start["status"], headers.get("content-type", "").split(";")[0], headers, body["body"])


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def _late(path: str) -> Answer:
    return _raw(WebhookApp(build_settings({"server": {"deadlineSeconds": 0.2}})), path, _never)


def _preview(query: str = "", body: bytes = POD_YAML, content_type: str = "application/yaml") -> Answer:
    return _answer(call(APP, "POST", f"/preview{query}", body, content_type=content_type))


def _busy() -> Answer:
    app = WebhookApp(build_settings({}))
    held = [app.previewer.take() for _ in range(app.previewer.slots)]
    try:
        return _raw(app, "/preview", _never, "application/yaml")
    finally:
        for worker in held:
            assert worker is not None
            app.previewer.give_back(worker)


def _killer() -> Answer:
    """What the gate answers when the pool reports that the document killed its worker twice
    (test_preview_worker_deaths.py kills real workers)."""
    app = WebhookApp(build_settings({}))

    def run(*_args: Any, **_kwargs: Any) -> Any:
        raise PreviewFailed(422, "the document made the preview worker die: killed by SIGKILL, twice")

    app.previewer.run = run  # type: ignore[method-assign]
    return _answer(call(app, "POST", "/preview", POD_YAML, content_type="application/yaml"))


def _mutate(path: str) -> dict[str, list[Callable[[], Answer]]]:
    small = WebhookApp(build_settings({"server": {"maxBodyBytes": 1024}}))
    return {
        f"POST {path} 200": [lambda: _answer(post_json(APP, path, review(yaml.safe_load(POD_YAML))))],
        f"POST {path} 400": [lambda: _answer(post_json(APP, path, {"kind": "AdmissionReview"}))],
        f"POST {path} 408": [lambda: _late(path)],
        f"POST {path} 413": [lambda: _answer(call(small, "POST", path, b" " * 2048, content_type=JSON))],
        f"POST {path} 415": [lambda: _answer(call(APP, "POST", path, b"{}", content_type="text/plain"))],
    }


ANSWERS: dict[str, list[Callable[[], Answer]]] = {
    "GET / 200": [lambda: _answer(call(APP, "GET", "/"))],
    "POST /preview 200": [
        *(lambda output=output: _preview(f"?output={output}") for output in ("json", "patch", "yaml", "diff")),
        lambda: _preview("?output=patch", POD_YAML + b"---\n" + POD_YAML),
        lambda: _preview("", POD_YAML + b"---\n" + POD_YAML),
    ],
    "POST /preview 400": [lambda: _preview("?output=xml"), lambda: _preview("", b"kind: 3\n")],
    "POST /preview 404": [
        lambda: _answer(call(WebhookApp(build_settings({"preview": {"enabled": False}})), "POST", "/preview"))
    ],
    "POST /preview 408": [lambda: _late("/preview")],
    "POST /preview 413": [lambda: _preview("", b"x" * (1024 * 1024 + 1))],
    "POST /preview 415": [lambda: _preview("", POD_YAML, "text/plain")],
    "POST /preview 422": [_killer],
    "POST /preview 503": [_busy],
    **_mutate("/mutate"),
    **_mutate("/mutate/ptrace"),
    **_mutate("/mutate/image-puller"),
    "GET /healthz 200": [lambda: _answer(call(APP, "GET", "/healthz"))],
    "GET /readyz 200": [lambda: _answer(call(APP, "GET", "/readyz"))],
    "GET /readyz 503": [
        lambda: _answer(call(WebhookApp(build_settings({}), readiness=[lambda: "caches not listed"]), "GET", "/readyz"))
    ],
    "GET /metrics 200": [lambda: _answer(call(APP, "GET", "/metrics"))],
}


def _documented(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        f"{method.upper()} {path} {status}": response
        for path, operations in spec["paths"].items()
        for method, operation in operations.items()
        for status, response in operation["responses"].items()
    }


def test_every_documented_status_is_one_the_server_answers_and_the_reverse() -> None:
    assert set(_documented(_openapi())) == set(ANSWERS)


def _body(answer: Answer) -> Any:
    if answer.media_type == JSON or answer.media_type.endswith("+json"):
        return orjson.loads(answer.body)
    return answer.body.decode()


@pytest.mark.parametrize("documented", sorted(ANSWERS))
def test_every_answer_has_its_documented_shape(documented: str) -> None:
    spec = _openapi()
    response = _documented(spec)[documented]
    media_types = set()
    for provoke in ANSWERS[documented]:
        answer = provoke()
        assert str(answer.status) == documented.rsplit(" ", 1)[1], answer
        assert answer.media_type in response["content"], answer
        media_types.add(answer.media_type)
        schema = {"components": spec["components"], **response["content"][answer.media_type]["schema"]}
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.validate(_body(answer), schema, cls=jsonschema.Draft202012Validator)
        required = [name for name, header in response.get("headers", {}).items() if header.get("required")]
        assert all(name.lower() in answer.headers for name in required), (required, answer.headers)
    assert media_types == set(response["content"]), "each documented form given"


def test_the_schemas_refuse_what_is_not_an_answer() -> None:
    """The shapes are not vacuous: a key too many, or one missing, is refused."""
    spec = _openapi()
    schemas = spec["components"]["schemas"]
    answer = orjson.loads(_preview().body)
    for wrong in ({**answer, "extra": 1}, {k: v for k, v in answer.items() if k != "decisions"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, {"components": spec["components"], **schemas["PreviewObject"]})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"detail": []}, {"components": spec["components"], **schemas["Error"]})


# --- the request body's examples, and GET / ---------------------------------------------------------------------


def test_the_request_body_takes_every_type_the_gate_reads_and_each_example_is_a_working_flyte_pod() -> None:
    body = _openapi()["paths"]["/preview"]["post"]["requestBody"]
    assert set(body["content"]) == {JSON, *YAML_TYPES} >= {"application/yaml", "text/yaml"}
    assert next(iter(body["content"])) == JSON, "Swagger UI offers the first type first"
    example = yaml.safe_load(Path(__file__).parent.parent.joinpath("examples", "flyte-1.15-pod.yaml").read_text())
    assert FLYTE_POD == example == yaml.safe_load(FLYTE_POD_YAML)
    assert load_yaml(PODS.parent / "flyte-src-1.15-io.yaml") == example
    for media, content in body["content"].items():
        (shown,) = content["examples"].values()
        sent = orjson.dumps(shown["value"]) if media == JSON else shown["value"].encode()
        answer = call(APP, "POST", "/preview", sent, content_type=media)
        assert answer.status_code == 200, answer.text
        assert answer.json()["decisions"]["ptrace"] == "add:primary"
        assert answer.json()["patch"]
    refused = call(APP, "POST", "/preview", POD_YAML, content_type="text/plain").json()["error"]
    assert all(media in refused for media in (JSON, *YAML_TYPES)), refused


def test_the_root_points_at_the_docs_and_lists_the_endpoints() -> None:
    res = call(APP, "GET", "/")
    assert res.status_code == 200
    index = res.json()
    assert (index["docs"], index["openapi"]) == ("/docs", "/openapi.json")
    assert {"POST /preview", "POST /mutate", "GET /healthz", "GET /docs", "GET /openapi.json"} <= set(
        index["endpoints"]
    )
    assert "/" not in {e.split()[1] for e in index["endpoints"]}
    head = call(APP, "HEAD", "/")
    assert (head.status_code, head.headers["content-type"], head.content) == (200, "application/json", b"")
    assert 'copilot_webhook_requests_total{path="/docs",result="ok"}' in call(APP, "GET", "/metrics").text


def test_the_path_label_stays_bounded() -> None:
    """docs/http-api.md: the human API's pages count as /docs, a path nobody serves as unknown, whatever its
    text, so a scanner cannot grow the metrics."""
    app = WebhookApp(build_settings({}))
    for path in ("/openapi.json", "/docs", "/nope-1", "/nope-2", "/mutate/../x"):
        call(app, "GET", path)
    text = call(app, "GET", "/metrics").text
    counted = set(re.findall(r'^copilot_webhook_requests_total\{path="([^"]*)"', text, re.MULTILINE))
    assert counted == {"/docs", "unknown"}
    assert 'copilot_webhook_requests_total{path="unknown",result="not_found"} 3.0' in text


@pytest.mark.parametrize(
    ("path", "allow"),
    [
        ("/", "GET, HEAD"),
        ("/openapi.json", "GET, HEAD"),
        ("/docs", "GET"),
        ("/docs/oauth2-redirect", "GET"),
        ("/static-offline-docs/swagger-ui.css", "GET, HEAD"),
        ("/preview", "POST"),
    ],
)
def test_a_wrong_method_on_the_fastapi_pages_names_what_the_path_takes(path: str, allow: str) -> None:
    """405's Allow lists the path's own methods (it once said POST for every page: "takes POST, not POST")."""
    method = "GET" if allow == "POST" else "POST"
    res = call(APP, method, path)
    assert res.status_code == 405
    assert res.headers["allow"] == allow
    assert res.json() == {"error": f"{path} takes {allow}, not {method}"}


def test_the_docs_page_loads_nothing_from_elsewhere() -> None:
    page = call(APP, "GET", "/docs")
    assert page.status_code == 200
    urls = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", page.text)
    assert urls
    assert all(u.startswith("/") for u in urls), urls
    asset = call(APP, "GET", "/static-offline-docs/swagger-ui-bundle.js")
    assert asset.status_code == 200
    assert len(asset.content) > 100_000


@pytest.fixture(scope="module")
def served(tls_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with running_server(tls_dir, tmp_path_factory.mktemp("docs")) as server:
        yield server


# Every name resolves to nothing and every connection but the server's goes to a dead proxy.
OFFLINE = [
    "--headless", "--no-sandbox", "--disable-gpu", "--ignore-certificate-errors",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=127.0.0.1",
]  # fmt: skip
WAIT = 90.0  # seconds for any one step of the page, on a loaded two-core machine


def _high(fd: int) -> int:
    """The same pipe end at a number above 9, clear of the 3 and 4 Chromium's pipe is moved to (by bash:
    dash redirects only single-digit descriptors)."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


class Page:
    """A Chromium tab driven through the DevTools protocol on a pipe (--remote-debugging-pipe: commands in on
    fd 3, answers and events out on fd 4, each a JSON text ending in NUL): no driver package, no port."""

    def __init__(self, commands: int, answers: int) -> None:
        self._commands, self._answers = commands, answers
        self._buffer = b""
        self._last = 0
        self.session = ""

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        self._last += 1
        message: dict[str, Any] = {"id": self._last, "method": method, "params": params or {}}
        if self.session:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + WAIT
        while True:
            answer = self._next(deadline)
            if answer.get("id") == self._last:
                assert "error" not in answer, (method, answer["error"])
                result: dict[str, Any] = answer["result"]
                return result

    def _next(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            assert left > 0, "Chromium did not answer in time"
            if select.select([self._answers], [], [], left)[0]:
                chunk = os.read(self._answers, 1 << 16)
                assert chunk, "Chromium closed its pipe"
                self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        found: dict[str, Any] = json.loads(message)
        return found

    def evaluate(self, script: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": script, "returnByValue": True})
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def until(self, script: str, what: str) -> Any:
        """The script's value once it is truthy: the page is polled until then, for at most WAIT seconds."""
        deadline = time.monotonic() + WAIT
        while not (value := self.evaluate(script)):
            if time.monotonic() > deadline:
                text = self.evaluate("document.body ? document.body.innerText.slice(0, 3000) : ''")
                raise AssertionError(f"{what}: not within {WAIT:g} s; the page says:\n{text}")
            time.sleep(0.2)
        return value


@contextmanager
def _browser(url: str, profile: Path) -> Iterator[Page]:
    into_r, into_w = (_high(fd) for fd in os.pipe())
    out_r, out_w = (_high(fd) for fd in os.pipe())
    process = subprocess.Popen(
        ["bash", "-c", f'exec "$0" "$@" 3<&{into_r} 4>&{out_w} {into_r}<&- {out_w}>&-', "chromium", *OFFLINE,
         f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
        pass_fds=(into_r, out_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(into_r)
    os.close(out_w)
    page = Page(into_w, out_r)
    try:
        target = page.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        page.session = page.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page.send("Page.navigate", {"url": url})
        yield page
    finally:
        page.session = ""
        with suppress(OSError, AssertionError, subprocess.TimeoutExpired):  # it may be gone already
            page.send("Browser.close")
            process.wait(timeout=30)
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(into_w)
        os.close(out_r)


OPERATION = "#operations-default-preview_preview_post"
_CHOOSE = """(() => {{
    const select = document.querySelector({where!r});
    if (!select) return false;
    Object.getOwnPropertyDescriptor(HTMLSelectElement.prototype, "value").set.call(select, {value!r});
    select.dispatchEvent(new Event("change", {{bubbles: true}}));
    return select.value === {value!r};
}})()"""
_CLICK = "(() => {{ const found = document.querySelector({where!r}); if (found) found.click(); return !!found; }})()"
_TEXT = "(() => {{ const found = document.querySelector({where!r}); return found ? {what} : ''; }})()"


def _click(page: Page, where: str) -> None:
    page.until(_CLICK.format(where=f"{OPERATION} {where}"), f"a {where} to click")


def _choose(page: Page, where: str, value: str) -> None:
    page.until(_CHOOSE.format(where=f"{OPERATION} {where}", value=value), f"{value} chosen in {where}")


def _text(page: Page, where: str, what: str = "found.textContent") -> str:
    return str(page.evaluate(_TEXT.format(where=f"{OPERATION} {where}", what=what)))


def _executed(page: Page) -> tuple[str, str]:
    """Execute, then the status and the response (body and headers) Swagger UI shows."""
    _click(page, "button.execute")
    shown = _TEXT.format(
        where=f"{OPERATION} .live-responses-table tr.response .response-col_status", what="found.textContent"
    )
    page.until(shown, "a response shown")
    status = _text(page, ".live-responses-table tr.response .response-col_status").strip()
    return status, _text(page, ".live-responses-table tr.response .response-col_description")


def test_docs_render_in_a_headless_browser_without_network(served: Server, tmp_path: Path) -> None:
    require("chromium")
    with _browser(f"{served.url}/docs", tmp_path / "profile") as page:
        paths = "[...document.querySelectorAll('[data-path]')].map(e => e.dataset.path)"
        page.until(f"{paths}.includes('/metrics')", "the operations listed")
        rendered = set(page.evaluate(paths))
        assert rendered >= {"/", "/preview", "/mutate", "/mutate/ptrace", "/mutate/image-puller", "/healthz"}
        assert "copilot-webhook" in page.evaluate("document.querySelector('.info .title').textContent")


def _the_json_example(page: Page) -> None:
    """Try it out, then Execute the body as shown: the JSON example, the first type."""
    _click(page, ".opblock-summary-control")
    _click(page, ".try-out__btn")
    body = page.until(_TEXT.format(where=f"{OPERATION} textarea.body-param__text", what="found.value"), "the example")
    assert json.loads(body) == FLYTE_POD
    status, shown = _executed(page)
    assert status == "200", shown
    assert '"ptrace": "add:primary"' in shown
    assert "copilot-webhook-image-puller" in shown, "the patch adds the puller"
    assert "ptrace=add:primary;image-puller=containerd:/run/containerd/containerd.sock" in shown, "header"


def _the_yaml_example_as_a_patch(page: Page) -> None:
    """Clear, choose YAML (the example follows) and output=patch, Execute."""
    _click(page, ".btn-clear")
    page.until(f"!document.querySelector('{OPERATION} .live-responses-table')", "the response cleared")
    _choose(page, ".opblock-section-request-body select", "application/yaml")
    yaml_shown = "found.value.startsWith('apiVersion: v1')"
    page.until(_TEXT.format(where=f"{OPERATION} textarea.body-param__text", what=yaml_shown), "the YAML example")
    assert yaml.safe_load(_text(page, "textarea.body-param__text", "found.value")) == FLYTE_POD
    _choose(page, "tr[data-param-name='output'] select", "patch")
    status, shown = _executed(page)
    assert status == "200", shown
    assert "output=patch" in _text(page, ".request-url")
    assert "Content-Type: application/yaml" in _text(page, ".curl-command")
    patch = json.loads(_text(page, ".live-responses-table tr.response .response-col_description .highlight-code pre"))
    assert {"op": "add", "path": "/spec/initContainers/0"}.items() <= patch[0].items()
    assert patch[0]["value"]["name"] == "copilot-webhook-image-puller"
    assert "ptrace=add:primary" in shown


def test_try_it_out_previews_the_example_pod_as_json_and_as_yaml(served: Server, tmp_path: Path) -> None:
    """In Swagger UI as a person uses it: open /preview, Try it out, Execute the example as it is shown (JSON,
    the first type), then choose YAML and output=patch and Execute again."""
    require("chromium")
    with _browser(f"{served.url}/docs", tmp_path / "profile") as page:
        _the_json_example(page)
        _the_yaml_example_as_a_patch(page)


def test_a_served_preview_sends_its_warning_and_decision_headers_as_utf_8(served: Server) -> None:
    """Through the real server: a warning cut at 120 characters ends with an ellipsis, which no latin-1
    header could carry."""
    pod = yaml.safe_load(POD_YAML)
    pod["metadata"]["annotations"] = {"primary_container_name": "é" * 200}
    with served.client() as client:
        answer = client.post("/preview?output=patch", content=yaml.safe_dump(pod), headers=YAML_BODY)
    assert answer.status_code == 200
    (warning,) = answer.headers.get_list("warning")
    assert warning.startswith('299 - "copilot-webhook: left unchanged, cannot decide: primary_container_name')
    assert warning.endswith('é…"')
    assert answer.headers.get_list("copilot-webhook-decision") == [
        "Pod/bq2m4-n1-0: ptrace=skipped(undecided);image-puller=containerd:/run/containerd/containerd.sock"
    ]
