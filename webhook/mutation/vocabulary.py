"""Our own labels and annotations (`copilot-webhook.io/...`) and the values each takes.

One vocabulary switches the webhook on and off, wherever the switch is: `disabled` and `false` are off,
`enabled` and `true` are on, spelt exactly (label values are case-sensitive, and the chart's
namespaceSelector compares them as they are). Every value of a key the webhook reads is either one it
understands or is named in a warning and counted (copilot_webhook_ignored_values_total), and so is an
annotation under our prefix that the webhook does not know: a misspelt key must not pass in silence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NamedTuple

PREFIX = "copilot-webhook.io/"
INJECT = "copilot-webhook.io/inject"  # pod annotation and namespace label: the opt-out (and opt-in)
PTRACE = "copilot-webhook.io/ptrace"  # pod annotation: add, drop or keep
IMAGE_PULLER = "copilot-webhook.io/image-puller"  # pod annotation: the puller's opt-out
MODE = "copilot-webhook.io/mode"  # namespace label: shadow
MUTATED = "copilot-webhook.io/mutated"  # pod annotation the webhook writes

OFF: tuple[str, ...] = ("disabled", "false")
ON: tuple[str, ...] = ("enabled", "true")
SWITCH_VALUES: tuple[str, ...] = ON + OFF
PTRACE_VALUES: tuple[str, ...] = ("add", "drop", "keep")
MODE_VALUES: tuple[str, ...] = ("shadow", "enforce")

Source = Literal["pod", "namespace"]
# The `key` label of the metric: the keys we read, and "unknown" for any other annotation under our prefix,
# so the label set stays bounded whatever pods carry.
MetricKey = Literal["inject", "ptrace", "image-puller", "mode", "unknown"]
_METRIC_KEYS: dict[str, MetricKey] = {
    INJECT: "inject",
    PTRACE: "ptrace",
    IMAGE_PULLER: "image-puller",
    MODE: "mode",
}
_SHOWN = 20  # characters of a value (or of a key after our prefix) quoted in a warning


class Ignored(NamedTuple):
    """A value of ours the webhook did not understand, and ignored."""

    source: Source
    key: MetricKey
    warning: str


def switch(value: str | None) -> bool | None:
    """True for on, False for off, None when absent or not understood."""
    if value in ON:
        return True
    if value in OFF:
        return False
    return None


def _expected(values: tuple[str, ...]) -> str:
    return ", ".join(values[:-1]) + " or " + values[-1]


def _check(source: Source, key: str, value: str | None, allowed: tuple[str, ...]) -> Ignored | None:
    if value is None or value in allowed:
        return None
    where = "namespace label " if source == "namespace" else ""
    return Ignored(source, _METRIC_KEYS[key], f"{where}{key}={value[:_SHOWN]!r} ignored: expected {_expected(allowed)}")


def _annotation(key: str, value: str, *, ptrace: bool, puller: bool) -> Ignored | None:
    if key == INJECT:
        return _check("pod", key, value, SWITCH_VALUES)
    if key == PTRACE:
        return _check("pod", key, value, PTRACE_VALUES) if ptrace else None
    if key == IMAGE_PULLER:
        return _check("pod", key, value, SWITCH_VALUES) if puller else None
    if key == MUTATED:
        return None
    return Ignored("pod", "unknown", f"unknown annotation {key[: _SHOWN + len(PREFIX)]} ignored: ours are {_OURS}")


_OURS = ", ".join(k.removeprefix(PREFIX) for k in (INJECT, PTRACE, IMAGE_PULLER))


def check(
    annotations: Mapping[str, str] | None,
    namespace_labels: Mapping[str, str] | None,
    *,
    ptrace: bool,
    puller: bool,
) -> list[Ignored]:
    """What the pod's annotations and its namespace's labels hold of ours that is not understood. The
    ptrace and image-puller annotations are checked by the kind of mutation that reads them."""
    found: list[Ignored] = []
    for key, value in (annotations or {}).items():
        if key.startswith(PREFIX):
            problem = _annotation(key, value, ptrace=ptrace, puller=puller)
            if problem is not None:
                found.append(problem)
    if namespace_labels:
        for key, allowed in ((INJECT, SWITCH_VALUES), (MODE, MODE_VALUES)):
            problem = _check("namespace", key, namespace_labels.get(key), allowed)
            if problem is not None:
                found.append(problem)
    return found
