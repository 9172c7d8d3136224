"""The image-puller init container (spec 1.3): which images, the container, its socket volume, and the
node-affinity pin for heterogeneous clusters. Pure.

The puller runs first among the init containers and pulls every selected image through the node's
runtime socket, in parallel, so the kubelet finds them present. It is the only container that sees the
socket, and it runs with the least the socket allows: root (the socket is root's), no privilege
escalation, no capabilities, a read-only root filesystem.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar

from webhook.config import FLAVOURS, ImagePullerSettings, PullerImages
from webhook.mutation.copilot import Undecidable
from webhook.mutation.facts import Facts
from webhook.mutation.pod import PodShapeError, PodView
from webhook.mutation.pointer import Operation, add, join
from webhook.mutation.runtime import Runtime, decide_runtime, required_terms

S = TypeVar("S")
R = TypeVar("R")
PULLER_NAME = "copilot-webhook-image-puller"
VOLUME_NAME = "copilot-webhook-runtime-socket"
PULLER_COMMAND = "copilot-webhook-pull"


@lru_cache(maxsize=64)
def _matcher(patterns: tuple[str, ...]) -> Callable[[str], re.Match[str] | None]:
    if not patterns:
        return lambda _image: None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match


def _per_settings(fn: Callable[[S], R]) -> Callable[[S], R]:
    """Cache a value derived from a settings object by the object's identity: settings are immutable
    and replaced whole on reload, and hashing a pydantic model costs more than building the value."""
    cache: dict[int, tuple[S, R]] = {}

    def cached(settings: S) -> R:
        hit = cache.get(id(settings))
        if hit is None or hit[0] is not settings:
            if len(cache) > 16:
                cache.clear()
            hit = cache[id(settings)] = (settings, fn(settings))
        return hit[1]

    return cached


@_per_settings
def _own_images(images: PullerImages) -> frozenset[str]:
    return frozenset(images.of(f) for f in FLAVOURS)


def select_images(view: PodView, settings: ImagePullerSettings) -> list[str]:
    """Images of the pod's containers and init containers that match `images` and not `exclude`, without
    the puller's own, de-duplicated in order."""
    wanted, unwanted = _matcher(settings.images), _matcher(settings.exclude)
    own = _own_images(settings.puller_images)
    chosen: list[str] = []
    for c in view.containers:
        if c.field == "ephemeralContainers" or c.name == PULLER_NAME:
            continue
        image = c.body.get("image")
        if not isinstance(image, str) or not image or image in own or image in chosen:
            continue
        if wanted(image) and not unwanted(image):
            chosen.append(image)
    return chosen


def puller_container(runtime: Runtime, images: list[str], settings: ImagePullerSettings) -> dict[str, Any]:
    template = _template(settings)
    return {
        "name": PULLER_NAME,
        "image": settings.puller_images.of(runtime.flavour),
        **template,
        "args": [
            f"--client={runtime.client}",
            f"--socket={runtime.socket}",
            *template["args"],
            *images,
        ],
        "volumeMounts": [{"name": VOLUME_NAME, "mountPath": runtime.socket}],
    }


