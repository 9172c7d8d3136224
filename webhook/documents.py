"""Reading YAML and JSON from outside (configuration files, preview bodies) as exactly what JSON carries.

Kubernetes objects are JSON values. YAML can say much more (binary, sets, timestamps, integers of any
size, aliases, keys that are not strings) and PyYAML's composer recurses once per level, so a few hundred
nested levels end in RecursionError. The loader here accepts only what JSON can carry and only to a
bounded depth, and every refusal is a DocumentError whose message names the problem and its line.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import orjson
import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode

from webhook.errors import DocumentError

# The deepest real pod path (affinity ... matchExpressions[].values[]) is about 10 levels; a CronJob in a
# List in a multi-document body adds 6. 64 leaves room for custom resources in annotations' values
# (strings anyway) and stays far below both Python's recursion limit and orjson's serialiser (254).
MAX_DEPTH = 64
INT64 = (-(2**63), 2**63 - 1)


class _JSONLoader(yaml.SafeLoader):
    """SafeLoader restricted to JSON values: str keys, no aliases, no tags beyond JSON's, bounded depth."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            raise DocumentError(f"YAML aliases are not accepted (line {mark.line + 1})")
        self._depth += 1
        if self._depth > MAX_DEPTH:
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            raise DocumentError(f"nested deeper than {MAX_DEPTH} levels (line {mark.line + 1})")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _value in node.value:
            key = key_node.value
            if not (isinstance(key_node, ScalarNode) and key_node.tag == "tag:yaml.org,2002:str"):
                line = key_node.start_mark.line + 1
                raise DocumentError(f"mapping key {key!r} (line {line}) is not a string; quote it")
            if key in seen:
                raise DocumentError(f"duplicate key {key!r} (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _int(loader: _JSONLoader, node: ScalarNode) -> int:
    value = yaml.SafeLoader.construct_yaml_int(loader, node)
    if not INT64[0] <= value <= INT64[1]:
        raise DocumentError(f"integer {node.value[:40]} (line {node.start_mark.line + 1}) is beyond 64 bits")
    return int(value)


def _float(loader: _JSONLoader, node: ScalarNode) -> float:
    value = float(yaml.SafeLoader.construct_yaml_float(loader, node))
    if value != value or value in (float("inf"), float("-inf")):
        raise DocumentError(f"{node.value!r} (line {node.start_mark.line + 1}) is not a number JSON can carry")
    return value


def _text(loader: _JSONLoader, node: ScalarNode) -> str:
    # Kubernetes' YAML reader (go-yaml into interface{}) keeps an unquoted date as a string.
    return str(loader.construct_scalar(node))


def _str(loader: _JSONLoader, node: ScalarNode) -> str:
    value = str(loader.construct_scalar(node))
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # "\ud83d\ude00" escapes arrive as two surrogates: join a pair as JSON does, refuse a lone one.
        try:
            value = value.encode("utf-16", "surrogatepass").decode("utf-16")
        except UnicodeDecodeError:
            raise DocumentError(f"a string (line {node.start_mark.line + 1}) holds a lone UTF-16 surrogate") from None
    return value


def _refuse(_loader: _JSONLoader, node: Node) -> None:
    raise DocumentError(
        f"YAML tag {node.tag.replace('tag:yaml.org,2002:', '!!')} (line {node.start_mark.line + 1}) is not "
        "accepted: Kubernetes objects hold only JSON values"
    )


_JSONLoader.yaml_constructors = {
    "tag:yaml.org,2002:null": yaml.SafeLoader.construct_yaml_null,
    "tag:yaml.org,2002:bool": yaml.SafeLoader.construct_yaml_bool,
    "tag:yaml.org,2002:int": _int,
    "tag:yaml.org,2002:float": _float,
    "tag:yaml.org,2002:str": _str,
    "tag:yaml.org,2002:timestamp": _text,
    "tag:yaml.org,2002:seq": yaml.SafeLoader.construct_yaml_seq,
    "tag:yaml.org,2002:map": yaml.SafeLoader.construct_yaml_map,
    None: _refuse,  # every other tag: !!binary, !!set, !!omap, !!pairs, !python/..., custom
}


def load_yaml_documents(text: str) -> list[Any]:
    """Every document of a YAML stream, as JSON values; empty documents are left out."""
    try:
        return [doc for doc in yaml.load_all(text, Loader=_JSONLoader) if doc is not None]
    except DocumentError:
        raise
    except ConstructorError as exc:
        raise DocumentError(f"not valid YAML: {exc}") from None
    except yaml.YAMLError as exc:
        raise DocumentError(f"not valid YAML: {exc}") from None


def decode_text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"not UTF-8 text (byte {exc.start})") from None


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _value in pairs:
            if key in seen:
                raise DocumentError(f"duplicate key {key!r}")
            seen.add(key)
    return obj


def shaped(decoder: msgspec.json.Decoder[Any], data: bytes) -> Any:
    """`data` decoded into `decoder`'s shapes, the keys outside them skipped without being built, or, when
    it does not fit them (a malformed or hostile document), parsed whole by orjson, which refuses what is
    not JSON with its own message (orjson.JSONDecodeError). For documents whose readers declare what they
    read: the API server's Table pages and events, admission reviews."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):  # msgspec's depth limit is a RecursionError
        return orjson.loads(data)


def load_json_document(data: bytes) -> Any:
    """One JSON document, refusing duplicate keys and integers beyond 64 bits (orjson would make them floats),
    within MAX_DEPTH. For user-facing input; admission reads reviews with `shaped` (review.py)."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise DocumentError(f"not valid JSON: {exc}") from None
    check_depth(value)
    # The standard parser only for what orjson cannot tell: duplicate keys and integer size.
    try:
        json.loads(data, object_pairs_hook=_pairs, parse_int=_json_int)
    except DocumentError:
        raise
    except ValueError as exc:  # pragma: no cover - orjson accepted it; the two parsers agree on syntax
        raise DocumentError(f"not valid JSON: {exc}") from None
    return value


def _json_int(text: str) -> int:
    value = int(text)
    if not INT64[0] <= value <= INT64[1]:
        raise DocumentError(f"integer {text[:40]} is beyond 64 bits")
    return value


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """Refuse a value nested deeper than `limit`, without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise DocumentError(f"nested deeper than {limit} levels")
        if type(item) is dict:
            stack.extend((v, depth + 1) for v in item.values() if type(v) in (dict, list))
        elif type(item) is list:
            stack.extend((v, depth + 1) for v in item if type(v) in (dict, list))
