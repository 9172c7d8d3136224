"""Fuzzing every endpoint with hostile bodies: seeded (derandomised) Hypothesis, bounded in examples and time.

Shapes: AdmissionReviews whose pods carry junk in every field the plan reads, JSON nested past every
limit, integers beyond 64 bits, duplicate keys, YAML with tags, aliases and deep flow collections, raw
bytes. What must hold: no 5xx, every 4xx is JSON with an `error` string, and, against the real server,
bounded memory and a live `/healthz` afterwards.
"""

from __future__ import annotations

import contextlib
import json
import socket
import string
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.server_process import client_context, free_port, running_server, status_kb
from tests.asgi import call
from tests.helpers import pod
from webhook.config import build_settings
from webhook.preview.render import _yaml
from webhook.web.api import PATHS as API_PATHS
from webhook.web.server import ROUTES, WebhookApp

PATHS = ["/mutate", "/mutate/ptrace", "/mutate/image-puller", "/preview"]
CONTENT_TYPES = ["application/json", "application/yaml", "text/yaml", "text/plain", ""]
QUERIES = ["", "?output=diff", "?output=yaml", "?output=patch", "?runtime=docker&node=n1", "?output=%ff", "?x=1"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["SYS_PTRACE", "cap_sys_ptrace", "ALL", "/bin/flyte-copilot", "Always", "flyte-copilot-uploader"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20,
)


@st.composite
def hostile_pods(draw: st.DrawFn) -> dict[str, Any]:
    """A Flyte pod with junk swapped in at the places the plan reads."""
    obj = pod("flyte-1.15-bare.yaml")
    places: list[tuple[str, ...]] = [
        ("metadata",),
        ("metadata", "annotations"),
        ("spec",),
        ("spec", "containers"),
        ("spec", "initContainers"),
        ("spec", "nodeSelector"),
        ("spec", "affinity"),
        ("spec", "imagePullSecrets"),
        ("spec", "shareProcessNamespace"),
    ]
    if draw(st.booleans()):
        container = obj["spec"]["containers"][0]
        field = draw(st.sampled_from(["securityContext", "image", "command", "name", "imagePullPolicy"]))
        container[field] = draw(json_values)
    for path in draw(st.lists(st.sampled_from(places), max_size=3)):
        node = obj
        for key in path[:-1]:
            node = node.setdefault(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node[path[-1]] = draw(json_values)
    return obj


def _deep(depth: int) -> bytes:
    return b'{"kind":"Pod","spec":{"containers":[],"x":' + b"[" * depth + b"]" * depth + b"}}"


YAML_FRAGMENTS = [
    b"kind: Pod\n",
    b"spec: {containers: [{name: a, image: x}]}\n",
    b"x: !!binary aGVsbG8=\n",
    b"y: !!set {a, b}\n",
    b"z: 1" + b"0" * 30 + b"\n",
    b"a: &x [1]\nb: *x\n",
    b"---\n",
    b"t: 2026-11-30\n",
    b"f: .nan\n",
    b"k: [" * 80 + b"]" * 80 + b"\n",
    b"? [complex, key]\n: v\n",
    b"\xff\xfe\x00",
    b"kind: List\nitems: [{kind: Pod}]\n",
]


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()  # the standard encoder writes integers beyond 64 bits too


def _review(obj: dict[str, Any]) -> dict[str, Any]:
    request = {"uid": "f1", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE"}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {**request, "object": obj}}


bodies = st.one_of(
    hostile_pods().map(lambda p: _json(_review(p))),
    hostile_pods().map(_json),
    json_values.map(_json),
    st.integers(min_value=1, max_value=3000).map(_deep),
    st.lists(st.sampled_from(YAML_FRAGMENTS), max_size=6).map(b"".join),
    st.binary(max_size=200),
    st.just(b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"a","uid":"b"}}'),
)


def _check(status: int, content_type: str, body: bytes) -> None:
    assert status < 500, body[:300]
    if status >= 400:
        assert content_type.startswith("application/json"), content_type
        error = orjson.loads(body)["error"]
        assert isinstance(error, str)
        assert error


APP = WebhookApp(build_settings({}))


@pytest.mark.server  # its paths include /preview, rendered in a worker process (tests/tiers.py)
@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    path=st.sampled_from(PATHS),
    content_type=st.sampled_from(CONTENT_TYPES),
    query=st.sampled_from(QUERIES),
    body=bodies,
)
def test_no_body_gets_a_5xx_in_process(path: str, content_type: str, query: str, body: bytes) -> None:
    headers = {"content_type": content_type} if content_type else {}
    res = call(APP, "POST", path + query, body, **headers)
    _check(res.status_code, res.headers.get("content-type", ""), res.content)


yaml_texts = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["true", "no", "~", "null", "0x1f", "1e3", "2026-11-30", "- a", "a: b", "#x", "'q'", '"', "%"]),
    st.text(alphabet="ab \n\t:#-'\"\\\u00e9\u2028\ufeff", max_size=100),
)
yaml_values = st.recursive(
    st.one_of(scalars, yaml_texts),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(yaml_texts, inner, max_size=4)),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.dictionaries(yaml_texts, yaml_values, max_size=6))
