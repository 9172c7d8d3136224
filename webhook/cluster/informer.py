"""One list+watch loop over one resource, with the real `kubernetes` client, keeping a projection.

Lists are paged (`limit`, `continue`) and read as raw JSON, never as the client's model objects: a
Node with its image list is 10 KB of JSON, and 5,000 of them as typed objects would cost seconds and
hundreds of megabytes. Each object is projected to the few fields the rules read at once and the rest
is dropped. The watch resumes from the last resourceVersion seen (bookmarks included), relists on
`410 Gone`, and backs off exponentially, with jitter, after any failure. The projection is published
as an immutable mapping, replaced (copy on write) only when a projected value actually changes, so
the frequent status-only updates of nodes cost a comparison and no copy.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import orjson
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

T = TypeVar("T")
Project = Callable[[dict[str, Any]], T]
ListCall = Callable[..., Any]  # CoreV1Api.list_node / list_namespace

PAGE_SIZE = 500
WATCH_SECONDS = 290  # the API server ends a watch at its own minRequestTimeout; we ask a little less


def list_pages(list_call: ListCall, page_size: int = PAGE_SIZE) -> Iterator[dict[str, Any]]:
    """Every page of a paged list (`limit`, `continue`), each parsed from raw JSON."""
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"limit": page_size, "_preload_content": False, "_request_timeout": (10, 60)}
        if token:
            kwargs["_continue"] = token
        response = list_call(**kwargs)
        try:
            page: dict[str, Any] = orjson.loads(response.data)
        finally:
            response.release_conn()
        yield page
        token = (page.get("metadata") or {}).get("continue") or None
        if token is None:
            return


class Gone(Exception):
    """The resourceVersion we hold has been compacted away: relist."""


class Informer(Generic[T]):
    def __init__(
        self,
        name: str,
        list_call: ListCall,
        project: Project[T],
        on_change: Callable[[Mapping[str, T]], None] | None = None,
        page_size: int = PAGE_SIZE,
        watch_seconds: int = WATCH_SECONDS,
        backoff: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        self.name = name
        self._list_call = list_call
        self._project = project
        self._on_change = on_change
        self._page_size = page_size
        self._watch_seconds = watch_seconds
        self._backoff = backoff
        self._items: Mapping[str, T] = MappingProxyType({})
        self.resource_version: str | None = None
        self.synced = threading.Event()
        self.stop = threading.Event()
        self.relists = 0
        self.skipped_events = 0

    @property
    def items(self) -> Mapping[str, T]:
        return self._items

    # --- publishing ---------------------------------------------------------------------------------
    def _publish(self, items: dict[str, T]) -> None:
        self._items = MappingProxyType(items)
        if self._on_change is not None:
            self._on_change(self._items)

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        metadata = obj.get("metadata")
        name = metadata.get("name") if isinstance(metadata, dict) else None
        if not isinstance(name, str):
            raise ValueError("object without metadata.name")
        if kind == "DELETED":
            if name in self._items:
                items = dict(self._items)
                del items[name]
                self._publish(items)
            return
        value = self._project(obj)
        if self._items.get(name) != value:
            items = dict(self._items)
            items[name] = value
            self._publish(items)

    # --- list ---------------------------------------------------------------------------------------
    def list_once(self) -> None:
        items: dict[str, T] = {}
        for page in list_pages(self._list_call, self._page_size):
            for obj in page.get("items") or ():
                try:
                    items[obj["metadata"]["name"]] = self._project(obj)
                except (KeyError, TypeError, ValueError) as exc:
                    self.skipped_events += 1
                    log.warning("%s cache: skipped an unreadable object in a list: %s", self.name, exc)
            metadata = page.get("metadata") or {}
            self.resource_version = metadata.get("resourceVersion")
        self._publish(items)
        self.synced.set()
        log.info("%s cache: listed %d at resourceVersion %s", self.name, len(items), self.resource_version)

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
        )
        try:
            for line in self._lines(response):
                if self.stop.is_set():
                    return
                self._event(line)
        finally:
            response.release_conn()

    def _event(self, line: bytes) -> None:
        try:
            event = orjson.loads(line)
            kind, obj = event["type"], event["object"]
            if not isinstance(obj, dict):
                raise TypeError("object is not an object")
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            self.skipped_events += 1
            log.warning("%s cache: skipped a malformed watch event (%s): %.200r", self.name, exc, line)
            return
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", "resource version too old"))
            raise RuntimeError(f"watch error: {obj.get('message') or obj}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind != "BOOKMARK":
            if kind not in ("ADDED", "MODIFIED", "DELETED"):
                self.skipped_events += 1
                log.warning("%s cache: skipped a watch event of unknown type %r", self.name, kind)
                return
            try:
                self._apply(kind, obj)
            except (KeyError, TypeError, ValueError) as exc:
                self.skipped_events += 1
                log.warning("%s cache: skipped an unreadable %s event: %s", self.name, kind, exc)
                return
        if isinstance(version, str) and version:
            self.resource_version = version

    # --- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        failures = 0
        need_list = True
        while not self.stop.is_set():
            try:
                if need_list:
                    self.list_once()
                    need_list = False
                self.watch_once()
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
                self._sleep(failures, f"API error {exc.status}: {exc.reason}")
            except Exception as exc:  # a dropped connection, a timeout, a bad page
                failures += 1
                self._sleep(failures, f"{type(exc).__name__}: {exc}")

    def _sleep(self, failures: int, why: str) -> None:
        low, high = self._backoff
        delay = min(high, low * 2 ** (failures - 1)) * random.uniform(0.8, 1.2)  # noqa: S311 - jitter, not security
        log.warning("%s cache: %s; retrying in %.1f s", self.name, why, delay)
        self.stop.wait(delay)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name=f"{self.name}-informer", daemon=True)
        thread.start()
        return thread

    def wait_synced(self, timeout: float) -> bool:
        return self.synced.wait(timeout)
