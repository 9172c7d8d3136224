"""bench/pods_bench.py's report of the tail, in-process: the worst slice, the p99.9, our server's loop over
each slice as its /metrics tells it, and the webhook calls as the API server and our server timed them."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import subprocess
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from bench.pods_bench import (
    API_WEBHOOK,
    Durations,
    LoopState,
    Phase,
    Totals,
    Usage,
    _measured,
    _spread,
    load,
    pool_report,
    report,
    run_turn,
    save,
    spread,
    turns,
    usage,
)

METRICS = """\
copilot_webhook_event_loop_lag_seconds_bucket{{le="0.001"}} {a}
copilot_webhook_event_loop_lag_seconds_bucket{{le="0.05"}} {b}
copilot_webhook_event_loop_lag_seconds_bucket{{le="0.1"}} {c}
copilot_webhook_event_loop_lag_seconds_bucket{{le="0.25"}} {d}
copilot_webhook_event_loop_lag_seconds_bucket{{le="+Inf"}} {d}
copilot_webhook_event_loop_stalls_total {stalls}
"""


def _state(a: int, b: int, c: int, d: int, stalls: int) -> LoopState:
    return LoopState.parse(METRICS.format(a=a, b=b, c=c, d=d, stalls=stalls))


def test_a_slice_reads_its_stalls_and_its_worst_lag_from_the_histogram() -> None:
    before = _state(100, 110, 110, 111, 1)
    assert _state(150, 210, 210, 211, 1).since(before) == (0, 0.05)  # half over 1 ms, none over 50 ms
    assert _state(200, 210, 211, 213, 3).since(before) == (2, 0.25)  # two over 100 ms: stalls
    assert _state(300, 300, 300, 300, 1).since(_state(300, 300, 300, 300, 1))[1] != 0.0  # nothing counted: NaN


def _phase(target: str, index: int, latencies_ms: list[float], stalls: float = 0.0) -> Phase:
    phase = Phase(target, 50, index, latencies=[ms / 1000 for ms in latencies_ms], stalls=stalls, worst_lag=0.05)
    phase.cpu = {"ours": 1.0, "go-floor": 1.0, "kube-apiserver": 1.0, "etcd": 1.0, "client": 1.0}
    return phase


def test_the_report_names_the_worst_slice_and_the_goals() -> None:
    quiet = [10.0] * 998
    phases = [
        *(_phase("none", i, [5.0] * 1000) for i in (1, 2)),
        _phase("ours", 1, [*quiet, 300.0, 300.0], stalls=2),
        _phase("ours", 2, [*[12.0] * 980, *[40.0] * 20]),
        *(_phase("ours-ptrace", i, [9.0] * 1000) for i in (1, 2)),
        *(_phase("go-floor", i, [8.0] * 990 + [20.0] * 10) for i in (1, 2)),
    ]
    args = argparse.Namespace(pods=2000, slices=2, connections=64, rates=[50], same_answer=False, steal_bound=50.0)
    info = {"load before": "0.1", "load after": "0.2", "chart webhooks": "x", "stall lines": ""}
    text = report(phases, args, info)
    ours = next(line for line in text.splitlines() if line.startswith("| 50/s | ours |"))
    cells = [c.strip() for c in ours.split("|")[1:-1]]
    assert cells[4:6] == ["300.0", "40.0"], "p99.9 from the pooled slices; the worst slice's p99"
    assert cells[-2:] == ["2", "50"], "our loop's stalls and worst lag over the target's slices"
    assert "worst slice p99 40.0 ms against go-floor's 20.0 ms: 2.00x (goal 2x)" in text
    assert "ours-ptrace ÷ go-floor: added p99 0.27x (goal 1.2x)" in text
    # Turn by turn: ours' first slice (p99 10 ms) is below go-floor's (20 ms), its second (40 ms) above.
    assert "ours ÷ go-floor: added p99 2.33x" in text
    assert "p99 slice by slice above in 1 of 2 turns (median ratio 1.25x)" in text
    assert "p99 slice by slice above in 0 of 2 turns (median ratio 0.45x)" in text
    assert text.endswith("(none)")
    assert "go-same" not in text, "the control is reported only when it ran"


def test_turns_pair_only_slices_sent_in_the_same_turn() -> None:
    ours, theirs = Totals([_phase("ours-ptrace", 1, [9.0] * 100)]), Totals([_phase("go-floor", 2, [8.0] * 100)])
    assert ours.against(theirs) == "no turns to pair"


def test_the_control_is_set_against_ours_and_go_floor() -> None:
    phases = [
        *(_phase("none", i, [5.0] * 1000) for i in (1, 2)),
        *(_phase("ours", i, [12.0] * 1000) for i in (1, 2)),
        *(_phase("ours-ptrace", i, [17.0] * 1000) for i in (1, 2)),
        *(_phase("go-floor", i, [9.0] * 1000) for i in (1, 2)),
        *(_phase("go-same", i, [15.0] * 1000) for i in (1, 2)),
    ]
    for p in phases:
        p.cpu["go-same"] = 1.0
        p.cpu["kube-apiserver"] = {"go-floor": 8.0, "go-same": 10.0}.get(p.target, 12.0)
    args = argparse.Namespace(pods=2000, slices=2, connections=64, rates=[50], same_answer=True, steal_bound=50.0)
    info = {"load before": "0.1", "load after": "0.2", "chart webhooks": "x", "stall lines": ""}
    text = report(phases, args, info)
    assert any(line.startswith("| 50/s | go-same | 15.0 |") for line in text.splitlines())
    assert (
        "ours-ptrace ÷ go-same (the same answer): added p99 1.20x (90% of turn draws 1.20x to 1.20x), kube-apiserver "
        "CPU 1.20x; p99 slice by slice "
        "above in 2 of 2 turns (median ratio 1.13x)" in text
    )
    assert "go-same ÷ go-floor (our answer against go-floor's, both from Go): added p99 2.50x" in text
    assert "- 50/s, go-same: the API server's" in text


WEBHOOK_METRICS = """\
{family}_bucket{{name="a.example",operation="CREATE",rejected="false",type="admit",le="0.025"}} {a25}
{family}_bucket{{name="a.example",operation="CREATE",rejected="false",type="admit",le="0.1"}} {a100}
{family}_bucket{{name="a.example",operation="CREATE",rejected="false",type="admit",le="0.5"}} {a}
{family}_bucket{{name="a.example",operation="CREATE",rejected="false",type="admit",le="+Inf"}} {a}
{family}_sum{{name="a.example",operation="CREATE",rejected="false",type="admit"}} {a_sum}
{family}_count{{name="a.example",operation="CREATE",rejected="false",type="admit"}} {a}
{family}_bucket{{name="b.example",operation="CREATE",rejected="false",type="admit",le="0.025"}} 10
{family}_bucket{{name="b.example",operation="CREATE",rejected="false",type="admit",le="0.1"}} 10
{family}_bucket{{name="b.example",operation="CREATE",rejected="false",type="admit",le="0.5"}} 10
{family}_bucket{{name="b.example",operation="CREATE",rejected="false",type="admit",le="+Inf"}} 10
{family}_sum{{name="b.example",operation="CREATE",rejected="false",type="admit"}} 0.05
{family}_count{{name="b.example",operation="CREATE",rejected="false",type="admit"}} 10
{family}_bucket{{name="b.example",operation="CREATE",rejected="false",type="validate",le="+Inf"}} 99
"""


def _calls(a25: int, a100: int, a: int, a_sum: float) -> Durations:
    text = WEBHOOK_METRICS.format(family=API_WEBHOOK, a25=a25, a100=a100, a=a, a_sum=a_sum)
    return Durations.parse(text, API_WEBHOOK, 'type="admit"')


def test_a_slice_counts_the_calls_the_api_server_timed_and_the_slowest() -> None:
    before = _calls(90, 100, 100, 0.5)
    slice_ = _calls(180, 196, 200, 1.4).since(before)  # 100 calls more: 6 over 25 ms, 4 of them over 100 ms
    assert (slice_.observed, round(slice_.seconds, 6)) == (100, 0.9), "the other webhook and validating calls left out"
    assert (slice_.over(0.025), slice_.over(0.1)) == (10, 4)
    assert slice_.worst() == 0.5
    assert slice_.describe() == "100 calls, mean 9.0 ms, 10 over 25 ms, 4 over 100 ms, the slowest <= 500 ms"
    assert _calls(185, 200, 200, 1.0).since(before).worst() == 0.1, "5 over 25 ms, none over 100 ms"
    assert _calls(190, 200, 200, 1.0).since(before).worst() == 0.025
    assert math.isnan(before.since(before).worst()), "no call in the slice: no slowest"


def test_each_target_takes_each_place_and_follows_each_other_equally_often() -> None:
    for names in (("a", "b", "c", "d"), ("a", "b", "c", "d", "e")):
        n = len(names)
        count = n if n % 2 == 0 else 2 * n
        orders = turns(names, count)
        assert all(sorted(order) == sorted(names) for order in orders), "every target once in every turn"
        for place in range(n):
            assert Counter(order[place] for order in orders) == Counter({name: count // n for name in names})
        pairs = Counter((order[i], order[i + 1]) for order in orders for i in range(n - 1))
        assert len(pairs) == n * (n - 1), "every target follows every other"
        assert set(pairs.values()) == {count // n}
    assert turns(("a", "b", "c"), 7)[6] == turns(("a", "b", "c"), 7)[0], "the design repeats past its length"


def test_a_slice_counts_each_threads_wait_for_a_cpu_from_its_own_start() -> None:
    before = Usage({"ours": 1.0}, {"ours": {10: 5_000_000, 11: 2_000_000, 12: 9_000_000, 14: 6_000_000}}, steal=7.0)
    after = Usage({"ours": 1.5}, {"ours": {10: 8_000_000, 11: 2_000_000, 13: 4_000_000, 14: 1_000_000}}, steal=7.25)
    cpu, waited = after.since(before)
    assert cpu == {"ours": 0.5}
    # Thread 10 waited 3 ms more, 11 none, 13 started meanwhile (all of its 4 ms), 12 exited (left out), and
    # 14's id was taken by a new thread (its count fell): none.
    assert waited == {"ours": 0.007, "steal": 0.25}


def test_the_waits_of_a_process_include_its_descendants_threads() -> None:
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    assert shell.stdout is not None
    sleeper = int(shell.stdout.readline())
    try:
        now = usage({"shell": shell.pid})
        assert set(now.waits["shell"]) == {shell.pid, sleeper}, "the shell's thread and its child's"
        assert all(ns >= 0 for ns in now.waits["shell"].values())
        assert os.getpid() in now.waits["client"], "this process, the load generator"
        assert now.cpu["client"] > 0
        assert now.steal >= 0
    finally:
        os.kill(sleeper, signal.SIGKILL)
        shell.wait()
        shell.stdout.close()


def test_the_report_says_who_waited_for_a_cpu_in_each_targets_worst_slice() -> None:
    phases = [
        *(_phase("none", i, [5.0] * 100) for i in (1, 2, 3)),
        *(_phase("ours", i, [12.0] * 100) for i in (1, 2, 3)),
        *(_phase("ours-ptrace", i, [9.0] * 100) for i in (1, 2, 3)),
        *(_phase("go-floor", i, [8.0] * 100) for i in (1, 2, 3)),
    ]
    for p in phases:
        p.measured = 2.0
        p.cpu_wait = {"ours": 0.02, "kube-apiserver": 0.1, "steal": 0.0}
    pile_up = phases[7]  # ours-ptrace's second turn
    pile_up.latencies = [0.009] * 90 + [0.12] * 10
    pile_up.max_in_flight = 13
    pile_up.cpu_wait = {"ours": 0.04, "kube-apiserver": 0.9, "steal": 0.3}
    args = argparse.Namespace(pods=300, slices=3, connections=64, rates=[50], same_answer=False, steal_bound=50.0)
    info = {"load before": "0.1", "load after": "0.2", "chart webhooks": "x", "stall lines": ""}
    text = report(phases, args, info)
    assert (
        "- 50/s, ours-ptrace: turn 2, p99 120.0 ms, most in flight 13; "
        "waited ours 20 (10), kube-apiserver 450 (50), steal 150 (0)" in text
    ), "in ms per second of the slice, the target's median slice in brackets"


def _sender(steal_ms_per_s: list[float]) -> tuple[list[Phase], Callable[[Phase], Awaitable[None]]]:
    """A stand-in for a slice through the API server: each slice sent gets the next steal figure."""
    sent: list[Phase] = []

    async def send(phase: Phase) -> None:
        phase.measured, phase.latencies = 1.0, [0.01] * 100
        phase.cpu_wait = {"steal": steal_ms_per_s[len(sent)] / 1000}
        sent.append(phase)

    return sent, send


def test_a_disturbed_turn_is_run_again_in_the_same_order_while_repeats_last() -> None:
    order = ("go-floor", "ours", "none")
    sent, send = _sender([0, 80, 0, 10, 20, 30])  # the first run's second slice: 80 ms a second stolen
    phases, left = asyncio.run(run_turn(order, 50, 3, send, 50.0, repeats=2))
    assert phases == sent
    assert [(p.target, p.attempt, p.repeated) for p in phases] == [
        ("go-floor", 0, True), ("ours", 0, True), ("none", 0, True),
        ("go-floor", 1, False), ("ours", 1, False), ("none", 1, False),
    ]  # fmt: skip
    assert left == 1
    assert {p.slice for p in phases} == {3}, "a turn run again keeps its number, so turns still pair"


def test_a_turn_is_kept_once_the_repeats_are_used_up_and_never_repeated_with_a_negative_bound() -> None:
    _, send = _sender([90, 90, 90, 90])
    phases, left = asyncio.run(run_turn(("a", "b"), 50, 1, send, 50.0, repeats=1))
    assert [p.repeated for p in phases] == [True, True, False, False]
    assert left == 0
    _, send = _sender([900, 900])
    phases, _ = asyncio.run(run_turn(("a", "b"), 50, 1, send, -1.0, repeats=5))
    assert [p.repeated for p in phases] == [False, False]


def test_the_report_leaves_turns_run_again_out_of_the_figures_and_lists_them() -> None:
    phases = []
    for target, p99s in {"none": [5.0, 5.0], "ours": [12.0, 12.0], "ours-ptrace": [9.0, 9.0]}.items():
        for turn, ms in enumerate(p99s, start=1):
            phases.append(_phase(target, turn, [ms] * 100))
    floor = [_phase("go-floor", 1, [8.0] * 100), _phase("go-floor", 2, [8.0] * 100)]
    stolen = [_phase(t, 2, [400.0] * 100) for t in ("none", "ours", "ours-ptrace", "go-floor")]
    for p in [*phases, *floor, *stolen]:
        p.measured = 1.0
        p.cpu_wait = {"steal": 0.3 if p in stolen else 0.0}
    for p in stolen:
        p.repeated = True
    for p in [*phases, *floor]:
        p.attempt = 1 if p.slice == 2 else 0
    args = argparse.Namespace(pods=200, slices=2, connections=64, rates=[50], same_answer=False, steal_bound=50.0)
    info = {"load before": "0.1", "load after": "0.2", "chart webhooks": "x", "stall lines": ""}
    text = report([*phases, *stolen, *floor], args, info)
    assert any(line.startswith("| 50/s | ours | 12.0 | 12.0 | 12.0 | 12.0 |") for line in text.splitlines())
    assert (
        "- 50/s: 1 run again; turn 2: none 400.0 ms (300), ours 400.0 ms (300), ours-ptrace 400.0 ms (300), "
        "go-floor 400.0 ms (300)" in text
    )
    assert "kept though disturbed" not in text
    off = report([*phases, *floor], argparse.Namespace(**{**vars(args), "steal_bound": -1.0}), info)
    assert "no turn run again" in off
    assert "No turn was run again (--steal-bound negative)." in off


def test_a_slice_whose_creates_all_failed_still_has_a_length_to_divide_its_waits_by() -> None:
    assert _measured([1.0, 2.0], [3.0, 5.0], 9.0) == (4.0, 0.5), "from the first start to the last answer"
    assert _measured([1.0, 2.0], [], 9.0) == (8.0, 0.0), "no answer: until the usage was read after the last failure"
    assert _measured([], [], 9.0) == (0.0, 0.0)


def _turn(ms: dict[str, float], count: int = 100) -> dict[str, list[float]]:
    return {target: [value / 1000] * count for target, value in ms.items()}


def test_a_ratios_spread_over_the_turns_says_whether_one_run_can_tell_the_goal() -> None:
    same = [_turn({"none": 5.0, "ours-ptrace": 10.0 + i, "go-floor": 10.0 + i}) for i in range(5)]
    assert spread(same)["ours-ptrace", "go-floor"] == (1.0, 1.0), "equal in every turn: every draw says so"
    assert _spread(spread(same), ("ours-ptrace", "go-floor"), 1.2) == "90% of turn draws 1.00x to 1.00x: met"
    over = [_turn({"none": 5.0, "ours-ptrace": 20.0 + i, "go-floor": 10.0 + i}) for i in range(5)]
    low, high = spread(over)["ours-ptrace", "go-floor"]
    assert 2.1 < low <= high <= 3.0, "(15 + i) / (5 + i) ms added, i the worst turn drawn"
    assert _spread(spread(over), ("ours-ptrace", "go-floor"), 1.2).endswith(": missed")
    # One turn far above and four equal: which draws hold that turn decides the ratio, so the run cannot tell.
    one = [_turn({"none": 5.0, "ours-ptrace": 60.0 if i == 0 else 10.0, "go-floor": 10.0}) for i in range(5)]
    low, high = spread(one)["ours-ptrace", "go-floor"]
    assert (low, high) == (1.0, 11.0)
    assert _spread(spread(one), ("ours-ptrace", "go-floor"), 1.2).endswith(": not resolved")
    assert spread(one, seed=0) == spread(one, seed=0), "the same turns give the same spread"
    assert ("go-same", "go-floor") not in spread(one), "a pair with a target that did not run has no spread"
    assert _spread({}, ("go-same", "go-floor")) == "no spread"
    # go-floor adds nothing in the first turn: a draw of that turn alone has no ratio to give.
    flat = [_turn({"none": 10.0, "ours-ptrace": 12.0, "go-floor": 10.0}), *one[1:]]
    assert (
        _spread(spread(flat), ("ours-ptrace", "go-floor"), 1.2) == "90% of turn draws 1.00x to no bound: not resolved"
    )


def _run(turn_ms: list[dict[str, float]], stolen: int | None = None) -> list[Phase]:
    phases = []
    for number, ms in enumerate(turn_ms, start=1):
        for target, latencies in _turn(ms).items():
            phases.append(Phase(target, 50, number, latencies=latencies, repeated=number == stolen))
    return phases


def test_saved_runs_pool_their_kept_turns_and_pair_only_slices_of_one_turn_of_one_run(tmp_path: Path) -> None:
    quiet = {"none": 5.0, "ours": 14.0, "ours-ptrace": 10.0, "go-floor": 10.0}
    first = _run([quiet, {**quiet, "ours-ptrace": 11.0}, {k: 400.0 for k in quiet}], stolen=3)
    second = _run([{**quiet, "go-floor": 12.0}, quiet])
    for name, run in (("a.json", first), ("b.json", second)):
        save(tmp_path / name, run)
    runs = [load(tmp_path / "a.json", 1), load(tmp_path / "b.json", 2)]
    assert [p.slice for p in runs[1]] == [2001] * 4 + [2002] * 4
    assert runs[0][0].latencies == first[0].latencies
    text = pool_report(runs)
    assert "| 50/s | ours-ptrace | 4 | 400 | 11.0 | 11.0 | 6.0 |" in text, "the turn set aside is left out"
    assert "| 50/s | go-floor | 4 | 400 | 12.0 | 12.0 | 7.0 |" in text
    assert "- 50/s, ours-ptrace ÷ go-floor: added p99 0.86x (goal 1.2x), 90% of turn draws" in text
    # Turn by turn over both runs: ours-ptrace above go-floor in the first run's second turn alone.
    assert "p99 slice by slice above in 1 of 4 turns (median ratio 1.00x)" in text
    assert "- run 1, 50/s: ours 1.40x, ours-ptrace 1.10x (go-floor's worst 10.0 ms)" in text
    assert "- run 2, 50/s: ours 1.17x, ours-ptrace 0.83x (go-floor's worst 12.0 ms)" in text


def test_a_file_that_is_not_a_saved_run_is_named_not_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"slices": [{"target": "none"}]}')
    with pytest.raises(SystemExit) as exited:
        load(bad, 1)
    assert str(exited.value.code).startswith(f"{bad}: not a run saved by --save (")
