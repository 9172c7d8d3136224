"""A preview worker that dies costs no preview but the one that killed it.

The real pool, real spawned workers, each killed at a point: idle between previews (kill -9 from outside),
after the pool found it alive and before the job reached it, while it parses, while it diffs, just after it
answered. Every preview there is answered 200 with the same bytes as an undisturbed one. A body that kills
every worker it reaches is answered 422 after its second death; a preview that outlives
`preview.timeoutSeconds` is not run again, and the run again shares the first run's deadline. The workers die
at those points through `tests.worker_hooks`, put in place of the worker's entry point by monkeypatch: nothing
in a request can ask for it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import httpx
import pytest

from harness.server_process import running_server
from tests import worker_hooks
from tests.asgi import call
from tests.helpers import PODS
from webhook.config import build_settings
from webhook.preview import workers
from webhook.preview.render import PreviewQuery, preview
from webhook.web.server import WebhookApp

ROUNDS = 20  # deaths per point
SECONDS = 240  # at most, per test: a fresh worker takes well under a second to start
POD_YAML = (PODS / "flyte-1.15-bare.yaml").read_bytes()
DIFF = preview(POD_YAML, "application/yaml", PreviewQuery.of({"output": "diff"}), settings=build_settings({})).content


class Pool:
    """A WebhookApp whose preview workers run `tests.worker_hooks` with `point`, and what they wrote."""

    def __init__(self, folder: Path, concurrency: int = 1, timeout: float = 10) -> None:
        self.folder, self.concurrency = folder, concurrency
        preview = {"concurrency": concurrency, "timeoutSeconds": timeout}
        self.app = WebhookApp(build_settings({"preview": preview}))
        self.seen: set[int] = set()  # every worker pid met
        # Workers of other servers this test process ran before (their apps are not this pool's).
        (folder / "others").write_text(" ".join(map(str, worker_hooks.workers(os.getpid()))))
        self.give_up = time.monotonic() + SECONDS

    def preview(self, body: bytes = POD_YAML) -> httpx.Response:
        assert time.monotonic() < self.give_up, f"not done within {SECONDS} s"
        res = call(self.app, "POST", "/preview?output=diff", body, content_type="application/yaml")
        self.seen.update(self.workers())
        return res

    def workers(self) -> list[int]:
        """This pool's live worker processes."""
        foreign = worker_hooks.others(str(self.folder))
        return [pid for pid in worker_hooks.workers(os.getpid()) if pid not in foreign]

    def arm(self) -> None:
        (self.folder / "kill").write_text("")

    def taken(self) -> bool:
        """Whether a worker took the `kill` token; waits for it a little (a worker takes it after answering)."""
        until = time.monotonic() + 10
        while (self.folder / "kill").exists() and time.monotonic() < until:
            time.sleep(0.01)
        return not (self.folder / "kill").exists()

    def started(self) -> list[tuple[int, int]]:
        """(pid, live workers then) for each worker started."""
        path = self.folder / "started"
        lines = path.read_text().splitlines() if path.exists() else []
        return [(int(pid), int(live)) for pid, live in (line.split() for line in lines)]

    def check(self) -> None:
        """No worker killed or dead is left unreaped; never more workers than preview.concurrency."""
        states = worker_hooks.children(os.getpid())
        ever = self.seen | {pid for pid, _ in self.started()}
        assert [pid for pid in ever if states.get(pid) == "Z"] == [], "a dead worker left unreaped"
        assert len(self.workers()) <= self.concurrency
        assert all(live <= self.concurrency for _, live in self.started())


