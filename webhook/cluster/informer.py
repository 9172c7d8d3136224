"""One list+watch loop over one resource, with the real `kubernetes` client, keeping a projection.

Lists are paged (`limit`, `continue`) and read as raw JSON, never as the client's model objects, whose
CPU and memory grow with every field of a Node, image lists included, that the rules never read. Each
object is projected to the few fields the rules read at once and the rest is dropped. The watch resumes
from the last resourceVersion seen (bookmarks included), relists on `410 Gone`, and backs off
exponentially, with jitter, after any failure. The projection is published as an immutable mapping,
replaced (copy on write) only when a projected value actually changes, so the frequent status-only
updates of nodes cost a comparison and no copy.

With `table` (a `Rows` reader), lists and watches ask the API server for its Table rendering with each
row's object metadata (`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`; `includeObject=Metadata`
is the default): a column such as the node's container runtime plus labels and annotations, without the
image lists and conditions that are most of a Node's bytes. Each row is read back into the small object
the projection reads, so the projection is the same either way. A server that answers with plain
objects instead is read as usual.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import random
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import Future
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import orjson
from kubernetes.client.exceptions import ApiException

from webhook import objects
from webhook.cluster import decoding
from webhook.cluster.errors import Gone, WatchError, described

log = logging.getLogger(__name__)

T = TypeVar("T")
Project = Callable[[objects.JSONObject], T]
ListCall = Callable[..., Any]  # CoreV1Api.list_node / list_namespace

PAGE_SIZE = 500
YIELD_EVERY = 5  # objects projected between two yields of the interpreter to the event loop
RELIST_PAGE_SIZE = 50
# A relist while serving takes at most this share of the interpreter, by its thread's CPU time (the requests'
# p99 moves once it takes more than about 1%: docs/performance.md), ...
RELIST_SHARE = 1 / 64
# ... unless that would make it last longer than this. The watch resumes from the list's resourceVersion,
# and the API server's watch cache keeps at least 75 s of events (k8s.io/apiserver's cacher,
# DefaultEventFreshDuration), not always more; older, the watch gets 410 Gone and the relist starts over.
RELIST_SECONDS = 60.0
WATCH_SECONDS = 290  # the API server ends a watch at its own minRequestTimeout; we ask a little less
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"
# A Table row -> the object the projection reads (None: unreadable), given the column names in order.
Rows = Callable[[objects.TableRow, list[str]], objects.JSONObject | None]


def list_pages(
    list_call: ListCall,
    page_size: int = PAGE_SIZE,
    headers: dict[str, str] | None = None,
    *,
    decode: Callable[[bytes], Any] = orjson.loads,
    ahead: bool = False,
    yielding: bool = False,
) -> Generator[objects.ListPage, None, None]:
    """Every page of a paged list (`limit`, `continue`), each parsed from raw JSON. `ahead`: each next page
    is requested as soon as the one before it has arrived, so the API server makes it while the caller
    reads this one. `yielding`: the interpreter is yielded before and after each page's decoding, one call
    that holds it, so the event loop runs between reading, decoding and projecting rather than waiting
    through all three."""

    def fetch(token: str | None) -> objects.ListPage:
        kwargs: dict[str, Any] = {"limit": page_size, "_preload_content": False, "_request_timeout": (10, 60)}
        if headers:
            kwargs["_headers"] = headers
        if token:
            kwargs["_continue"] = token
        response = list_call(**kwargs)
        try:
            data = response.data
        finally:
            response.release_conn()
        if yielding:
            time.sleep(0)
        page: objects.ListPage = decode(data)
        if yielding:
            time.sleep(0)
        return page

    page = fetch(None)
    while True:
        token = (page.get("metadata") or {}).get("continue") or None
        following = _in_background(fetch, token) if ahead and token else None
        yield page
        if token is None:
            return
        if following is None:
            page = fetch(token)
            continue
        try:
            page = following.result()
        finally:
            following = None  # a failure's traceback holds this frame: no cycle back through the future


def _in_background(call: Callable[[str], objects.ListPage], token: str) -> Future[objects.ListPage]:
    """`call(token)` in a daemon thread: a request hung on a dead connection never holds the process at
    exit, as a pool's worker would (concurrent.futures joins those)."""
    future: Future[objects.ListPage] = Future()
    threading.Thread(target=_settle, args=(future, call, token), name="list-ahead", daemon=True).start()
    return future


def _settle(future: Future[objects.ListPage], call: Callable[[str], objects.ListPage], token: str) -> None:
    try:
        future.set_result(call(token))
    except BaseException as exc:  # handed to the caller, raised where it waits for the page
        future.set_exception(exc)
    del future  # the failure's traceback holds this frame: it must not hold the future that holds it


