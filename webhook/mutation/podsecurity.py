"""The Pod Security level in force for a pod, decided as the API server's PodSecurity admission
decides it (k8s.io/pod-security-admission, admission.go and api/helpers.go):

1. an exempt namespace, or a pod whose runtimeClassName is exempt, has no level enforced;
2. else the namespace's `pod-security.kubernetes.io/enforce` label; a value that is not one of the three
   levels, spelt exactly, is enforced as `restricted`;
3. else the cluster's default, the AdmissionConfiguration's `defaults.enforce` as the settings give it; a
   namespace the cache has not seen yet counts here, never as unrestricted.

Exempt usernames are not read (the review's userInfo is not decoded): a pod created by an exempt user is
judged at its namespace's level, which can only leave out what the API server would have allowed.
"""

from __future__ import annotations

from typing import NamedTuple

from webhook.config import LEVELS, PodSecuritySettings
from webhook.mutation.facts import PSA_ENFORCE_LABEL, Facts
from webhook.mutation.pod import PodView


class Level(NamedTuple):
    name: str  # privileged, baseline or restricted
    source: str  # where it comes from, as a warning names it

    @property
    def forbids_privilege(self) -> bool:
        """Both baseline and restricted forbid hostPath volumes and adding SYS_PTRACE."""
        return self.name != "privileged"

    def __str__(self) -> str:
        return f"Pod Security {self.name!r} ({self.source})"


def level_in_force(view: PodView, facts: Facts, settings: PodSecuritySettings) -> Level:
    if facts.request.pod_security is not None:
        return Level(facts.request.pod_security, "what-if")
    exemptions = settings.exemptions
    if exemptions.namespaces and facts.request.namespace in exemptions.namespaces:
        return Level("privileged", "exempt namespace")
    runtime_class = view.spec.get("runtimeClassName")
    if exemptions.runtime_classes and type(runtime_class) is str and runtime_class in exemptions.runtime_classes:
        return Level("privileged", "exempt runtime class")
    label = facts.cluster.label(PSA_ENFORCE_LABEL)
    if label is not None:
        return Level(label if label in LEVELS else "restricted", "namespace label")
    return Level(settings.defaults.enforce, "cluster default")
