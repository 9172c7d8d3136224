"""The command line as a user runs it: exit codes, messages, outputs."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from harness.environment import child_env
from tests.helpers import GOLDEN, HERE, PODS

ENV = child_env()


def _run(*args: str, env: dict[str, str] | None = None, stdin: bytes | None = None) -> subprocess.CompletedProcess[Any]:
    """Text out, unless `stdin` is given: then bytes in and out."""
    return subprocess.run(
        [sys.executable, "-m", "webhook", *args],
        capture_output=True,
        text=stdin is None,
        input=stdin,
        env={**ENV, **(env or {})},
        timeout=60,
        check=False,
    )


def test_config_show_prints_the_effective_configuration(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("ptrace:\n  target: all\n")
    result = _run("config", "show", "--config", str(config), env={"COPILOT_WEBHOOK_PTRACE__MODE": "drop"})
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["ptrace"] == {"mode": "drop", "target": "all", "allowPodOverride": False}
    assert shown["failurePolicy"] == "Ignore"


def test_invalid_configuration_exits_2_naming_key_value_and_choices() -> None:
    result = _run("config", "show", env={"COPILOT_WEBHOOK_PTRACE__MODE": "maybe"})
    assert result.returncode == 2
    assert (
        "invalid configuration: ptrace.mode: 'maybe' is not allowed; expected 'add', 'drop' or 'keep'" in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_serve_with_invalid_configuration_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("server:\n  port: -1\n")
    result = _run("serve", "--config", str(config))
    assert result.returncode == 2
    assert "server.port" in result.stderr


def test_serve_without_certificate_exits_1_naming_the_file(tmp_path: Path) -> None:
    result = _run("serve", "--tls-cert", str(tmp_path / "missing.crt"), "--tls-key", str(tmp_path / "missing.key"))
    assert result.returncode == 1
    assert "missing.crt" in result.stderr


def test_usage_errors_exit_2() -> None:
    assert _run("frobnicate").returncode == 2
    assert _run("preview").returncode == 2


def test_certs_generate_prints_the_ca_bundle(tmp_path: Path) -> None:
    result = _run(
        "certs", "generate", "--out", str(tmp_path), "--service", "s", "--namespace", "n", "--dns", "x.example"
    )
    assert result.returncode == 0, result.stderr
    assert base64.b64decode(result.stdout.strip()) == (tmp_path / "ca.crt").read_bytes()


def test_preview_matches_the_http_answer_offline() -> None:
    result = _run("preview", "-f", str(PODS / "flyte-1.15-bare.yaml"), "--output", "patch")
    assert result.returncode == 1, result.stderr
    ops = orjson.loads(result.stdout)
    assert {"op": "add", "path": "/spec/shareProcessNamespace", "value": True} in ops


def test_preview_what_if_a_pod_security_level_is_in_force() -> None:
    result = _run("preview", "-f", str(PODS / "flyte-1.15-bare.yaml"), "--pod-security", "restricted")
    assert result.returncode == 0, result.stderr
    answer = orjson.loads(result.stdout)
    assert answer["patch"] == []
    assert "copilot-webhook: SYS_PTRACE not added: Pod Security 'restricted' (what-if) forbids it" in answer["warnings"]
    assert _run("preview", "-f", str(PODS / "flyte-1.15-bare.yaml"), "--pod-security", "strict").returncode == 2


def test_preview_from_stdin_as_diff() -> None:
    result = _run("preview", "-f", "-", "-o", "diff", stdin=(PODS / "flyte-1.15-bare.yaml").read_bytes())
    assert result.returncode == 1
    assert b"+  shareProcessNamespace: true" in result.stdout


def test_preview_of_a_bad_file_exits_2_with_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "deployment.yaml"
    bad.write_text("kind: Deployment\nspec: {}\n")
    result = _run("preview", "-f", str(bad))
    assert result.returncode == 2
    assert "copilot-webhook: " + str(bad) + ": object: Deployment has no pod template at spec.template" in result.stderr
    assert result.stdout == ""
    missing = _run("preview", "-f", str(tmp_path / "none.yaml"))
    assert missing.returncode == 2
    assert "cannot read" in missing.stderr


DORP_WARNING = "Warning: copilot-webhook: copilot-webhook.io/ptrace='dorp' ignored: expected add, drop or keep\n"


def _dorp(tmp_path: Path) -> Path:
    pod = yaml.safe_load((PODS / "flyte-1.15-bare.yaml").read_text())
    pod["metadata"]["annotations"] = {"copilot-webhook.io/ptrace": "dorp"}
    path = tmp_path / "dorp.yaml"
    path.write_text(yaml.safe_dump(pod))
    return path


@pytest.mark.parametrize("output", ["json", "yaml", "patch", "diff"])
def test_preview_warnings_are_warning_lines_on_stderr_in_every_output(tmp_path: Path, output: str) -> None:
    result = _run("preview", "-f", str(_dorp(tmp_path)), "-o", output)
    assert DORP_WARNING in result.stderr
    assert "Warning:" not in result.stdout
    assert "Warning:" not in _run("preview", "-f", str(PODS / "flyte-1.15-bare.yaml"), "-o", output).stderr


@pytest.mark.parametrize("output", ["json", "yaml", "patch", "diff"])
def test_preview_says_on_stderr_when_a_pod_would_be_refused(tmp_path: Path, output: str) -> None:
    config = tmp_path / "fail.yaml"
    config.write_text("failurePolicy: Fail\n")
    result = _run("preview", "-f", str(GOLDEN / "primary-missing-fail.yaml"), "--config", str(config), "-o", output)
    assert (
        "copilot-webhook: Pod/no-primary would be refused: copilot-webhook cannot decide (failurePolicy Fail): "
        "primary_container_name 'does-not-exist' names no regular container\n"
    ) in result.stderr


def test_preview_exits_as_kubectl_diff_does(tmp_path: Path) -> None:
    """0 nothing would change, 1 something would, 3 an object would be refused (whatever else would change),
    2 usage and input it cannot preview; whatever the output form."""
    config = tmp_path / "fail.yaml"
    config.write_text("failurePolicy: Fail\n")
    refused = (GOLDEN / "primary-missing-fail.yaml").read_text()
    bundle = tmp_path / "bundle.yaml"
    bundle.write_text((PODS / "flyte-1.15-bare.yaml").read_text() + "---\n" + refused)
    shadow = tmp_path / "shadow.yaml"
    shadow.write_text("mode: shadow\n")
    cases = [
        (("-f", str(PODS / "plain.yaml")), 0),
        (("-f", str(PODS / "flyte-1.15-bare.yaml")), 1),
        (("-f", str(PODS / "flyte-1.15-bare.yaml"), "--config", str(shadow)), 0),
        (("-f", str(GOLDEN / "primary-missing-fail.yaml"), "--config", str(config)), 3),
        (("-f", str(bundle), "--config", str(config)), 3),
        (("-f", str(bundle)), 1),
        (("-f", str(tmp_path / "missing.yaml")), 2),
        (("-f", str(PODS / "plain.yaml"), "--runtime", "podman"), 2),
    ]
    for output in ("json", "diff"):
        for args, code in cases:
            assert _run("preview", *args, "-o", output).returncode == code, (args, output)


def test_the_readmes_preview_is_what_preview_prints() -> None:
    readme = (HERE.parent / "README.md").read_text()
    start = readme.index("```diff\n") + len("```diff\n")
    shown = readme[start : readme.index("```\n", start)]
    result = _run("preview", "-f", str(HERE.parent / "examples" / "flyte-1.15-pod.yaml"), "-o", "diff")
    assert result.stdout == shown
    assert result.returncode == 1, "the README says so"
    assert "exit status is 1" in readme


def test_preview_passes_a_service_through_saying_nothing_applies(tmp_path: Path) -> None:
    service = tmp_path / "svc.yaml"
    service.write_text("apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n")
    result = _run("preview", "-f", str(service), "-o", "yaml")
    assert result.returncode == 0
    assert yaml.safe_load(result.stdout) == {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}}
    assert result.stderr.splitlines() == [
        "# Service/web: ptrace=skipped(no-pod-template);image-puller=skipped(no-pod-template)",
        "Warning: copilot-webhook: Service passed through unchanged: the webhook acts on Pods alone (a Pod, the pod "
        "template of a Deployment, StatefulSet, DaemonSet, ReplicaSet, Job, CronJob, an AdmissionReview)",
    ]


@pytest.mark.parametrize("output", ["yaml", "patch", "diff"])
def test_preview_names_each_objects_decisions_on_stderr_where_the_answer_does_not(tmp_path: Path, output: str) -> None:
    bundle = tmp_path / "bundle.yaml"
    bundle.write_text((PODS / "plain.yaml").read_text() + "---\n" + (PODS / "flyte-1.16.yaml").read_text())
    result = _run("preview", "-f", str(bundle), "-o", output)
    assert result.returncode == 1
    assert result.stderr == (
        "# Pod/web: ptrace=skipped(not-copilot);image-puller=skipped(not-copilot)\n"
        "# Pod/dz7-n0-0: ptrace=add:none(native-sidecar);image-puller=containerd:/run/containerd/containerd.sock\n"
    )
    json_answer = _run("preview", "-f", str(bundle))
    assert json_answer.stderr == ""
    assert [e["decisions"]["ptrace"] for e in orjson.loads(json_answer.stdout)] == [
        "skipped(not-copilot)",
        "add:none(native-sidecar)",
    ]
