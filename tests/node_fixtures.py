"""What the modules that run pods on the node (tests/node.py) set up alike: the node itself, and images built
by a real dockerd on the stand-in base (made from Debian's packages, as tests/test_images.py builds it) and
imported into the node's containerd (`docker save | ctr images import`). Each module's fixtures call these,
so each module has a node and images of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.controlplane import ControlPlane
from tests.daemons import dockerd, require
from tests.node import Node, node, require_node, unmount_under


def running_node(kube: ControlPlane, *tools: str) -> Iterator[Node]:
    """The node, for a module-scoped fixture to yield from; `tools`: what else the module needs on PATH."""
    from tests.gotools import binary

    require_node()
    require(*tools)
    kubelet, controllers = binary("kubelet"), binary("kube-controller-manager")
    # Short: unix socket paths (containerd's, the shims') are limited to 108 bytes.
    work = Path(f"/tmp/cwn-{os.getpid()}")
    try:
        with node(kube, work, kubelet, controllers) as running:
            yield running
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_images(the_node: Node, work: Path, build: Callable[[str, dict[str, str]], list[str]]) -> None:
    """`build(base, env)` builds images with the dockerd that `env` names, on the stand-in base `base`, and
    returns their tags; they are then saved and imported into the node's containerd."""
    from tests.test_images import _build_base

    short = Path(f"/tmp/cwd-{os.getpid()}")
    try:
        with dockerd(short, storage="overlay2") as docker:
            env = {**os.environ, "DOCKER_HOST": f"unix://{docker.socket}", "DOCKER_BUILDKIT": "0"}
            base = _build_base(work, env)
            tags = build(base, env)
            archive = work / "images.tar"
            subprocess.run(
                ["docker", "save", "--output", str(archive), *tags],
                check=True,
                capture_output=True,
                env=env,
                timeout=600,
            )
        the_node.import_image(archive)
    finally:
        unmount_under(short)  # dockerd leaves its exec-root's network namespace mounted
        shutil.rmtree(short, ignore_errors=True)
