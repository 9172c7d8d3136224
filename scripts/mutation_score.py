"""The score of the last `make mutation` run (mutmut's results in mutants/): the counts by outcome, the
score, and every mutant the tests did not kill, by name (`mutmut show <name>` prints its diff).

The score is the share of mutants the tests detected: killed, or made to run past their time limit
(a mutant that loops forever is caught by its timeout). A mutant that no selected test reaches counts
against it, like a survivor."""

from __future__ import annotations

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
    subprocess.run([str(MUTMUT), "export-cicd-stats"], cwd=ROOT, check=True, capture_output=True)
    stats: dict[str, int] = json.loads(STATS.read_text())
    detected, judged = score(stats)
    print(", ".join(f"{name.replace('_', ' ')} {stats[name]}" for name in COUNTS) + f"; total {stats['total']}")
    print(f"mutation score: {detected}/{judged} = {100 * detected / max(judged, 1):.1f}%")
    print("not killed (mutmut show <name>):")
    subprocess.run([str(MUTMUT), "results"], cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
