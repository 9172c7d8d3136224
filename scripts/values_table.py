"""The chart values table in docs/operations.md, generated from values.yaml and its `# --` comments, so the
two cannot disagree. `python -m scripts.values_table` rewrites the table; a test checks it is current."""

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
LEAF_MAPPINGS = ("requests", "limits", "labels")  # shown whole, not key by key


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


def _rows(values: dict[str, Any], comments: dict[str, str], prefix: str = "") -> list[str]:
    rows = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in LEAF_MAPPINGS:
            rows += _rows(value, comments, path + ".")
        else:
            rows.append(f"| `{path}` | `{_default(value)}` | {comments.get(path, '')} |")
    return rows


def table() -> str:
    text = VALUES.read_text()
    rows = _rows(yaml.safe_load(text), _comments(text))
    return "\n".join([MARK, "| key | default | what it does |", "|---|---|---|", *rows, MARK])


def current() -> str:
    readme = README.read_text()
    start, end = readme.index(MARK), readme.rindex(MARK) + len(MARK)
    return readme[start:end]


if __name__ == "__main__":
    README.write_text(README.read_text().replace(current(), table()))
