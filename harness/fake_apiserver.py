"""A small HTTP server that speaks the Kubernetes list and watch protocol for nodes and namespaces, for
the real `kubernetes` client to talk to: paged lists with `continue` tokens and a list resourceVersion,
chunked watch streams of ADDED/MODIFIED/DELETED/BOOKMARK events, `410 Gone` for a compacted version,
dropped connections, malformed events, and merge-patches of node labels (for the labeller).

Single objects (Secrets, MutatingWebhookConfigurations) are created, read, replaced, JSON-patched and
deleted with optimistic concurrency; their collections are listed and watched with a
`metadata.name` field selector, as a webhook watching its own configuration does.

What it does not prove: authentication and RBAC (every request is allowed, unless `refuse` makes it
answer every read 401 or 403 as a real API server refusing the credentials or the permission), admission,
defaulting and validation of what is stored, server-side apply, and protobuf or Table encodings."""

from __future__ import annotations

import base64
import bisect
import copy
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import jsonpatch
import jsonpointer

TOKEN = "test-token"  # the bearer token of `write_kubeconfig`'s user


def write_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig whose current context, `fake`, reaches `url` with the bearer token TOKEN."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "fake", "user": {"token": TOKEN}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        "current-context": "fake",
    }
    path.write_text(json.dumps(config))
    return path


STORED = ("/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",)  # lists and watches of `store`

RESOURCES = {
    "/api/v1/nodes": ("Node", "NodeList"),
    "/api/v1/namespaces": ("Namespace", "NamespaceList"),
    "/api/v1/pods": ("Pod", "PodList"),  # all namespaces; pod names are unique across namespaces in the tests
}


# Discovery, as much of it as the clients here ask for: the real `kubernetes` client needs none, Helm (for
# `lookup` and the release store) maps kinds to resources through it. (kind, resource, namespaced)
GROUPS: dict[str, list[tuple[str, str, bool]]] = {
    "v1": [
        ("Namespace", "namespaces", False),
        ("Node", "nodes", False),
        ("Pod", "pods", True),
        ("Secret", "secrets", True),
        ("ConfigMap", "configmaps", True),
        ("Service", "services", True),
        ("ServiceAccount", "serviceaccounts", True),
    ],
    "admissionregistration.k8s.io/v1": [
        ("MutatingWebhookConfiguration", "mutatingwebhookconfigurations", False),
        ("ValidatingAdmissionPolicy", "validatingadmissionpolicies", False),
        ("ValidatingAdmissionPolicyBinding", "validatingadmissionpolicybindings", False),
    ],
    "apps/v1": [("Deployment", "deployments", True)],
    "cert-manager.io/v1": [("Certificate", "certificates", True), ("Issuer", "issuers", True)],  # its CRDs installed
    "batch/v1": [("Job", "jobs", True)],
    "policy/v1": [("PodDisruptionBudget", "poddisruptionbudgets", True)],
    "autoscaling/v2": [("HorizontalPodAutoscaler", "horizontalpodautoscalers", True)],
    "networking.k8s.io/v1": [("NetworkPolicy", "networkpolicies", True)],
    "rbac.authorization.k8s.io/v1": [
        ("ClusterRole", "clusterroles", False),
        ("ClusterRoleBinding", "clusterrolebindings", False),
        ("Role", "roles", True),
        ("RoleBinding", "rolebindings", True),
    ],
}
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


def discovery(path: str, version: str) -> dict[str, Any] | None:
    """/version, /api, /apis and each group version's resource list; None for any other path."""
    if path == "/version":
        major, minor = version.split(".")[:2]
        return {"major": major, "minor": minor, "gitVersion": f"v{version}", "platform": "linux/amd64"}
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
    if path == "/apis":
        versions: dict[str, list[dict[str, str]]] = {}
        for gv in GROUPS:
            if "/" in gv:
                versions.setdefault(gv.split("/")[0], []).append({"groupVersion": gv, "version": gv.split("/")[1]})
        groups = [{"name": g, "versions": v, "preferredVersion": v[0]} for g, v in sorted(versions.items())]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
    group_version = path.removeprefix("/apis/") if path.startswith("/apis/") else path.removeprefix("/api/")
    if group_version in GROUPS and path in (f"/api/{group_version}", f"/apis/{group_version}"):
        resources = [
            {"name": r, "singularName": k.lower(), "namespaced": ns, "kind": k, "verbs": VERBS}
            for k, r, ns in GROUPS[group_version]
        ]
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}
    return None


