"""label-nodes and the in-process labeller against the fake API server, with the real client."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.environment import child_env, eventually
from harness.fake_apiserver import FakeAPIServer, node
from webhook.cluster.access import ClusterView, api_client
from webhook.config import ClusterSettings

LABEL = "copilot-webhook.io/container-runtime"
NODES = "/api/v1/nodes"


def _cluster(api: FakeAPIServer) -> None:
    api.put_many(
        NODES,
        [
            node("a", "containerd://1.7.11"),
            node("b", "docker://24.0.7", labels={LABEL: "docker"}),  # already right
            node("c", "cri-o://1.28.0", labels={LABEL: "docker"}),  # wrong
            node("d", "Unknown", labels={LABEL: "containerd"}),  # unknown now: the label must go
        ],
    )


def _run(api: FakeAPIServer, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    env = child_env(COPILOT_WEBHOOK_CLUSTER__KUBECONFIG=str(kubeconfig))
    command = [sys.executable, "-m", "webhook", "label-nodes", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)


def test_label_nodes_dry_run_changes_nothing(api: FakeAPIServer, tmp_path: Path) -> None:
    _cluster(api)
    result = _run(api, tmp_path, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"a: {LABEL}: (none) -> containerd",
        f"c: {LABEL}: docker -> cri-o",
        f"d: {LABEL}: containerd -> (removed: unknown runtime)",
        "3 of 4 node(s) to change (dry run)",
    ]
    assert api.patches == []


def test_label_nodes_patches_only_what_is_wrong(api: FakeAPIServer, tmp_path: Path) -> None:
    _cluster(api)
    result = _run(api, tmp_path)
    assert result.returncode == 0, result.stderr
    labels = {name: obj["metadata"]["labels"].get(LABEL) for name, obj in api.objects[NODES].items()}
    assert labels == {"a": "containerd", "b": "docker", "c": "cri-o", "d": None}
    assert [name for name, _ in api.patches] == ["a", "c", "d"]
    assert _run(api, tmp_path).stdout.splitlines()[-1] == "0 of 4 node(s) to change"


def test_label_nodes_without_cluster_access_fails_clearly(tmp_path: Path) -> None:
    env = child_env(HOME=str(tmp_path), KUBECONFIG=str(tmp_path / "none"))
    result = subprocess.run(
        [sys.executable, "-m", "webhook", "label-nodes"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "no cluster access" in result.stderr


def test_in_process_labeller_follows_the_cache(api: FakeAPIServer, tmp_path: Path) -> None:
    _cluster(api)
    client = api_client(ClusterSettings(kubeconfig=str(api.kubeconfig(tmp_path / "kc"))))
    assert client is not None
    view = ClusterView(client, label=LABEL, labeller_interval=0.2, watch_seconds=2, backoff=(0.05, 0.2))
    view.start()
    try:
        assert eventually(lambda: api.objects[NODES]["a"]["metadata"]["labels"].get(LABEL) == "containerd")
        api.put(NODES, node("e", "docker://25.0.0"))
        assert eventually(lambda: api.objects[NODES]["e"]["metadata"]["labels"].get(LABEL) == "docker")
    finally:
        view.stop()
