"""What every part of the harness needs from its surroundings: a missing counterpart (a skip on a laptop, a
failure under CI=true), the environment a child command runs in, and polling for what another thread or
process makes true."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NoReturn

COVERAGE_VARIABLES = ("COVERAGE_PROCESS_CONFIG", "COVERAGE_FILE", "COVERAGE_CORE")


def unavailable(message: str) -> NoReturn:
    """A real counterpart a test needs is missing: skipped on a laptop, a failure under CI=true (where
    .ci/run installs or builds everything)."""
    import pytest

    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def child_env(**variables: str) -> dict[str, str]:
    """A minimal environment for a command a test runs, plus coverage's own variables when the tests run
    under coverage, so the lines the command runs are counted too."""
    env = {"PATH": "/usr/bin:/bin"}
    env.update({k: os.environ[k] for k in COVERAGE_VARIABLES if k in os.environ})
    env.update(variables)
    return env


def eventually(check: Callable[[], bool], timeout: float = 10) -> bool:
    """Poll a condition that a background thread or process makes true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()
