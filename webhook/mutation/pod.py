"""A checked, read-only view of the parts of a Pod the plan reads.

Mutating webhooks run before the API server validates an object, and /preview takes whatever a user
sends, so every field we read is checked for its type here, once; the error names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from webhook import objects
from webhook.mutation.errors import PodShapeError

CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


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


def expect_object(value: Any, where: str) -> objects.JSONObject:
    """Callers test `type(x) is dict` first and only call this to fail: it formats the message."""
    if not isinstance(value, dict):
        raise PodShapeError(f"{where} must be an object, not {type_name(value)}")
    return value


@dataclass(slots=True, eq=False)  # identity: two containers are never the same one
class Container:
    field: str  # "containers", "initContainers" or "ephemeralContainers"
    index: int
    body: objects.Container
    name: str
    path: str  # the JSON Pointer of the container, e.g. /spec/initContainers/0

    @property
    def is_init(self) -> bool:
        return self.field == "initContainers"

    def where(self, *fields: str) -> str:
        return ".".join((f"spec.{self.field}[{self.index}]", *fields))

    def object_at(self, value: Any, *fields: str) -> objects.JSONObject | None:
        """`value`, read from the given fields of this container: None or an object (the message is only
        built when the check fails: this runs for every target container on every request)."""
        if value is None or type(value) is dict:
            return value
        raise PodShapeError(f"{self.where(*fields)} must be an object, not {type_name(value)}")

    def strings_at(self, value: Any, *fields: str) -> list[str] | None:
        if value is None or (type(value) is list and all(type(item) is str for item in value)):
            return value
        raise PodShapeError(f"{self.where(*fields)} must be an array of strings")


@dataclass(slots=True)
class PodView:
    pod: objects.Pod
    metadata: objects.ObjectMeta | None
    annotations: dict[str, str] | None
    spec: objects.PodSpec
    containers: tuple[Container, ...]

    def annotation(self, key: str) -> str | None:
        return None if self.annotations is None else self.annotations.get(key)


def read_pod(pod: Any, where: str = "pod") -> PodView:
    if type(pod) is not dict:
        expect_object(pod, where)
    metadata = pod.get("metadata")
    annotations = None
    if metadata is not None:
        if type(metadata) is not dict:
            expect_object(metadata, f"{where}.metadata")
        annotations = _annotations(metadata.get("annotations"), where)
    spec = pod.get("spec")
    if type(spec) is not dict:
        expect_object(spec, f"{where}.spec")
    return PodView(pod, metadata, annotations, spec, _containers(spec, where))


def _annotations(annotations: Any, where: str) -> dict[str, str] | None:
    if annotations is not None:
        if type(annotations) is not dict:
            expect_object(annotations, f"{where}.metadata.annotations")
        if not all(type(v) is str for v in annotations.values()):
            raise PodShapeError(f"{where}.metadata.annotations values must be strings")
    checked: dict[str, str] | None = annotations
    return checked


def _containers(spec: objects.PodSpec, where: str) -> tuple[Container, ...]:
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
    return tuple(found)
