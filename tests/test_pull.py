"""The puller program against fake `docker` and `crictl` clients on the PATH: no node needed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

FAKE_CLIENT = r"""#!/usr/bin/env bash
# A stand-in runtime client: logs its arguments, knows FAKE_PRESENT images, fails FAKE_FAILS times,
# sleeps FAKE_SLEEP seconds per pull and never finishes pulling FAKE_HANG.
echo "$(basename "$0") $*" >> "$FAKE_LOG"
image="${@: -1}"
case " $* " in
  *" inspect "*|*" inspecti "*)
    [[ ",$FAKE_PRESENT," == *",$image,"* ]] && exit 0
    echo "no such image: $image" >&2; exit 1 ;;
  *" pull "*)
    [[ "$image" == "$FAKE_HANG" ]] && sleep 100
    echo "start $image" >> "$FAKE_LOG"
    sleep "${FAKE_SLEEP:-0}"
    echo "end $image" >> "$FAKE_LOG"
    count_file="$FAKE_DIR/$(echo "$image" | tr '/:@' '___').count"
    n=$(( $(cat "$count_file" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$count_file"
    if [[ -n "$FAKE_FAILS" && "$FAKE_FAILS" == "$image="* ]]; then
      (( n <= ${FAKE_FAILS##*=} )) && { echo "registry unavailable (attempt $n)" >&2; exit 1; }
    fi
    exit 0 ;;
esac
echo "unexpected: $*" >&2; exit 2
"""


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("docker", "crictl"):
        script = bin_dir / name
        script.write_text(FAKE_CLIENT)
        script.chmod(0o755)
    return bin_dir


def _pull(fake_bin: Path, *args: str, **fake: str) -> tuple[subprocess.CompletedProcess[str], list[str], float]:
    log = fake_bin.parent / "calls.log"
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "FAKE_LOG": str(log), "FAKE_DIR": str(fake_bin.parent)}
    env.update({f"FAKE_{k.upper()}": v for k, v in fake.items()})
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "webhook.pull", *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return result, calls, time.monotonic() - started


def test_present_images_are_skipped_and_missing_ones_pulled_through_the_socket(fake_bin: Path) -> None:
    result, calls, _ = _pull(
        fake_bin, "--client=crictl", "--socket=/run/k3s/containerd/containerd.sock", "--",
        "nginx", "registry.example.com:5000/team/app@sha256:" + "a" * 64, present="nginx",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("image=nginx result=present attempts=0") for line in lines)
    assert any(
        line.startswith("image=registry.example.com:5000/team/app@sha256:") and "result=pulled attempts=1" in line
        for line in lines
    )
    assert lines[-1] == "summary present=1 pulled=1 failed=0"
    endpoint = "--runtime-endpoint unix:///run/k3s/containerd/containerd.sock --image-endpoint unix:///run/k3s/containerd/containerd.sock"
    assert f"crictl {endpoint} inspecti --quiet nginx" in calls
    assert not any(" pull nginx" in c for c in calls)


def test_docker_client_uses_the_docker_socket(fake_bin: Path) -> None:
    result, calls, _ = _pull(fake_bin, "--client=docker", "--socket=/var/run/docker.sock", "--", "busybox")
    assert result.returncode == 0
    assert [c for c in calls if c.startswith("docker ")] == [
        "docker --host unix:///var/run/docker.sock image inspect busybox",
        "docker --host unix:///var/run/docker.sock pull --quiet busybox",
    ]


def test_pulls_run_in_parallel(fake_bin: Path) -> None:
    images = [f"img-{i}" for i in range(4)]
    result, calls, _ = _pull(fake_bin, "--client=crictl", "--socket=/s", "--", *images, sleep="1")
    assert result.returncode == 0
    assert result.stdout.count("result=pulled") == 4
    events = [c.split()[0] for c in calls if c.startswith(("start ", "end "))]
    assert events[:4] == ["start"] * 4, f"every pull started before the first finished: {events}"


def test_failed_pulls_are_retried_with_back_off(fake_bin: Path) -> None:
    result, calls, _ = _pull(
        fake_bin, "--client=crictl", "--socket=/s", "--backoff=0.05", "--", "flaky", fails="flaky=2"
    )
    assert result.returncode == 0
    assert "image=flaky result=pulled attempts=3" in result.stdout
    assert sum(" pull flaky" in c for c in calls) == 3


@pytest.mark.parametrize(("policy", "code"), [("Ignore", 0), ("Fail", 1)])
def test_failure_policy_decides_the_exit_code(fake_bin: Path, policy: str, code: int) -> None:
    result, _, _ = _pull(
        fake_bin, "--client=crictl", "--socket=/s", "--backoff=0.01", f"--failure-policy={policy}", "--", "ok", "gone",
        fails="gone=99",
    )  # fmt: skip
    assert result.returncode == code
    assert "image=gone result=failed attempts=3" in result.stdout
    assert "error='registry unavailable (attempt 3)'" in result.stdout
    assert "summary present=0 pulled=1 failed=1" in result.stdout


def test_the_deadline_bounds_everything(fake_bin: Path) -> None:
    result, _, seconds = _pull(
        fake_bin, "--client=crictl", "--socket=/s", "--timeout=1.5", "--failure-policy=Fail", "--", "stuck", "fine",
        hang="stuck",
    )  # fmt: skip
    assert seconds < 5
    assert result.returncode == 1
    assert "image=stuck result=failed attempts=1" in result.stdout
    assert "error='timed out'" in result.stdout
    assert "image=fine result=pulled" in result.stdout


def test_a_missing_client_is_a_clear_failure(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "webhook.pull", "--client=docker", "--socket=/s", "--backoff=0.01", "--", "x"],
        capture_output=True, text=True, env=env, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 0  # Ignore is the default
    assert "error='cannot run docker: No such file or directory'" in result.stdout


def test_no_images_is_fine_and_usage_errors_exit_2(fake_bin: Path) -> None:
    assert _pull(fake_bin, "--client=crictl", "--socket=/s")[0].stdout.strip() == "no images to pull"
    assert _pull(fake_bin, "--client=podman", "--socket=/s", "--", "x")[0].returncode == 2


def test_the_planned_container_command_runs(fake_bin: Path) -> None:
    """The args the webhook writes into the puller container are the ones this program takes."""
    from webhook.config import build_settings
    from webhook.mutation.puller import puller_container
    from webhook.mutation.runtime import Runtime

    container = puller_container(
        Runtime("containerd", "/run/containerd/containerd.sock", "crictl", "test"),
        ["a", "b"],
        build_settings({}).image_puller,
    )
    assert container["command"] == ["copilot-webhook-pull"]
    result, _, _ = _pull(fake_bin, *container["args"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("result=pulled") == 2
