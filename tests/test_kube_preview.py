"""`preview --from-cluster` and the cluster options of the commands, on the real API server with the chart
installed: the answer is the installed release's (its ConfigMap's configuration, the live namespace labels and
nodes), and `--context` picks the right entry of a kubeconfig that has two."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from harness.environment import child_env
from harness.kube_api import PRIVILEGED_BY_DEFAULT, Kube, Release, release
from tests.helpers import load_yaml
from tests.test_kube_node_cache import add_node

NAMESPACE = "cwprev"
GOLDEN_PODS = Path(__file__).parent / "golden" / "pods"
EXAMPLE = Path(__file__).parent / "golden" / "pods" / "flyte-1.15-bare.yaml"
NODE = "prev-docker"
# Unlike the defaults: drop, so an answer that holds it came from the release's ConfigMap.
VALUES = {"ptrace": {"mode": "drop"}, "podSecurity": PRIVILEGED_BY_DEFAULT}


@pytest.fixture(scope="module")
def installed(kube_admin: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    work = tmp_path_factory.mktemp("from-cluster")
    add_node(kube_admin, NODE, "docker://24.0.7")
    kube_admin.create_namespace("prev-shadow", {"copilot-webhook.io/mode": "shadow"})
    kube_admin.create_namespace("prev-plain")
    installed = release(kube_admin, NAMESPACE, work, VALUES)
    try:
        yield installed
    finally:
        installed.remove_webhooks()
        kube_admin.delete(f"/api/v1/nodes/{NODE}")


@pytest.fixture(scope="module")
def kubeconfig(installed: Release, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two clusters: `elsewhere` (the current context, where nothing listens) and `test`, the real one."""
    path = tmp_path_factory.mktemp("kubeconfig") / "two.kubeconfig"
    config = yaml.safe_load(installed.kubeconfig.read_text())
    config["clusters"].append({"name": "elsewhere", "cluster": {"server": "https://127.0.0.1:1"}})
    config["contexts"].append({"name": "elsewhere", "context": {"cluster": "elsewhere", "user": "user"}})
    config["current-context"] = "elsewhere"
    path.write_text(yaml.safe_dump(config))
    return path


