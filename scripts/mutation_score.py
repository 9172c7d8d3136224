"""The score of the last `make mutation` run (mutmut's results in mutants/): the counts by outcome, the
score, and every mutant the tests did not kill, by name (`mutmut show <name>` prints its diff).

The score is the share of mutants the tests detected: killed, or made to run past their time limit
(a mutant that loops forever is caught by its timeout). A mutant that no selected test reaches, or that
was not run, counts against it, like a survivor. `--fail-under P` exits 1 below P percent."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
MUTMUT = Path(sys.executable).parent / "mutmut"
STATS = ROOT / "mutants" / "mutmut-cicd-stats.json"
COUNTS = ("killed", "timeout", "survived", "no_tests", "suspicious", "segfault", "skipped")


def score(stats: dict[str, int]) -> tuple[int, int]:
    """(detected, judged): judged leaves out the mutants mutmut was told to skip."""
    return stats["killed"] + stats["timeout"], stats["total"] - stats["skipped"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--fail-under", type=float, default=0.0, metavar="PERCENT")
    args = parser.parse_args()
    subprocess.run([str(MUTMUT), "export-cicd-stats"], cwd=ROOT, check=True, capture_output=True)
    stats: dict[str, int] = json.loads(STATS.read_text())
    detected, judged = score(stats)
    not_run = stats["total"] - sum(stats[name] for name in (*COUNTS, "check_was_interrupted_by_user"))
    counts = ", ".join(f"{name.replace('_', ' ')} {stats[name]}" for name in COUNTS)
    print(f"{counts}, not run {not_run}; total {stats['total']}")
    percent = 100 * detected / max(judged, 1)
    print(f"mutation score: {detected}/{judged} = {percent:.1f}%")
    print("not killed (mutmut show <name>):")
    subprocess.run([str(MUTMUT), "results"], cwd=ROOT, check=True)
    if percent < args.fail_under:
        print(f"the score is under the floor of {args.fail_under}%")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
