"""The package as `pip install .` builds it for a user who wants only the CLI: a licence expression its
metadata carries, and a build without deprecation warnings."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_the_licence_expression_and_builds_without_deprecations(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--wheel-dir", str(tmp_path), "-v"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    assert "DeprecationWarning" not in built.stdout + built.stderr
    (wheel,) = tmp_path.glob("copilot_webhook-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        fields = archive.read(metadata).decode().splitlines()
        names = archive.namelist()
    assert "License-Expression: Apache-2.0" in fields
    assert any(name.endswith("licenses/LICENSE") for name in names), "the licence text is in the wheel"
