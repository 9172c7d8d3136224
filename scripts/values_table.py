"""The chart values table in docs/operations.md, generated from values.yaml and its `# --` comments, so the
two cannot disagree. `python -m scripts.values_table` rewrites the table; a test checks it is current.

Every row needs a description: a value without one, or a description written above a mapping whose keys
are listed one by one (it would be shown nowhere), makes the table refuse to generate."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parent.parent
VALUES = ROOT / "deploy" / "helm" / "copilot-webhook" / "values.yaml"
README = ROOT / "docs" / "operations.md"
MARK = "<!-- values table -->"
LEAF_MAPPINGS = ("requests", "limits", "labels", "resources", "podSecurityContext")  # shown whole, not key by key


class UndescribedValueError(ValueError):
    """values.yaml has a value the table cannot describe."""


def _comments(text: str) -> dict[str, str]:
    """Dotted key -> the `# --` comment lines just above it."""
    found: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending.append(stripped.removeprefix("# --").strip())
            continue
        match = re.match(r"^(\s*)([A-Za-z0-9_.-]+):", line)
        if not match or stripped.startswith("#"):
            if not stripped:
                pending = []
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        found[".".join(k for _, k in stack)] = " ".join(pending)
        pending = []
    return found


def _default(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _rows(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> default, one per row of the table."""
    rows: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in LEAF_MAPPINGS:
            rows.update(_rows(value, path + "."))
        else:
            rows[path] = value
    return rows


def _check(rows: dict[str, Any], comments: dict[str, str]) -> None:
    """Every row described, and no description lost above a mapping that is listed key by key."""
    undescribed = [path for path in rows if not comments.get(path)]
    if undescribed:
        raise UndescribedValueError(f"values.yaml: no `# --` description for {', '.join(undescribed)}")
    lost = [path for path, text in comments.items() if text and path not in rows]
    if lost:
        raise UndescribedValueError(
            f"values.yaml: a `# --` description above {', '.join(lost)}, whose keys are listed one by one: "
            "describe each key instead"
        )


def table(text: str | None = None) -> str:
    """The table for `text` (values.yaml by default); raises UndescribedValueError on a value without a
    description."""
    text = VALUES.read_text() if text is None else text
    rows, comments = _rows(yaml.safe_load(text)), _comments(text)
    _check(rows, comments)
    lines = [f"| `{path}` | `{_default(value)}` | {comments[path]} |" for path, value in rows.items()]
    return "\n".join([MARK, "| key | default | what it does |", "|---|---|---|", *lines, MARK])


def current() -> str:
    readme = README.read_text()
    start, end = readme.index(MARK), readme.rindex(MARK) + len(MARK)
    return readme[start:end]


if __name__ == "__main__":
    README.write_text(README.read_text().replace(current(), table()))
