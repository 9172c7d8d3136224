"""Facts the plan reads besides the pod: the request and what the caches know of the cluster.

Named tuples rather than frozen dataclasses: equally immutable, and built on every request at a tenth
of the cost (a frozen dataclass sets each field through object.__setattr__).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

INJECT_LABEL = "copilot-webhook.io/inject"
MODE_LABEL = "copilot-webhook.io/mode"
PSA_ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"


class RequestFacts(NamedTuple):
    namespace: str
    dry_run: bool = False


class ClusterFacts(NamedTuple):
    """What is known of the pod's namespace. `namespace_labels` is None when there is no cluster access."""

    namespace_labels: Mapping[str, str] | None = None

    def label(self, key: str) -> str | None:
        return None if self.namespace_labels is None else self.namespace_labels.get(key)

    @property
    def pod_security_level(self) -> str:
        """The namespace's Pod Security `enforce` level; `privileged` (no restriction) when unset or unknown."""
        return (self.label(PSA_ENFORCE_LABEL) or "privileged").lower()


NO_CLUSTER = ClusterFacts()


def cluster_facts(namespace_labels: Mapping[str, str] | None) -> ClusterFacts:
    if namespace_labels is None:
        return NO_CLUSTER
    return ClusterFacts(MappingProxyType(dict(namespace_labels)))


class Facts(NamedTuple):
    request: RequestFacts
    cluster: ClusterFacts = NO_CLUSTER