def relist_rest(cpu: float, wall: float, seconds_left: float, pages_left: int) -> float:
    """Seconds a relist while serving rests after a page that took `cpu` seconds of its thread's CPU and
    `wall` seconds in all (the API server's time included): enough to keep its share of the interpreter at
    RELIST_SHARE, no more than leaves each of the `pages_left` pages its part of `seconds_left`, never
    below zero."""
    by_share = cpu / RELIST_SHARE - wall
    by_deadline = seconds_left / max(pages_left, 1) - wall
    return max(0.0, min(by_share, by_deadline))


def _malloc_trim() -> Callable[[], object]:
    """glibc's malloc_trim: gives back the pages a relist's parsing freed, which the C allocator would keep,
    so the resident size follows what the cache holds. A no-op without glibc."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0)


release_free_memory = _malloc_trim()


class _Collector:
    """The cyclic garbage collector, off while any first list runs (the node and namespace caches list at
    once, at start-up), since a cache growing by pages would make every full collection walk all of it
    again. The collector runs again after the last of them, unless it was off before, and the first list
    collects before it freezes what it holds (a failed attempt can leave cycles: an exception and the
    frames of its traceback). A relist leaves it on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lists = 0
        self._was_on = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:
            if self._lists == 0:
                self._was_on = gc.isenabled()
                gc.disable()
            self._lists += 1
        try:
            yield
        finally:
            with self._lock:
                self._lists -= 1
                if self._lists == 0 and self._was_on:
                    gc.enable()


_COLLECTOR = _Collector()


