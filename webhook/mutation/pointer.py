"""RFC 6901 JSON Pointers and the RFC 6902 operations we emit, built at known paths (never by diffing)."""

from __future__ import annotations

from typing import Any, Literal, Required, TypedDict


class Operation(TypedDict, total=False):
    """One RFC 6902 operation, of the two kinds we emit."""

    op: Required[Literal["add", "remove"]]
    path: Required[str]
    value: Any  # a JSON value of the pod's: any of them


def escape(token: str) -> str:
    # Order matters: "~" first, or the "~1" produced for "/" would be escaped again.
    return token.replace("~", "~0").replace("/", "~1")


def join(*tokens: str | int) -> str:
    return "".join("/" + (escape(t) if isinstance(t, str) else str(t)) for t in tokens)


def add(path: str, value: Any) -> Operation:
    return {"op": "add", "path": path, "value": value}


def remove(path: str) -> Operation:
    return {"op": "remove", "path": path}
