"""Keep `imagePuller.runtimeLabel` true on every node (heterogeneous: pin).

`copilot-webhook label-nodes` does it once; with `imagePuller.labeller: true` the server does it after
every change of the node cache. A node of unknown runtime has the label removed: a pod pinned to a
flavour must never land on a node we cannot vouch for. Needs `patch` on nodes, and nothing else.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from webhook.mutation.facts import NodeFacts

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"


class LabelChange(NamedTuple):
    node: str
    current: str | None
    wanted: str | None  # None: remove the label


def label_changes(nodes: Mapping[str, NodeFacts], label: str) -> list[LabelChange]:
    changes = []
    for name in sorted(nodes):
        facts = nodes[name]
        current = facts.labels.get(label)
        if current != facts.flavour:
            changes.append(LabelChange(name, current, facts.flavour))
    return changes


def apply_changes(patch_node: Callable[..., Any], label: str, changes: list[LabelChange]) -> list[str]:
    """Patch each node; returns the errors (one line per node that failed), having tried them all."""
    errors = []
    for change in changes:
        body = {"metadata": {"labels": {label: change.wanted}}}
        try:
            patch_node(change.node, body, _content_type=MERGE_PATCH)
        except Exception as exc:  # one node's failure must not stop the others
            errors.append(f"{change.node}: {exc}")
    return errors


class Labeller:
    """Relabels after node cache changes, at most once per `interval` seconds, in its own thread."""

    def __init__(
        self,
        nodes: Callable[[], Mapping[str, NodeFacts]],
        patch_node: Callable[..., Any],
        label: str,
        *,
        interval: float = 10.0,
    ) -> None:
        self._nodes, self._patch, self._label, self._interval = nodes, patch_node, label, interval
        self.dirty = threading.Event()
        self.stopping = threading.Event()

    def changed(self, _items: object = None) -> None:
        self.dirty.set()

    def run(self) -> None:
        while not self.stopping.is_set():
            if not self.dirty.wait(1.0):
                continue
            self.dirty.clear()
            changes = label_changes(self._nodes(), self._label)
            for error in apply_changes(self._patch, self._label, changes):
                log.warning("labeller: %s", error)
                self.dirty.set()  # try again at the next round
            if changes:
                log.info("labeller: set %s on %d node(s)", self._label, len(changes))
            self.stopping.wait(self._interval)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="node-labeller", daemon=True)
        thread.start()
        return thread