def test_the_previews_fast_yaml_reads_back_as_the_object(value: dict[str, Any]) -> None:
    """The YAML and diff outputs skip PyYAML's representer and write with libyaml's emitter, for speed:
    whatever the strings hold (quotes, escapes, look-alikes of numbers and booleans), it reads back as is."""
    assert yaml.safe_load(_yaml(value, {})) == value


plain_texts = st.text(alphabet=string.printable.translate({ord(c): None for c in "\t\r\x0b\x0c"}), max_size=200)
plain_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        plain_texts,
        st.sampled_from(["true", "no", "~", "null", "0x1f", "1e3", "2026-11-30", "- a", "a: b", "#x", "'q'", "%"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(string.printable[:94], min_size=1, max_size=100), inner)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.dictionaries(st.text(string.printable[:94], min_size=1, max_size=100), plain_values, max_size=6))
def test_the_previews_fast_yaml_writes_what_safe_dump_wrote(value: dict[str, Any]) -> None:
    """Byte for byte, for text that needs no escapes (what Kubernetes objects hold). libyaml differs from
    PyYAML's own emitter in corners only: `'': x` for `? ''`, and where a long escaped string folds."""
    assert _yaml(value, {}) == yaml.safe_dump(value, sort_keys=False, default_flow_style=False)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_the_real_server_survives_a_minute_of_hostile_bodies(tls_dir: Path, tmp_path: Path) -> None:
    """The same shapes through TLS and uvicorn; memory stays bounded and /healthz answers afterwards."""
    budget = time.monotonic() + 45
    sent = [0]
    with running_server(tls_dir, tmp_path / "srv") as server, server.client() as client:
        client.get("/healthz")
        start_rss = status_kb(server.process.pid)

        @settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(path=st.sampled_from(PATHS), content_type=st.sampled_from(CONTENT_TYPES), body=bodies)
        def send(path: str, content_type: str, body: bytes) -> None:
            if time.monotonic() > budget:
                return
            headers = {"content-type": content_type} if content_type else {}
            res = client.post(path, content=body, headers=headers)
            # A preview worker still being replaced (one stopped at its timeout) answers 503 with Retry-After,
            # as designed: a client waits as asked and sends again.
            for _ in range(10):
                if not (path == "/preview" and res.status_code == 503 and "retry-after" in res.headers):
                    break
                time.sleep(float(res.headers["retry-after"]))
                res = client.post(path, content=body, headers=headers)
            sent[0] += 1
            _check(res.status_code, res.headers.get("content-type", ""), res.content)

        send()
        end_rss = status_kb(server.process.pid)
        assert client.get("/healthz").status_code == 200
        assert server.process.poll() is None
    assert sent[0] > 100
    assert end_rss - start_rss < 60_000, f"RSS grew from {start_rss} KB to {end_rss} KB"
    assert "Traceback" not in server.output()


def test_hostile_requests_at_the_http_level_are_answered(tls_dir: Path, tmp_path: Path) -> None:
    """Methods, headers and lengths that are wrong rather than bodies."""
    with running_server(tls_dir, tmp_path / "srv") as server, server.client() as client:
        cases = [
            client.request("DELETE", "/mutate"),
            client.request("PUT", "/preview", content=b"{}"),
            client.post("/mutate", content=b"{}", headers={"content-type": "application/json; charset=utf-16"}),
            client.get("/" + "a" * 4000),
        ]
        for res in cases:
            _check(res.status_code, res.headers.get("content-type", ""), res.content)
        for garbage in RAW_REQUESTS:
            with (
                socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw,
                client_context(server.ca).wrap_socket(raw, server_hostname="localhost") as tls,
            ):
                tls.sendall(garbage)
                answer = b""
                with contextlib.suppress(OSError):
                    while chunk := tls.recv(65536):
                        answer += chunk
                # httptools refuses what it cannot parse with a bare 400 and a closed connection.
                assert answer == b"" or answer.startswith(b"HTTP/1.1 4"), answer[:200]
        assert client.get("/healthz").status_code == 200
    assert "Traceback" not in server.output()


METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
EVERY_PATH = [*ROUTES, *API_PATHS, "/static-offline-docs/swagger-ui.css", "/nope"]


def test_every_405_lists_methods_the_path_takes() -> None:
    """Every path under every method: no 5xx, and a 405's Allow names methods that are then not refused
    (it once said POST for FastAPI's GET pages)."""
    for path in EVERY_PATH:
        for method in METHODS:
            res = call(APP, method, path)
            assert res.status_code < 500, (method, path, res.text[:200])
            if res.status_code != 405:
                continue
            allow = res.headers["allow"]
            if method != "HEAD":  # an answer to HEAD has no body
                assert res.json() == {"error": f"{path} takes {allow}, not {method}"}
            for allowed in allow.split(", "):
                assert allowed != method
                assert call(APP, allowed, path).status_code != 405, (allowed, path)


# A head's shape: method, path, the number of filler headers, the size of one large value, an Upgrade.
heads = st.tuples(
    st.sampled_from(METHODS),
    st.sampled_from(EVERY_PATH),
    st.one_of(st.integers(0, 20), st.integers(90, 110), st.integers(200, 2000)),
    st.one_of(st.just(0), st.integers(1, 1000), st.integers(20_000, 40_000), st.integers(60_000, 300_000)),
    st.sampled_from(
        [b"", b"upgrade: websocket\r\nconnection: Upgrade\r\n", b"upgrade: h2c\r\nconnection: Upgrade\r\n"]
    ),
)


def _answer(conn: socket.socket, method: str) -> bytes:
    """The answer's head and body (Content-Length), or what came before the connection closed."""
    answer = b""
    with contextlib.suppress(OSError):
        while chunk := conn.recv(65536):
            answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            lengths = [int(line[15:]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
            if _ and (method == "HEAD" or (lengths and len(body) >= lengths[0])):
                break
    return answer


@pytest.mark.parametrize("port", ["admission", "metrics"])
def test_hostile_heads_are_answered_without_a_5xx(tls_dir: Path, tmp_path: Path, port: str) -> None:
    """Seeded heads with many headers, large ones and protocol upgrades, on the TLS port and the plain
    metrics port: a head over the bounds (100 fields, 32 KB) is 431; within them, it is routed; nothing
    is upgraded; no answer is a 5xx, and memory stays bounded."""
    metrics_port = free_port()
    config = f"server:\n  metricsPort: {metrics_port}\n"
    with running_server(tls_dir, tmp_path / "srv", config=config) as server:
        start_rss = status_kb(server.process.pid)

        def connect() -> socket.socket:
            if port == "metrics":
                return socket.create_connection(("127.0.0.1", metrics_port), timeout=10)
            raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            return client_context(server.ca).wrap_socket(raw, server_hostname="localhost")

        @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(head=heads)
        def send(head: tuple[str, str, int, int, bytes]) -> None:
            method, path, fields, big, upgrade = head
            request = (
                f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n".encode()
                + upgrade
                + b"".join(b"x-%d: v\r\n" % i for i in range(fields))
                + (b"x-big: " + b"a" * big + b"\r\n" if big else b"")
                + b"\r\n"
            )
            with connect() as conn:
                with contextlib.suppress(OSError):  # refused before it was all written: the answer tells
                    conn.sendall(request)
                answer = _answer(conn, method)
            status = int(answer[9:12]) if answer.startswith(b"HTTP/1.1 ") else 0
            too_many = fields + 2 + bool(upgrade) * 2 + bool(big) > 100
            assert status != 0 or too_many or big > 32_000, answer[:200]  # only a refusal may be cut short
            assert status < 500, answer[:300]
            assert not answer.startswith(b"HTTP/1.1 101")
            if too_many or len(request) > 40_000:
                assert status in (0, 431), answer[:200]
            elif len(request) < 30_000:
                assert status != 431, answer[:200]

        send()
        assert status_kb(server.process.pid) - start_rss < 30_000
        assert server.process.poll() is None
    assert "Traceback" not in server.output()
    assert " ERROR " not in server.output()


RAW_REQUESTS = [
    b"\x00\x01\x02garbage\r\n\r\n",
    b"POST /mutate HTTP/1.1\r\nhost: x\r\ncontent-length: x\r\n\r\n{}",
    b"POST /mutate HTTP/1.1\r\nno colon here\r\n\r\n",
    b"POST /mutate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    b"POST /mutate HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 200_000 + b"\r\n\r\n",
    b"GET /healthz HTTP/9.9\r\nhost: x\r\nconnection: close\r\n\r\n",
]
