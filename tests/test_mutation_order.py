"""`make mutation` runs the test modules [tool.mutmut] in pyproject.toml selects, in the order
tests/mutation_order.py gives them: a module selected there but not ordered runs last, after the golden
cases, and costs each mutant it kills every test before it."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tests.mutation_order import ORDER

ROOT = Path(__file__).resolve().parent.parent


def test_every_module_mutation_testing_selects_is_ordered_and_no_other() -> None:
    mutmut = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    selection = mutmut["pytest_add_cli_args_test_selection"]
    modules = {arg.partition("::")[0] for arg in selection if not arg.startswith("-")}
    assert modules == set(ORDER)
    assert all((ROOT / module).is_file() for module in ORDER)