# The API server's Table rendering of a Node (kubernetes pkg/printers/internalversion/printers.go:
# nodeColumnDefinitions and printNode; the server always renders the wide columns).
NODE_COLUMNS: list[dict[str, Any]] = [
    {"name": "Name", "type": "string", "format": "name", "description": "Name must be unique.", "priority": 0},
    {"name": "Status", "type": "string", "format": "", "description": "The status of the node", "priority": 0},
    {"name": "Roles", "type": "string", "format": "", "description": "The roles of the node", "priority": 0},
    {"name": "Age", "type": "string", "format": "", "description": "CreationTimestamp.", "priority": 0},
    {"name": "Version", "type": "string", "format": "", "description": "Kubelet Version reported.", "priority": 0},
    {"name": "Internal-IP", "type": "string", "format": "", "description": "Addresses.", "priority": 1},
    {"name": "External-IP", "type": "string", "format": "", "description": "Addresses.", "priority": 1},
    {"name": "OS-Image", "type": "string", "format": "", "description": "OS Image reported.", "priority": 1},
    {"name": "Kernel-Version", "type": "string", "format": "", "description": "Kernel Version.", "priority": 1},
    {"name": "Container-Runtime", "type": "string", "format": "", "description": "Runtime version.", "priority": 1},
]
TABLE_TYPE = "as=Table"


def node_row(obj: dict[str, Any]) -> dict[str, Any]:
    """printNode: the cells of one Node and, includeObject=Metadata (the default), its metadata."""
    metadata = obj.get("metadata") or {}
    status = obj.get("status") or {}
    info = status.get("nodeInfo") or {}
    ready = {c.get("type"): c.get("status") for c in status.get("conditions") or ()}.get("Ready")
    state = "Unknown" if ready is None else ("Ready" if ready == "True" else "NotReady")
    if (obj.get("spec") or {}).get("unschedulable"):
        state += ",SchedulingDisabled"
    labels = metadata.get("labels") or {}
    roles = {k.removeprefix("node-role.kubernetes.io/") for k in labels if k.startswith("node-role.kubernetes.io/")}
    roles |= {labels["kubernetes.io/role"]} if labels.get("kubernetes.io/role") else set()
    roles.discard("")

    def address(kind: str) -> str:
        return next((a["address"] for a in status.get("addresses") or () if a.get("type") == kind), "<none>")

    cells = [
        metadata.get("name", ""),
        state,
        ",".join(sorted(roles)) or "<none>",
        "30d" if metadata.get("creationTimestamp") else "<unknown>",
        info.get("kubeletVersion", ""),
        address("InternalIP"),
        address("ExternalIP"),
        info.get("osImage") or "<unknown>",
        info.get("kernelVersion") or "<unknown>",
        info.get("containerRuntimeVersion") or "<unknown>",
    ]
    return {
        "cells": cells,
        "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": metadata},
    }


def is_collection(path: str) -> bool:
    """A collection of a resource discovery lists: /api/v1/secrets-like paths, namespaced or not."""
    parts = path.strip("/").split("/")
    group_version = parts[1] if parts[:1] == ["api"] else "/".join(parts[1:3])
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if len(rest) == 3 and rest[0] == "namespaces":
        rest = rest[2:]
    return len(rest) == 1 and any(r == rest[0] for _k, r, _ns in GROUPS.get(group_version, ()))


def _labels_match(obj: dict[str, Any], selector: str) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    pairs = [term.split("=", 1) for term in selector.split(",") if term]
    return all(labels.get(key) == value for key, value in pairs)


