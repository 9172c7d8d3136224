"""The puller's pure parts: reference normalisation, the credential keyring, its command line. Every
client path runs against real daemons in test_pull_daemons.py."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from webhook.errors import InvalidReference
from webhook.pull.errors import ERROR_LIMIT, PullError
from webhook.pull.keyring import Keyring
from webhook.references import normalise, parse


@pytest.mark.parametrize(
    ("written", "normalised"),
    [
        ("busybox", "docker.io/library/busybox:latest"),
        ("library/busybox", "docker.io/library/busybox:latest"),
        ("docker.io/library/busybox:latest", "docker.io/library/busybox:latest"),
        ("index.docker.io/library/busybox", "docker.io/library/busybox:latest"),
        ("team/app:1", "docker.io/team/app:1"),
        ("localhost/app", "localhost/app:latest"),
        ("localhost:5000/app:v1", "localhost:5000/app:v1"),
        ("registry.example.com:5000/a/b/c@sha256:" + "ab" * 32, "registry.example.com:5000/a/b/c@sha256:" + "ab" * 32),
        ("cr.flyte.org/flyteorg/flytecopilot:v1.15.3", "cr.flyte.org/flyteorg/flytecopilot:v1.15.3"),
    ],
)
def test_references_normalise_as_the_runtimes_do(written: str, normalised: str) -> None:
    assert normalise(written) == normalised


@pytest.mark.parametrize("text", ["--help", "-x", "UPPER/app", "app:", "a b", "", "app@sha256:xyz", "x" * 600])
def test_invalid_references_never_reach_a_client(text: str) -> None:
    with pytest.raises(InvalidReference):
        parse(text)


def _keyring(tmp_path: Path, auths: dict[str, object]) -> Keyring:
    (tmp_path / "s.json").write_text(json.dumps({"auths": auths}))
    keyring, problems = Keyring.from_directory(str(tmp_path))
    assert problems == []
    return keyring


def _auth(user: str) -> dict[str, str]:
    return {"auth": base64.b64encode(f"{user}:pw".encode()).decode()}


def test_keyring_matches_as_the_kubelet_does(tmp_path: Path) -> None:
    keyring = _keyring(
        tmp_path,
        {
            "https://index.docker.io/v1/": _auth("hub"),
            "registry.example.com": _auth("any-path"),
            "registry.example.com/team": _auth("team"),
            "*.corp.example": _auth("wildcard"),
            "registry.example.com:5000": _auth("port"),
        },
    )

    def users(image: str) -> list[str]:
        return [c.username for c in keyring.lookup(parse(image))]

    assert users("busybox") == ["hub"]
    assert users("registry.example.com/team/app:1") == ["team", "any-path"], "most specific first, then the rest"
    assert users("registry.example.com/other/app:1") == ["any-path"]
    assert users("registry.example.com:5000/team/app:1") == ["port"], "ports must be equal"
    assert users("git.corp.example/tools/agent:3") == ["wildcard"]
    assert users("a.b.corp.example/x:1") == [], "a * matches one label"


def test_broken_pull_secrets_are_reported_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "badauth.json").write_text(json.dumps({"auths": {"r.example": {"auth": "!!"}}}))
    (tmp_path / "good.json").write_text(json.dumps({"auths": {"r.example": _auth("ok")}}))
    keyring, problems = Keyring.from_directory(str(tmp_path))
    assert len(problems) == 2
    assert [c.username for c in keyring.lookup(parse("r.example/x:1"))] == ["ok"]


def test_long_errors_keep_what_failed_and_why() -> None:
    error = PullError("failed to pull " + "x" * 500 + ": not found")
    assert len(error.message) <= ERROR_LIMIT
    assert error.message.startswith("failed to pull")
    assert error.message.endswith(": not found")
    assert error.permanent


def _pull(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "webhook.pull", *args], capture_output=True, text=True, timeout=60)


def test_usage_errors_exit_2_and_no_images_is_fine() -> None:
    assert _pull("--runtime=podman", "--socket=/s", "--", "x").returncode == 2
    assert _pull("--runtime=docker", "--socket=/s", "--pod-network-registry=r", "--", "x").returncode == 2
    done = _pull("--runtime=cri", "--socket=/s")
    assert done.returncode == 0
    assert done.stdout.startswith("summary present=0")


def test_an_absent_socket_fails_each_image_with_its_cause() -> None:
    done = _pull("--runtime=docker", "--socket=/nonexistent.sock", "--retries=1", "--", "busybox:1")
    assert done.returncode == 0, done.stderr
    assert "image=busybox:1 result=failed attempts=0" in done.stdout, "it never got to pull"
    assert "No such file or directory" in done.stdout


@pytest.mark.parametrize(
    ("message", "permanent"),
    [
        ('Get "http://127.0.0.1:40135/v2/": dial tcp 127.0.0.1:40135: connect: connection refused', False),
        ("dial tcp 10.0.0.1:4030: i/o timeout", False),
        ("pulling from host r:5000 failed with status code [manifests v1]: 401 Unauthorized", True),
        ("unexpected status: 403 Forbidden", True),
        ("failed to resolve reference: not found", True),
    ],
)
def test_refusals_are_told_from_addresses_that_contain_the_same_digits(message: str, permanent: bool) -> None:
    assert PullError(message).permanent is permanent
