"""Previews in worker processes, so that no preview slows an admission review.

A preview parses, plans and renders up to `preview.maxBodyBytes` in Python, seconds of CPU for the largest
bodies (docs/http-api.md has each output's cost). In a thread of the server's own process it would hold the
GIL against the event loop for as long, and admission would wait behind it; a worker process runs on
another core instead (bench/preview_isolation.py measures admission while previews run).

Each worker is one spawned process answering one job at a time over a pipe; `preview.concurrency`
workers at most, started on the first preview. A job carries the body, query, settings, the namespaces'
labels and the nodes' runtime groups. Nodes are asked for while the job runs, over the same pipe: the
label-index entries and the nodes a pod's scheduling constraints name, answered from the snapshot of the
job's start, so a worker holds no copy of the nodes and its memory does not grow with them. A job
that outlives `preview.timeoutSeconds` has its worker killed and is answered 503; it is not run again.

A preview is lost only when its own work was lost. A worker that dies otherwise (killed while idle, or while
it runs the job) is replaced, and the job run once more on the fresh worker, within the same deadline
(previews are pure: running one again changes nothing). A job that both workers had taken when they died
made them die: it is answered 422 and not run a third time. At most one run again per preview, in the same
slot: never more than `preview.concurrency` worker processes, and each one that dies or is killed is
reaped before its slot starts another.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from multiprocessing.connection import Connection
from types import MappingProxyType
from typing import Any, NamedTuple

from webhook.config import Settings
from webhook.errors import PreviewFailed, RequestError
from webhook.mutation.facts import NO_CLUSTER, NO_FACTS, ClusterFacts, ExportedFacts, NodeFacts, NodeSnapshot
from webhook.preview.render import Previewed, PreviewQuery
from webhook.review import NamespaceFacts

log = logging.getLogger(__name__)

FactsExport = Callable[[], tuple[ExportedFacts, NodeSnapshot | None]]
ASK, ANSWER = "ask", "answer"  # a worker's question about nodes, mid-job, and its reply
TAKEN = "taken"  # a worker has the job: a death from here on may be the job's doing
CHUNK = 5000  # nodes per answer when a worker needs all of them


def no_cluster_export() -> tuple[ExportedFacts, NodeSnapshot | None]:
    return NO_FACTS, None


def answer(snapshot: NodeSnapshot | None, kind: str, arg: Any) -> Any:
    """A worker's question, answered from the job's snapshot: "label" (key, value) -> (names, their
    facts); "nodes" [names] -> {name: facts or None}; "names" -> every node name."""
    if snapshot is None:
        return ((), {}) if kind == "label" else ({} if kind == "nodes" else [])
    if kind == "label":
        names = tuple(snapshot.by_label.get(tuple(arg), ()))
        return names, {name: snapshot.nodes[name] for name in names}
    if kind == "nodes":
        return {name: snapshot.nodes.get(name) for name in arg}
    return list(snapshot.nodes)


class _Job(NamedTuple):
    body: bytes
    content_type: str
    query: PreviewQuery
    settings: Settings
    facts: ExportedFacts


class WorkerDied(Exception):
    """The worker process died before answering, its deadline not passed; `taken`: it had taken the job."""

    def __init__(self, taken: bool, exitcode: int | None) -> None:
        super().__init__(f"preview worker died ({_death(exitcode)}) {'running' if taken else 'before'} its job")
        self.taken, self.exitcode = taken, exitcode


def _death(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"killed by signal {-exitcode}"


class Worker:
    """One worker process; `run` blocks (call it from a thread) until the answer or the deadline."""

    def __init__(self) -> None:
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def _start(self) -> Connection:
        context = multiprocessing.get_context("spawn")  # no fork of a threaded server
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child,), name="copilot-webhook-preview", daemon=True)
        process.start()
        child.close()
        self._process, self._conn = process, parent
        return parent

    def stop(self) -> int | None:
        """Kill and reap the process; its exit code (None when there was none)."""
        exitcode = None
        if self._process is not None:
            self._process.kill()
            self._process.join(timeout=5)
            exitcode = self._process.exitcode
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None
        return exitcode

    def _live(self) -> Connection:
        """The pipe to a live process: the one running, else a fresh one (the dead one reaped first)."""
        process, conn = self._process, self._conn
        if process is not None and conn is not None and process.is_alive():
            return conn
        if process is not None:
            log.warning("preview worker died (%s) between jobs; starting a fresh one", _death(self.stop()))
        self.stop()
        return self._start()

    def run(self, job: _Job, deadline: float, snapshot: NodeSnapshot | None = None) -> Previewed:
        """The job's answer by `deadline` (time.monotonic()): PreviewFailed past it (the process killed),
        WorkerDied if the process dies first."""
        conn = self._live()
        taken = False
        try:
            conn.send(job)
            while True:
                message = self._next(conn, deadline, job)
                if message[0] == TAKEN:
                    taken = True
                elif message[0] == ASK:
                    conn.send((ANSWER, answer(snapshot, message[1], message[2])))
                else:
                    break
        except (EOFError, OSError):  # BrokenPipeError and ConnectionResetError included
            raise WorkerDied(taken, self.stop()) from None
        status, result = message
        if status != 200:
            raise PreviewFailed(status, result)
        previewed: Previewed = result
        return previewed

    def _next(self, conn: Connection, deadline: float, job: _Job) -> Any:
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            self.stop()
            timeout = job.settings.preview.timeout_seconds
            raise PreviewFailed(503, f"preview took longer than preview.timeoutSeconds ({timeout:g} s); stopped")
        return conn.recv()


_KILLER = (
    "the document made the preview worker die: two workers died running it ({how}); it was not run a third"
    " time, and sending it again will do the same"
)


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
        self, worker: Worker, body: bytes, content_type: str, *, query: PreviewQuery, settings: Settings
    ) -> Previewed:
        """The preview's answer from `worker`. A death of its process (not a timeout) runs the job once more,
        on a fresh process, by the same deadline; 422 when both processes had taken the job."""
        facts, snapshot = self._export()
        job = _Job(body, content_type, query, settings, facts)
        deadline = time.monotonic() + settings.preview.timeout_seconds
        try:
            return worker.run(job, deadline, snapshot)
        except WorkerDied as exc:
            first = exc
        log.warning("%s; running it again on a fresh worker", first)
        try:  # at most once more, within the same deadline
            return worker.run(job, deadline, snapshot)
        except WorkerDied as second:
            log.warning("%s, the second time", second)
            if first.taken and second.taken:
                raise PreviewFailed(422, _KILLER.format(how=_death(second.exitcode))) from None
            raise PreviewFailed(503, "the preview worker stopped; try again") from None

    def stop(self) -> None:
        with self._lock:
            for worker in self._free:
                worker.stop()


# --- in the worker process ---------------------------------------------------------------------------------


class _Nodes(Mapping[str, NodeFacts]):
    """The server's nodes as the worker sees them: each asked for once, then kept for the job."""

    def __init__(self, ask: Callable[[str, Any], Any], count: int) -> None:
        self._ask, self._count = ask, count
        self.known: dict[str, NodeFacts | None] = {}
        self._complete = False

    def _lookup(self, name: str) -> NodeFacts | None:
        if name not in self.known and not self._complete:
            self.known.update(self._ask("nodes", [name]))
        return self.known.get(name)

    def __getitem__(self, name: str) -> NodeFacts:
        facts = self._lookup(name)
        if facts is None:
            raise KeyError(name)
        return facts

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._lookup(name) is not None

    def __iter__(self) -> Iterator[str]:
        if not self._complete:  # a constraint the label index cannot narrow: every node, in chunks
            names = self._ask("names", None)
            for start in range(0, len(names), CHUNK):
                self.known.update(self._ask("nodes", names[start : start + CHUNK]))
            self._complete = True
        return (name for name, facts in self.known.items() if facts is not None)

    def __len__(self) -> int:
        return self._count


