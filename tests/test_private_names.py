"""uvicorn is used through its public API only: no private name of it anywhere in webhook/.

A private name is one with a leading underscore, on uvicorn's modules or on an object of theirs, and
every module under uvicorn's own packages (`uvicorn.protocols`, `uvicorn.server`...): what it documents is
`uvicorn.Config`, `uvicorn.Server` and their public members. A subclass of a uvicorn class reads no
underscored attribute of its own instance that it did not set itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "webhook"
SOURCES = sorted(ROOT.rglob("*.py"))


def _uvicorn_names(tree: ast.AST) -> set[str]:
    """Local names bound to uvicorn or to something imported from it."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name for alias in node.names if alias.name.split(".")[0] == "uvicorn"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "uvicorn":
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _private_uses(tree: ast.AST) -> list[str]:
    found: list[str] = []
    names = _uvicorn_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "uvicorn":
            if node.module != "uvicorn":
                found.append(f"line {node.lineno}: from {node.module} import ...")
            found += [f"line {node.lineno}: {alias.name}" for alias in node.names if alias.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("uvicorn.")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and _rooted_in(node.value, names):
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ClassDef) and any(_rooted_in(base, names) for base in node.bases):
            found += _private_inherited(node)
    return found


def _rooted_in(node: ast.expr, names: set[str]) -> bool:
    while isinstance(node, ast.Attribute | ast.Call):
        node = node.value if isinstance(node, ast.Attribute) else node.func
    return isinstance(node, ast.Name) and node.id in names


def _private_inherited(cls: ast.ClassDef) -> list[str]:
    """`self._x` read in a subclass of a uvicorn class, where the class never assigns `self._x`."""
    own = {
        target.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
    }
    own |= {node.name for node in cls.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    return [
        f"line {node.lineno}: self.{node.attr} (uvicorn's)"
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in own
    ]


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_private_uvicorn_name(source: Path) -> None:
    assert _private_uses(ast.parse(source.read_text())) == []


@pytest.mark.parametrize(
    ("code", "found"),
    [
        ("from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol", 1),
        ("import uvicorn\nuvicorn.Server(c)._captured_signals.append(1)", 1),
        ("import uvicorn\nclass S(uvicorn.Server):\n    def f(self):\n        return self._captured_signals", 1),
        ("import uvicorn.server", 1),
        (
            "import uvicorn\nclass S(uvicorn.Server):\n    def f(self):\n"
            "        self._mine = 1\n        return self._mine",
            0,
        ),
        ("import uvicorn\nuvicorn.Server(uvicorn.Config(app)).serve()", 0),
    ],
)
def test_the_check_finds_private_names(code: str, found: int) -> None:
    """The check itself: each shape of a private use is found, public uses are not."""
    assert len(_private_uses(ast.parse(code))) == found
