"""The namespace cache: per namespace only the labels the webhook reads (opt-out, mode, Pod Security)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from webhook import objects
from webhook.cluster.informer import Informer, ListCall
from webhook.mutation.facts import NAMESPACE_LABELS


def project_namespace(obj: objects.Namespace) -> Mapping[str, str]:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    if not isinstance(labels, dict):
        raise TypeError("namespace labels must be an object")
    return {key: str(labels[key]) for key in NAMESPACE_LABELS if key in labels}


class NamespaceCache:
    def __init__(self, list_call: ListCall, **informer_options: Any) -> None:
        self.informer: Informer[Mapping[str, str]] = Informer(
            "namespace", list_call, project_namespace, **informer_options
        )

    @property
    def synced(self) -> bool:
        return self.informer.synced.is_set()

    def labels(self, namespace: str) -> Mapping[str, str] | None:
        return self.informer.items.get(namespace)
