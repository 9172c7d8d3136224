"""What a test run did not run, and why: a pytest plugin (registered by tests/conftest.py).

At the end of every run it writes how many tests ran and how many were skipped, the skips grouped by
reason, each with its tests. Under CI=true, a skip of a test that is not in ALLOWED_SKIPS fails the run:
CI installs or builds every counterpart the tests need, so there a skip means evidence that was never
gathered. It sees every kind of skip: `pytest.skip` in a test or a fixture, `skipif`/`skip` markers, and
module-level skips at collection.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

# The skips a CI run accepts: a test's node id (without parameters it covers all of them) and the reason
# it cannot run in any CI run. Keep it short; a counterpart CI can install or build belongs in .ci/run.
ALLOWED_SKIPS: Mapping[str, str] = {}

SECTION = "tests run and skipped"


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


@dataclass(eq=False)  # hashable by identity, as pluggy keeps its plugins
class SkipLedger:
    """Records each test's outcome; `allowed` maps node ids to why CI may skip them."""

    allowed: Mapping[str, str]
    ran: set[str] = field(default_factory=set)
    skipped: dict[str, str] = field(default_factory=dict)  # node id -> reason
    session: pytest.Session | None = None

    def allowance(self, nodeid: str) -> str | None:
        return self.allowed.get(nodeid, self.allowed.get(nodeid.partition("[")[0]))

    def unlisted(self) -> list[str]:
        return [nodeid for nodeid in self.skipped if self.allowance(nodeid) is None]

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:
            self.skipped[report.nodeid] = _reason(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and (not report.skipped or hasattr(report, "wasxfail")):
            self.ran.add(report.nodeid)  # passed, failed, or failed as expected (xfail)
        elif report.skipped:
            self.skipped[report.nodeid] = _reason(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # A plain hook: it runs before the terminal reporter (a wrapper) writes the summary and the exit code.
        green = session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if in_ci() and self.unlisted() and green:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        write = terminalreporter.write_line
        terminalreporter.ensure_newline()
        terminalreporter.section(SECTION, sep="-")
        write(f"{len(self.ran)} ran, {len(self.skipped)} skipped")
        by_reason: dict[str, list[str]] = {}
        for nodeid, reason in self.skipped.items():
            by_reason.setdefault(reason, []).append(nodeid)
        for reason, nodeids in sorted(by_reason.items(), key=lambda item: (-len(item[1]), item[0])):
            write(f"skipped {len(nodeids)}: {reason}")
            for nodeid in nodeids:
                allowance = self.allowance(nodeid)
                write(f"    {nodeid}" + ("" if allowance is None else f" (allowed: {allowance})"))
        unlisted = self.unlisted()
        if unlisted and in_ci():
            write(f"CI=true: {len(unlisted)} skipped, not in ALLOWED_SKIPS (tests/skips.py); the run fails:", red=True)
            for nodeid in unlisted:
                write(f"    {nodeid}", red=True)
