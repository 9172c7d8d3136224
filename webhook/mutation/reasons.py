"""Why a kind of mutation changed nothing: the `reason` label of copilot_webhook_skips_total and the
`skipped(...)` or `none(...)` part of the audit annotation, listed once."""

from __future__ import annotations

from typing import Literal

# The whole pod, before either kind is planned.
PlanSkip = Literal["pod-opt-out", "namespace-opt-out", "namespace-not-opted-in", "not-copilot", "undecided"]
# Why a copilot pod needs no SYS_PTRACE: its watcher is a native sidecar (Flyte 1.16+), or it has none.
NoCapability = Literal["native-sidecar", "no-watcher"]
# The SYS_PTRACE policy.
PtraceSkip = Literal["mode-keep", "not-copilot", "native-sidecar", "no-watcher", "pod-security", "already-compliant"]
# The image puller, its runtime decision included.
PullerSkip = Literal[
    "disabled",
    "pod-opt-out",
    "not-copilot",
    "already-injected",
    "pod-security",
    "no-images",
    "cache-unsynced",
    "no-candidate-nodes",
    "unknown-runtime",
    "heterogeneous",
    "heterogeneous-sockets",
    "agent-untrusted",
]