def cli(kube_admin: Kube, work: Path, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """Our command line, run as an operator at a terminal would, in the control plane's network namespace."""
    env = child_env(HOME=str(work), KUBECONFIG=str(work / "absent"))
    command = kube_admin.plane.netns.command([sys.executable, "-m", "webhook", *args])
    return subprocess.run(command, env=env, input=stdin, capture_output=True, timeout=120, check=False)


def _pod_file(tmp_path: Path, **spec: Any) -> Path:
    obj = copy.deepcopy(load_yaml(EXAMPLE))
    obj["spec"].update(spec)
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


def test_from_cluster_answers_as_the_installed_release_would(
    kube_admin: Kube, kubeconfig: Path, tmp_path: Path
) -> None:
    flyte = str(GOLDEN_PODS / "flyte-1.15.yaml")
    offline = cli(kube_admin, tmp_path, "preview", "-f", flyte, "-n", "prev-plain")
    assert orjson.loads(offline.stdout)["decisions"]["ptrace"].startswith("add"), "the built-in default"
    ran = cli(
        kube_admin, tmp_path, "preview", "-f", flyte, "--from-cluster", "--release", NAMESPACE,
        "--release-namespace", NAMESPACE, "-n", "prev-plain", "--kubeconfig", str(kubeconfig), "--context", "test",
    )  # fmt: skip
    assert ran.returncode == 1, ran.stderr.decode()
    answer = orjson.loads(ran.stdout)
    assert answer["decisions"]["ptrace"] == "drop"
    assert any(c["op"] == "remove" and "capabilities/add" in c["path"] for c in answer["changes"])
    assert f"# from the cluster: release {NAMESPACE} in {NAMESPACE} (ConfigMap cwprev-copilot-webhook)" in (
        ran.stderr.decode()
    )


def test_from_cluster_reads_the_namespaces_labels(kube_admin: Kube, kubeconfig: Path, tmp_path: Path) -> None:
    flyte = str(GOLDEN_PODS / "flyte-1.15.yaml")
    ran = cli(
        kube_admin, tmp_path, "preview", "-f", flyte, "--from-cluster", "--release", NAMESPACE,
        "--release-namespace", NAMESPACE, "-n", "prev-shadow", "--kubeconfig", str(kubeconfig), "--context", "test",
    )  # fmt: skip
    assert ran.returncode == 0, "shadow: nothing would change"
    assert "shadow mode:" in ran.stderr.decode()


def test_from_cluster_reads_the_nodes(kube_admin: Kube, kubeconfig: Path, tmp_path: Path) -> None:
    pod = _pod_file(tmp_path, nodeName=NODE)
    ran = cli(
        kube_admin, tmp_path, "preview", "-f", str(pod), "--from-cluster", "--release", NAMESPACE,
        "--release-namespace", NAMESPACE, "-n", "prev-plain", "--kubeconfig", str(kubeconfig), "--context", "test",
    )  # fmt: skip
    assert ran.returncode == 1, ran.stderr.decode()
    runtime = orjson.loads(ran.stdout)["runtime"]
    assert (runtime["flavour"], runtime["socket"]) == ("docker", "/var/run/docker.sock")
    offline = orjson.loads(cli(kube_admin, tmp_path, "preview", "-f", str(pod)).stdout)["runtime"]
    assert offline["flavour"] == "containerd", "without the cluster: imagePuller.defaultRuntime"


def test_the_current_context_is_used_unless_context_names_another(
    kube_admin: Kube, kubeconfig: Path, tmp_path: Path
) -> None:
    flyte = str(GOLDEN_PODS / "flyte-1.15.yaml")
    ran = cli(
        kube_admin, tmp_path, "preview", "-f", flyte, "--from-cluster", "--release", NAMESPACE,
        "--release-namespace", NAMESPACE, "--kubeconfig", str(kubeconfig),
    )  # fmt: skip
    assert ran.returncode == 2
    assert ran.stdout == b""
    refused = "copilot-webhook: preview --from-cluster: cannot reach 127.0.0.1:1: connection refused\n"
    assert ran.stderr.decode() == refused


def test_a_release_that_is_not_there_is_named(kube_admin: Kube, kubeconfig: Path, tmp_path: Path) -> None:
    flyte = str(GOLDEN_PODS / "flyte-1.15.yaml")
    ran = cli(
        kube_admin, tmp_path, "preview", "-f", flyte, "--from-cluster", "--kubeconfig", str(kubeconfig),
        "--context", "test",
    )  # fmt: skip
    assert ran.returncode == 2
    assert "no release 'copilot-webhook' in namespace 'copilot-webhook'" in ran.stderr.decode()
    assert "Traceback" not in ran.stderr.decode()


COMMANDS = {
    "audit": ("audit", "-n", "prev-plain"),
    "label-nodes": ("label-nodes", "--dry-run"),
    "verify": ("verify", "--webhook-config", "no-such-webhook"),
    "unregister": ("unregister", "--webhook-config", "no-such-webhook"),
    "certs ensure": ("certs", "ensure", "--secret", "s", "--webhook-config", "no-such-webhook", "--namespace", "x"),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_each_cluster_command_takes_kubeconfig_and_context(
    kube_admin: Kube, kubeconfig: Path, tmp_path: Path, command: str
) -> None:
    args = COMMANDS[command]
    elsewhere = cli(kube_admin, tmp_path, *args, "--kubeconfig", str(kubeconfig))
    assert elsewhere.returncode == 1
    assert "cannot reach 127.0.0.1:1: connection refused" in elsewhere.stderr.decode()
    assert "Traceback" not in elsewhere.stderr.decode()
    here = cli(kube_admin, tmp_path, *args, "--kubeconfig", str(kubeconfig), "--context", "test")
    assert "127.0.0.1:1" not in (here.stdout + here.stderr).decode(), "the test context's API server answered"
    expected = {"audit": 0, "label-nodes": 0, "verify": 1, "unregister": 0, "certs ensure": 1}[command]
    assert here.returncode == expected, here.stderr.decode()


def test_a_context_the_kubeconfig_lacks_is_named(kube_admin: Kube, kubeconfig: Path, tmp_path: Path) -> None:
    ran = cli(kube_admin, tmp_path, "audit", "--kubeconfig", str(kubeconfig), "--context", "nope")
    assert ran.returncode == 1
    assert "nope" in ran.stderr.decode()
    assert "Traceback" not in ran.stderr.decode()
