"""The image-puller init container: which images, the container, its volumes, and the
node-affinity pin for heterogeneous clusters. Pure, but for the agent's CA bundle, read from its file.

The puller runs first among the init containers so the kubelet finds the images present. Two modes:

- socket: it pulls through the node's runtime socket, a hostPath volume. It is the only container that
  sees the socket, and runs with the least the socket allows: root (the socket is root's), no privilege
  escalation, no capabilities, a read-only root filesystem. Levels baseline and restricted forbid it.
- agent: it asks the node agent (a DaemonSet, the only holder of the socket) over TLS, with a projected
  ServiceAccount token of the agent's audience; it runs as Pod Security `restricted` requires (non-root,
  no capabilities, RuntimeDefault seccomp, no hostPath), so every level admits it and no runtime is
  decided at admission: the node's agent knows its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from webhook import objects
from webhook.config import ImagePullerSettings
from webhook.errors import InvalidReference
from webhook.mutation.errors import PodShapeError, Undecidable
from webhook.mutation.facts import Facts
from webhook.mutation.pod import Container, PodView
from webhook.mutation.podsecurity import Level
from webhook.mutation.pointer import Operation, add, join
from webhook.mutation.reasons import PullerSkip
from webhook.mutation.runtime import Runtime, decide_runtime
from webhook.mutation.scheduling import required_terms
from webhook.mutation.vocabulary import IMAGE_PULLER, switch
from webhook.references import Reference, normalise, parse

S = TypeVar("S")
R = TypeVar("R")
PULLER_NAME = "copilot-webhook-image-puller"
VOLUME_NAME = "copilot-webhook-runtime-socket"
SECRETS_VOLUME = "copilot-webhook-pull-secrets"
SECRETS_PATH = "/var/run/copilot-webhook/pull-secrets"
PULLER_COMMAND = "copilot-webhook-pull"
TOKEN_VOLUME = "copilot-webhook-agent-token"  # noqa: S105 (a volume name)
TOKEN_PATH = "/var/run/copilot-webhook/agent-token"  # noqa: S105 (a mount path)
AGENT_CA_ENV = "COPILOT_WEBHOOK_AGENT_CA"


def _kubelet_pulls_anyway(container: objects.Container, reference: Reference) -> bool:
    """`Always`, or no policy on a `:latest` (or untagged) reference without a digest, which the API server
    defaults to Always: the kubelet pulls these whatever is present, so pre-pulling gains nothing."""
    policy = container.get("imagePullPolicy")
    if policy == "Always":
        return True
    return policy is None and reference.digest is None and reference.tag == "latest"


def _pullable(c: Container) -> tuple[str, Reference] | None:
    """The container's image, and its reference, when the kubelet will pull it and the puller may: not an
    ephemeral container, not the puller, not `Never`, a reference that parses (else the API server
    refuses it: nothing to pull)."""
    if c.field == "ephemeralContainers" or c.name == PULLER_NAME:
        return None
    image = c.body.get("image")
    if not isinstance(image, str) or not image or c.body.get("imagePullPolicy") == "Never":
        return None
    try:
        return image, parse(image)
    except InvalidReference:
        return None


def select_images(view: PodView, settings: ImagePullerSettings) -> list[str]:
    """Images of the pod's containers and init containers that match `images` and not `exclude`, without
    the puller's own, those the kubelet never pulls (`Never`) or pulls anyway (`Always`), normalised the
    way the runtimes normalise them and de-duplicated in order."""
    wanted, unwanted, own = settings.wanted, settings.unwanted, settings.own_images
    chosen: list[str] = []
    for c in view.containers:
        pullable = _pullable(c)
        if pullable is None:
            continue
        image, reference = pullable
        normalised = normalise(image)
        if normalised in own or normalised in chosen or _kubelet_pulls_anyway(c.body, reference):
            continue
        if wanted(image) and not unwanted(image):
            chosen.append(normalised)
    return chosen


def pull_secrets(view: PodView) -> list[str]:
    """The pod's imagePullSecrets (the API server has added the service account's before webhooks run)."""
    secrets = view.spec.get("imagePullSecrets")
    if not isinstance(secrets, list):
        return []
    names = [s.get("name") for s in secrets if isinstance(s, dict)]
    return list(dict.fromkeys(n for n in names if isinstance(n, str) and n))


def secrets_volume(names: list[str], *, mode: int = 0o440) -> objects.Volume:
    """Each secret's .dockerconfigjson as <name>.json; optional, as the kubelet treats a missing pull secret.
    Only the puller mounts it: 0440 for the root socket puller, 0444 for the agent's non-root client."""
    sources = [
        {"secret": {"name": n, "items": [{"key": ".dockerconfigjson", "path": f"{n}.json"}], "optional": True}}
        for n in names
    ]
    return {"name": SECRETS_VOLUME, "projected": {"sources": sources, "defaultMode": mode}}


