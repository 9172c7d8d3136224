"""Cluster access (`cluster.enabled`) and the facts lookup the server reads on every request."""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

from webhook.cluster.errors import ClusterAccessError
from webhook.cluster.labeller import Labeller
from webhook.cluster.namespaces import NamespaceCache
from webhook.cluster.nodes import NodeCache
from webhook.config import ClusterSettings
from webhook.mutation.facts import ClusterFacts, ExportedFacts, NodeSnapshot, NodeState

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


# The loaders' refresh_api_key_hook runs before every request and sets the whole configuration again, the
# host included, whose setter reads every environment variable looking for a proxy: its cost grows with the
# pod's environment (service links add seven variables per Service in the namespace). The credentials it
# refreshes last minutes, so once a second is enough.
REFRESH_SECONDS = 1.0


class RefreshAtMostEvery:
    """A refresh_api_key_hook run at most once per `seconds` for each configuration. It is copied with
    the configuration (client_without_retries makes copies), so each copy keeps its own time."""

    def __init__(self, hook: Callable[[client.Configuration], object], seconds: float = REFRESH_SECONDS) -> None:
        self.hook, self.seconds = hook, seconds
        self.last = -float("inf")

    def __call__(self, configuration: client.Configuration) -> None:
        now = time.monotonic()
        if now - self.last >= self.seconds:
            self.hook(configuration)
            self.last = now
            installed = configuration.refresh_api_key_hook
            if installed is not None and installed is not self:  # the loaders' hooks install themselves again
                self.hook = installed
                configuration.refresh_api_key_hook = self


def _refresh_at_most_every_second(configuration: client.Configuration) -> client.Configuration:
    if configuration.refresh_api_key_hook is not None:
        configuration.refresh_api_key_hook = RefreshAtMostEvery(configuration.refresh_api_key_hook)
    return configuration


def load_configuration(settings: ClusterSettings) -> client.Configuration | None:
    """The client configuration per `cluster.enabled`: `auto` uses the in-cluster service account or a
    kubeconfig when one is present and runs without cluster facts otherwise; `true` requires access; `false`
    never. Says at INFO where the access comes from (the service account and its namespace, or the kubeconfig,
    its context and server); never a token or any other credential."""
    if settings.enabled == "false":
        return None
    kubeconfig, source = _kubeconfig(settings)
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and SERVICE_ACCOUNT_TOKEN.exists()
    if settings.kubeconfig is None and settings.context is None and in_cluster:
        return _refresh_at_most_every_second(_in_cluster())
    if Path(kubeconfig.split(os.pathsep)[0]).exists():
        return _refresh_at_most_every_second(_from_kubeconfig(kubeconfig, source, settings.context))
    if settings.kubeconfig is not None:
        raise ClusterAccessError(f"the kubeconfig {settings.kubeconfig} does not exist")
    if settings.enabled == "true":
        raise ClusterAccessError("cluster.enabled is true, but there is no service account and no kubeconfig")
    log.info("no service account and no kubeconfig: running without cluster facts")
    return None


def _in_cluster() -> client.Configuration:
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except config.ConfigException as exc:
        raise ClusterAccessError(f"cannot load cluster credentials: {exc}") from None
    except OSError as exc:
        raise ClusterAccessError(f"cannot read the service account's credentials: {exc}") from None
    try:
        namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "(empty)"
    except OSError:
        namespace = "(unknown)"
    log.info(
        "cluster access: the in-cluster service account of namespace %s, API server %s", namespace, configuration.host
    )
    return configuration


def _from_kubeconfig(kubeconfig: str, source: str, context: str | None) -> client.Configuration:
    configuration = client.Configuration()
    try:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, context=context, client_configuration=configuration
        )
        context = context or _current_context(kubeconfig)
    except config.ConfigException as exc:
        raise ClusterAccessError(f"cannot load cluster credentials: {exc}") from None
    except OSError as exc:
        raise ClusterAccessError(f"cannot read the kubeconfig {kubeconfig}: {exc.strerror or exc}") from None
    except (ValueError, yaml.YAMLError) as exc:
        raise ClusterAccessError(f"cannot read the kubeconfig {kubeconfig}: {exc}") from None
    except (TypeError, AttributeError, KeyError):  # YAML, but not shaped as a kubeconfig
        raise ClusterAccessError(f"the kubeconfig {kubeconfig} is not a kubeconfig") from None
    log.info(
        "cluster access: kubeconfig %s (%s), context %s, API server %s", kubeconfig, source, context, configuration.host
    )
    return configuration


def _kubeconfig(settings: ClusterSettings) -> tuple[str, str]:
    """The kubeconfig that would be read, and where its name comes from."""
    if settings.kubeconfig:
        return settings.kubeconfig, "cluster.kubeconfig"
    if os.environ.get("KUBECONFIG"):
        return os.environ["KUBECONFIG"], "$KUBECONFIG"
    return str(Path.home() / ".kube" / "config"), "the default"


def _current_context(kubeconfig: str) -> str:
    _contexts, current = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    name = current.get("name") if isinstance(current, dict) else None
    return str(name) if name else "(none)"


def api_client(settings: ClusterSettings) -> client.ApiClient | None:
    """An API client per `cluster.enabled` (load_configuration)."""
    configuration = load_configuration(settings)
    return client.ApiClient(configuration) if configuration is not None else None


def client_without_retries(configuration: client.Configuration) -> client.ApiClient:
    """A client on a copy of `configuration` whose requests urllib3 does not retry, for callers that try again
    themselves (the caches and the keeper of the webhook configuration): a failed request is then one
    failure, said once by them, not first retried three times at once, each retry a warning of urllib3's own."""
    own = copy.deepcopy(configuration)
    own.retries = 0
    return client.ApiClient(own)


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
