"""Finding Flyte copilot containers and the SYS_PTRACE policy for their pods.

Flyte adds the copilot in flyteplugins' `flytek8s/copilot.go`: an init container `<prefix>downloader`
when the task has inputs, and when it has outputs `<prefix>sidecar` (<= 1.13) or `<prefix>uploader`
(>= 1.14) as a regular container that watches the primary container's process through a shared process
namespace, hence SYS_PTRACE (<= 1.15, which grants it to every copilot task, even one with neither).
From 1.16 the uploader is a native sidecar (init container, restartPolicy: Always) that waits for a
signal instead. scripts/flyte_source.py rebuilds these pods from the Go code, tag by tag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from webhook.config import CopilotSettings, PtraceMode, PtraceSettings
from webhook.mutation.errors import Undecidable
from webhook.mutation.pod import Container, PodView
from webhook.mutation.podsecurity import Level
from webhook.mutation.pointer import Operation, add, remove
from webhook.mutation.reasons import NoCapability, PtraceSkip
from webhook.mutation.vocabulary import PTRACE as PTRACE_ANNOTATION

SIDECAR_ROLES = frozenset({"uploader", "sidecar"})
ROLES = SIDECAR_ROLES | {"downloader"}
PRIMARY_ANNOTATION = "primary_container_name"
CAPABILITY = "SYS_PTRACE"
_PRIVILEGE = {"drop": 0, "keep": 1, "add": 2}


def copilot_role(container: Container, settings: CopilotSettings) -> str | None:
    """The copilot role of a container, or None. The name alone never qualifies: a user must not be able
    to obtain a capability by naming a container; the command or the image must be Flyte's too."""
    if container.field == "ephemeralContainers" or not container.name.startswith(settings.name_prefix):
        return None
    role = container.name[len(settings.name_prefix) :]
    if role not in ROLES:
        return None
    command = container.body.get("command")
    if isinstance(command, list) and command and command[0] in settings.commands:
        return role
    image = container.body.get("image")
    if isinstance(image, str) and settings.image_matcher(image):
        return role
    return None


@dataclass(frozen=True, slots=True)
class Copilot:
    members: tuple[Container, ...]
    sidecars: tuple[Container, ...]

    @property
    def watchers(self) -> tuple[Container, ...]:
        """The uploader/sidecar running as a regular container (Flyte <= 1.15): the one process that reads
        the primary's /proc. A native sidecar (>= 1.16) waits for a signal; a downloader watches nothing."""
        return tuple(c for c in self.sidecars if c.field == "containers")

    @property
    def legacy(self) -> bool:
        return bool(self.watchers)

    def why_no_capability(self) -> NoCapability:
        native = any(c.is_init and c.body.get("restartPolicy") == "Always" for c in self.sidecars)
        return "native-sidecar" if native else "no-watcher"


def find_copilot(view: PodView, settings: CopilotSettings) -> Copilot | None:
    members: list[Container] = []
    sidecars: list[Container] = []
    for container in view.containers:
        role = copilot_role(container, settings)
        if role is not None:
            members.append(container)
            if role in SIDECAR_ROLES:
                sidecars.append(container)
    return Copilot(tuple(members), tuple(sidecars)) if members else None


def is_ptrace(capability: str) -> bool:
    """The kubelet and the runtimes upper-case names and add a missing CAP_ prefix before comparing."""
    name = capability.upper()
    return name == CAPABILITY or name == "CAP_" + CAPABILITY


