"""Reading the API server's Table pages and watch events without what the caches never read.

A Table row's object metadata carries `managedFields`, most of a row's bytes, which no cache reads: msgspec
decodes into the shapes below and skips every other key without building it, so a relist's CPU goes to the
fields read. Anything that does not fit them (a malformed page or event) is parsed whole instead, and meets
the same checks as a page that fits.
"""

from __future__ import annotations

from typing import Any, TypedDict

import msgspec

from webhook.documents import shaped

_Metadata = TypedDict(
    "_Metadata",
    {
        "name": Any,
        "namespace": Any,
        "labels": Any,
        "annotations": Any,
        "resourceVersion": Any,
        "continue": Any,
    },
    total=False,
)


class _RowObject(TypedDict, total=False):
    apiVersion: Any
    kind: Any
    metadata: _Metadata


class _Row(TypedDict, total=False):
    cells: Any
    object: _RowObject


class _Object(TypedDict, total=False):
    """A Table (a list page, or a watch event's object), or whatever else the server sent instead: a
    plain list or object (its fields kept whole but for the metadata's), a Status."""

    apiVersion: Any
    kind: Any
    metadata: _Metadata
    columnDefinitions: Any
    rows: list[_Row]
    items: Any
    spec: Any
    status: Any
    code: Any
    message: Any
    reason: Any


class _Event(TypedDict, total=False):
    type: Any
    object: _Object


_page = msgspec.json.Decoder(_Object)
_event = msgspec.json.Decoder(_Event)


def table_page(data: bytes) -> Any:
    return shaped(_page, data)


def table_event(data: bytes) -> Any:
    return shaped(_event, data)
