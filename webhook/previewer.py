"""Previews in worker processes, so that no preview slows an admission review.

A preview parses, plans and renders up to `preview.maxBodyBytes` of YAML in pure Python: about a second
of CPU. In a thread of the server's own process it holds the GIL against the event loop, and in one
measurement /mutate/ptrace fell from 7,715 to 338 req/s (p99 4 ms -> 196 ms) while previews ran
(bench/preview_isolation.py). A worker process runs on the other core instead.

Each worker is one spawned process answering one job at a time over a pipe; `preview.concurrency`
workers at most, started on the first preview. A job carries everything the preview reads: body, query,
settings and the cluster facts, exported as plain data (the node table only when it changed since that
worker last saw it). A job that outlives `preview.timeoutSeconds` has its worker killed; a worker that
dies is replaced at the next job.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from webhook.config import Settings
from webhook.mutation.facts import NO_CLUSTER, NO_FACTS, ClusterFacts, ExportedFacts, NodeFacts, node_snapshot
from webhook.review import NamespaceFacts, RequestError

log = logging.getLogger(__name__)

FactsExport = Callable[[int | None], ExportedFacts]  # argument: the node version the worker holds


def no_cluster_export(_have: int | None) -> ExportedFacts:
    return NO_FACTS


class PreviewFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _Job(NamedTuple):
    body: bytes
    content_type: str
    params: dict[str, str]
    settings: Settings
    facts: ExportedFacts


class Worker:
    """One worker process; `run` blocks (call it from a thread) until the answer or the deadline."""

    def __init__(self) -> None:
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self.node_version: int | None = None

    def _start(self) -> Connection:
        context = multiprocessing.get_context("spawn")  # no fork of a threaded server
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child,), name="copilot-webhook-preview", daemon=True)
        process.start()
        child.close()
        self._process, self._conn, self.node_version = process, parent, None
        return parent

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None
        self.node_version = None

    def run(self, job: _Job, timeout: float) -> tuple[bytes, str]:
        conn = self._conn if self._process is not None and self._process.is_alive() else None
        if conn is None:
            self.stop()
            conn = self._start()
        try:
            conn.send(job)
            if not conn.poll(timeout):
                self.stop()
                raise PreviewFailed(503, f"preview took longer than preview.timeoutSeconds ({timeout:g} s); stopped")
            status, first, second = conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.stop()
            raise PreviewFailed(503, "the preview worker stopped; try again") from None
        if job.facts.nodes is not None:
            self.node_version = job.facts.node_version
        if status != 200:
            raise PreviewFailed(status, first)
        return first, second


class Previewer:
    """Up to `slots` workers; a preview beyond them is refused at once (503, Retry-After)."""

    def __init__(self, slots: int, export: FactsExport = no_cluster_export) -> None:
        self._free = [Worker() for _ in range(slots)]
        self._lock = threading.Lock()
        self._export = export
        self.slots = slots

    def take(self) -> Worker | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def give_back(self, worker: Worker) -> None:
        with self._lock:
            self._free.append(worker)

    def run(
        self, worker: Worker, body: bytes, content_type: str, params: dict[str, str], settings: Settings
    ) -> tuple[bytes, str]:
        job = _Job(body, content_type, params, settings, self._export(worker.node_version))
        return worker.run(job, settings.preview.timeout_seconds)

    def stop(self) -> None:
        with self._lock:
            for worker in self._free:
                worker.stop()


# --- in the worker process ---------------------------------------------------------------------------------

_held: dict[str, Any] = {"version": None, "snapshot": None}


def _lookup(facts: ExportedFacts) -> NamespaceFacts:
    if facts.namespaces is None and facts.node_state == "none":
        return lambda _namespace: NO_CLUSTER
    if facts.nodes is not None:
        rows = {name: NodeFacts(*row) for name, row in facts.nodes.items()}
        _held["version"], _held["snapshot"] = facts.node_version, node_snapshot(rows)
    snapshot = _held["snapshot"] if _held["version"] == facts.node_version else node_snapshot({})
    namespaces = facts.namespaces or {}
    return lambda namespace: ClusterFacts(namespaces.get(namespace), snapshot, facts.node_state)


def _serve(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the server, which stops us
    os.nice(10)  # where cores are short, admission reviews come first
    from webhook import preview  # imported here: the spawned interpreter starts empty

    while True:
        try:
            job: _Job = conn.recv()
        except (EOFError, OSError):
            return  # the server is gone
        try:
            content, content_type = preview.preview(
                job.body, job.content_type, job.params, job.settings, _lookup(job.facts)
            )
            conn.send((200, content, content_type))
        except RequestError as exc:
            conn.send((exc.status, exc.message, ""))
        except Exception as exc:
            log.exception("preview failed")
            conn.send((500, f"preview failed ({type(exc).__name__}); the server logged the details", ""))


__all__ = ["PreviewFailed", "Previewer", "Worker", "no_cluster_export"]
