"""Micro-benchmark of planning alone (no HTTP, no JSON): the 5 KB Flyte 1.15 pod, and copilot pods of
growing width to show the cost grows linearly with the number of containers.

    python bench/plan_bench.py [--repeat 7]

Prints a Markdown table; each number is the median of `repeat` runs of timeit, in microseconds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import timeit
from pathlib import Path
from typing import Any

import orjson

from webhook.config import Settings
from webhook.mutation.facts import Facts, RequestFacts
from webhook.mutation.plan import PTRACE, plan

HERE = Path(__file__).parent


def wide_pod(base: dict[str, Any], n: int) -> dict[str, Any]:
    """The Flyte pod with its primary container repeated until the pod has n regular containers."""
    pod = copy.deepcopy(base)
    primary, uploader = pod["spec"]["containers"]
    workers = []
    for i in range(n - 1):
        worker = copy.deepcopy(primary)
        worker["name"] = f"worker-{i}"
        workers.append(worker)
    pod["spec"]["containers"] = [*workers, uploader]
    return pod


def median_us(fn: Any, repeat: int, budget_s: float = 0.2) -> float:
    number = max(1, int(budget_s / max(timeit.timeit(fn, number=1), 1e-7)))
    return statistics.median(t / number * 1e6 for t in timeit.repeat(fn, number=number, repeat=repeat))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    body = (HERE / "data" / "flyte-1.15-review.json").read_bytes()
    review = orjson.loads(body)
    pod = review["request"]["object"]
    settings, facts = Settings(), Facts(RequestFacts(review["request"]["namespace"]))
    print(f"pod: {len(orjson.dumps(pod))} bytes of JSON, {len(pod['spec']['containers'])} containers")
    print("| case | containers | median µs | µs per container |")
    print("|---|---:|---:|---:|")
    base = median_us(lambda: plan(pod, facts, settings, kinds=(PTRACE,)), args.repeat)
    print(f"| Flyte 1.15 pod, ptrace add | 3 | {base:.1f} | {base / 3:.1f} |")
    both = median_us(lambda: plan(pod, facts, settings), args.repeat)
    print(f"| Flyte 1.15 pod, ptrace add and image puller (/mutate) | 3 | {both:.1f} | {both / 3:.1f} |")
    loads = median_us(lambda: orjson.loads(body), args.repeat)
    print(f"| (for scale: orjson.loads of the whole review) | | {loads:.1f} | |")
    for n in (10, 50, 100, 200):
        wide = wide_pod(pod, n)
        us = median_us(lambda wide=wide: plan(wide, facts, settings, kinds=(PTRACE,)), args.repeat)
        print(f"| wide copilot pod, ptrace add | {n + 1} | {us:.1f} | {us / (n + 1):.2f} |")


if __name__ == "__main__":
    main()
