"""The skip ledger (tests/skips.py), run on small test files of its own by pytester: every kind of skip is
counted and named, a skip in ALLOWED_SKIPS passes under CI=true, any other fails the run there, and
without CI the run stays green and reports the skip."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

# The allow-list the inner runs get, through a conftest of their own.
CONFTEST = """
from tests.skips import SkipLedger

def pytest_configure(config):
    config.pluginmanager.register(SkipLedger({"test_it.py::test_allowed": "no machine has it"}), "skip-ledger")
"""

# One test per way a test is skipped, and one that runs.
TESTS = """
import pytest

@pytest.fixture
def missing():
    pytest.skip("a fixture's counterpart is missing")

def test_runs():
    pass

def test_allowed():
    pytest.skip("nothing runs this")

def test_in_the_body():
    pytest.skip("the body's counterpart is missing")

@pytest.mark.skipif(True, reason="a marker's condition holds")
def test_marked():
    pass

def test_in_a_fixture(missing):
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_parametrized(n):
    pytest.skip("each parameter's counterpart is missing")
"""

UNLISTED = [
    "test_it.py::test_in_the_body",
    "test_it.py::test_marked",
    "test_it.py::test_in_a_fixture",
    "test_it.py::test_parametrized[1]",
    "test_it.py::test_parametrized[2]",
]


@pytest.fixture
def files(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_it=TESTS)
    return pytester


def _summary(result: pytest.RunResult) -> list[str]:
    """The ledger's lines: from its section's header to pytest's closing line (excluded)."""
    lines = result.outlines
    (start,) = [i for i, line in enumerate(lines) if "tests run and skipped" in line]
    return [line for line in lines[start + 1 : -1] if line]


def test_without_ci_the_run_is_green_and_names_every_skip(
    files: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)
    result = files.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    summary = _summary(result)
    assert summary[0] == "1 ran, 6 skipped"
    assert "skipped 2: each parameter's counterpart is missing" in summary
    for reason in ("a fixture's counterpart is missing", "the body's counterpart is missing",
                   "a marker's condition holds", "nothing runs this"):  # fmt: skip
        assert f"skipped 1: {reason}" in summary, summary
    assert "    test_it.py::test_allowed (allowed: no machine has it)" in summary
    for nodeid in UNLISTED:
        assert f"    {nodeid}" in summary
    assert not any("CI=true" in line for line in summary)
    # pytest's own closing line stays last.
    assert re.fullmatch(r"=+ 1 passed, 6 skipped in .* =+", result.outlines[-1]), result.outlines[-1]


def test_under_ci_an_unlisted_skip_fails_the_run_naming_it(
    files: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    result = files.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    summary = _summary(result)
    (header,) = [i for i, line in enumerate(summary) if line.startswith("CI=true")]
    assert summary[header] == "CI=true: 5 skipped, not in ALLOWED_SKIPS (tests/skips.py); the run fails:"
    assert summary[header + 1 :] == [f"    {nodeid}" for nodeid in UNLISTED]
    assert re.fullmatch(r"=+ 1 passed, 6 skipped in .* =+", result.outlines[-1]), result.outlines[-1]


def test_under_ci_listed_skips_pass(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_it="import pytest\n\ndef test_allowed():\n    pytest.skip('nothing runs this')\n\n"
                        "def test_runs():\n    pass\n")  # fmt: skip
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    assert _summary(result) == [
        "1 ran, 1 skipped",
        "skipped 1: nothing runs this",
        "    test_it.py::test_allowed (allowed: no machine has it)",
    ]


def test_under_ci_a_module_skipped_at_collection_fails_the_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_gone="import pytest\n\npytest.skip('the module needs what is missing', allow_module_level=True)\n"
    )
    pytester.makepyfile(test_it="def test_runs():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    summary = _summary(result)
    assert "skipped 1: the module needs what is missing" in summary
    assert summary[-1] == "    test_gone.py"


def test_each_allowed_skip_names_a_test_file_and_a_reason() -> None:
    from tests.skips import ALLOWED_SKIPS

    root = Path(__file__).parent.parent
    for nodeid, reason in ALLOWED_SKIPS.items():
        assert (root / nodeid.partition("::")[0]).is_file(), nodeid
        assert reason.strip(), nodeid