@dataclass(slots=True)
class PtraceResult:
    ops: list[tuple[Operation, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    decision: str = "keep"  # what the audit annotation and summary say
    skip_reason: PtraceSkip | None = None


def effective_mode(view: PodView, settings: PtraceSettings, result: PtraceResult) -> PtraceMode:
    """The cluster mode, or the pod's annotation where it grants no more (or overrides are allowed)."""
    wanted = view.annotation(PTRACE_ANNOTATION)
    if wanted is None:
        return settings.mode
    if wanted not in _PRIVILEGE:  # warned of with every value of ours not understood (vocabulary.py)
        return settings.mode
    if _PRIVILEGE[wanted] > _PRIVILEGE[settings.mode] and not settings.allow_pod_override:
        result.warnings.append(f"{PTRACE_ANNOTATION}={wanted} refused: grants more than ptrace.mode {settings.mode}")
        return settings.mode
    return wanted  # type: ignore[return-value]


def _capabilities(
    c: Container,
) -> tuple[dict[str, object] | None, dict[str, object] | None, list[str] | None, list[str] | None]:
    sc = c.object_at(c.body.get("securityContext"), "securityContext")
    caps = c.object_at(sc.get("capabilities"), "securityContext", "capabilities") if sc else None
    if caps is None:
        return sc, None, None, None
    added = c.strings_at(caps.get("add"), "securityContext", "capabilities", "add")
    dropped = c.strings_at(caps.get("drop"), "securityContext", "capabilities", "drop")
    return sc, caps, added, dropped


def grant(c: Container, why: str) -> list[tuple[Operation, str]]:
    sc, caps, added, dropped = _capabilities(c)
    base = c.path + "/securityContext"
    ops: list[tuple[Operation, str]] = []
    if sc is None:
        ops.append((add(base, {"capabilities": {"add": [CAPABILITY]}}), why))
    elif caps is None:
        ops.append((add(base + "/capabilities", {"add": [CAPABILITY]}), why))
    elif added is None:
        ops.append((add(base + "/capabilities/add", [CAPABILITY]), why))
    elif not any(is_ptrace(name) for name in added):
        ops.append((add(base + "/capabilities/add/-", CAPABILITY), why))
    for i in reversed(range(len(dropped or ()))):
        if is_ptrace(dropped[i]):  # type: ignore[index]
            ops.append(
                (
                    remove(f"{base}/capabilities/drop/{i}"),
                    f"{c.name}: a drop of SYS_PTRACE would cancel the grant",
                )
            )
    return ops


def _adds_all_undropped(added: list[str] | None, dropped: list[str] | None) -> bool:
    """`add: [ALL]` without a drop of SYS_PTRACE: ALL grants SYS_PTRACE too."""
    return (
        bool(added)
        and any(name.upper() == "ALL" for name in added or ())
        and not any(is_ptrace(d) for d in dropped or ())
    )


def revoke(c: Container, result: PtraceResult, why: str = "ptrace.mode drop removes SYS_PTRACE") -> None:
    sc, _caps, added, dropped = _capabilities(c)
    base = c.path + "/securityContext/capabilities"
    for i in reversed(range(len(added or ()))):
        if is_ptrace(added[i]):  # type: ignore[index]
            result.ops.append((remove(f"{base}/add/{i}"), f"{c.name}: {why}"))
    if _adds_all_undropped(added, dropped):
        # The runtimes apply drops after adds, so dropping SYS_PTRACE wins over ALL.
        why = f"{c.name}: adds ALL capabilities; SYS_PTRACE is dropped explicitly"
        op = add(base + "/drop/-", CAPABILITY) if dropped is not None else add(base + "/drop", [CAPABILITY])
        result.ops.append((op, why))
    if sc is not None and sc.get("privileged") is True:
        result.warnings.append(f"container {c.name} is privileged and keeps SYS_PTRACE whatever ptrace.mode says")


_LOCAL_DIR_FLAGS = ("--to-local-dir", "--from-local-dir")  # DownloadCommandArgs, SidecarCommandArgs


def _mounts(c: Container) -> list[tuple[str, str]]:
    mounts = c.body.get("volumeMounts")
    if type(mounts) is not list:
        return []
    # A mount without a string name or path (the API server refuses it after admission) mounts nothing.
    return [
        (m["name"], m["mountPath"])
        for m in mounts
        if type(m) is dict and type(m.get("name")) is str and type(m.get("mountPath")) is str
    ]


def data_volumes(copilot: Copilot) -> set[str]:
    """The copilot's data volumes: in each copilot container, the volume mounted at the directory its
    arguments name (`--to-local-dir` for the downloader, `--from-local-dir` for the uploader). Flyte mounts
    these in the primary container alone (AddCoPilotToContainer); other mounts a copilot container has (the
    storage configuration, Flyte's secrets webhook's secrets) are shared with other containers too."""
    volumes: set[str] = set()
    for c in copilot.members:
        args = c.body.get("args")
        if type(args) is not list:
            continue
        for flag in _LOCAL_DIR_FLAGS:
            if flag in args:  # a C-level scan; this runs on every review of a legacy copilot pod
                i = args.index(flag) + 1
                if i < len(args):
                    volumes.update(name for name, path in _mounts(c) if path == args[i])
    return volumes


def _named_primary(regular: list[Container], named: str) -> Container:
    chosen = [c for c in regular if c.name == named]
    if not chosen:
        raise Undecidable(f"{PRIMARY_ANNOTATION} {named!r} names no regular container")
    return chosen[0]


def _mounting_primary(regular: list[Container], copilot: Copilot) -> Container:
    volumes = data_volumes(copilot)
    chosen = [c for c in regular if any(name in volumes for name, _path in _mounts(c))]
    if len(chosen) != 1:
        found = ", ".join(c.name for c in chosen) or "none"
        raise Undecidable(f"no single primary container: mounting the copilot's volumes: {found[:60]}")
    return chosen[0]


def primary_container(view: PodView, copilot: Copilot) -> Container:
    """The container Flyte made primary: named by `primary_container_name` when present (Flyte sets it on
    single-container pods only), else the one regular container that mounts the copilot's data volumes."""
    regular = [c for c in view.containers if c.field == "containers" and c not in copilot.members]
    named = view.annotation(PRIMARY_ANNOTATION)
    return _mounting_primary(regular, copilot) if named is None else _named_primary(regular, named)


# The chart's matchConditions test the same owners and labels in CEL; keep the two alike (test_match_conditions).
_FLYTE_OWNERS = {("flyte.lyft.com", "flyteworkflow"), ("flyte.lyft.com", "FlyteWorkflow"), ("flyte.org", "TaskAction")}
# flytepropeller's labels on every task pod (compiler/transformers/k8s/workflow.go, nodes/node_exec_context.go).
_FLYTE_LABELS = ("execution-id", "node-id")


def flyte_owned(view: PodView) -> bool:
    """A pod Flyte created: owned by its workflow resource (FlyteWorkflow; TaskAction in Flyte 2) or
    carrying flytepropeller's labels. Used to remove a privilege only, so it need not be spoof-proof."""
    metadata = view.metadata or {}
    owners = metadata.get("ownerReferences")
    if type(owners) is list:
        for owner in owners:
            if type(owner) is dict and type(owner.get("apiVersion")) is str and type(owner.get("kind")) is str:
                group = owner["apiVersion"].partition("/")[0]
                if (group, owner["kind"]) in _FLYTE_OWNERS:
                    return True
    labels = metadata.get("labels")
    return type(labels) is dict and all(key in labels for key in _FLYTE_LABELS)


def plan_ptrace(view: PodView, copilot: Copilot | None, settings: PtraceSettings, *, level: Level) -> PtraceResult:
    """`copilot` is None for a Flyte-owned pod without copilot containers: only `drop` applies to it."""
    result = PtraceResult()
    mode = effective_mode(view, settings, result)
    if mode == "keep":
        result.decision, result.skip_reason = "keep", "mode-keep"
    elif mode == "drop":
        _drop(view, copilot, result)
    elif copilot is None:
        result.decision, result.skip_reason = "keep", "not-copilot"
    elif not copilot.legacy:
        why = copilot.why_no_capability()
        result.decision, result.skip_reason = f"add:none({why})", why
    elif level.forbids_privilege:
        result.decision, result.skip_reason = f"add:skipped(pod-security={level.name})", "pod-security"
        result.warnings.append(f"SYS_PTRACE not added: {level} forbids it")
    else:
        _add(view, copilot, settings, result=result)
    return result


def _drop(view: PodView, copilot: Copilot | None, result: PtraceResult) -> None:
    result.decision = "drop"
    for container in view.containers:
        revoke(container, result)
    if copilot is not None and copilot.legacy:
        result.warnings.append("SYS_PTRACE dropped: a legacy copilot may not see the user process exit")
    if not result.ops:
        result.skip_reason = "already-compliant"


def _add(view: PodView, copilot: Copilot, settings: PtraceSettings, *, result: PtraceResult) -> None:
    targets: list[tuple[Container, str]] = []
    if settings.target in ("primary", "all"):
        targets.append((primary_container(view, copilot), "primary container"))
    if settings.target in ("sidecar", "all"):
        targets += [(c, "copilot watcher") for c in copilot.watchers]
    result.decision = f"add:{settings.target}"
    for container, role in targets:
        result.ops += grant(
            container, f"{container.name}: the {role} gets SYS_PTRACE (ptrace.target {settings.target})"
        )
    if settings.target == "sidecar":
        # Least privilege: the watcher reads the primary's /proc, so it alone needs the capability.
        chosen = {id(c) for c, _role in targets}
        for container in view.containers:
            if id(container) not in chosen:
                revoke(container, result, "ptrace.target sidecar grants SYS_PTRACE to the copilot watcher alone")
    _share_process_namespace(view, result)
    if not result.ops:
        result.skip_reason = "already-compliant"


def _share_process_namespace(view: PodView, result: PtraceResult) -> None:
    if view.spec.get("shareProcessNamespace") is True:
        return
    if view.spec.get("hostPID") is True:
        result.warnings.append(
            "shareProcessNamespace not set: the pod uses hostPID, which the API server forbids with it"
        )
    else:
        result.ops.append((add("/spec/shareProcessNamespace", value=True), "the copilot watches the primary process"))
