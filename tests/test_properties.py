"""What must hold for every pod: the patch applies to the exact object sent, re-running the webhook on its
output changes nothing, and no container we did not identify is touched."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import apply, decoded_patch
from webhook.config import Settings, build_settings
from webhook.mutation.copilot import Copilot, find_copilot, flyte_owned, is_ptrace
from webhook.mutation.facts import Facts, RequestFacts
from webhook.mutation.plan import KINDS, PTRACE, plan
from webhook.mutation.pod import read_pod
from webhook.review import response

FLYTE_IMAGE = "cr.flyte.org/flyteorg/flytecopilot:v1.15.0"
CAPS = st.lists(
    st.sampled_from(["SYS_PTRACE", "sys_ptrace", "CAP_SYS_PTRACE", "NET_ADMIN", "ALL", "CHOWN"]), max_size=3
)
NAMES = st.sampled_from(
    ["main", "worker", "flyte-copilot-uploader", "flyte-copilot-sidecar", "flyte-copilot-downloader", "helper"]
)


@st.composite
def containers(draw: st.DrawFn, init: bool) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": draw(NAMES),
        "image": draw(st.sampled_from([FLYTE_IMAGE, "busybox:1.36", "ghcr.io/flyteorg/flytecopilot@sha256:ab"])),
    }
    if draw(st.booleans()):
        container["command"] = [draw(st.sampled_from(["/bin/flyte-copilot", "/bin/sh"]))]
    context = draw(
        st.one_of(
            st.none(),
            st.just("null"),
            st.fixed_dictionaries(
                {},
                optional={
                    "privileged": st.booleans(),
                    "capabilities": st.one_of(
                        st.none(), st.fixed_dictionaries({}, optional={"add": CAPS, "drop": CAPS})
                    ),
                },
            ),
        )
    )
    if context == "null":
        container["securityContext"] = None
    elif context is not None:
        container["securityContext"] = context
    if init and draw(st.booleans()):
        container["restartPolicy"] = "Always"
    return container


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    unique = {"unique_by": lambda c: c["name"]}
    regular = draw(st.lists(containers(False), min_size=1, max_size=4, **unique))  # type: ignore[arg-type]
    taken = {c["name"] for c in regular}
    init = [c for c in draw(st.lists(containers(True), max_size=3, **unique)) if c["name"] not in taken]  # type: ignore[arg-type]
    spec: dict[str, Any] = {"containers": regular}
    if init:
        spec["initContainers"] = init
    if draw(st.booleans()):
        spec["shareProcessNamespace"] = draw(st.booleans())
    elif draw(st.booleans()):
        spec["hostPID"] = True
    metadata: dict[str, Any] = {"name": "p"}
    annotations: dict[str, Any] = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "primary_container_name": st.sampled_from([c["name"] for c in regular] + ["ghost"]),
                "copilot-webhook.io/ptrace": st.sampled_from(["add", "drop", "keep", "bogus"]),
                "a/b~c": st.just("x"),
            },
        )
    )
    if annotations or draw(st.booleans()):  # type: ignore[arg-type]
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


SETTINGS = st.builds(
    lambda mode, target, allow, policy, shadow: build_settings(
        {
            "mode": "shadow" if shadow else "enforce",
            "failurePolicy": policy,
            "ptrace": {"mode": mode, "target": target, "allowPodOverride": allow},
        }
    ),
    st.sampled_from(["add", "drop", "keep"]),
    st.sampled_from(["primary", "sidecar", "all"]),
    st.booleans(),
    st.sampled_from(["Ignore", "Fail"]),
    st.booleans(),
)
FACTS = Facts(RequestFacts("ns"))
CONTAINER_PATH = re.compile(r"^/spec/(containers|initContainers|ephemeralContainers)/(\d+)(/|$)")


def _answer(pod: dict[str, Any], cfg: Settings, kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    return dict(response("uid", plan(pod, FACTS, cfg, kinds=kinds), cfg))


def _effective_ptrace(container: dict[str, Any]) -> bool:
    caps = (container.get("securityContext") or {}).get("capabilities") or {}
    added = caps.get("add") or []
    dropped = caps.get("drop") or []
    granted = any(is_ptrace(c) or c.upper() == "ALL" for c in added)
    return granted and not any(is_ptrace(c) for c in dropped)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pods(), SETTINGS)
def test_patch_applies_and_is_idempotent(pod: dict[str, Any], cfg: Settings) -> None:
    answer = _answer(pod, cfg)
    ops = decoded_patch(answer)
    mutated = apply(pod, ops)
    if answer["allowed"] and "patch" in answer:
        assert decoded_patch(_answer(mutated, cfg)) == []


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pods(), SETTINGS)
def test_only_identified_containers_are_touched(pod: dict[str, Any], cfg: Settings) -> None:
    answer = _answer(pod, cfg, (PTRACE,))
    ops = decoded_patch(answer)
    copilot = find_copilot(read_pod(pod), cfg.copilot)
    if copilot is None:
        if not flyte_owned(read_pod(pod)) or cfg.ptrace.mode != "drop":
            assert ops == [], "a pod without a positively identified copilot is never granted anything"
            return
        copilot = Copilot((), ())
    if cfg.mode == "shadow":
        assert ops == []
        return
    touched = {(m[1], int(m[2])) for op in ops if (m := CONTAINER_PATH.match(op["path"]))}
    mutated = apply(pod, ops)
    granted = {
        (field, i)
        for field in ("containers", "initContainers")
        for i, c in enumerate(mutated["spec"].get(field, []))
        if _effective_ptrace(c) and not _effective_ptrace(pod["spec"][field][i])
    }
    if granted:
        assert answer["auditAnnotations"]["ptrace"].startswith("add:"), "capabilities only granted in add mode"
        members = {(c.field, c.index) for c in copilot.members}
        assert copilot.legacy, "a grant needs a watcher running as a regular container"
        for field, i in granted:
            assert field == "containers", "SYS_PTRACE is only ever granted to regular containers"
            target = cfg.ptrace.target
            is_sidecar = (field, i) in {(c.field, c.index) for c in copilot.sidecars}
            if (field, i) in members:
                assert is_sidecar
                assert target in ("sidecar", "all")
            else:
                assert target in ("primary", "all")
    if answer.get("auditAnnotations", {}).get("ptrace") == "drop":
        for field in ("containers", "initContainers"):
            for c in mutated["spec"].get(field, []):
                privileged = (c.get("securityContext") or {}).get("privileged") is True
                assert privileged or not _effective_ptrace(c), f"{c['name']} keeps SYS_PTRACE under drop"
    assert all(field in ("containers", "initContainers") for field, _ in touched)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pods(), SETTINGS)
def test_mutated_pods_validate_against_the_kubernetes_schema(pod: dict[str, Any], cfg: Settings) -> None:
    mutated = apply(pod, decoded_patch(_answer(pod, cfg)))
    kubernetes_validate.validate(mutated, "1.37.0", strict=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pods(), SETTINGS)
def test_the_puller_is_the_only_container_added_and_alone_sees_the_socket(pod: dict[str, Any], cfg: Settings) -> None:
    answer = _answer(pod, cfg)
    mutated = apply(pod, decoded_patch(answer))
    before = [c["name"] for f in ("initContainers", "containers") for c in pod["spec"].get(f, [])]
    after = [c["name"] for f in ("initContainers", "containers") for c in mutated["spec"].get(f, [])]
    added = [name for name in after if name not in before]
    assert added in ([], ["copilot-webhook-image-puller"])
    if added:
        assert find_copilot(read_pod(pod), cfg.copilot) is not None, "scope copilot: only copilot pods get a puller"
        assert mutated["spec"]["initContainers"][0]["name"] == "copilot-webhook-image-puller"
        for field in ("initContainers", "containers"):
            for c in mutated["spec"].get(field, []):
                mounts = {m["name"] for m in c.get("volumeMounts", [])}
                assert ("copilot-webhook-runtime-socket" in mounts) == (c["name"] == "copilot-webhook-image-puller")
