"""Event-loop lag and stalls: how late the loop runs a timer, and what held it when it was late.

A probe on the loop asks to be woken every `INTERVAL` seconds; how late each wake-up comes is the loop's lag,
the wait a request arriving then would have had before the loop read it. A wake-up later than
`STALL_SECONDS` is a stall. A stall of at least `STALL_SECONDS + INTERVAL` is always counted (the probe may
have been due anywhere inside a shorter one).

A watchdog thread, not the loop, finds out what held it: it sleeps until the probe's next wake-up is
`STALL_SECONDS` overdue and, if it still has not come, samples the loop thread's stack there and then
(`sys._current_frames()`), which shows what holds the loop rather than what the loop does once free. After the
stall it logs one line: how late, the stack, and, when the watchdog itself woke late, that the interpreter or
the process was held (another thread holding the interpreter lock, the CPU limit's throttling, the node) with
where the other threads stood. At most one line each `LOG_EVERY` seconds, naming the stalls left unlogged; a
stall still going on after `STILL_HELD` seconds is logged then, since it may never end.

On the loop, a wake-up costs a clock read, a histogram observation and a timer (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import NamedTuple

log = logging.getLogger(__name__)

INTERVAL = 0.05
# A loop late by 100 ms holds every request in flight for many times the /mutate median (docs/performance.md)
# and shows in the p99 that pod creation feels; below it, a busy node's scheduling noise would count too. A bucket
# bound of the lag histogram (metrics.py), so the histogram and the counter agree.
STALL_SECONDS = 0.1
LOG_EVERY = 60.0
STILL_HELD = 5.0
FRAMES = 12  # of the loop thread's stack, innermost first
_MARGIN = 0.005  # the watchdog wakes this much after the bound, so an overdue wake-up is past it
# Where a stack leaves the code the loop runs for the loop's own machinery: asyncio's callback runner and its
# turn, and the frame that started uvloop's (which runs callbacks from C).
_LOOP_RUNNERS = {
    ("asyncio.events", "Handle._run"),
    ("asyncio.base_events", "BaseEventLoop._run_once"),
    ("asyncio.runners", "Runner.run"),
}


IN_THE_LOOP = "the event loop's own code"


class Beat(NamedTuple):
    """What the probe last wrote, one assignment the watchdog reads whole."""

    due: float  # when the next wake-up is due (time.monotonic)
    stalls: int  # stalls so far
    stall_due: float  # when the latest stall's wake-up was due
    stall_lag: float  # and how late it came


class Sample(NamedTuple):
    due: float  # the wake-up that was overdue
    stack: str
    watchdog_late: float  # how late the watchdog itself woke to take it
    others: str  # where the other threads stood, when the watchdog was late too


def stack(frame: FrameType | None, limit: int = FRAMES) -> str:
    """`module:line function` for each frame, innermost first, joined by ' < ' (called by), down to the frame
    that runs the loop's callbacks."""
    parts: list[str] = []
    while frame is not None and len(parts) < limit:
        code = frame.f_code
        module = frame.f_globals.get("__name__", code.co_filename)
        if (module, code.co_qualname) in _LOOP_RUNNERS:
            return " < ".join(parts) or IN_THE_LOOP
        parts.append(f"{module}:{frame.f_lineno} {code.co_qualname}")
        frame = frame.f_back
    if frame is not None:
        parts.append("...")
    return " < ".join(parts) or "no Python frame"


def _not_started(_delay: float, _callback: Callable[[], None]) -> asyncio.TimerHandle:
    raise RuntimeError("LoopMonitor.start was not called")


