"""The node cache's memory, compactly: each node's labels and the label index.

What nodes share is held once, so that memory grows with what is a node's own (docs/performance.md has
the measure). Most nodes of a pool carry the same labels but for the one equal to their own name (the
hostname), so a node's labels are its key set's positions (one dict per distinct key set) and a tuple of
values shared by every node with the same ones, the name standing in where the value is the node's name.
The index keeps, per label pair, the sorted ids of the nodes carrying it in an array of 4-byte integers; a
pair whose value is the node's own name is not indexed at all but answered by looking that node up.
"""

from __future__ import annotations

import bisect
import itertools
import sys
from array import array
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any, Protocol

Pair = tuple[str, str]


class _Labelled(Protocol):
    @property
    def labels(self) -> Mapping[str, str]: ...


class NodeLabels(Mapping[str, str]):
    """A node's labels, read-only. `values[i]` is None where the value is the node's name."""

    __slots__ = ("_name", "_positions", "_values")

    def __init__(self, positions: Mapping[str, int], values: tuple[str | None, ...], name: str) -> None:
        self._positions, self._values, self._name = positions, values, name

    def __getitem__(self, key: str) -> str:
        value = self._values[self._positions[key]]
        return self._name if value is None else value

    def get(self, key: str, default: Any = None) -> Any:
        at = self._positions.get(key)
        if at is None:
            return default
        value = self._values[at]
        return self._name if value is None else value

    def __contains__(self, key: object) -> bool:
        return key in self._positions

    def __iter__(self) -> Iterator[str]:
        return iter(self._positions)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        values = self._values
        if type(other) is dict and len(other) == len(values) and list(other) == list(self._positions):
            # The same keys in the same order (the API server writes a map's keys sorted, so a relist's labels
            # come as they came before): compared position by position, in C.
            return list(other.values()) == self._value_list()
        if isinstance(other, NodeLabels) and other._positions is self._positions and other._values is values:
            return other._name == self._name or None not in values  # shared: only the name may differ
        if not isinstance(other, Mapping) or len(other) != len(values):
            return False
        missing, name = object(), self._name
        pairs = zip(self._positions, values, strict=True)
        return all(other.get(key, missing) == (name if value is None else value) for key, value in pairs)

    def _value_list(self) -> list[str]:
        """The values in key order, the node's name where it stands in."""
        values: list[Any] = list(self._values)
        while None in values:
            values[values.index(None)] = self._name
        return values

    __hash__ = None  # type: ignore[assignment]  # equal to dicts, which are unhashable

    def __repr__(self) -> str:
        return repr(dict(self.items()))

    @property
    def shared_values(self) -> tuple[str | None, ...]:
        return self._values

    @property
    def shape(self) -> tuple[int, int]:
        """Equal for nodes whose labels are equal but for their own names (ids of shared objects)."""
        return (id(self._positions), id(self._values))

    def shared_pairs(self) -> list[Pair]:
        """The (key, value) pairs whose value is not the node's name: the same for every node whose
        labels share this one's values."""
        return [(k, v) for k, v in zip(self._positions, self._values, strict=True) if v is not None]

    def __reduce__(self) -> tuple[Any, ...]:
        return (NodeLabels, (dict(self._positions), self._values, self._name))


def _changed_ids(ids: array[int], changes: list[tuple[int, bool]]) -> array[int]:
    """A copy of the sorted `ids` with each (id, add) applied in order: a few in place, many through a set."""
    if len(changes) > 64:
        kept = set(ids)
        for node_id, add in changes:
            (kept.add if add else kept.discard)(node_id)
        return array("I", sorted(kept))
    ids = array("I", ids)
    for node_id, add in changes:
        at = bisect.bisect_left(ids, node_id)
        present = at < len(ids) and ids[at] == node_id
        if add and not present:
            ids.insert(at, node_id)
        elif not add and present:
            del ids[at]
    return ids


