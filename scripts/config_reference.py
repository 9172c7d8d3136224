"""The configuration reference in docs/configuration.md, generated from the settings model (webhook/config.py),
so the table and the code cannot disagree. `python -m scripts.config_reference` rewrites it; a test checks it
is current."""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from webhook.config import Settings

DOC = Path(__file__).parent.parent / "docs" / "configuration.md"
MARK = "<!-- configuration reference -->"
_ENTRY = {"imagePuller.registries": "host"}  # what the keys of a mapping of sections are


def _allowed(annotation: Any, info: FieldInfo) -> str:
    """What a key accepts, in words: its literals, its type and the bounds pydantic checks."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return ", ".join(f"`{v}`" for v in typing.get_args(annotation))
    if origin in (types.UnionType, typing.Union):
        return _union(annotation, info)
    if annotation in (int, float):
        return _number(annotation, info)
    if annotation is str:
        return _string(info)
    named = {bool: "boolean"}.get(annotation) or {tuple: "list of strings", dict: "mapping"}.get(origin)
    return str(named or getattr(annotation, "__name__", annotation))


def _union(annotation: Any, info: FieldInfo) -> str:
    members = typing.get_args(annotation)
    parts = [a for a in members if a is not type(None)]
    words = " or ".join(_allowed(p, info) for p in parts)
    return words + (", or none" if type(None) in members else "")


def _number(annotation: Any, info: FieldInfo) -> str:
    bounds = {type(m).__name__: m for m in info.metadata}
    low = f">= {bounds['Ge'].ge}" if "Ge" in bounds else (f"> {bounds['Gt'].gt}" if "Gt" in bounds else "")
    high = f"<= {bounds['Le'].le}" if "Le" in bounds else (f"< {bounds['Lt'].lt}" if "Lt" in bounds else "")
    words = ", ".join(w for w in (low, high) if w)
    return f"{'integer' if annotation is int else 'number'}{' ' + words if words else ''}"


def _string(info: FieldInfo) -> str:
    limits = [f"at least {m.min_length} characters" for m in info.metadata if isinstance(m, MinLen)]
    limits += [f"at most {m.max_length}" for m in info.metadata if isinstance(m, MaxLen)]
    limits += [f"matching `{m.pattern}`" for m in info.metadata if hasattr(m, "pattern") and m.pattern]
    return "string" + (f" ({', '.join(limits)})" if limits else "")


def _default(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(by_alias=True)
    if isinstance(value, tuple):
        value = list(value)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, dict)):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def _rows(model: type[BaseModel], instance: BaseModel, prefix: str = "") -> list[str]:
    rows = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{info.alias or name}"
        value = getattr(instance, name)
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += _rows(annotation, value, key + ".")
            continue
        description = (info.description or "").replace("|", "\\|")
        rows.append(f"| `{key}` | {_default(value)} | {_allowed(annotation, info)} | {description} |")
        held = typing.get_args(annotation)[1] if typing.get_origin(annotation) is dict else None
        if isinstance(held, type) and issubclass(held, BaseModel):
            # A mapping of sections (registries: host -> settings): each entry's keys, with their defaults.
            rows += _rows(held, held(), f"{key}.<{_ENTRY.get(key, 'key')}>.")
    return rows


def table() -> str:
    head = ["| key | default | allowed | |", "|---|---|---|---|"]
    return "\n".join([MARK, *head, *_rows(Settings, Settings()), MARK])


def current() -> str:
    text = DOC.read_text()
    return text[text.index(MARK) : text.rindex(MARK) + len(MARK)]


if __name__ == "__main__":
    DOC.write_text(DOC.read_text().replace(current(), table()))

__all__ = ["Ge", "Gt", "Le", "Lt"]
