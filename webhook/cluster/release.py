"""What an installed release would answer: its configuration (the chart's ConfigMap) and the live facts of
the cluster (namespace labels, nodes), for `preview --from-cluster`. Read once, nothing watched."""

from __future__ import annotations

import base64
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from webhook.cluster.errors import ClusterAccessError
from webhook.cluster.namespaces import NamespaceCache
from webhook.cluster.nodes import NodeCache
from webhook.config import ConfigDocument, Settings, build_settings, dump_settings, parse_config
from webhook.errors import ConfigError
from webhook.mutation.facts import ClusterFacts

CONFIG_KEY = "config.yaml"
INSTANCE_LABEL = "app.kubernetes.io/instance"  # the chart labels every object with its release's name


@dataclass(frozen=True)
class Release:
    """The release's settings, the facts lookup, and what they came from (for the user)."""

    settings: Settings
    namespaces: Callable[[str], ClusterFacts]
    source: str
    existing: frozenset[str]  # the namespaces the cluster has


def release_config(core: client.CoreV1Api, release: str, namespace: str) -> tuple[str, ConfigDocument]:
    """The name and configuration of the release's ConfigMap: the one in `namespace`, labelled with the
    release, that holds config.yaml."""
    found = core.list_namespaced_config_map(namespace, label_selector=f"{INSTANCE_LABEL}={release}")
    holding = [c for c in found.items if CONFIG_KEY in (c.data or {})]
    if not holding:
        raise ClusterAccessError(
            f"no release {release!r} in namespace {namespace!r}: no ConfigMap there labelled "
            f"{INSTANCE_LABEL}={release} holds {CONFIG_KEY} (name the release with --release and --release-namespace)"
        )
    config_map = holding[0]
    name = str(config_map.metadata.name if config_map.metadata else release)
    where = f"the configuration of release {release!r} (ConfigMap {namespace}/{name})"
    return name, parse_config(str((config_map.data or {})[CONFIG_KEY]).encode(), where)


def _agent_ca(api: client.ApiClient, release: str, workdir: Path) -> str | None:
    """Agent mode: the CA the webhook configuration publishes, which also signs the node agent's certificate,
    written to a file for imagePuller.agent.caFile (the release's path is inside its pods)."""
    admission = client.AdmissionregistrationV1Api(api)
    found = admission.list_mutating_webhook_configuration(label_selector=f"{INSTANCE_LABEL}={release}")
    for config in found.items:
        for hook in config.webhooks or ():
            bundle = hook.client_config.ca_bundle if hook.client_config else None
            if bundle:
                path = workdir / "ca.crt"
                path.write_bytes(base64.b64decode(bundle))
                return str(path)
    return None


def from_cluster(api: client.ApiClient, settings: Settings, *, release: str, namespace: str) -> Release:
    """The release's configuration with this command's cluster access, and the cluster's namespaces and nodes
    as listed now. Raises ClusterAccessError (or the API client's errors) when they cannot be read, and
    ConfigError when the release's configuration is not one this version reads."""
    core = client.CoreV1Api(api)
    name, data = release_config(core, release, namespace)
    data = {**data, "cluster": dump_settings(settings)["cluster"]}
    try:
        released = build_settings(data)
    except ConfigError as exc:
        raise ConfigError(f"release {release!r} (ConfigMap {namespace}/{name}): {exc}") from None
    if released.image_puller.mode == "agent":
        ca_file = _agent_ca(api, release, Path(tempfile.mkdtemp(prefix="copilot-webhook-")))
        agent = {**dump_settings(released)["imagePuller"]["agent"], "caFile": ca_file}
        released = build_settings({**data, "imagePuller": {**data.get("imagePuller", {}), "agent": agent}})
    namespaces = NamespaceCache(core.list_namespace)
    namespaces.informer.list_once()
    nodes = NodeCache(core.list_node)
    nodes.informer.list_once()
    snapshot = nodes.snapshot
    labels: Mapping[str, Mapping[str, str]] = namespaces.informer.items

    def lookup(name: str) -> ClusterFacts:
        # A namespace that does not exist counts as one without labels, as the API server would see it once made.
        return ClusterFacts(labels.get(name) or {}, snapshot, "synced")

    count = len(snapshot.nodes)
    source = f"release {release} in {namespace} (ConfigMap {name}), {count} node(s), {len(labels)} namespace(s)"
    return Release(released, lookup, source, frozenset(labels))
