"""requirements/images.lock: the exact version of every package the images install (the webhook's
dependencies and the puller's grpcio), resolved once by pip and pinned, so an image built next month
holds what was tested. `python -m scripts.lock` resolves it again (it needs the package index); a test
checks that it still covers every dependency pyproject.toml declares."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parent.parent
LOCK = ROOT / "requirements" / "images.lock"
PULLER = "grpcio>=1.60"  # pyproject's `puller` extra, which the puller image installs beside the package


def resolve() -> list[tuple[str, str]]:
    with tempfile.TemporaryDirectory() as work:
        report = Path(work) / "report.json"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--report",
             str(report), str(ROOT), PULLER],
            check=True,
        )  # fmt: skip
        installed = json.loads(report.read_text())["install"]
    return sorted(
        (item["metadata"]["name"].lower(), item["metadata"]["version"])
        for item in installed
        if item["metadata"]["name"].lower() != "copilot-webhook"
    )


if __name__ == "__main__":
    header = "# The images' packages, pinned (python -m scripts.lock resolves them again). Used as pip constraints.\n"
    LOCK.write_text(header + "".join(f"{name}=={version}\n" for name, version in resolve()))
