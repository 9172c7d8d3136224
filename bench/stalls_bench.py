"""What the event-loop monitor (webhook/web/stalls.py) costs, in-process, on uvloop as the server runs it (with
the interpreter's switch interval the server sets when it has cluster access, as it has in a cluster).

    python bench/stalls_bench.py [--seconds 3] [--repeat 7]

- one probe wake-up timed alone (the clock, the histogram, the next timer; the timer cancelled after), and
  one look of the watchdog at a loop on time;
- how often each runs while the loop is busy: the probe every 50 ms, the watchdog's wake-ups counted;
- /mutate/ptrace on a saturated loop, the monitor on and off in alternating runs: the loop does nothing but
  answer the Flyte 1.15 review (bench/data) through `WebhookApp.answer`, the code the connection runs for an
  admission request, one answer per callback; answers per CPU-second of the process (every thread: the
  watchdog's wake-ups and its handing over of the interpreter lock are in it; other processes' load mostly
  is not) with the monitor over the same without it, per pair of runs.

Prints a Markdown table of medians over `repeat` runs (pairs for the ratio, with its range).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import ClassVar

import uvloop

from webhook.config import build_settings
from webhook.web import stalls
from webhook.web.metrics import Metrics
from webhook.web.serve import SWITCH_INTERVAL
from webhook.web.server import WebhookApp
from webhook.web.stalls import INTERVAL, Beat, LoopMonitor

REVIEW = (Path(__file__).parent / "data" / "flyte-1.15-review.json").read_bytes()


def _monitor(metrics: Metrics) -> LoopMonitor:
    return LoopMonitor(metrics.event_loop_lag.observe, metrics.event_loop_stalls.inc)


def one_wake_us(number: int = 20000) -> float:
    """A probe wake-up called directly, its timer cancelled after (the cancel is in the figure)."""

    async def run() -> float:
        monitor = _monitor(Metrics())
        monitor.start(asyncio.get_running_loop())
        try:
            wake = monitor._wake

            def once() -> None:
                wake()
                handle = monitor._handle
                assert handle is not None
                handle.cancel()

            return timeit.timeit(once, number=number) / number * 1e6
        finally:
            monitor.stop()

    return uvloop.run(run())


def one_look_us(number: int = 20000) -> float:
    """The watchdog's look at a loop whose next wake-up is not yet due."""
    watchdog = stalls._Watchdog(_monitor(Metrics()))
    beat = Beat(time.monotonic() + 3600, 0, 0.0, 0.0)
    return timeit.timeit(lambda: watchdog.check(beat, time.monotonic(), 0.0), number=number) / number * 1e6


class _CountedWatchdog(stalls._Watchdog):
    """Counts its looks and the CPU time of its thread (time.thread_time: its waits, wake-ups and looks)."""

    looks = 0
    cpu: ClassVar[list[float]] = []

    def check(self, beat: Beat, now: float, late: float) -> float:
        _CountedWatchdog.looks += 1
        _CountedWatchdog.cpu.append(time.thread_time())
        return super().check(beat, now, late)


def answers_per_cpu_second(seconds: float, monitored: bool) -> tuple[float, float, float]:
    """Answers per CPU-second of a loop doing nothing but admission; the watchdog's looks per second and its
    thread's CPU µs per second."""
    app = WebhookApp(build_settings({}), Metrics())
    gc.collect()
    gc.freeze()  # as the server does before it serves

    def write(_status: int, _body: bytes) -> None:
        pass

    async def run() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        count = 0

        def answer() -> None:
            nonlocal count
            app.answer("/mutate/ptrace", REVIEW, time.perf_counter(), write)
            count += 1
            if not done.is_set():
                loop.call_soon(answer)

        monitor = _monitor(app.metrics) if monitored else None
        _CountedWatchdog.looks, _CountedWatchdog.cpu = 0, []
        if monitor is not None:
            monitor.start(loop)
        started, cpu = time.perf_counter(), time.process_time()
        loop.call_soon(answer)
        loop.call_later(seconds, done.set)
        await done.wait()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        if monitor is not None:
            monitor.stop()
        spent = _CountedWatchdog.cpu[-1] - _CountedWatchdog.cpu[0] if _CountedWatchdog.cpu else 0.0
        return count / cpu, _CountedWatchdog.looks / elapsed, spent / elapsed * 1e6

    return uvloop.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    stalls._Watchdog = _CountedWatchdog  # type: ignore[misc]
    sys.setswitchinterval(SWITCH_INTERVAL)
    wake = statistics.median(one_wake_us() for _ in range(args.repeat))
    look = statistics.median(one_look_us() for _ in range(args.repeat))
    ratios, bare, watched, looks, watchdog_cpu, per_wake = [], [], [], [], [], []
    answers_per_cpu_second(1.0, monitored=True)  # warm-up
    for pair in range(args.repeat):
        # Side by side, and each first in every other pair: a drift of the process or the machine over the
        # runs falls on both alike.
        if pair % 2:
            with_monitor, looked, spent = answers_per_cpu_second(args.seconds, monitored=True)
            without = answers_per_cpu_second(args.seconds, monitored=False)[0]
        else:
            without = answers_per_cpu_second(args.seconds, monitored=False)[0]
            with_monitor, looked, spent = answers_per_cpu_second(args.seconds, monitored=True)
        bare.append(without)
        watched.append(with_monitor)
        looks.append(looked)
        watchdog_cpu.append(spent)
        marks = _CountedWatchdog.cpu
        per_wake += [(b - a) * 1e6 for a, b in itertools.pairwise(marks)]
        ratios.append(with_monitor / without)
    print(
        f"{args.repeat} pairs of {args.seconds:g} s runs, probe every {INTERVAL * 1000:g} ms, "
        f"switch interval {SWITCH_INTERVAL * 1000:g} ms"
    )
    print("| measure | median |")
    print("|---|---:|")
    print(f"| one probe wake-up alone | {wake:.2f} µs |")
    print(f"| one watchdog look alone (loop on time) | {look:.2f} µs |")
    print(f"| probe wake-ups per second | {1 / INTERVAL:.0f} |")
    print(f"| watchdog looks per second, loop saturated | {statistics.median(looks):.1f} |")
    print(f"| watchdog thread's CPU per wake-up and look, loop saturated | {statistics.median(per_wake):.0f} µs |")
    print(f"| the slowest of them | {max(per_wake):.0f} µs |")
    print(f"| watchdog thread's CPU per second, loop saturated | {statistics.median(watchdog_cpu):.0f} µs |")
    print(f"| /mutate/ptrace answers per CPU-second, without the monitor | {statistics.median(bare):,.0f} |")
    print(f"| /mutate/ptrace answers per CPU-second, with it | {statistics.median(watched):,.0f} |")
    print(
        f"| with ÷ without, per pair | {statistics.median(ratios):.4f} (range {min(ratios):.4f} to {max(ratios):.4f}) |"
    )


if __name__ == "__main__":
    main()
