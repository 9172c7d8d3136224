"""A pytest plugin for `make mutation` (loaded with `-p tests.mutation_order` from [tool.mutmut] in
pyproject.toml): runs the tests a mutant is checked against quickest first. mutmut stops at the first
failure, so a mutant a unit test kills costs that test, not a tour of every golden case first. The order
changes no verdict: a mutant survives only if every selected test passes."""

from __future__ import annotations

import pytest

# Modules by the time one test takes, quickest first; any other module runs after these.
ORDER = (
    "tests/test_globs.py",
    "tests/test_copilot.py",
    "tests/test_scheduling.py",
    "tests/test_pod_security.py",
    "tests/test_mutation_survivors.py",
    "tests/test_config.py",
    "tests/test_pull.py",
    "tests/test_review_decoding.py",
    "tests/test_agent_mode.py",
    "tests/test_vocabulary.py",
    "tests/test_projection.py",
    "tests/test_golden.py",
)


def _rank(item: pytest.Item) -> int:
    module = item.nodeid.partition("::")[0]
    return ORDER.index(module) if module in ORDER else len(ORDER)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: within a module, the order pytest collected