@pytest.fixture
def pool(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    options = dict(getattr(request, "param", {}))
    point = options.pop("point", "none")
    monkeypatch.setattr(workers, "_serve", worker_hooks.hooked(point, tmp_path))
    made = Pool(tmp_path, **options)
    try:
        yield made
    finally:
        made.app.previewer.stop()
    made.check()


def _ok(res: httpx.Response) -> None:
    assert (res.status_code, res.content) == (200, DIFF), res.text[:300]


def _answer(res: httpx.Response) -> str:
    """200 with the undisturbed preview's bytes, as "ok"; else the status and the error."""
    return "ok" if (res.status_code, res.content) == (200, DIFF) else f"{res.status_code} {res.text[:120]}"


def _all_ok(answers: list[str]) -> None:
    failed = [a for a in answers if a != "ok"]
    assert failed == [], f"{len(failed)} of {len(answers)} previews failed"


def test_a_preview_just_after_its_idle_worker_was_killed_is_answered(pool: Pool) -> None:
    answers = []
    for _ in range(ROUNDS):
        if not pool.workers():
            _ok(pool.preview())  # an idle worker to kill
        (worker,) = pool.workers()
        os.kill(worker, signal.SIGKILL)
        answers.append(_answer(pool.preview()))
        pool.check()
    _all_ok(answers)


def _zombie(pid: int) -> None:
    until = time.monotonic() + 10
    while worker_hooks.children(os.getpid()).get(pid) != "Z":
        assert time.monotonic() < until, f"worker {pid} was killed and did not die"
        time.sleep(0.001)


def test_a_preview_whose_worker_dies_after_it_was_found_alive_is_answered(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker dies between the pool's check that it lives and the job's send."""
    armed = threading.Event()
    is_alive = BaseProcess.is_alive

    def alive_then_dead(process: BaseProcess) -> bool:
        alive = is_alive(process)
        if alive and process.name == "copilot-webhook-preview" and armed.is_set():
            armed.clear()
            assert process.pid is not None
            os.kill(process.pid, signal.SIGKILL)
            _zombie(process.pid)  # dead, not yet reaped: nothing told the pool
        return alive

    monkeypatch.setattr(BaseProcess, "is_alive", alive_then_dead)
    answers = []
    for _ in range(ROUNDS):
        if not pool.workers():
            _ok(pool.preview())  # a live worker to find alive
        armed.set()
        answers.append(_answer(pool.preview()))
        assert not armed.is_set(), "the worker was found alive and killed"
        pool.check()
    _all_ok(answers)


@pytest.mark.parametrize("pool", [{"point": "parse"}, {"point": "diff"}], indirect=True, ids=["parse", "diff"])
def test_a_preview_whose_worker_dies_mid_job_is_run_again_on_a_fresh_one(pool: Pool) -> None:
    answers = []
    for _ in range(ROUNDS):
        pool.arm()
        answers.append(_answer(pool.preview()))
        assert pool.taken()
        pool.check()
    _all_ok(answers)
    assert len(pool.started()) == ROUNDS + 1, "one fresh worker per death"


@pytest.mark.parametrize("pool", [{"point": "answered"}], indirect=True, ids=["answered"])
def test_a_worker_that_dies_just_after_answering_costs_no_preview(pool: Pool) -> None:
    answers = []
    for _ in range(ROUNDS):
        pool.arm()
        answers.append(_answer(pool.preview()))  # its worker dies after this answer; the next one meets it dead
        pool.taken()
    answers.append(_answer(pool.preview()))
    pool.check()
    _all_ok(answers)
    assert len(pool.started()) == ROUNDS + 1, "one fresh worker per death"


def test_a_body_that_kills_its_worker_twice_is_answered_422_not_run_a_third_time(pool: Pool) -> None:
    _ok(pool.preview())
    for _ in range(5):
        before = len(pool.started())
        res = pool.preview(POD_YAML + b"\n# " + worker_hooks.DIES + b"\n")
        assert res.status_code == 422, res.text
        assert "the document made the preview worker die" in res.json()["error"]
        assert "retry-after" not in res.headers
        assert len(pool.started()) == before + 1, "one run again, on a fresh worker; no third"
        pool.check()
        _ok(pool.preview())
    metrics = call(pool.app, "GET", "/metrics").text
    assert 'copilot_webhook_requests_total{path="/preview",result="worker_died"} 5.0' in metrics


@pytest.mark.parametrize("pool", [{"point": "parse", "timeout": 1}], indirect=True, ids=["timeout-1s"])
def test_a_preview_past_its_timeout_is_stopped_and_not_run_again(pool: Pool) -> None:
    _ok(pool.preview())
    (pool.folder / "sleep").write_text("5")
    for _ in range(3):
        before = len(pool.started())
        res = pool.preview(POD_YAML + b"\n# " + worker_hooks.SLEEPS + b"\n")
        assert res.status_code == 503, res.text
        assert "preview.timeoutSeconds (1 s)" in res.json()["error"]
        assert len(pool.started()) in (before, before + 1)  # a fresh worker only when the last one was stopped
        pool.check()
    (pool.folder / "sleep").write_text("0")
    _ok(pool.preview())


@pytest.mark.parametrize("pool", [{"point": "parse", "timeout": 3}], indirect=True, ids=["timeout-3s"])
def test_the_run_again_has_what_is_left_of_the_first_runs_deadline(pool: Pool) -> None:
    """2 s, then a death, then 2 s more on a fresh worker: past the 3 s both share, so stopped (503)."""
    _ok(pool.preview())
    (pool.folder / "sleep").write_text("2")
    pool.arm()
    before = len(pool.started())
    res = pool.preview(POD_YAML + b"\n# " + worker_hooks.SLEEPS + b"\n")
    assert res.status_code == 503, res.text
    assert "preview.timeoutSeconds (3 s)" in res.json()["error"]
    assert pool.taken()
    assert len(pool.started()) == before + 1
    pool.check()


@pytest.mark.parametrize("pool", [{"point": "parse", "concurrency": 2}], indirect=True, ids=["concurrency-2"])
def test_deaths_among_concurrent_previews_keep_within_the_worker_bound(pool: Pool) -> None:
    answers: list[httpx.Response] = []

    def two() -> None:
        answers.append(pool.preview())

    for _ in range(ROUNDS // 2):
        pool.arm()
        threads = [threading.Thread(target=two) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert pool.taken()
        pool.check()
    _all_ok([_answer(res) for res in answers])
    assert len(answers) == ROUNDS


def test_the_server_answers_a_preview_sent_just_after_its_idle_worker_was_killed(tls_dir: Path, tmp_path: Path) -> None:
    """kill -9 of the idle worker, as an OOM kill, then a preview at once: each one 200."""
    with running_server(tls_dir, tmp_path / "srv") as server, server.client() as client:

        def send() -> httpx.Response:
            headers = {"content-type": "application/yaml"}
            return client.post("/preview?output=diff", content=POD_YAML, headers=headers)

        statuses = []
        for _ in range(ROUNDS):
            if not worker_hooks.workers(server.process.pid):
                assert send().status_code == 200  # an idle worker to kill
            (worker,) = worker_hooks.workers(server.process.pid)
            os.kill(worker, signal.SIGKILL)
            statuses.append(send().status_code)
        assert statuses == [200] * ROUNDS, f"{ROUNDS - statuses.count(200)} of {ROUNDS} failed: {statuses}"
        assert "Z" not in worker_hooks.children(server.process.pid).values()