def puller_container(
    runtime: Runtime, images: list[str], settings: ImagePullerSettings, *, secrets: list[str] | None = None
) -> objects.Container:
    template = settings.memo(container_template)
    mounts: list[dict[str, Any]] = [{"name": VOLUME_NAME, "mountPath": runtime.socket}]
    args = [f"--runtime={runtime.client}", f"--socket={runtime.socket}"]
    if secrets:
        mounts.append({"name": SECRETS_VOLUME, "mountPath": SECRETS_PATH, "readOnly": True})
        args.append(f"--pull-secrets={SECRETS_PATH}")
    env: list[dict[str, str]] = []
    if runtime.client == "cri" and runtime.flavour == "containerd":
        for i, (host, registry) in enumerate(sorted(settings.registries.items())):
            args.append(f"--pod-network-registry={host}")
            if registry.ca is not None:
                variable = f"COPILOT_WEBHOOK_REGISTRY_CA_{i}"
                env.append({"name": variable, "value": registry.ca})
                args.append(f"--registry-ca={host}={variable}")
            if registry.plain_http:
                args.append(f"--registry-plain-http={host}")
            if registry.skip_verify:
                args.append(f"--registry-skip-verify={host}")
    container = {
        "name": PULLER_NAME,
        "image": settings.puller_images.of(runtime.flavour),
        **template,
        "args": [*args, *template["args"], *images],
        "volumeMounts": mounts,
    }
    if env:
        container["env"] = env
    return container


def container_template(settings: ImagePullerSettings) -> objects.Container:
    """The parts of the puller container that depend on the settings alone, built once per settings
    (ImagePullerSettings.memo). Shared between answers: nothing downstream mutates a
    planned value."""
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


