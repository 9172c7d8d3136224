"""The fake API server (harness/fake_apiserver.py) stays only where it answers as the real kube-apiserver
does: each test here sends the same requests to both and compares what the caches, `certs ensure` and the
keeper read. The fake is kept for what the real server cannot be made to do on demand (drop a watch
mid-stream, fail a list with 500, expire one continue token, hold 65,000 nodes in a benchmark) and for
speed; what it stands in for is checked against the real thing here."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from harness.controlplane import ControlPlane
from harness.fake_apiserver import FakeAPIServer, node
from harness.kube_api import Kube, Obj, mwc_path

TABLE = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}
AGE = 3  # printNode's Age column: the fake cannot know how old a node is
NODES = ("fid-a", "fid-b", "fid-c")


@dataclass
class Backend:
    name: str
    http: httpx.Client
    add_node: Callable[[Obj], None]
    compact: Callable[[], None]
    store_mwc: Callable[[Obj], None]


def _real(plane: ControlPlane, kube: Kube) -> Backend:
    def add_node(obj: Obj) -> None:
        metadata = {k: v for k, v in obj["metadata"].items() if k in ("name", "labels", "annotations")}
        kube.create("/api/v1/nodes", {"metadata": metadata, "spec": obj["spec"]})
        kube.patch(f"/api/v1/nodes/{obj['metadata']['name']}/status", {"status": obj["status"]})

    def store_mwc(obj: Obj) -> None:
        kube.create("/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations", obj)

    def compact() -> None:
        # A watch resumes from the API server's watch cache, which keeps history etcd has compacted away:
        # the real 410 comes once both are gone (a restarted API server fills its cache from now on).
        plane.compact_etcd()
        plane.restart_apiserver()

    return Backend("real", kube.http, add_node, compact, store_mwc)


def _fake(api: FakeAPIServer) -> Backend:
    def store_mwc(obj: Obj) -> None:
        api.store[mwc_path(obj["metadata"]["name"])] = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}

    http = httpx.Client(base_url=api.url, timeout=30)
    return Backend("fake", http, lambda obj: api.put("/api/v1/nodes", obj), api.compact, store_mwc)


@pytest.fixture
def backends(kube: ControlPlane, kube_admin: Kube, api: FakeAPIServer) -> Iterator[list[Backend]]:
    both = [_real(kube, kube_admin), _fake(api)]
    for backend in both:
        for name in NODES:
            backend.add_node(node(name, "containerd://1.7.11", {"pool": "fidelity"}))
    yield both
    for name in NODES:
        kube_admin.delete(f"/api/v1/nodes/{name}")
    both[1].http.close()


def _fidelity_rows(table: Obj) -> dict[str, Obj]:
    return {row["cells"][0]: row for row in table["rows"] if row["cells"][0] in NODES}


def test_the_node_table_is_rendered_alike(backends: list[Backend]) -> None:
    seen = {}
    for backend in backends:
        table = backend.http.get("/api/v1/nodes", params={"includeObject": "Metadata"}, headers=TABLE).json()
        columns = [(c["name"], c["type"], c["format"], c["priority"]) for c in table["columnDefinitions"]]
        rows = _fidelity_rows(table)
        cells = {name: row["cells"][:AGE] + row["cells"][AGE + 1 :] for name, row in rows.items()}
        objects = {(r["object"]["kind"], r["object"]["apiVersion"]) for r in rows.values()}
        metadata_keys = {key for r in rows.values() for key in r["object"]["metadata"]}
        managed = [
            [(m["operation"], m.get("subresource"), m["fieldsV1"]) for m in r["object"]["metadata"]["managedFields"]]
            for r in rows.values()
        ]
        kept = metadata_keys - {"creationTimestamp", "uid"}
        seen[backend.name] = (table["kind"], columns, cells, objects, kept, managed)
    assert seen["fake"] == seen["real"]


def test_a_paged_list_continues_alike(backends: list[Backend]) -> None:
    seen = {}
    for backend in backends:
        params = {"limit": "2", "labelSelector": "pool=fidelity"}
        first = backend.http.get("/api/v1/nodes", params=params).json()
        second = backend.http.get("/api/v1/nodes", params={**params, "continue": first["metadata"]["continue"]})
        pages = [[o["metadata"]["name"] for o in page["items"]] for page in (first, second.json())]
        seen[backend.name] = (pages, "continue" in second.json()["metadata"])
    assert seen["fake"] == seen["real"] == ([["fid-a", "fid-b"], ["fid-c"]], False)


def _events(http: httpx.Client, params: dict[str, str], headers: dict[str, str]) -> list[Obj]:
    with http.stream("GET", "/api/v1/nodes", params={**params, "watch": "true"}, headers=headers) as stream:
        return [json.loads(line) for line in stream.iter_lines() if line]


def test_a_table_watch_sends_column_definitions_with_its_first_event_only(backends: list[Backend]) -> None:
    seen = {}
    for backend in backends:
        listed = backend.http.get("/api/v1/nodes", headers=TABLE).json()
        for name in ("fid-w1", "fid-w2"):
            backend.add_node(node(name, "docker://24.0.7"))
        params = {"resourceVersion": listed["metadata"]["resourceVersion"], "timeoutSeconds": "2"}
        events = [
            e for e in _events(backend.http, params, TABLE) if e["object"]["rows"][0]["cells"][0].startswith("fid-w")
        ]
        # (the real server sends ADDED then MODIFIED for a node created, then given its status)
        headers = [e["object"]["columnDefinitions"] is not None for e in events]
        seen[backend.name] = (events[0]["type"], {e["object"]["kind"] for e in events}, headers[0], any(headers[1:]))
    assert seen["fake"] == seen["real"] == ("ADDED", {"Table"}, True, False)


def test_a_watch_from_a_compacted_version_ends_with_410_expired(backends: list[Backend], kube_admin: Kube) -> None:
    seen = {}
    for backend in backends:
        old = backend.http.get("/api/v1/nodes").json()["metadata"]["resourceVersion"]
        backend.add_node(node("fid-late", "docker://24.0.7"))
        backend.compact()
        events = _events(backend.http, {"resourceVersion": old, "timeoutSeconds": "2"}, {})
        errors = [e["object"] for e in events if e["type"] == "ERROR"]
        seen[backend.name] = [(s["kind"], s["code"], s["reason"]) for s in errors]
    kube_admin.delete("/api/v1/nodes/fid-late")
    assert seen["fake"] == seen["real"] == [("Status", 410, "Expired")]


def _webhook_configuration(name: str) -> Obj:
    hook = {
        "name": "fidelity.tests.example",
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "clientConfig": {"url": "https://127.0.0.1:1/", "caBundle": base64.b64encode(b"x").decode()},
    }
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": name}, "webhooks": [hook]}  # fmt: skip


def test_webhook_configurations_by_name_and_conditional_patches_alike(
    backends: list[Backend], kube_admin: Kube
) -> None:
    seen: dict[str, Any] = {}
    for backend in backends:
        for name in ("fid-mwc", "fid-other"):
            backend.store_mwc(_webhook_configuration(name))
        collection = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
        listed = backend.http.get(collection, params={"fieldSelector": "metadata.name=fid-mwc"}).json()
        stale = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": "999999999"},
            {"op": "replace", "path": "/webhooks/0/clientConfig/caBundle", "value": "eQ=="},
        ]
        current = listed["items"][0]["metadata"]["resourceVersion"]
        fresh = [{**stale[0], "value": current}, stale[1]]
        codes = []
        for ops in (stale, fresh):
            answer = backend.http.patch(
                mwc_path("fid-mwc"), content=json.dumps(ops), headers={"Content-Type": "application/json-patch+json"}
            )
            codes.append(answer.status_code)
        seen[backend.name] = ([o["metadata"]["name"] for o in listed["items"]], codes)
    for name in ("fid-mwc", "fid-other"):
        kube_admin.delete(mwc_path(name))
    assert seen["fake"] == seen["real"]