class LabelShapes:
    """Makes NodeLabels, sharing what nodes have in common: one positions dict per key set, one values
    tuple per distinct values, one string per distinct value. When it holds much more than the nodes
    use (nodes come and gone), it starts over."""

    def __init__(self) -> None:
        self._positions: dict[tuple[str, ...], Mapping[str, int]] = {}
        self._values: dict[tuple[str | None, ...], tuple[str | None, ...]] = {}
        self._strings: dict[str, str] = {}

    def __call__(self, name: str, labels: Mapping[str, Any]) -> NodeLabels:
        keys = tuple(labels)
        positions = self._positions.get(keys)
        if positions is None:
            positions = self._positions[keys] = {sys.intern(str(k)): i for i, k in enumerate(keys)}
        found: list[str | None] = list(labels.values())
        if None in found:  # None stands for the node's name below: a null label value is unreadable
            raise TypeError("node label values must be strings")
        while name in found:  # the hostname, most often the only value a node does not share
            found[found.index(name)] = None
        values = tuple(found)
        shared = self._values.get(values)  # an all-string tuple equals its shared copy
        if shared is None:  # values not seen before: each string shared with the other nodes'
            if not all(v is None or type(v) is str for v in values):
                raise TypeError("node label values must be strings")
            strings = self._strings
            shared = tuple(None if v is None else strings.setdefault(v, v) for v in values)
            # Keyed by the shared copy, so the decoded strings of the first node seen are not kept too.
            shared = self._values.setdefault(shared, shared)
        return NodeLabels(positions, shared, name)

    def trim(self, live: int) -> None:
        if len(self._values) > 1000 + 2 * live or len(self._strings) > 1000 + 4 * live:
            self._positions, self._values, self._strings = {}, {}, {}


class Names(Collection[str]):
    """The names of the nodes carrying a label pair: sorted ids in an array, read through the index's
    id table. Membership is a binary search."""

    __slots__ = ("_extra", "_ids", "_index")

    def __init__(self, index: LabelIndex, ids: array[int] | tuple[()], extra: str | None) -> None:
        self._index, self._ids, self._extra = index, ids, extra

    def __len__(self) -> int:
        return len(self._ids) + (self._extra is not None)

    def __iter__(self) -> Iterator[str]:
        found = map(self._index.table.names.__getitem__, self._ids)  # at C speed: set() and set operations read it
        return found if self._extra is None else itertools.chain(found, (self._extra,))

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        if name == self._extra:
            return True
        at = self._index.table.get(name)
        if at is None:
            return False
        found = bisect.bisect_left(self._ids, at)
        return found < len(self._ids) and self._ids[found] == at


class IdTable:
    """Node name <-> id without an int object per node: the names of the build, sorted, each one's id its
    position, found by bisection; the names added since, appended, with a dict of their own ids. Shared by
    an index's lineage; it only grows."""

    __slots__ = ("_added", "_sorted", "names")

    def __init__(self, names: Iterable[str]) -> None:
        self.names: list[str] = sorted(names)
        self._sorted = len(self.names)
        self._added: dict[str, int] = {}

    def get(self, name: str) -> int | None:
        at = bisect.bisect_left(self.names, name, 0, self._sorted)
        if at < self._sorted and self.names[at] == name:
            return at
        return self._added.get(name)

    def add(self, name: str) -> int:
        """The name's id, a new one if it has none."""
        found = self.get(name)
        if found is None:
            found = self._added[name] = len(self.names)
            self.names.append(name)
        return found

    def __len__(self) -> int:
        return len(self.names)


