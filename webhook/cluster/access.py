"""Cluster access (`cluster.enabled`) and the facts lookup the server reads on every request."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from kubernetes import client, config

from webhook.cluster.errors import ClusterAccessError
from webhook.cluster.labeller import Labeller
from webhook.cluster.namespaces import NamespaceCache
from webhook.cluster.nodes import NodeCache
from webhook.config import ClusterSettings
from webhook.mutation.facts import ClusterFacts, ExportedFacts, NodeSnapshot, NodeState

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


def api_client(settings: ClusterSettings) -> client.ApiClient | None:
    """An API client per `cluster.enabled`: `auto` uses the in-cluster service account or a kubeconfig
    when one is present and runs without cluster facts otherwise; `true` requires access; `false` never."""
    if settings.enabled == "false":
        return None
    configuration = client.Configuration()
    kubeconfig = settings.kubeconfig or os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and SERVICE_ACCOUNT_TOKEN.exists()
    try:
        if settings.kubeconfig is None and settings.context is None and in_cluster:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        elif Path(kubeconfig.split(os.pathsep)[0]).exists():
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, context=settings.context, client_configuration=configuration
            )
        elif settings.kubeconfig is not None:
            raise ClusterAccessError(f"the kubeconfig {settings.kubeconfig} does not exist")
        elif settings.enabled == "true":
            raise ClusterAccessError("cluster.enabled is true, but there is no service account and no kubeconfig")
        else:
            log.info("no service account and no kubeconfig: running without cluster facts")
            return None
    except config.ConfigException as exc:
        raise ClusterAccessError(f"cannot load cluster credentials: {exc}") from None
    return client.ApiClient(configuration)


class ClusterView:
    """The caches behind one lookup function: namespace -> ClusterFacts."""

    def __init__(
        self, api: client.ApiClient, label: str | None = None, labeller_interval: float = 10.0, **informer_options: Any
    ) -> None:
        core = client.CoreV1Api(api)
        informer_options.setdefault("server", api.configuration.host)
        self.nodes = NodeCache(core.list_node, **informer_options)
        self.namespaces = NamespaceCache(core.list_namespace, **informer_options)
        self.labeller: Labeller | None = None
        if label is not None:
            self.labeller = Labeller(
                lambda: self.nodes.snapshot.nodes, core.patch_node, label, interval=labeller_interval
            )
            self.nodes.listeners.append(self.labeller.changed)

    def start(self) -> None:
        self.nodes.informer.start()
        self.namespaces.informer.start()
        if self.labeller is not None:
            self.labeller.start()

    def stop(self) -> None:
        self.nodes.informer.stopping.set()
        self.namespaces.informer.stopping.set()
        if self.labeller is not None:
            self.labeller.stopping.set()

    def __call__(self, namespace: str) -> ClusterFacts:
        # An unsynced node cache is a decision (no puller, a warning), never a wait.
        state: NodeState = "synced" if self.nodes.synced else "unsynced"
        return ClusterFacts(self.namespaces.labels(namespace), self.nodes.snapshot, state)

    def export(self) -> tuple[ExportedFacts, NodeSnapshot]:
        """The facts as plain data for a preview worker, and the node snapshot its questions are answered
        from (the one of this moment, for the whole preview)."""
        nodes = self.nodes.snapshot
        namespaces = {name: dict(labels) for name, labels in self.namespaces.informer.items.items()}
        state: NodeState = "synced" if self.nodes.synced else "unsynced"
        return ExportedFacts(namespaces, state, dict(nodes.groups), len(nodes.nodes)), nodes

    def readiness(self) -> str | None:
        waiting = [c.informer.name for c in (self.nodes, self.namespaces) if not c.synced]
        return f"{' and '.join(waiting)} cache not synced yet" if waiting else None
