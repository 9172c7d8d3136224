"""The FastAPI part of the HTTP API: /preview's typed parameters and error contract, the OpenAPI
description (the whole API, /mutate* included), and /docs rendered by a real headless browser (Debian's
Chromium) with every host but the server's shut out, so a page that needed a CDN would stay blank."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.asgi import call
from tests.daemons import require
from tests.server_process import Server, running_server
from tests.support import PODS
from webhook.config import build_settings
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
    assert set(spec["paths"]) >= {"/preview", "/mutate", "/mutate/ptrace", "/mutate/image-puller", "/healthz",
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


@pytest.mark.parametrize(
    ("path", "allow"),
    [
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


def test_docs_render_in_a_headless_browser_without_network(served: Server, tmp_path: Path) -> None:
    require("chromium")
    dom = subprocess.run(
        [
            "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--ignore-certificate-errors",
            f"--user-data-dir={tmp_path / 'profile'}",
            # Every name resolves to nothing and every connection but the server's goes to a dead proxy.
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=127.0.0.1",
            "--virtual-time-budget=20000", "--dump-dom", f"{served.url}/docs",
        ],
        capture_output=True, text=True, timeout=120, check=False,
    ).stdout  # fmt: skip
    rendered = set(re.findall(r'data-path="([^"]+)"', dom))
    assert {"/preview", "/mutate", "/mutate/ptrace", "/mutate/image-puller", "/healthz"} <= rendered, dom[:2000]
    assert "copilot-webhook" in dom


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
