"""examples/: every file is previewed as examples/README.md says (exit status and the stderr of each command
it lists), the Flyte pods are the ones Flyte creates, and the bundle passes its other objects through."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import yaml

from harness.environment import child_env
from tests.helpers import GOLDEN, HERE, load_yaml

EXAMPLES = HERE.parent / "examples"


def _rows() -> list[tuple[str, int, list[str]]]:
    """(command, exit status, stderr lines) of the README's command table."""
    text = (EXAMPLES / "README.md").read_text()
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `") or "copilot-webhook preview" not in line:
            continue
        command, status, stderr = (cell.strip() for cell in line.strip("|").split(" | "))
        rows.append((command.strip("`"), int(status), [part.strip("`") for part in stderr.split("<br>")]))
    return rows


ROWS = _rows()


def _run(command: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    words = shlex.split(command)
    env = dict(word.split("=", 1) for word in words[: words.index("copilot-webhook")])
    args = words[words.index("copilot-webhook") + 1 :]
    result = subprocess.run(
        [sys.executable, "-m", "webhook", *args],
        cwd=EXAMPLES,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result, args


def test_every_example_is_in_a_documented_command() -> None:
    files = {path.name for path in EXAMPLES.glob("*.yaml")}
    assert files >= {"flyte-1.15-pod.yaml", "flyte-1.16-pod.yaml", "deployment.yaml", "bundle.yaml"}
    named = {word for command, _, _ in ROWS for word in shlex.split(command) if word.endswith(".yaml")}
    assert named == files


@pytest.mark.parametrize(("command", "status", "stderr"), ROWS, ids=[row[0] for row in ROWS])
def test_each_command_exits_and_says_what_the_readme_says(command: str, status: int, stderr: list[str]) -> None:
    result, args = _run(command)
    assert result.returncode == status, result.stderr
    assert result.stderr.splitlines() == stderr
    output = args[args.index("-o") + 1]
    if output == "diff":
        assert bool(result.stdout) is (status == 1), "a diff exactly when something would change"
    if output == "patch":
        assert orjson.loads(result.stdout), "a patch with operations"


def test_the_flyte_examples_are_the_pods_flyte_creates() -> None:
    assert load_yaml(EXAMPLES / "flyte-1.15-pod.yaml") == load_yaml(GOLDEN / "flyte-src-1.15-io.yaml")
    assert load_yaml(EXAMPLES / "flyte-1.16-pod.yaml") == load_yaml(HERE / "flyte" / "pods" / "v1.16" / "io.yaml")
    bundled = list(yaml.safe_load_all((EXAMPLES / "bundle.yaml").read_text()))
    assert bundled[-1] == load_yaml(EXAMPLES / "flyte-1.16-pod.yaml")


def test_the_bundle_passes_its_configmap_and_service_through() -> None:
    result, _ = _run("copilot-webhook preview -f bundle.yaml -o yaml")
    given = list(yaml.safe_load_all((EXAMPLES / "bundle.yaml").read_text()))
    admitted = list(yaml.safe_load_all(result.stdout))
    assert [o["kind"] for o in admitted] == ["ConfigMap", "Service", "Pod"]
    assert admitted[:2] == given[:2]
    assert admitted[2] != given[2]


def test_a_workloads_template_is_what_changes() -> None:
    result, _ = _run("COPILOT_WEBHOOK_IMAGEPULLER__SCOPE=all copilot-webhook preview -f deployment.yaml -o patch")
    paths = [op["path"] for op in orjson.loads(result.stdout)]
    assert paths
    assert all(path.startswith("/spec/template/") for path in paths)


def test_drop_removes_the_capability_flyte_115_asked_for() -> None:
    result, _ = _run("COPILOT_WEBHOOK_PTRACE__MODE=drop copilot-webhook preview -f flyte-1.15-pod.yaml -o patch")
    removed = [op for op in orjson.loads(result.stdout) if op["op"] == "remove"]
    assert [op["path"] for op in removed] == ["/spec/containers/0/securityContext/capabilities/add/0"]


def test_the_readmes_example_is_a_flyte_pod() -> None:
    readme = (HERE.parent / "README.md").read_text()
    assert "--data-binary @examples/flyte-1.15-pod.yaml" in readme
    assert Path(EXAMPLES / "flyte-1.15-pod.yaml").read_text().startswith("# A Flyte 1.15 raw-container task")