class _Index(Mapping[tuple[str, str], Collection[str]]):
    def __init__(self, ask: Callable[[str, Any], Any], nodes: _Nodes) -> None:
        self._ask, self._nodes = ask, nodes
        self._known: dict[tuple[str, str], Collection[str]] = {}

    def __getitem__(self, pair: tuple[str, str]) -> Collection[str]:
        if pair not in self._known:
            names, facts = self._ask("label", list(pair))
            self._nodes.known.update(facts)  # the pod's constraints read these nodes next
            self._known[pair] = names
        if not self._known[pair]:
            raise KeyError(pair)
        return self._known[pair]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        raise TypeError("the label index is asked for one entry at a time")

    def __len__(self) -> int:
        raise TypeError("the label index is asked for one entry at a time")


def _lookup(facts: ExportedFacts, conn: Connection) -> NamespaceFacts:
    if facts.namespaces is None and facts.node_state == "none":
        return lambda _namespace: NO_CLUSTER

    def ask(kind: str, arg: Any) -> Any:
        conn.send((ASK, kind, arg))
        reply = conn.recv()
        return reply[1]

    nodes = _Nodes(ask, facts.node_count)
    snapshot = NodeSnapshot(nodes, MappingProxyType(facts.groups), _Index(ask, nodes))
    namespaces = facts.namespaces or {}
    return lambda namespace: ClusterFacts(namespaces.get(namespace), snapshot, facts.node_state)


def _serve(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the server, which stops us
    os.nice(10)  # where cores are short, admission reviews come first
    from webhook.preview import render  # imported here: the spawned interpreter starts empty

    while True:
        try:
            job: _Job = conn.recv()
            conn.send((TAKEN,))
        except (EOFError, OSError):
            return  # the server is gone
        try:
            previewed = render.preview(
                job.body, job.content_type, job.query, settings=job.settings, namespaces=_lookup(job.facts, conn)
            )
            conn.send((200, previewed))
        except RequestError as exc:
            conn.send((exc.status, exc.message))
        except Exception as exc:
            log.exception("preview failed")
            conn.send((500, f"preview failed ({type(exc).__name__}); the server logged the details"))
