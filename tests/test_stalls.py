"""Event-loop stalls (webhook/web/stalls.py): a real event loop, asyncio's and uvloop's (the server's), blocked on
purpose by time.sleep in a callback, is seen late by the probe (histogram, counter) and named by the watchdog's
sample of the loop thread's stack, in one log line; and the real server process, stopped by SIGSTOP, counts
the stall in its /metrics and logs that the process itself was held."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import uvloop

from harness.environment import eventually
from harness.server_process import running_server
from webhook.web.metrics import LATENCY_BUCKETS, Metrics
from webhook.web.stalls import STALL_SECONDS, LoopMonitor

LOGGER = "webhook.web.stalls"
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def hold_the_loop_on_purpose(seconds: float) -> None:
    time.sleep(seconds)


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


def _stalls(metrics: Metrics) -> float:
    return _value(metrics, "copilot_webhook_event_loop_stalls_total")


def _late(metrics: Metrics) -> float:
    """Lag observations above the stall bound, read from the histogram alone."""
    lag = "copilot_webhook_event_loop_lag_seconds"
    return _value(metrics, f"{lag}_count") - _value(metrics, f"{lag}_bucket", le=f"{STALL_SECONDS}")


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def _watch(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
    body: Callable[[asyncio.AbstractEventLoop], Awaitable[None]],
    caplog: pytest.LogCaptureFixture,
    **options: float,
) -> Metrics:
    """Run `body` on a fresh loop under a monitor; wait, still on the loop, until the watchdog has had its say."""
    metrics = Metrics()
    monitor = LoopMonitor(metrics.event_loop_lag.observe, metrics.event_loop_stalls.inc, **options)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        monitor.start(loop)
        try:
            await asyncio.sleep(0.3)  # wake-ups on time first
            await body(loop)
            deadline = time.monotonic() + 5
            while (_stalls(metrics) == 0 or not _lines(caplog)) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # and a moment for a line too many
        finally:
            monitor.stop()

    with caplog.at_level(logging.WARNING, logger=LOGGER), asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
    return metrics


async def _hold(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    """Block the loop for `seconds` in a callback of its own, then give it back for two wake-ups."""
    loop.call_soon(hold_the_loop_on_purpose, seconds)
    await asyncio.sleep(0.12)


# A loaded machine stalls a loop of its own accord: each test allows stalls it did not cause, never fewer.


@pytest.mark.parametrize("loop", LOOPS)
def test_a_blocked_loop_is_counted_measured_and_named_in_one_line(loop: str, caplog: pytest.LogCaptureFixture) -> None:
    metrics = _watch(LOOPS[loop], lambda running: _hold(running, 0.35), caplog, log_every=0)
    assert _stalls(metrics) >= 1
    assert _late(metrics) == _stalls(metrics), "the histogram saw the same stalls"
    lag = "copilot_webhook_event_loop_lag_seconds"
    assert _value(metrics, f"{lag}_count") - _value(metrics, f"{lag}_bucket", le="0.25") >= 1, "ours: 0.25 s late"
    lines = _lines(caplog)
    assert len(lines) == _stalls(metrics), "one line per stall when nothing limits them"
    (line,) = [line for line in lines if "hold_the_loop_on_purpose" in line]
    assert "\n" not in line
    late = re.search(r"a timer ran (\d+) ms late", line)
    assert late, line
    assert int(late.group(1)) >= 250, line
    # The watchdog's sample: the blocking function, innermost, called by the loop (whose own frames are left out).
    held = re.search(r"held by the loop thread at (.*)$", line)
    assert held, line
    assert re.fullmatch(r"tests\.test_stalls:\d+ hold_the_loop_on_purpose", held.group(1)), line


def test_the_stall_bound_is_a_bucket_of_the_lag_so_the_counter_and_histogram_agree() -> None:
    assert STALL_SECONDS in LATENCY_BUCKETS


def test_a_storm_of_stalls_is_counted_whole_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    async def storm(loop: asyncio.AbstractEventLoop) -> None:
        for _ in range(8):
            await _hold(loop, 0.2)

    metrics = _watch(uvloop.new_event_loop, storm, caplog)
    assert _stalls(metrics) >= 8
    assert _late(metrics) == _stalls(metrics)
    assert len(_lines(caplog)) == 1


def _unlogged(line: str) -> int:
    more = re.search(r"; (\d+) more since the last line$", line)
    return int(more.group(1)) if more else 0


def test_the_next_line_after_the_quiet_time_names_the_stalls_left_unlogged(caplog: pytest.LogCaptureFixture) -> None:
    async def two_bursts(loop: asyncio.AbstractEventLoop) -> None:
        for _ in range(3):
            await _hold(loop, 0.2)
        await asyncio.sleep(1.0)  # past log_every
        await _hold(loop, 0.2)

    metrics = _watch(uvloop.new_event_loop, two_bursts, caplog, log_every=0.9)
    lines = _lines(caplog)
    assert len(lines) >= 2, lines
    assert _unlogged(lines[1]) >= 2, "the burst's second and third"
    # Every stall is logged or named by a later line; only those after the last line may be neither.
    assert sum(1 + _unlogged(line) for line in lines) <= _stalls(metrics)


def test_a_stall_that_goes_on_is_logged_while_it_lasts_and_only_then(caplog: pytest.LogCaptureFixture) -> None:
    ended: list[float] = []

    async def long_hold(loop: asyncio.AbstractEventLoop) -> None:
        loop.call_soon(hold_the_loop_on_purpose, 1.2)
        await asyncio.sleep(0)
        ended.append(time.time())
        await asyncio.sleep(0.2)

    _watch(uvloop.new_event_loop, long_hold, caplog, still_held=0.5, log_every=0)
    (record,) = [r for r in caplog.records if r.name == LOGGER and "hold_the_loop_on_purpose" in r.getMessage()]
    assert re.search(r"event loop held for \d+ ms so far", record.getMessage())
    assert record.created < ended[0], "logged while the loop was still held"
    assert not [line for line in _lines(caplog) if re.search(r"ran \d{4,} ms late", line)], "and not again at its end"


def test_the_server_process_counts_a_stall_and_says_the_process_itself_was_held(tls_dir: Path, tmp_path: Path) -> None:
    """SIGSTOP holds every thread, the watchdog's too: the line must say the process, not the loop's code, was
    held."""
    with running_server(tls_dir, tmp_path) as server, server.client() as client:

        def stalls() -> float:
            text = client.get("/metrics").text
            found = re.search(r"^copilot_webhook_event_loop_stalls_total (\S+)$", text, re.MULTILINE)
            assert found, text
            return float(found.group(1))

        assert eventually(lambda: "copilot_webhook_event_loop_lag_seconds_count" in client.get("/metrics").text)
        before, logged_before = stalls(), _stall_lines(server.output())
        os.kill(server.process.pid, signal.SIGSTOP)
        time.sleep(0.5)
        os.kill(server.process.pid, signal.SIGCONT)
        assert eventually(lambda: stalls() >= before + 1, timeout=5)
        if logged_before:  # the machine stalled it first: the line of the minute is taken
            time.sleep(0.5)
            assert _stall_lines(server.output()) == logged_before
            return
        assert eventually(lambda: bool(_stall_lines(server.output())), timeout=5)
        time.sleep(0.5)
        (line,) = _stall_lines(server.output())
        assert "WARNING webhook.web.stalls: event loop stalled" in line
        assert "watchdog itself woke" in line, line


def _stall_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "webhook.web.stalls" in line]