def agent_container(images: list[str], settings: ImagePullerSettings, ca: str, *, secrets: bool) -> objects.Container:
    """The client that asks the node agent: Pod Security `restricted` as the API server checks it."""
    template = settings.memo(container_template)
    agent = settings.agent
    args = [
        f"--agent=https://{agent.address}",
        f"--agent-ca-env={AGENT_CA_ENV}",
        f"--token={TOKEN_PATH}/token",
        f"--connect-timeout={agent.connect_timeout_seconds}",
    ]
    mounts: list[dict[str, Any]] = [{"name": TOKEN_VOLUME, "mountPath": TOKEN_PATH, "readOnly": True}]
    if secrets:
        mounts.append({"name": SECRETS_VOLUME, "mountPath": SECRETS_PATH, "readOnly": True})
        args.append(f"--pull-secrets={SECRETS_PATH}")
    return {
        "name": PULLER_NAME,
        "image": agent.image,
        **template,
        "args": [*args, *template["args"], *images],
        "env": [{"name": AGENT_CA_ENV, "value": ca}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": agent.run_as_user,
            "runAsGroup": agent.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": mounts,
    }


def token_volume(settings: ImagePullerSettings) -> objects.Volume:
    """A token of the agent's audience, bound to this pod: the kubelet writes and renews it."""
    token = {"audience": settings.agent.audience, "expirationSeconds": settings.agent.token_seconds, "path": "token"}
    return {"name": TOKEN_VOLUME, "projected": {"sources": [{"serviceAccountToken": token}]}}


def socket_volume(runtime: Runtime) -> objects.Volume:
    return {"name": VOLUME_NAME, "hostPath": {"path": runtime.socket, "type": "Socket"}}


def _volume_names(view: PodView) -> set[str]:
    volumes = view.spec.get("volumes") or []
    if not isinstance(volumes, list):
        raise PodShapeError("spec.volumes must be an array")
    # Only a string can be a name of ours; anything else (a list: unhashable) is the API server's to refuse.
    return {v["name"] for v in volumes if isinstance(v, dict) and isinstance(v.get("name"), str)}


def _clash(container: bool, names: set[str], recorded: bool) -> str | None:
    """The name of ours the pod uses without our record of having put the puller there with its own
    volume (the socket's, or the agent token's), if any."""
    socket, token = VOLUME_NAME in names, TOKEN_VOLUME in names
    ours = recorded and container and (socket != token)  # exactly one mode's volume
    if (container or socket or token) and not ours:
        return PULLER_NAME if container else VOLUME_NAME if socket else TOKEN_VOLUME
    if SECRETS_VOLUME in names and not (recorded and container):
        return SECRETS_VOLUME
    return None


def already_injected(view: PodView, recorded: bool) -> bool:
    """True when our puller is in place, in either mode. A container or volume with our names that we did
    not record putting there is someone else's: a clash, never silently reused, and Undecidable."""
    container = any(c.name == PULLER_NAME for c in view.containers)
    names = _volume_names(view)
    taken = _clash(container, names, recorded)
    if taken is not None:
        raise Undecidable(f"the name {taken} is already used by the pod")
    return container


def insert_ops(
    view: PodView, runtime: Runtime, images: list[str], *, settings: ImagePullerSettings
) -> list[tuple[Operation, str]]:
    why = f"pull {len(images)} image(s) through the {runtime.flavour} socket before the other containers start"
    secrets = pull_secrets(view)
    container = puller_container(runtime, images, settings, secrets=secrets)
    added = [(socket_volume(runtime), f"the {runtime.flavour} socket {runtime.socket}, mounted in the puller only")]
    if secrets:
        added.append((secrets_volume(secrets), "the pod's image pull secrets, for the puller only"))
    return _insert(view, (container, why), added)


def agent_ops(
    view: PodView, images: list[str], ca: str, *, settings: ImagePullerSettings
) -> list[tuple[Operation, str]]:
    why = f"ask the node agent to pull {len(images)} image(s) before the other containers start"
    secrets = pull_secrets(view)
    container = agent_container(images, settings, ca, secrets=bool(secrets))
    added = [(token_volume(settings), f"a token of audience {settings.agent.audience} for the puller only")]
    if secrets:
        added.append((secrets_volume(secrets, mode=0o444), "the pod's image pull secrets, for the puller only"))
    return _insert(view, (container, why), added)


def _insert(
    view: PodView, container: tuple[objects.Container, str], volumes: list[tuple[objects.Volume, str]]
) -> list[tuple[Operation, str]]:
    """The puller first among the init containers, and its volumes after the pod's."""
    ops: list[tuple[Operation, str]] = []
    if isinstance(view.spec.get("initContainers"), list):
        ops.append((add("/spec/initContainers/0", container[0]), container[1]))
    else:
        ops.append((add("/spec/initContainers", [container[0]]), container[1]))
    if isinstance(view.spec.get("volumes"), list):
        ops += [(add("/spec/volumes/-", v), w) for v, w in volumes]
    else:
        ops.append((add("/spec/volumes", [v for v, _w in volumes]), volumes[0][1]))
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


PULLER_ANNOTATION = IMAGE_PULLER


@dataclass(slots=True)
class PullerResult:
    ops: list[tuple[Operation, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    decision: str = ""
    skip_reason: PullerSkip | None = None
    runtime: Runtime | None = None


def _skip(reason: PullerSkip, warning: str | None = None, runtime: Runtime | None = None) -> PullerResult:
    return PullerResult(
        warnings=[warning] if warning else [], decision=f"skipped({reason})", skip_reason=reason, runtime=runtime
    )


def plan_puller(
    view: PodView, is_copilot: bool, facts: Facts, *, settings: ImagePullerSettings, recorded: bool, level: Level
) -> PullerResult:
    """Raises Undecidable on a name clash (handled per failurePolicy)."""
    if not settings.enabled:
        return _skip("disabled")
    if switch(view.annotation(PULLER_ANNOTATION)) is False:
        return _skip("pod-opt-out")
    if settings.scope == "copilot" and not is_copilot:
        return _skip("not-copilot")
    if already_injected(view, recorded):
        return _skip("already-injected")
    if settings.mode == "agent":
        return _plan_agent(view, settings)
    if level.forbids_privilege:
        return _skip("pod-security", f"no image puller: {level} forbids its hostPath socket volume")
    images = select_images(view, settings)
    if not images:
        return _skip("no-images")
    decision = decide_runtime(view, facts.request, facts.cluster, settings=settings)
    if decision.runtime is None:
        return _skip(decision.skip_reason or "unknown-runtime", decision.warning)
    runtime = decision.runtime
    result = PullerResult(decision=f"{runtime.flavour}:{runtime.socket}", runtime=runtime)
    if decision.pin is not None:
        result.ops += pin_ops(view, settings.runtime_label, decision.pin)
        result.warnings.append(
            f"pinned to {decision.pin} nodes (label {settings.runtime_label}): candidate nodes disagree"
        )
    result.ops += insert_ops(view, runtime, images, settings=settings)
    result.warnings += registry_warnings(images, runtime, settings)
    return result


def _plan_agent(view: PodView, settings: ImagePullerSettings) -> PullerResult:
    """No runtime decided here, no level to check: the client is `restricted`, and the node's agent
    knows its own runtime."""
    images = select_images(view, settings)
    if not images:
        return _skip("no-images")
    ca = settings.agent.ca()
    if ca is None:
        where = settings.agent.ca_file or "none set"
        return _skip("agent-untrusted", f"no image puller: no CA bundle to verify the node agent (caFile: {where})")
    return PullerResult(ops=agent_ops(view, images, ca, settings=settings), decision=f"agent:{settings.agent.address}")


def registry_warnings(images: list[str], runtime: Runtime, settings: ImagePullerSettings) -> list[str]:
    if not settings.registries:
        return []
    registries = {parse(image).registry for image in images} & set(settings.registries)
    if not registries:
        return []
    if not (runtime.client == "cri" and runtime.flavour == "containerd"):
        return [f"{', '.join(sorted(registries))[:40]}: the {runtime.flavour} runtime pulls; no pod-network path"]
    risky = sorted(h for h in registries if settings.registries[h].plain_http or settings.registries[h].skip_verify)
    return [f"{', '.join(risky)[:50]}: pulled without TLS verification (registries opt-in)"] if risky else []
