"""A checked, read-only view of the parts of a Pod the plan reads.

Mutating webhooks run before the API server validates an object, and /preview takes whatever a user
sends, so every field we read is checked for its type here, once; the error names the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


class PodShapeError(ValueError):
    """The object is not a Pod we can read; the message names the field and what was expected."""


_TYPE_NAMES: dict[type, str] = {
    dict: "object",
    list: "array",
    str: "string",
    bool: "boolean",
    int: "number",
    float: "number",
}


def type_name(value: Any) -> str:
    """A JSON type name for error messages."""
    return "null" if value is None else _TYPE_NAMES.get(type(value), type(value).__name__)


def expect_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PodShapeError(f"{where} must be an object, not {type_name(value)}")
    return value


def optional_object(value: Any, where: str) -> dict[str, Any] | None:
    return None if value is None else expect_object(value, where)


def optional_strings(value: Any, where: str) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise PodShapeError(f"{where} must be an array of strings")
    return value


@dataclass(slots=True)
class Container:
    field: str  # "containers", "initContainers" or "ephemeralContainers"
    index: int
    body: dict[str, Any]
    name: str
    path: str  # the JSON Pointer of the container, e.g. /spec/initContainers/0

    @property
    def is_init(self) -> bool:
        return self.field == "initContainers"

    @property
    def restart_always(self) -> bool:
        return self.body.get("restartPolicy") == "Always"

    def where(self, *fields: str) -> str:
        return ".".join((f"spec.{self.field}[{self.index}]", *fields))


@dataclass(slots=True)
class PodView:
    pod: dict[str, Any]
    metadata: dict[str, Any] | None
    annotations: dict[str, str] | None
    spec: dict[str, Any]
    containers: tuple[Container, ...]

    def annotation(self, key: str) -> str | None:
        return None if self.annotations is None else self.annotations.get(key)

    def of(self, field: str) -> Iterator[Container]:
        return (c for c in self.containers if c.field == field)


def read_pod(pod: Any, where: str = "pod") -> PodView:
    pod = expect_object(pod, where)
    metadata = optional_object(pod.get("metadata"), f"{where}.metadata")
    annotations = None
    if metadata is not None:
        annotations = optional_object(metadata.get("annotations"), f"{where}.metadata.annotations")
        if annotations is not None and not all(isinstance(v, str) for v in annotations.values()):
            raise PodShapeError(f"{where}.metadata.annotations values must be strings")
    spec = expect_object(pod.get("spec"), f"{where}.spec")
    found: list[Container] = []
    for field in CONTAINER_LISTS:
        items = spec.get(field)
        if items is None:
            if field == "containers":
                raise PodShapeError(f"{where}.spec.containers is required (an array of containers)")
            continue
        if not isinstance(items, list):
            raise PodShapeError(f"{where}.spec.{field} must be an array, not {type_name(items)}")
        for index, body in enumerate(items):
            if type(body) is not dict:
                expect_object(body, f"{where}.spec.{field}[{index}]")
            name = body.get("name")
            if type(name) is not str:
                raise PodShapeError(f"{where}.spec.{field}[{index}].name must be a string")
            found.append(Container(field, index, body, name, f"/spec/{field}/{index}"))
    return PodView(pod, metadata, annotations, spec, tuple(found))