class LoopMonitor:
    """The probe (`start` on the loop's thread) and its watchdog thread; `stop` ends both."""

    def __init__(
        self,
        observe: Callable[[float], None],
        stalled: Callable[[], None],
        *,
        interval: float = INTERVAL,
        bound: float = STALL_SECONDS,
        log_every: float = LOG_EVERY,
        still_held: float = STILL_HELD,
    ) -> None:
        self._observe, self._stalled = observe, stalled
        self._interval, self._bound, self._log_every, self._still_held = interval, bound, log_every, still_held
        self._beat = Beat(0.0, 0, 0.0, 0.0)
        self._call_later: Callable[[float, Callable[[], None]], asyncio.TimerHandle] = _not_started
        self._handle: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None
        self._loop_thread = 0
        # Held while the watchdog runs; stop() releases it. The watchdog sleeps in its timed acquire: one step
        # under the interpreter lock at each wake-up, where an Event's wait takes several (its condition's lock,
        # a new waiter), each a hand-over of the interpreter lock by a busy loop thread (docs/performance.md).
        self._running = threading.Lock()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start probing `loop`, which runs in the calling thread, and watching it."""
        self._call_later, self._loop_thread = loop.call_later, threading.get_ident()
        self._running.acquire()
        self._beat = Beat(time.monotonic() + self._interval, 0, 0.0, 0.0)
        self._handle = loop.call_later(self._interval, self._wake)
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._thread is not None:
            self._running.release()
            # A watchdog held in a log write (the loop thread holding the handler's lock) must not hold the exit.
            self._thread.join(timeout=1)
            self._thread = None

    def _wake(self) -> None:
        now = time.monotonic()
        beat = self._beat
        lag = max(now - beat.due, 0.0)
        self._observe(lag)
        if lag > self._bound:
            self._stalled()
            beat = Beat(beat.due, beat.stalls + 1, beat.due, lag)
        self._beat = Beat(now + self._interval, beat.stalls, beat.stall_due, beat.stall_lag)
        self._handle = self._call_later(self._interval, self._wake)

    def _watch(self) -> None:
        watchdog = _Watchdog(self)
        planned = time.monotonic()
        while True:
            now = time.monotonic()
            planned = watchdog.check(self._beat, now, now - planned)
            if self._running.acquire(timeout=max(planned - now, 0.0)):
                self._running.release()
                return

    def loop_stack(self) -> str:
        frame = sys._current_frames().get(self._loop_thread)
        try:
            return stack(frame)
        finally:
            del frame

    def other_threads(self) -> str:
        """Each other thread's innermost frame, by thread name."""
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        mine = (self._loop_thread, threading.get_ident())
        frames = {ident: frame for ident, frame in sys._current_frames().items() if ident not in mine}
        try:
            return "; ".join(f"{names.get(ident, ident)} at {stack(frame, 1)}" for ident, frame in frames.items())
        finally:
            del frames


class _Watchdog:
    """The watchdog thread's state: the sample of the stall in progress and what was logged."""

    def __init__(self, monitor: LoopMonitor) -> None:
        self.monitor = monitor
        self.sample: Sample | None = None
        self.logged_stalls = 0  # the probe's stall count when the last line was logged or skipped
        self.unlogged = 0  # stalls since the last line that got none
        self.last_line = -float("inf")
        self.held_logged = -1.0  # the due of a stall logged while still held

    def check(self, beat: Beat, now: float, late: float) -> float:
        """Look at the probe's beat at `now` (the watchdog woke `late`); when to look next."""
        monitor = self.monitor
        overdue = now - beat.due
        if overdue > monitor._bound:
            if self.sample is None or self.sample.due != beat.due:
                if now - self.last_line >= monitor._log_every:
                    others = monitor.other_threads() if late > monitor._bound else ""
                    self.sample = Sample(beat.due, monitor.loop_stack(), late, others)
            elif overdue > monitor._still_held and self.held_logged != beat.due:
                self.held_logged = beat.due
                self._line(f"event loop held for {overdue * 1000:.0f} ms so far", self.sample, now)
        if beat.stalls != self.logged_stalls:
            self._ended(beat, now, late)
        if overdue > monitor._bound:
            return now + monitor._interval  # until it ends
        return beat.due + monitor._bound + _MARGIN

    def _ended(self, beat: Beat, now: float, late: float) -> None:
        new = beat.stalls - self.logged_stalls
        self.logged_stalls = beat.stalls
        if self.held_logged == beat.stall_due:
            self.unlogged += new - 1
            return
        if now - self.last_line < self.monitor._log_every:
            self.unlogged += new
            return
        sample = self.sample if self.sample is not None and self.sample.due == beat.stall_due else None
        self.unlogged += new - 1
        self._line(f"event loop stalled: a timer ran {beat.stall_lag * 1000:.0f} ms late", sample, now, late)

    def _line(self, what: str, sample: Sample | None, now: float, late: float = 0.0) -> None:
        bound = self.monitor._bound
        late = sample.watchdog_late if sample is not None else late
        if late > bound:
            where = (
                f"the watchdog itself woke {late * 1000:.0f} ms late, so the interpreter or the process was held "
                "(another thread holding the interpreter lock, CPU throttling, the process stopped)"
            )
            if sample is not None:
                where += f"; the loop thread was at {sample.stack}; other threads: {sample.others or 'none'}"
        elif sample is None:
            where = "not sampled: the loop was free again before the watchdog looked"
        elif sample.stack == IN_THE_LOOP:
            where = (
                f"the loop thread was in {IN_THE_LOOP} (waiting for events, or between callbacks), so it did not "
                "get the CPU or the interpreter lock in time (CPU throttling, a busy node, another thread holding "
                "the lock)"
            )
        else:
            where = f"held by the loop thread at {sample.stack}"
        more = f"; {self.unlogged} more since the last line" if self.unlogged else ""
        log.warning("%s (stall bound %.0f ms): %s%s", what, bound * 1000, where, more)
        self.unlogged = 0
        self.last_line = now
