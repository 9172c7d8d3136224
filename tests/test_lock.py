"""requirements/images.lock pins every package the images install; it must still satisfy what
pyproject.toml declares (after a dependency changes there, `python -m scripts.lock` resolves it again)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from scripts.lock import LOCK, PULLER

ROOT = Path(__file__).parent.parent


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_lock_pins_every_declared_runtime_dependency_within_its_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    locked = {_norm(n): v for n, v in (line.split("==") for line in LOCK.read_text().split() if "==" in line)}
    for declared in [*project["dependencies"], PULLER, *project["optional-dependencies"]["puller"]]:
        requirement = Requirement(declared)
        name = _norm(requirement.name)
        assert name in locked, f"{declared} is not pinned in {LOCK.name}: run python -m scripts.lock"
        assert requirement.specifier.contains(locked[name]), f"{LOCK.name} pins {name}=={locked[name]}, not {declared}"


def test_the_dockerfile_installs_with_the_lock() -> None:
    installs = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if "pip install" in line]
    assert installs
    assert all("-c /src/requirements/images.lock" in line or "--no-deps" in line for line in installs)