class LabelIndex(Mapping[Pair, Collection[str]]):
    """(key, value) -> the names of the nodes carrying that label. Immutable once built; `updated`
    returns a new index sharing what did not change. Node ids are never reused within the index's
    lineage (a snapshot in use keeps reading its own ids); a full build starts them over."""

    def __init__(self, nodes: Mapping[str, _Labelled], table: IdTable) -> None:
        self.nodes, self.table = nodes, table
        self.postings: dict[Pair, array[int]] = {}
        # Answers derived from these nodes alone, kept by those who ask (runtime.py); a new index, made
        # at every change of the nodes, starts without them.
        self.memo: dict[Any, Any] = {}

    @classmethod
    def build(cls, nodes: Mapping[str, _Labelled]) -> LabelIndex:
        table = IdTable(nodes)
        index = cls(nodes, table)
        # Nodes with the very same labels (a pool's, save the hostname) are indexed as one group. Ids are
        # gathered in arrays of 4-byte integers, not lists of int objects: a build at tens of thousands of
        # nodes would otherwise allocate more than the index it makes (the first list's peak memory).
        groups: dict[tuple[int, int], tuple[Iterable[Pair], array[int]]] = {}
        for i, name in enumerate(table.names):
            labels = nodes[name].labels
            if isinstance(labels, NodeLabels):
                group = groups.get(labels.shape)
                if group is None:
                    group = groups[labels.shape] = (labels.shared_pairs(), array("I"))
                group[1].append(i)
            else:
                groups[(-1, i)] = ([(k, v) for k, v in labels.items() if v != name], array("I", (i,)))
        by_pair: dict[Pair, list[array[int]]] = {}
        for pairs, ids in groups.values():
            for pair in pairs:
                by_pair.setdefault(pair, []).append(ids)
        # A pair of one group shares that group's ids (postings are never changed in place: _changed_ids
        # copies); a pair of several gets their ids merged, sorted, in one array of its own.
        index.postings = {
            pair: found[0] if len(found) == 1 else array("I", sorted(itertools.chain.from_iterable(found)))
            for pair, found in by_pair.items()
        }
        return index

    def stale(self) -> bool:
        """Too many ids of nodes gone: the next change should build afresh."""
        return len(self.table) > 1000 + 2 * len(self.nodes)

    def updated(
        self, nodes: Mapping[str, _Labelled], before: Mapping[str, _Labelled], changed: Iterable[str]
    ) -> LabelIndex:
        """The index of `nodes`, given the names that changed since `before` (this index's nodes). The id
        table grows in place: a snapshot in use never holds the ids added after it, and none is reused."""
        steps: dict[Pair, list[tuple[int, bool]]] = {}
        for name in changed:
            node_id = self.table.add(name)
            for facts, add in ((before.get(name), False), (nodes.get(name), True)):
                for pair in facts.labels.items() if facts is not None else ():
                    if pair[1] != name:
                        steps.setdefault(pair, []).append((node_id, add))
        index = LabelIndex(nodes, self.table)
        index.postings = postings = dict(self.postings)
        for pair, changes in steps.items():
            found = _changed_ids(postings.get(pair, array("I")), changes)
            if found:
                postings[pair] = found
            else:
                postings.pop(pair, None)
        return index

    def _own_name(self, pair: Pair) -> str | None:
        """The node named by the pair's value, when its label `key` is its own name."""
        key, value = pair
        facts = self.nodes.get(value)
        return value if facts is not None and facts.labels.get(key) == value else None

    def get(self, pair: Pair, default: Any = None) -> Any:
        ids, extra = self.postings.get(pair, ()), self._own_name(pair)
        if not ids and extra is None:
            return default
        return Names(self, ids, extra)

    def __getitem__(self, pair: Pair) -> Collection[str]:
        found: Collection[str] | None = self.get(pair)
        if found is None:
            raise KeyError(pair)
        return found

    def _pairs(self) -> Iterator[Pair]:
        yield from self.postings
        for name, facts in self.nodes.items():
            own = ((key, name) for key, value in facts.labels.items() if value == name)
            yield from (pair for pair in own if pair not in self.postings)  # else yielded above

    def __iter__(self) -> Iterator[Pair]:
        return self._pairs()

    def __len__(self) -> int:
        return sum(1 for _ in self._pairs())

    def __contains__(self, pair: object) -> bool:
        return isinstance(pair, tuple) and len(pair) == 2 and self.get(pair) is not None