class Informer(Generic[T]):
    def __init__(
        self,
        name: str,
        list_call: ListCall,
        project: Project[T],
        *,
        on_change: Callable[[Mapping[str, T], frozenset[str] | None], None] | None = None,
        page_size: int = PAGE_SIZE,
        watch_seconds: int = WATCH_SECONDS,
        backoff: tuple[float, float] = (0.5, 30.0),
        table: Rows | None = None,
        resource: str | None = None,
        server: str | None = None,
    ) -> None:
        """`resource` and `server` name what is listed and where, in the lines that say why it failed
        (default: the name made plural, and no server)."""
        self.name = name
        self.resource = resource or f"{name}s"
        self.server = server
        self._table = table
        # Table pages and events are read without their rows' managedFields (decoding.py).
        self._decode_page = decoding.table_page if table is not None else orjson.loads
        self._decode_event = decoding.table_event if table is not None else orjson.loads
        self._columns: list[str] = []  # the Table's column names, from a list or the first watch event
        self._list_call = list_call
        self._project = project
        self._on_change = on_change
        self._page_size = page_size
        self._watch_seconds = watch_seconds
        self._backoff = backoff
        self._items: Mapping[str, T] = MappingProxyType({})
        self.resource_version: str | None = None
        self.synced = threading.Event()
        self.stopping = threading.Event()
        self.relists = 0
        self.skipped_events = 0
        self._traced: set[type[BaseException]] = set()  # the unexpected errors whose traceback was logged

    @property
    def items(self) -> Mapping[str, T]:
        return self._items

    # --- publishing ---------------------------------------------------------------------------------
    def _publish(self, items: dict[str, T], changed: frozenset[str] | None) -> None:
        """`changed`: the names whose value changed (None: any may have)."""
        self._items = MappingProxyType(items)
        if self._on_change is not None:
            self._on_change(self._items, changed)

    def _apply(self, kind: str, obj: objects.JSONObject) -> None:
        metadata = obj.get("metadata")
        name = metadata.get("name") if isinstance(metadata, dict) else None
        if not isinstance(name, str):
            raise ValueError("object without metadata.name")
        if kind == "DELETED":
            if name in self._items:
                items = dict(self._items)
                del items[name]
                self._publish(items, frozenset((name,)))
            return
        value = self._project(obj)
        if self._items.get(name) != value:
            items = dict(self._items)
            items[name] = value
            self._publish(items, frozenset((name,)))

    # --- the Table rendering ---------------------------------------------------------------------------
    @property
    def _headers(self) -> dict[str, str] | None:
        return {"Accept": TABLE} if self._table is not None else None

    def _objects(self, page: objects.ListPage) -> list[Any]:
        """The objects of a list page, or of a watch event's Table (one row; a bookmark's row is empty)."""
        if page.get("kind") != "Table":
            return page.get("items") or []
        self._remember_columns(page)
        if self._table is None:
            raise ValueError("a Table answer to a request that did not ask for one")
        objects = []
        for row in page.get("rows") or ():
            obj = self._table(row, self._columns) if isinstance(row, dict) else None
            if obj is None:
                self.skipped_events += 1
                log.warning("%s cache: skipped an unreadable Table row: %.200r", self.name, row)
            else:
                objects.append(obj)
        return objects

    def _remember_columns(self, table: objects.ListPage) -> None:
        columns = table.get("columnDefinitions")  # null after a watch's first event
        if isinstance(columns, list) and columns:
            self._columns = [str(c.get("name")) if isinstance(c, dict) else "" for c in columns]

    # --- list ---------------------------------------------------------------------------------------
    def _take_page(
        self, page: objects.ListPage, held: Mapping[str, T], items: dict[str, T], *, changed: set[str]
    ) -> int:
        """Project a page's objects into `items`, keeping the object held where the value is equal and
        adding the names of the others to `changed`; how many of the page's names were held before."""
        kept = 0
        for i, obj in enumerate(self._objects(page)):
            try:
                name, value = obj["metadata"]["name"], self._project(obj)
                if not isinstance(name, str) or not name:
                    raise ValueError("object without metadata.name")
            except (KeyError, TypeError, ValueError) as exc:
                self.skipped_events += 1
                log.warning("%s cache: skipped an unreadable object in a list: %s", self.name, exc)
                continue
            old = held.get(name)
            if old is not None:
                kept += 1
            if old is not None and old == value:
                value = old
            else:
                changed.add(name)
            items[name] = value
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                time.sleep(0)
        return kept

    def list_once(self) -> None:
        """List everything, projecting as pages arrive. A value equal to the one held is kept (the same
        object), and nothing is published when nothing changed, so a relist after `410 Gone` costs the
        list and the comparisons. Between pages the thread yields the interpreter, so requests on the
        event loop wait for a page at most, never for a whole relist."""
        started = time.monotonic()
        held = self._items
        items: dict[str, T] = {}
        changed: set[str] = set()
        kept = 0  # names held before and listed again: all of them means none was removed
        page_started, page_cpu = time.monotonic(), time.thread_time()
        # While serving, smaller pages: decoding one is a single call that holds the interpreter, so the page's
        # size bounds how long a request waits for it.
        synced = self.synced.is_set()
        page_size = min(self._page_size, RELIST_PAGE_SIZE) if synced else self._page_size
        # The first list asks for each next page while projecting this one: the API server's time making a page
        # (a Table of 500 nodes) overlaps ours reading the last. A relist while serving does not: its rests
        # between pages are for the requests.
        pages = list_pages(
            self._list_call, page_size, self._headers, decode=self._decode_page, ahead=not synced, yielding=synced
        )
        with contextlib.closing(pages), _COLLECTOR.paused() if not synced else contextlib.nullcontext():
            for page in pages:
                kept += self._take_page(page, held, items, changed=changed)
                metadata = page.get("metadata") or {}
                self.resource_version = metadata.get("resourceVersion")
                # A relist while serving takes turns with the requests, resting after each page (relist_rest),
                # the pages left estimated from what is held; the snapshot it replaces serves meanwhile. The
                # first list runs flat out: the pod is not ready, no request waits for it.
                if synced:
                    now = time.monotonic()
                    pages_left = -(-max(len(held) - len(items), page_size) // page_size)
                    cpu = time.thread_time() - page_cpu
                    rest = relist_rest(cpu, now - page_started, started + RELIST_SECONDS - now, pages_left)
                    if self.stopping.wait(rest):
                        return  # stopped: the rest of the relist is for nobody
                page_started, page_cpu = time.monotonic(), time.thread_time()
            if kept < len(held):
                changed.update(held.keys() - items.keys())
            if changed or not synced:
                self._publish(items, frozenset(changed) if synced else None)
        count = len(items)
        del held, items
        release_free_memory()
        # What was just listed lives until the next change: out of the collector's way. Otherwise every
        # full collection walks the whole cache, holding the interpreter for time that grows with the
        # cache, and a relist triggers several. The cache holds no reference cycles: what it drops
        # later is freed by reference counting, frozen or not.
        if not synced:
            gc.collect()  # cycles left by failed attempts (the collector rested through them), before the freeze
        gc.freeze()
        self.synced.set()
        log.info(
            "%s cache: listed %d (%d changed) at resourceVersion %s in %.2f s",
            self.name,
            count,
            len(changed),
            self.resource_version,
            time.monotonic() - started,
        )

    # --- watch --------------------------------------------------------------------------------------
    def _lines(self, response: Any) -> Iterator[bytes]:
        buffer = b""
        for chunk in response.stream(65536, decode_content=True):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            yield from (line for line in lines if line.strip())
        if buffer.strip():
            yield buffer

    def watch_once(self) -> None:
        response = self._list_call(
            watch=True,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._watch_seconds,
            _preload_content=False,
            # A read timeout beyond the watch's own end: a connection that went silent is a dropped one.
            _request_timeout=(10, self._watch_seconds + 30),
            **({"_headers": self._headers} if self._headers else {}),
        )
        try:
            for line in self._lines(response):
                if self.stopping.is_set():
                    return
                self._event(line)
        finally:
            response.release_conn()

    def _parse(self, line: bytes) -> tuple[str, objects.WatchEvent] | None:
        """(type, object) of a watch event line; None (counted, logged) when it is malformed."""
        try:
            event = self._decode_event(line)
            kind, obj = event["type"], event["object"]
            if not isinstance(obj, dict):
                raise TypeError("object is not an object")
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            self.skipped_events += 1
            log.warning("%s cache: skipped a malformed watch event (%s): %.200r", self.name, exc, line)
            return None
        return kind, obj

    def _unwrap(self, kind: str, obj: objects.WatchEvent) -> objects.JSONObject | None:
        """The object of a Table event (a bookmark's Table carries only its version and columns)."""
        if obj.get("kind") != "Table":
            return obj
        if kind == "BOOKMARK":
            self._remember_columns(obj)
            return obj
        rows = self._objects(obj)
        return rows[0] if rows else None

    def _event(self, line: bytes) -> None:
        parsed = self._parse(line)
        if parsed is None:
            return
        kind, obj = parsed
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", "resource version too old"))
            raise WatchError(str(obj.get("message") or obj))
        version = (obj.get("metadata") or {}).get("resourceVersion")
        unwrapped = self._unwrap(kind, obj)
        if unwrapped is None:
            return
        if kind != "BOOKMARK" and not self._applied(kind, unwrapped):
            return
        if isinstance(version, str) and version:
            self.resource_version = version

    def _applied(self, kind: str, obj: objects.JSONObject) -> bool:
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            self.skipped_events += 1
            log.warning("%s cache: skipped a watch event of unknown type %r", self.name, kind)
            return False
        try:
            self._apply(kind, obj)
        except (KeyError, TypeError, ValueError) as exc:
            self.skipped_events += 1
            log.warning("%s cache: skipped an unreadable %s event: %s", self.name, kind, exc)
            return False
        return True

    # --- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        failures = 0
        need_list = True
        while not self.stopping.is_set():
            try:
                if need_list:
                    self.list_once()
                    need_list = False
                    failures = 0  # progress: a watch dropped after a good list starts the back-off over
                version = self.resource_version
                try:
                    self.watch_once()
                finally:
                    if self.resource_version != version:
                        failures = 0  # the watch delivered: a drop after that is a first failure
                failures = 0  # a watch that ended normally (its timeout): resume from where it stopped
            except Gone as exc:
                log.info("%s cache: %s; relisting", self.name, exc)
                self.relists += 1
                need_list = True
            except ApiException as exc:
                failures += 1
                if exc.status == 410:
                    self.relists += 1
                    need_list = True
                    log.info("%s cache: list continuation expired; relisting", self.name)
                    continue
                self._sleep(failures, "list" if need_list else "watch", exc)
            except Exception as exc:  # a dropped connection, a timeout, a bad page, or a fault of ours
                failures += 1
                self._sleep(failures, "list" if need_list else "watch", exc)

    def _sleep(self, failures: int, verb: str, error: Exception) -> None:
        """Back off, having said why in one line: what could not be listed or watched, from where, and the
        reason in plain words. An error that is neither the API's answer nor the way to it failing (a fault
        of ours) is named by its class, and its traceback logged the first time that class is seen."""
        low, high = self._backoff
        delay = min(high, low * 2 ** (failures - 1)) * random.uniform(0.8, 1.2)  # noqa: S311 - jitter, not security
        why, ours = described(error)
        trace = error if ours and type(error) not in self._traced else None
        if ours:
            self._traced.add(type(error))
        where = f" from {self.server}" if self.server else ""
        log.warning(
            "%s cache: cannot %s %s%s: %s; retrying in %.1f s",
            self.name,
            verb,
            self.resource,
            where,
            why,
            delay,
            exc_info=trace,
        )
        self.stopping.wait(delay)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name=f"{self.name}-informer", daemon=True)
        thread.start()
        return thread

    def wait_synced(self, timeout: float) -> bool:
        return self.synced.wait(timeout)