@_per_settings
def _template(settings: ImagePullerSettings) -> dict[str, Any]:
    """The parts of the puller container that depend on the settings alone, built once per settings.
    Shared between answers: nothing downstream mutates a planned value."""
    resources = {
        k: v
        for k, v in (
            ("requests", settings.resources.requests.as_dict()),
            ("limits", settings.resources.limits.as_dict()),
        )
        if v
    }
    return {
        "imagePullPolicy": "IfNotPresent",
        "command": [PULLER_COMMAND],
        "args": [f"--timeout={settings.timeout_seconds}", f"--failure-policy={settings.failure_policy}", "--"],
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": False,
            "runAsUser": 0,  # the runtime socket belongs to root; nothing else needs it
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def socket_volume(runtime: Runtime) -> dict[str, Any]:
    return {"name": VOLUME_NAME, "hostPath": {"path": runtime.socket, "type": "Socket"}}


def already_injected(view: PodView, recorded: bool) -> bool:
    """True when our puller is in place. A container or volume with our names that we did not record
    putting there is someone else's: a clash, never silently reused, and Undecidable (spec 1.3)."""
    container = any(c.name == PULLER_NAME for c in view.containers)
    volumes = view.spec.get("volumes") or []
    if not isinstance(volumes, list):
        raise PodShapeError("spec.volumes must be an array")
    volume = any(isinstance(v, dict) and v.get("name") == VOLUME_NAME for v in volumes)
    if (container or volume) and not (recorded and container and volume):
        taken = PULLER_NAME if container else VOLUME_NAME
        raise Undecidable(f"the name {taken} is already used by the pod")
    return container and volume


def insert_ops(
    view: PodView, runtime: Runtime, images: list[str], settings: ImagePullerSettings
) -> list[tuple[Operation, str]]:
    why = f"pull {len(images)} image(s) through the {runtime.flavour} socket before the other containers start"
    container = puller_container(runtime, images, settings)
    ops: list[tuple[Operation, str]] = []
    if isinstance(view.spec.get("initContainers"), list):
        ops.append((add("/spec/initContainers/0", container), why))
    else:
        ops.append((add("/spec/initContainers", [container]), why))
    volume = socket_volume(runtime)
    vwhy = f"the {runtime.flavour} socket {runtime.socket}, mounted in the puller only"
    if isinstance(view.spec.get("volumes"), list):
        ops.append((add("/spec/volumes/-", volume), vwhy))
    else:
        ops.append((add("/spec/volumes", [volume]), vwhy))
    return ops


def pin_ops(view: PodView, label: str, flavour: str) -> list[tuple[Operation, str]]:
    """Require nodes labelled with the chosen runtime: the requirement joins every existing required
    term (terms are ORed, so each must carry it), or becomes the only term."""
    requirement = {"key": label, "operator": "In", "values": [flavour]}
    why = f"pin the pod to {flavour} nodes: the puller speaks {flavour}"
    terms = required_terms(view.spec)
    base = "/spec/affinity"
    if terms is None:
        affinity = view.spec.get("affinity")
        required = {"nodeSelectorTerms": [{"matchExpressions": [requirement]}]}
        if not isinstance(affinity, dict):
            return [(add(base, {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}), why)]
        if not isinstance(affinity.get("nodeAffinity"), dict):
            return [(add(base + "/nodeAffinity", {"requiredDuringSchedulingIgnoredDuringExecution": required}), why)]
        return [(add(base + "/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution", required), why)]
    ops: list[tuple[Operation, str]] = []
    path = join(
        "spec", "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution", "nodeSelectorTerms"
    )
    for i, term in enumerate(terms):
        expressions = term.get("matchExpressions") if isinstance(term, dict) else None
        if isinstance(expressions, list):
            if requirement not in expressions:
                ops.append((add(f"{path}/{i}/matchExpressions/-", requirement), why))
        else:
            ops.append((add(f"{path}/{i}/matchExpressions", [requirement]), why))
    return ops


PULLER_ANNOTATION = "copilot-webhook.io/image-puller"


@dataclass(slots=True)
class PullerResult:
    ops: list[tuple[Operation, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    decision: str = ""
    skip_reason: str | None = None
    runtime: Runtime | None = None


def _skip(reason: str, warning: str | None = None, runtime: Runtime | None = None) -> PullerResult:
    return PullerResult(
        warnings=[warning] if warning else [], decision=f"skipped({reason})", skip_reason=reason, runtime=runtime
    )


def plan_puller(
    view: PodView, is_copilot: bool, facts: Facts, settings: ImagePullerSettings, recorded: bool
) -> PullerResult:
    """Raises Undecidable on a name clash (spec 1.3: handled per failurePolicy)."""
    if not settings.enabled:
        return _skip("disabled")
    if view.annotation(PULLER_ANNOTATION) == "false":
        return _skip("pod-opt-out")
    if settings.scope == "copilot" and not is_copilot:
        return _skip("not-copilot")
    if already_injected(view, recorded):
        return _skip("already-injected")
    level = facts.cluster.pod_security_level
    if level in ("baseline", "restricted"):
        return _skip("pod-security", f"no image puller: Pod Security {level!r} forbids its hostPath socket volume")
    images = select_images(view, settings)
    if not images:
        return _skip("no-images")
    decision = decide_runtime(view, facts.request, facts.cluster, settings)
    if decision.runtime is None:
        return _skip(str(decision.skip_reason), decision.warning)
    runtime = decision.runtime
    result = PullerResult(decision=f"{runtime.flavour}:{runtime.socket}", runtime=runtime)
    if decision.pin is not None:
        result.ops += pin_ops(view, settings.runtime_label, decision.pin)
        result.warnings.append(
            f"pinned to {decision.pin} nodes (label {settings.runtime_label}): candidate nodes disagree"
        )
    result.ops += insert_ops(view, runtime, images, settings)
    return result