def refusal(code: int, path: str) -> dict[str, Any]:
    """The Status a real API server answers a request it refuses: 401 for credentials it does not accept
    (its message is just the reason), 403 for a user it does not permit."""
    if code == 401:
        reason, message = "Unauthorized", "Unauthorized"
    else:
        resource = path.rstrip("/").rsplit("/", 1)[-1]
        reason = "Forbidden"
        who = f'User "fake" cannot list resource "{resource}" in API group "" at the cluster scope'
        message = f"{resource} is forbidden: {who}"
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeAPIServer:
    def __init__(self, version: str = "1.33.0") -> None:
        self.version = version  # what /version says
        self.objects: dict[str, dict[str, dict[str, Any]]] = {path: {} for path in RESOURCES}
        self.events: list[tuple[int, str, str, dict[str, Any] | bytes]] = []  # (rv, path, type, object)
        self.event_rvs: list[int] = []  # the events' resourceVersions, for a watch to find its place
        self.max_events: int | None = None  # keep this many events at most; older ones are compacted away
        self.delivered: dict[str, int] = {}  # watch events written, by path
        self.rv = 100
        self.compacted = 0  # versions at or below this are gone
        self.cond = threading.Condition()
        self.requests: list[str] = []
        self.generation = 0  # bumped to drop every open watch
        self.fail_lists = 0  # answer this many list requests with 500 first
        self.refuse: int | None = None  # answer every GET with this status (REFUSALS)
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.expire_next_continue = False  # answer the next continued list with 410, as after etcd compaction
        self.snapshots: dict[str, list[dict[str, Any]]] = {}
        # Single objects by URL path (Secrets, MutatingWebhookConfigurations), with optimistic concurrency.
        self.store: dict[str, dict[str, Any]] = {}
        self.writes: list[str] = []
        self.encoded: dict[str, dict[str, bytes]] = {path: {} for path in RESOURCES}
        self.encoded_rows: dict[str, dict[str, bytes]] = {path: {} for path in RESOURCES}  # nodes as Table rows
        self.sent: dict[str, int] = {}  # list bytes sent, by "path" or "path as Table"
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    # --- lifecycle and kubeconfig -------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeAPIServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.drop_watches()
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, path: Path) -> Path:
        return write_kubeconfig(path, self.url)

    # --- state changes, each recorded as a watch event -----------------------------------------------
    def _record(self, path: str, kind: str, obj: dict[str, Any] | bytes, owned: bool = False) -> None:
        """`owned`: the caller hands the object over (no copy is taken)."""
        self.rv += 1
        if isinstance(obj, dict):
            obj = obj if owned else copy.deepcopy(obj)
            obj["metadata"] = dict(obj.get("metadata") or {})
            obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
            name = obj["metadata"]["name"]
            if kind == "DELETED":
                self.objects[path].pop(name, None)
                self.encoded[path].pop(name, None)
                self.encoded_rows[path].pop(name, None)
            else:
                self.objects[path][name] = obj
                self.encoded[path].pop(name, None)  # encoded again at the next list that needs it
                self.encoded_rows[path].pop(name, None)
        self._append((self.rv, path, kind, obj))

    def _encoded(self, path: str, obj: dict[str, Any], table: bool) -> bytes:
        """An object as a list item, or as a Table row, serialised once per version."""
        cache = self.encoded_rows[path] if table else self.encoded[path]
        name = obj["metadata"]["name"]
        current = self.objects[path].get(name) is obj
        data = cache.get(name) if current else None
        if data is None:
            data = json.dumps(node_row(obj) if table else obj).encode()
            if current:
                cache[name] = data
        return data

    def _append(self, event: tuple[int, str, str, dict[str, Any] | bytes]) -> None:
        """Record a watch event (caller holds the lock); past max_events the older half is compacted away,
        as etcd does: a watch that has fallen behind it gets 410 Gone."""
        self.events.append(event)
        self.event_rvs.append(event[0])
        if self.max_events is not None and len(self.events) > self.max_events:
            half = len(self.events) // 2
            self.compacted = max(self.compacted, self.event_rvs[half - 1])
            del self.events[:half], self.event_rvs[:half]
        self.cond.notify_all()

    def save(self, path: str, obj: dict[str, Any] | None, action: str) -> None:
        """Store (None: delete) a single object at a new resourceVersion (caller holds the lock), log the
        write, and tell the watchers of its collection."""
        self.rv += 1
        if obj is None:
            obj = self.store.pop(path)
            kind = "DELETED"
        else:
            kind = "MODIFIED" if path in self.store else "ADDED"
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.store[path] = obj
        self.writes.append(f"{action} {path}")
        collection = path.rsplit("/", 1)[0]
        if collection in STORED:
            self._append((self.rv, collection, kind, copy.deepcopy(obj)))
        self.cond.notify_all()

    def edit(self, path: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Change a stored object as another client would (kubectl edit): a new version and a watch event."""
        with self.cond:
            obj = copy.deepcopy(self.store[path])
            change(obj)
            self.save(path, obj, "edit")

    def put(self, path: str, obj: dict[str, Any]) -> None:
        with self.cond:
            exists = obj["metadata"]["name"] in self.objects[path]
            self._record(path, "MODIFIED" if exists else "ADDED", obj)

    def delete(self, path: str, name: str) -> None:
        with self.cond:
            self._record(path, "DELETED", self.objects[path][name])

    def put_many(self, path: str, objs: list[dict[str, Any]]) -> None:
        """Objects present before anyone lists: no events (a compacted history)."""
        with self.cond:
            for obj in objs:
                self.rv += 1
                obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
                self.objects[path][obj["metadata"]["name"]] = obj
                self._encoded(path, obj, table=False)  # serialised now, not during the first list
                if path == "/api/v1/nodes":
                    self._encoded(path, obj, table=True)
            self.compacted = self.rv

    def malformed(self, path: str, raw: bytes) -> None:
        with self.cond:
            self._record(path, "RAW", raw)

    def bookmark(self, path: str) -> None:
        with self.cond:
            self.rv += 1
            self._append(
                (self.rv, path, "BOOKMARK", {"kind": RESOURCES[path][0], "metadata": {"resourceVersion": str(self.rv)}})
            )

    def compact(self) -> None:
        """Forget history: a watch from an older version gets 410 Gone."""
        with self.cond:
            self.compacted = self.rv

    def drop_watches(self) -> None:
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def count(self, needle: str) -> int:
        return sum(needle in r for r in self.requests)

    # --- HTTP --------------------------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> Any:
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")

            def _conflict(self, message: str) -> None:
                self._json(409, {"kind": "Status", "code": 409, "reason": "Conflict", "message": message})

            def do_POST(self) -> None:
                api.requests.append("POST " + self.path)
                body = self._body()
                path = urlparse(self.path).path + "/" + body["metadata"]["name"]
                with api.cond:
                    if path in api.store:
                        self._json(409, {"kind": "Status", "code": 409, "reason": "AlreadyExists"})
                        return
                    api.save(path, body, "create")
                self._json(201, body)

            def do_PUT(self) -> None:
                api.requests.append("PUT " + self.path)
                path, body = urlparse(self.path).path, self._body()
                with api.cond:
                    current = api.store.get(path)
                    if current is None:
                        self._json(404, {"kind": "Status", "code": 404})
                        return
                    if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                        self._conflict("the object has been modified; please apply your changes to the latest version")
                        return
                    api.save(path, body, "update")
                self._json(200, body)

            def do_GET(self) -> None:
                url = urlparse(self.path)
                api.requests.append(self.path)
                if api.refuse is not None:
                    self._json(api.refuse, refusal(api.refuse, url.path))
                    return
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                if url.path in api.store:
                    self._json(200, api.store[url.path])
                    return
                if url.path == "/openapi/v2":
                    # An empty OpenAPI document: clients that validate against it (Helm) find no schema
                    # and skip; the tests validate every object against the real schemas themselves.
                    self.send_response(200)
                    self.send_header("Content-Type", "application/com.github.proto-openapi.spec.v2.v1.0+protobuf")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                found = discovery(url.path, api.version)
                if found is not None:
                    self._json(200, found)
                    return
                path, namespace = url.path, None
                parts = url.path.split("/")  # /api/v1/namespaces/<ns>/pods: the pods of one namespace
                if len(parts) == 6 and parts[3] == "namespaces" and parts[5] == "pods":
                    path, namespace = "/api/v1/pods", parts[4]
                if path in STORED or (path not in RESOURCES and is_collection(path)):
                    self._stored(path, query)
                    return
                if path not in RESOURCES:
                    self._json(404, {"kind": "Status", "code": 404})
                    return
                if query.get("watch") in ("true", "1"):
                    self._watch(path, query)
                else:
                    self._list(path, query, namespace)

            def _list(self, path: str, query: dict[str, str], namespace: str | None = None) -> None:
                with api.cond:
                    if api.fail_lists > 0:
                        api.fail_lists -= 1
                        self._json(500, {"kind": "Status", "code": 500, "message": "etcd is having a bad day"})
                        return
                    token = query.get("continue")
                    if token:
                        rv, offset = json.loads(base64.b64decode(token))
                        if api.expire_next_continue:
                            api.expire_next_continue = False
                            self._json(
                                410, {"kind": "Status", "code": 410, "reason": "Expired", "message": "continue expired"}
                            )
                            return
                        items = api.snapshots[path]
                    else:
                        rv, offset = api.rv, 0
                        items = [
                            o
                            for _, o in sorted(api.objects[path].items())
                            if namespace is None or o["metadata"].get("namespace") == namespace
                        ]
                        api.snapshots[path] = items
                    limit = int(query.get("limit") or 0) or len(items)
                    page = items[offset : offset + limit]
                    meta: dict[str, Any] = {"resourceVersion": str(rv)}
                    if offset + limit < len(items):
                        meta["continue"] = base64.b64encode(json.dumps([rv, offset + limit]).encode()).decode()
                _kind, list_kind = RESOURCES[path]
                # Objects are serialised once, when stored: a 5,000-node list must not be bound by this server.
                if self._table(path):
                    head = json.dumps(
                        {
                            "kind": "Table",
                            "apiVersion": "meta.k8s.io/v1",
                            "metadata": meta,
                            "columnDefinitions": NODE_COLUMNS,
                        }
                    ).encode()[:-1]
                    data = head + b', "rows": [' + b",".join(api._encoded(path, o, True) for o in page) + b"]}"
                    key = path + " as Table"
                else:
                    head = json.dumps({"kind": list_kind, "apiVersion": "v1", "metadata": meta}).encode()[:-1]
                    data = head + b', "items": [' + b",".join(api._encoded(path, o, False) for o in page) + b"]}"
                    key = path
                api.sent[key] = api.sent.get(key, 0) + len(data)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _table(self, path: str) -> bool:
                """Did the client ask for the Table rendering (nodes only here)?"""
                return path == "/api/v1/nodes" and TABLE_TYPE in (self.headers.get("Accept") or "")

            def _stored(self, path: str, query: dict[str, str]) -> None:
                """List or watch a collection of single objects, narrowed by `fieldSelector=metadata.name=X`."""
                selector = query.get("fieldSelector", "")
                name = selector.removeprefix("metadata.name=") if selector.startswith("metadata.name=") else None
                if selector and name is None:
                    self._json(400, {"kind": "Status", "code": 400, "message": f"unsupported selector {selector}"})
                    return
                if query.get("watch") in ("true", "1"):
                    self._watch(path, query, name)
                    return
                with api.cond:
                    items = [
                        obj
                        for p, obj in sorted(api.store.items())
                        if p.rsplit("/", 1)[0] == path
                        and name in (None, obj["metadata"]["name"])
                        and _labels_match(obj, query.get("labelSelector", ""))
                    ]
                    meta = {"resourceVersion": str(api.rv)}
                resource = path.rsplit("/", 1)[-1]
                kind = next(k for kinds in GROUPS.values() for k, r, _ns in kinds if r == resource)
                self._json(200, {"kind": f"{kind}List", "apiVersion": "v1", "metadata": meta, "items": items})

            def _watch(self, path: str, query: dict[str, str], name: str | None = None) -> None:
                since = int(query.get("resourceVersion") or 0)
                timeout = float(query.get("timeoutSeconds") or 30)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                deadline = time.monotonic() + timeout
                with api.cond:
                    generation = api.generation
                table = self._table(path)
                headers = True  # a Table watch sends the column definitions with its first event only
                sent = since
                while True:
                    with api.cond:  # take what is new under the lock; write it without holding it
                        if api.generation != generation or time.monotonic() >= deadline:
                            break
                        if sent < api.compacted:  # never had, or fell behind, what is still kept
                            status = {
                                "kind": "Status",
                                "code": 410,
                                "reason": "Expired",
                                "message": "too old resource version",
                            }
                            self._chunk(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
                            break
                        pending = api.events[bisect.bisect_right(api.event_rvs, sent) :]
                        if not pending:
                            api.cond.wait(timeout=0.1)
                            continue
                        sent = pending[-1][0]
                    written = 0
                    for rv, p, kind, obj in pending:
                        if p != path or (
                            name is not None and isinstance(obj, dict) and obj["metadata"]["name"] != name
                        ):
                            continue
                        if kind == "RAW":
                            line = obj if isinstance(obj, bytes) else b""
                        elif table and isinstance(obj, dict):
                            as_table = {
                                "kind": "Table",
                                "apiVersion": "meta.k8s.io/v1",
                                "metadata": {"resourceVersion": str(rv)},
                                "columnDefinitions": NODE_COLUMNS if headers else None,
                                "rows": [node_row(obj)],
                            }
                            headers = False
                            line = json.dumps({"type": kind, "object": as_table}).encode()
                        else:
                            line = json.dumps({"type": kind, "object": obj}).encode()
                        self._chunk(line + b"\n")
                        written += 1
                    with api.cond:
                        api.delivered[path] = api.delivered.get(path, 0) + written
                dropped = api.generation != generation
                if dropped:
                    self.close_connection = True
                    self.connection.close()  # mid-stream, without the closing chunk: a dropped connection
                    return
                self._end()

            def _json_patch(self, path: str, ops: list[dict[str, Any]]) -> None:
                if self.headers.get("Content-Type") != "application/json-patch+json":
                    self._json(415, {"kind": "Status", "code": 415})
                    return
                with api.cond:
                    try:
                        patched = jsonpatch.apply_patch(api.store[path], ops)
                    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                        status = {"kind": "Status", "code": 422, "reason": "Invalid", "message": str(exc)}
                        self._json(422, status)
                        return
                    api.save(path, patched, "patch")
                self._json(200, patched)

            def _chunk(self, data: bytes) -> None:
                try:
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
                except OSError:
                    pass

            def _end(self) -> None:
                try:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except OSError:
                    pass

            def do_DELETE(self) -> None:
                path = urlparse(self.path).path
                api.requests.append("DELETE " + self.path)
                with api.cond:
                    if path not in api.store:
                        self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                        return
                    api.save(path, None, "delete")
                self._json(200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200})

            def do_PATCH(self) -> None:
                url = urlparse(self.path)
                api.requests.append("PATCH " + self.path)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if url.path in api.store:
                    self._json_patch(url.path, body)
                    return
                name = url.path.rsplit("/", 1)[-1]
                path = url.path.rsplit("/", 1)[0]
                with api.cond:
                    if path not in RESOURCES or name not in api.objects[path]:
                        self._json(404, {"kind": "Status", "code": 404})
                        return
                    obj = copy.deepcopy(api.objects[path][name])
                    labels = obj["metadata"].setdefault("labels", {})
                    for key, value in body.get("metadata", {}).get("labels", {}).items():
                        if value is None:
                            labels.pop(key, None)
                        else:
                            labels[key] = value
                    api.patches.append((name, body))
                    api._record(path, "MODIFIED", obj)
                    result = api.objects[path][name]
                self._json(200, result)

        return Handler


def node(name: str, runtime: str = "containerd://1.7.11", labels: dict[str, str] | None = None,
         annotations: dict[str, str] | None = None, images: int = 50) -> dict[str, Any]:  # fmt: skip
    """A realistic Node: the image list, conditions, addresses and capacity a kubelet reports, and the
    managed fields the API server records of them."""
    conditions = [
        {"type": t, "status": "False" if t != "Ready" else "True", "lastHeartbeatTime": "2026-11-30T03:00:00Z",
         "lastTransitionTime": "2026-11-01T00:00:00Z", "reason": f"Kubelet{t}", "message": f"kubelet reports {t}"}
        for t in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
    ]  # fmt: skip
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", **(annotations or {})},
        },
        "spec": {
            "podCIDR": "10.244.1.0/24",
            "podCIDRs": ["10.244.1.0/24"],
            "providerID": f"aws:///eu-west-1a/i-{name}",
        },
        "status": {
            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "allocatable": {"cpu": "7910m", "memory": "31Gi", "pods": "110"},
            "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}, {"type": "Hostname", "address": name}],
            "nodeInfo": {
                "machineID": "m" * 32,
                "systemUUID": "u" * 36,
                "bootID": "b" * 36,
                "kernelVersion": "6.1.0",
                "osImage": "Debian GNU/Linux 12",
                "containerRuntimeVersion": runtime,
                "kubeletVersion": "v1.30.2",
                "kubeProxyVersion": "v1.30.2",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
            "images": [
                {
                    "names": [
                        f"registry.example.com/team-{i % 7}/service-{i}@sha256:{i:064x}",
                        f"registry.example.com/team-{i % 7}/service-{i}:v1.{i}.0",
                    ],
                    "sizeBytes": 123456789 + i,
                }
                for i in range(images)
            ],
        },
    }
    obj["metadata"]["managedFields"] = managed_fields(obj)
    return obj


def _fields(value: Any, keys: dict[str, str]) -> dict[str, Any]:
    """Server-side apply's FieldsV1 set of what `value` holds: maps field by field, the lists keyed by a
    merge key (addresses and conditions by type) item by item, sets by value, other lists whole."""
    if not isinstance(value, dict):
        return {}
    fields: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(item, dict):
            fields[f"f:{key}"] = {".": {}, **_fields(item, keys)} if key in MAPS else _fields(item, keys)
        elif isinstance(item, list) and key in SETS:
            fields[f"f:{key}"] = {".": {}, **{f"v:{json.dumps(v)}": {} for v in item}}
        elif isinstance(item, list) and key in keys:
            merge = keys[key]
            entries = {
                f"k:{json.dumps({merge: e[merge]}, separators=(',', ':'))}": {".": {}, **_fields(e, keys)} for e in item
            }
            fields[f"f:{key}"] = {".": {}, **entries}
        else:
            fields[f"f:{key}"] = {}
    return fields


MAPS = {"labels", "annotations", "capacity", "allocatable"}  # fields the API server tracks as a whole map too
SETS = {"podCIDRs"}  # lists whose items are their own keys


def managed_fields(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """What the API server records of a Node created (metadata and spec) and then given its status, as a
    kubelet registers one; real Table rows carry it in each row's metadata (tests/test_fake_fidelity.py)."""
    keys = {"addresses": "type", "conditions": "type"}
    common = {"manager": "kubelet", "operation": "Update", "apiVersion": "v1", "time": "2026-11-01T00:00:00Z"}
    created = {"f:metadata": _fields({k: v for k, v in obj["metadata"].items() if k in MAPS}, keys)}
    if obj.get("spec"):
        created["f:spec"] = _fields(obj["spec"], keys)
    status = {"f:status": _fields(obj.get("status") or {}, keys)}
    return [
        {**common, "fieldsType": "FieldsV1", "fieldsV1": created},
        {**common, "fieldsType": "FieldsV1", "fieldsV1": status, "subresource": "status"},
    ]


def namespace(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name, **(labels or {})}},
    }
