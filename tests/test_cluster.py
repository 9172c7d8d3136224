"""The node and namespace caches, driven by the real `kubernetes` client against a server that speaks
the list and watch protocol (harness/fake_apiserver.py)."""

from __future__ import annotations

import copy
import gc
import logging
import re
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from kubernetes.client import CoreV1Api
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import MaxRetryError, NewConnectionError, ProtocolError, ReadTimeoutError

from harness.environment import eventually
from harness.fake_apiserver import TOKEN, FakeAPIServer, namespace, node, write_kubeconfig
from webhook.cluster.access import ClusterView, api_client, client_without_retries, load_configuration
from webhook.cluster.errors import ClusterAccessError, EnsureError, described, failure
from webhook.cluster.informer import RELIST_SHARE, YIELD_EVERY, Informer, list_pages, relist_rest
from webhook.cluster.nodes import project_node
from webhook.config import ClusterSettings
from webhook.mutation.runtime import CRI_SOCKET_ANNOTATION

NODES, NAMESPACES = "/api/v1/nodes", "/api/v1/namespaces"


def _view(api: FakeAPIServer, tmp_path: Path, **options: Any) -> ClusterView:
    client = api_client(ClusterSettings(kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig"))))
    assert client is not None
    options = {"watch_seconds": 2, "backoff": (0.05, 0.2), **options}
    return ClusterView(client, **options)


@pytest.fixture
def view(api: FakeAPIServer, tmp_path: Path) -> Iterator[ClusterView]:
    cluster = _view(api, tmp_path, page_size=50)
    yield cluster
    cluster.stop()


def _runtimes(view: ClusterView) -> dict[str, int]:
    return view.nodes.by_runtime()


def test_paged_list_projects_every_node_and_then_reports_ready(api: FakeAPIServer, view: ClusterView) -> None:
    api.put_many(NODES, [node(f"n{i:03d}") for i in range(120)])
    api.put_many(NODES, [node("k3s-1", "containerd://1.7.7-k3s1.27"), node("old", "docker://24.0.7")])
    api.put_many(NAMESPACES, [namespace("flyte", {"pod-security.kubernetes.io/enforce": "baseline", "team": "ml"})])
    assert view.readiness() == "node and namespace cache not synced yet"
    assert view("flyte").node_state == "unsynced"
    view.start()
    assert view.nodes.informer.wait_synced(10)
    assert eventually(lambda: view.readiness() is None)
    assert _runtimes(view) == {"containerd": 121, "docker": 1}
    assert api.count("/api/v1/nodes?limit=50") == 1
    assert api.count("continue=") == 2  # 122 nodes in pages of 50
    facts = view.nodes.snapshot.nodes["k3s-1"]
    assert (facts.flavour, facts.distro) == ("containerd", "k3s")
    cluster = view("flyte")
    assert cluster.node_state == "synced"
    assert cluster.namespace_labels == {"pod-security.kubernetes.io/enforce": "baseline"}  # nothing else kept


def test_watch_events_bookmarks_and_resume(api: FakeAPIServer, view: ClusterView) -> None:
    api.put_many(NODES, [node("a"), node("b")])
    view.start()
    assert view.nodes.informer.wait_synced(10)
    api.put(NODES, node("c", "cri-o://1.28.0"))
    api.put(NODES, node("a", "docker://24.0.7"))
    api.delete(NODES, "b")
    assert eventually(lambda: _runtimes(view) == {"cri-o": 1, "docker": 1})
    api.bookmark(NODES)
    bookmark = str(api.rv)
    assert eventually(lambda: view.nodes.informer.resource_version == bookmark)
    # The next watch (after the 2 s timeout) resumes from the bookmark, without relisting.
    assert eventually(lambda: api.count(f"nodes?allowWatchBookmarks=true&resourceVersion={bookmark}") >= 1, 6)
    assert view.nodes.informer.relists == 0
    assert api.count("/api/v1/nodes?limit=") == 1


def test_a_dropped_connection_resumes_without_losing_events(api: FakeAPIServer, view: ClusterView) -> None:
    api.put_many(NODES, [node("a")])
    view.start()
    assert view.nodes.informer.wait_synced(10)
    api.drop_watches()
    api.put(NODES, node("during-the-gap", "docker://24.0.7"))
    assert eventually(lambda: "during-the-gap" in view.nodes.snapshot.nodes)
    assert view.nodes.informer.relists == 0


def test_gone_relists_and_catches_up(api: FakeAPIServer, view: ClusterView) -> None:
    api.put_many(NODES, [node("a"), node("b")])
    view.start()
    assert view.nodes.informer.wait_synced(10)
    with api.cond:
        api.objects[NODES].pop("b")  # changes the watch never delivers: history is compacted past them
        api.encoded[NODES].pop("b")
        api.rv += 5
    api.compact()
    api.drop_watches()
    assert eventually(lambda: view.nodes.informer.relists >= 1)
    assert eventually(lambda: set(view.nodes.snapshot.nodes) == {"a"})
    assert api.count("/api/v1/nodes?limit=") == 2


def test_an_expired_continue_token_restarts_the_list(api: FakeAPIServer, tmp_path: Path) -> None:
    api.put_many(NODES, [node(f"n{i}") for i in range(30)])
    api.expire_next_continue = True
    cluster = _view(api, tmp_path, page_size=10)
    try:
        cluster.start()
        assert cluster.nodes.informer.wait_synced(10)
        assert len(cluster.nodes.snapshot.nodes) == 30
        assert api.count("/api/v1/nodes?limit=10") == 2  # the first attempt hit 410 on page 2
    finally:
        cluster.stop()


def test_failing_lists_back_off_then_sync(api: FakeAPIServer, view: ClusterView) -> None:
    api.put_many(NODES, [node("a")])
    api.fail_lists = 3
    view.start()
    assert view.nodes.informer.wait_synced(10)
    assert api.count("limit=") >= 4


def test_malformed_events_are_skipped_without_losing_the_cache(api: FakeAPIServer, view: ClusterView) -> None:
    api.put_many(NODES, [node("a"), node("b")])
    view.start()
    assert view.nodes.informer.wait_synced(10)
    api.malformed(NODES, b"{not json")
    api.malformed(NODES, b'{"type": "ADDED"}')
    api.malformed(NODES, b'{"type": "ADDED", "object": {"metadata": {}}}')
    api.malformed(NODES, b'{"type": "SURPRISE", "object": {"metadata": {"name": "x"}}}')
    api.put(NODES, node("c", "docker://24.0.7"))
    assert eventually(lambda: _runtimes(view) == {"containerd": 2, "docker": 1})
    assert view.nodes.informer.skipped_events == 4
    assert view.nodes.informer.relists == 0


def test_a_node_whose_cri_socket_annotation_is_not_a_string_is_skipped(api: FakeAPIServer, view: ClusterView) -> None:
    """A server that does not hold annotations to strings: the node is skipped, in a list and in a watch,
    and the cache syncs and serves the others."""
    bad = node("bad")
    bad["metadata"]["annotations"][CRI_SOCKET_ANNOTATION] = 5
    api.put_many(NODES, [node("a"), bad])
    view.start()
    assert view.nodes.informer.wait_synced(10)
    assert set(view.nodes.snapshot.nodes) == {"a"}
    worse = node("worse")
    worse["metadata"]["annotations"][CRI_SOCKET_ANNOTATION] = ["unix:///x.sock"]
    api.put(NODES, worse)
    api.put(NODES, node("c", "docker://24.0.7"))
    assert eventually(lambda: set(view.nodes.snapshot.nodes) == {"a", "c"})
    assert view.nodes.informer.skipped_events == 2
    assert view.nodes.informer.relists == 0


def test_status_only_updates_publish_nothing_new(api: FakeAPIServer, view: ClusterView) -> None:
    api.put_many(NODES, [node("a")])
    view.start()
    assert view.nodes.informer.wait_synced(10)
    before = view.nodes.snapshot
    heartbeat = node("a", images=3)
    heartbeat["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-11-30T04:00:00Z"
    api.put(NODES, heartbeat)
    api.put(NODES, node("marker", "docker://24.0.7"))
    assert eventually(lambda: "marker" in view.nodes.snapshot.nodes)
    assert view.nodes.snapshot.nodes["a"] is before.nodes["a"], "an unchanged projection is not replaced"


@pytest.mark.parametrize(
    ("runtime", "flavour"),
    [
        ("containerd://1.7.11", "containerd"),
        ("docker://24.0.7", "docker"),
        ("cri-o://1.28.0", "cri-o"),
        ("containerd://1.7.7-k3s1.27", "containerd"),
        ("", None),
        ("Unknown", None),
        ("rkt://1.0", None),
        (None, None),
    ],
)
def test_unknown_runtimes_are_not_guessed(runtime: str | None, flavour: str | None) -> None:
    obj = node("x", "")
    obj["status"]["nodeInfo"]["containerRuntimeVersion"] = runtime
    assert project_node(obj).flavour == flavour


def test_node_projection_keeps_only_what_the_rules_read() -> None:
    obj = node("x", annotations={"kubeadm.alpha.kubernetes.io/cri-socket": "unix:///run/crio/crio.sock", "other": "y"})
    facts = project_node(obj)
    assert facts.cri_socket == "/run/crio/crio.sock"
    assert facts.labels == {"kubernetes.io/hostname": "x", "kubernetes.io/os": "linux"}


def test_cluster_access_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert api_client(ClusterSettings(enabled="false")) is None
    assert api_client(ClusterSettings(enabled="auto")) is None
    with pytest.raises(ClusterAccessError, match="no service account and no kubeconfig"):
        api_client(ClusterSettings(enabled="true"))


def test_a_first_list_asks_for_each_next_page_while_this_one_is_read(api: FakeAPIServer, tmp_path: Path) -> None:
    api.put_many(NODES, [node(f"n{i:02d}") for i in range(30)])
    client = api_client(ClusterSettings(kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig"))))
    list_node = CoreV1Api(client).list_node
    pages = list_pages(list_node, 10, ahead=True)
    first = next(pages)
    assert eventually(lambda: api.count("continue=") == 1)  # page 2 asked for while page 1 is still ours
    rest = list(pages)
    names = [item["metadata"]["name"] for page in (first, *rest) for item in page["items"]]
    assert names == [f"n{i:02d}" for i in range(30)]
    assert api.count("continue=") == 2

    in_turn = list_pages(list_node, 10)  # a relist while serving: nothing asked for before it is read
    next(in_turn)
    time.sleep(0.2)
    assert api.count("continue=") == 2

    api.expire_next_continue = True  # a page fetched ahead that fails fails where it is read
    failing = list_pages(list_node, 10, ahead=True)
    next(failing)
    with pytest.raises(ApiException) as caught:
        next(failing)
    assert caught.value.status == 410


class _Answer:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def release_conn(self) -> None:
        pass


def _paged(count: int, size: int) -> Callable[..., _Answer]:
    """A list call that serves `count` namespaces in pages of `size`."""

    def list_call(**kwargs: Any) -> _Answer:
        start = int(kwargs.get("_continue") or 0)
        end = min(start + size, count)
        items = [namespace(f"ns{i}") for i in range(start, end)]
        metadata = {"resourceVersion": "1", "continue": str(end) if end < count else ""}
        return _Answer(orjson.dumps({"kind": "NamespaceList", "metadata": metadata, "items": items}))

    return list_call


def test_a_relist_while_serving_rests_by_its_cpu_share_and_within_its_bound() -> None:
    page_cpu, page_wall = 0.0015, 0.004  # a page of 50 nodes: our CPU, and the call's time in all
    # Plenty of time left: the rest keeps the relist's CPU at its share of the page's cycle.
    rest = relist_rest(page_cpu, page_wall, 100.0, 10)
    assert page_cpu / (page_wall + rest) == pytest.approx(RELIST_SHARE)
    # Little time left for many pages: each page gets its part of what is left, and no more.
    assert relist_rest(page_cpu, page_wall, 1.0, 100) == pytest.approx(1.0 / 100 - page_wall)
    # Past the bound, or a page whose call alone took longer than its cycle: no rest.
    assert relist_rest(page_cpu, page_wall, -5.0, 100) == 0.0
    assert relist_rest(page_cpu, 1.0, 100.0, 10) == 0.0
    # The last pages (the estimate from what is held can run out before the list does) count as one.
    assert relist_rest(page_cpu, page_wall, 1.0, 0) == relist_rest(page_cpu, page_wall, 1.0, 1)


def test_a_stopped_informer_ends_its_relist_at_the_next_rest() -> None:
    calls: list[dict[str, Any]] = []
    pages = _paged(25, 10)

    def list_call(**kwargs: Any) -> _Answer:
        calls.append(kwargs)
        return pages(**kwargs)

    informer: Informer[str] = Informer("namespace", list_call, lambda obj: str(obj["metadata"]["name"]))
    informer.list_once()  # the first list: 3 pages of 10
    assert len(calls) == 3
    held = informer.items
    informer.stopping.set()
    informer.list_once()  # a relist while serving: it stops after its first page
    assert len(calls) == 4
    assert informer.items is held  # nothing half-listed is published


def test_a_relist_while_serving_yields_the_interpreter_around_each_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding a page is one call that holds the interpreter: a relist while serving yields it just before
    and just after, and every YIELD_EVERY objects it projects, so a request on the event loop waits for one
    piece of a page, not for the page. The first list, which no request waits for, yields only while
    projecting."""
    events: list[str] = []
    monkeypatch.setattr(time, "sleep", lambda seconds: events.append(f"yield {seconds}"))
    pages = _paged(12, 6)

    def list_call(**kwargs: Any) -> _Answer:
        events.append("read")
        return pages(**kwargs)

    def decode(data: bytes) -> Any:
        events.append("decode")
        return orjson.loads(data)

    list(list_pages(list_call, 6, decode=decode, yielding=True))
    assert events == ["read", "yield 0", "decode", "yield 0"] * 2
    events.clear()
    list(list_pages(list_call, 6, decode=decode))
    assert events == ["read", "decode"] * 2

    def project(obj: Any) -> str:
        events.append("project")
        return str(obj["metadata"]["name"])

    informer: Informer[str] = Informer("namespace", list_call, project, page_size=6)
    events.clear()
    informer.list_once()  # the first list (each next page read ahead, in a thread of its own)
    assert sorted(events) == ["project"] * 12 + ["read"] * 2 + ["yield 0"] * 2  # the projecting's only
    events.clear()
    informer.list_once()  # a relist while serving
    every = ["project"] * YIELD_EVERY + ["yield 0"]
    assert events == ["read", "yield 0", "yield 0", *every, *["project"] * (6 - YIELD_EVERY)] * 2


def test_the_collector_rests_during_the_first_list_only() -> None:
    seen: list[bool] = []

    def project(obj: Any) -> str:
        seen.append(gc.isenabled())
        return str(obj["metadata"]["name"])

    informer: Informer[str] = Informer("namespace", _paged(25, 10), project)
    assert eventually(gc.isenabled), "another test's informer is still in its first list"
    informer.list_once()
    assert seen == [False] * 25  # a cache growing page by page is not walked again and again
    assert gc.isenabled()
    seen.clear()
    informer.list_once()  # a relist while serving: requests make garbage, the collector keeps up
    assert seen == [True] * 25
    assert len(informer.items) == 25

    gc.disable()  # whoever turned it off keeps it off
    try:
        Informer("namespace", _paged(5, 10), project).list_once()
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Page(dict[str, Any]):
    """A decoded page that can be watched for being freed."""


def test_a_page_fetched_ahead_that_fails_leaves_nothing_for_the_collector() -> None:
    """With the collector resting, whatever a failed first list held must be freed by reference counting:
    a cycle through the failure's traceback would outlive the retry and be frozen with the cache."""
    held: list[weakref.ref[_Page]] = []

    def decode(data: bytes) -> _Page:
        page = _Page(orjson.loads(data))
        held.append(weakref.ref(page))
        return page

    def list_call(**kwargs: Any) -> _Answer:
        if kwargs.get("_continue"):
            raise ApiException(status=410, reason="Gone")
        return _Answer(b'{"kind": "NamespaceList", "metadata": {"continue": "2"}, "items": []}')

    gc.disable()
    try:
        pages = list_pages(list_call, 10, decode=decode, ahead=True)
        next(pages)
        with pytest.raises(ApiException):
            next(pages)
        del pages
        assert [ref() for ref in held] == [None]
    finally:
        gc.enable()


# --- what the caches say when the API server cannot be listed -------------------------------------------


def _refused() -> MaxRetryError:
    reason = NewConnectionError(None, "Failed to establish a new connection: [Errno 111] Connection refused")  # type: ignore[arg-type]
    return MaxRetryError(None, "/api/v1/nodes?limit=500", reason)  # type: ignore[arg-type]


def _forbidden() -> ApiException:
    refused = ApiException(status=403, reason="Forbidden")
    refused.body = orjson.dumps(
        {"kind": "Status", "message": 'nodes is forbidden: User "x" cannot list resource'}
    ).decode()
    return refused


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (_refused(), "connection refused"),
        (ApiException(status=401, reason="Unauthorized"), "401 Unauthorized"),
        (_forbidden(), '403 Forbidden: nodes is forbidden: User "x" cannot list resource'),
        (ReadTimeoutError(None, "/api/v1/nodes", "Read timed out. (read timeout=60)"), "timed out"),  # type: ignore[arg-type]
        (ProtocolError("Connection broken: IncompleteRead(0 bytes read, 2 more expected)"), "the connection broke off"),
        (
            ProtocolError("Connection aborted.", ConnectionResetError(104, "Connection reset by peer")),
            "connection reset",
        ),
        (orjson.JSONDecodeError("unexpected character", "<html>", 0), "an answer that is not JSON"),
        (TypeError("'NoneType' object is not subscriptable"), None),  # a fault of ours: no plain reason
    ],
    ids=["refused", "401", "403", "read timeout", "cut short", "reset", "not JSON", "a fault of ours"],
)
def test_a_failed_request_is_said_in_plain_words(error: Exception, said: str | None) -> None:
    why = failure(error)
    assert (why if said is None else (why or "")[: len(said)]) == said
    assert "Error" not in (why or ""), "no class names where a plain reason exists"


def test_our_own_errors_are_said_by_their_message_and_anything_else_is_ours() -> None:
    assert described(EnsureError("MutatingWebhookConfiguration cw not found")) == (
        "MutatingWebhookConfiguration cw not found",
        False,
    )
    assert described(_refused()) == ("connection refused", False)
    assert described(KeyError("name")) == ("unexpected KeyError: 'name'", True)


def _failing(error: Exception, calls: list[float]) -> Callable[..., Any]:
    def list_call(**_kwargs: Any) -> Any:
        calls.append(time.monotonic())
        raise error

    return list_call


def _steps(error: Exception, count: int, caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The records of an informer whose every list fails with `error`, over `count` back-off steps."""
    calls: list[float] = []
    informer: Informer[str] = Informer(
        "node", _failing(error, calls), str, backoff=(0.01, 0.04), server="https://127.0.0.1:1"
    )
    with caplog.at_level(logging.INFO):
        thread = informer.start()
        assert eventually(lambda: len(calls) >= count)
        informer.stopping.set()
        thread.join(5)
    return [r for r in caplog.records if r.name.startswith(("webhook", "urllib3"))]


def test_an_unreachable_api_server_is_one_line_per_back_off_step(caplog: pytest.LogCaptureFixture) -> None:
    records = _steps(_refused(), 4, caplog)
    assert len(records) >= 4
    line = re.compile(
        r"node cache: cannot list nodes from https://127\.0\.0\.1:1: connection refused; retrying in \d+\.\d s"
    )
    for record in records:
        assert record.levelno == logging.WARNING
        assert line.fullmatch(record.getMessage()), record.getMessage()
        assert record.exc_info is None


def test_a_fault_of_ours_logs_its_traceback_once_not_at_every_step(caplog: pytest.LogCaptureFixture) -> None:
    records = _steps(TypeError("'NoneType' object is not subscriptable"), 4, caplog)
    assert len(records) >= 4
    assert all("cannot list nodes from https://127.0.0.1:1: unexpected TypeError:" in r.getMessage() for r in records)
    assert [bool(r.exc_info) for r in records] == [True] + [False] * (len(records) - 1)


def test_a_refusing_api_server_is_said_with_its_status_and_message(
    api: FakeAPIServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.refuse = 403
    cluster = _view(api, tmp_path)
    with caplog.at_level(logging.WARNING, logger="webhook.cluster.informer"):
        cluster.start()
        try:
            assert eventually(lambda: len(caplog.records) >= 4)
        finally:
            cluster.stop()
    said = {r.getMessage().split("; retrying")[0] for r in caplog.records}
    assert said == {
        f"{name} cache: cannot list {name}s from {api.url}: 403 Forbidden: {name}s is forbidden: "
        f'User "fake" cannot list resource "{name}s" in API group "" at the cluster scope'
        for name in ("node", "namespace")
    }


def test_cluster_access_says_once_where_it_comes_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "from-env", "https://127.0.0.1:1")))
    named = write_kubeconfig(tmp_path / "named", "https://10.0.0.1:6443")
    with caplog.at_level(logging.INFO, logger="webhook.cluster.access"):
        assert load_configuration(ClusterSettings()) is not None
        assert load_configuration(ClusterSettings(kubeconfig=str(named), context="fake")) is not None
    assert [r.getMessage() for r in caplog.records] == [
        f"cluster access: kubeconfig {tmp_path / 'from-env'} ($KUBECONFIG), context fake, API server https://127.0.0.1:1",
        f"cluster access: kubeconfig {named} (cluster.kubeconfig), context fake, API server https://10.0.0.1:6443",
    ]
    assert TOKEN not in caplog.text


def test_in_cluster_access_names_the_service_accounts_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kubernetes.config import incluster_config

    from webhook.cluster import access

    for name, text in (("token", "a-secret-token"), ("ca.crt", "a CA"), ("namespace", "flyte-system")):
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setattr(access, "SERVICE_ACCOUNT_TOKEN", tmp_path / "token")
    monkeypatch.setattr(access, "SERVICE_ACCOUNT_NAMESPACE", tmp_path / "namespace")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with caplog.at_level(logging.INFO, logger="webhook.cluster.access"):
        assert load_configuration(ClusterSettings()) is not None
    assert [r.getMessage() for r in caplog.records] == [
        "cluster access: the in-cluster service account of namespace flyte-system, API server https://10.96.0.1:443"
    ]
    assert "a-secret-token" not in caplog.text


def test_credentials_are_refreshed_at_most_once_a_second_for_each_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's hook, which reads the whole environment on each run, runs once a second at most, whatever
    the number of requests; it still refreshes, and a copy of the configuration keeps its own time."""
    from webhook.cluster import access

    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    configuration = load_configuration(
        ClusterSettings(kubeconfig=str(write_kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:1")))
    )
    assert configuration is not None
    wrapped = configuration.refresh_api_key_hook
    assert isinstance(wrapped, access.RefreshAtMostEvery)
    for _ in range(3):
        assert configuration.auth_settings()["BearerToken"]["value"] == f"Bearer {TOKEN}"
        now[0] += 1
    assert configuration.refresh_api_key_hook is wrapped, "the kubeconfig loader's hook installed itself again"

    runs: list[str] = []

    def loader(conf: Any) -> None:  # as the loaders do: set the credential read, install the hook again
        runs.append("run")
        conf.api_key["BearerToken"] = f"token-{len(runs)}"
        conf.refresh_api_key_hook = loader

    configuration.refresh_api_key_hook = access.RefreshAtMostEvery(loader)
    assert {configuration.auth_settings()["BearerToken"]["value"] for _ in range(100)} == {"token-1"}
    assert runs == ["run"]
    copied = copy.deepcopy(configuration)
    now[0] += 0.5
    configuration.auth_settings()
    assert len(runs) == 1
    now[0] += 0.5
    assert configuration.auth_settings()["BearerToken"]["value"] == "token-2"
    # The copy keeps its own time: a second since its last run, though the original has just run.
    assert copied.auth_settings()["BearerToken"]["value"] == "token-3"
    now[0] += 0.5
    assert copied.auth_settings()["BearerToken"]["value"] == "token-3"
    assert len(runs) == 3
    assert isinstance(configuration.refresh_api_key_hook, access.RefreshAtMostEvery)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("just a string\n", "is not a kubeconfig"),
        ("clusters: [\n", "cannot read the kubeconfig"),
    ],
)
def test_a_kubeconfig_that_cannot_be_read_is_said_so(tmp_path: Path, text: str, said: str) -> None:
    (tmp_path / "kubeconfig").write_text(text)
    with pytest.raises(ClusterAccessError, match=said):
        load_configuration(ClusterSettings(kubeconfig=str(tmp_path / "kubeconfig")))


def test_the_caches_client_leaves_retrying_to_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A request to a closed port fails at once with one reason, without urllib3's retries (a warning each)."""
    configuration = load_configuration(
        ClusterSettings(kubeconfig=str(write_kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:1")))
    )
    assert configuration is not None
    with caplog.at_level(logging.WARNING), pytest.raises(MaxRetryError) as caught:
        CoreV1Api(client_without_retries(configuration)).list_node(_request_timeout=5)
    assert failure(caught.value) == "connection refused"
    assert caplog.records == []
    assert configuration.retries is None, "the configuration given is left as it was"
