"""Images built by a real dockerd on a stand-in base, once per test session (tests/conftest.py's
`image_builder` and `dockerfile_images`). Public base images cannot be pulled here, so the base is made from
Debian's packages (mmdebstrap of bookworm with python3, `docker import`), and the Dockerfile's targets are
built on it with wheels of every dependency built beforehand on the host (the Dockerfile's
PIP_INSTALL_OPTIONS). The base by mmdebstrap is most of what a build costs, so the session makes it once:
tests/test_images.py starts the Dockerfile's images in this dockerd, and the modules that run pods on the
node (harness/node_setup.py) build their own images in it on the same base and import them, with the
Dockerfile's, into their node's containerd."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness.daemons import Dockerd, dockerd, require

ROOT = Path(__file__).parent.parent
CONTEXT_FILES = ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "requirements", "webhook", "certs")
BASE = "cw-test-base:bookworm"
# The registry `make images` tags the Dockerfile's targets under here, as REGISTRY/<name>:<appVersion>.
REGISTRY = "cw-test"


@dataclass
class ImageBuilder:
    docker: Dockerd
    env: dict[str, str]  # the environment in which `docker` talks to this dockerd
    base: str  # the stand-in base's tag


@contextmanager
def start_builder(work: Path) -> Iterator[ImageBuilder]:
    """A dockerd (overlay2, or vfs where the kernel refuses it) with the stand-in base imported."""
    from harness.node import unmount_under

    require("dockerd", "docker", "mmdebstrap")
    # Short: a unix socket path is limited to 108 bytes. A folder of its own: tests/test_pull_daemons.py
    # removes /tmp/cwd-<pid> when its module ends, and this dockerd lives until the session ends.
    short = Path(f"/tmp/cws-{os.getpid()}")
    try:
        with dockerd(short, storage="overlay2") as docker:
            env = {**os.environ, "DOCKER_HOST": f"unix://{docker.socket}", "DOCKER_BUILDKIT": "0"}
            yield ImageBuilder(docker, env, build_base(work, env))
    finally:
        unmount_under(short)  # dockerd leaves its exec-root's network namespace mounted
        shutil.rmtree(short, ignore_errors=True)


def build_base(work: Path, env: dict[str, str]) -> str:
    tarball = work / "bookworm.tar"
    subprocess.run(
        ["mmdebstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm", str(tarball)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    subprocess.run(["docker", "import", str(tarball), BASE], check=True, capture_output=True, env=env)
    return BASE


def build_context(work: Path) -> Path:
    """The repository's build inputs, with wheels of every dependency built here beforehand."""
    context = work / "context"
    context.mkdir()
    for name in CONTEXT_FILES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=shutil.ignore_patterns("__pycache__", "dev"))
        else:
            shutil.copy(source, context / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(context / "wheels"),
         "-c", str(ROOT / "requirements" / "images.lock"), f"{ROOT}[puller]", "setuptools>=69"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return context


def build_targets(work: Path, builder: ImageBuilder) -> dict[str, str]:
    """The Dockerfile's targets on the stand-in base, built by `make images` as a user builds them: their tags
    by target."""
    context = build_context(work)
    wheels = "PIP_INSTALL_OPTIONS='--no-index --find-links=/src/wheels'"
    flags = f"--quiet --network host --build-arg BASE={builder.base} --build-arg {wheels}"
    subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), "images",
         f"REGISTRY={REGISTRY}", f"CONTEXT={context}", f"DOCKER_BUILD_FLAGS={flags}"],
        check=True, capture_output=True, env=builder.env, timeout=1800,
    )  # fmt: skip
    version = yaml.safe_load((ROOT / "deploy" / "helm" / "copilot-webhook" / "Chart.yaml").read_text())["appVersion"]
    return {"puller": f"{REGISTRY}/image-puller:{version}", "webhook": f"{REGISTRY}/copilot-webhook:{version}"}
