"""What the modules that run pods on the node (harness/node.py) set up alike: the node itself, and the images
built in the session's dockerd on the stand-in base (harness/image_builds.py: the base and the Dockerfile's
targets are built once per session, each module builds its own images there) imported into the node's
containerd (`docker save | ctr images import`). Each module's fixtures call these, so each module has a
node of its own with its images in it."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.controlplane import ControlPlane
from harness.daemons import require
from harness.image_builds import ImageBuilder
from harness.node import Node, node, require_node
from webhook.references import normalise


def running_node(kube: ControlPlane, *tools: str) -> Iterator[Node]:
    """The node, for a module-scoped fixture to yield from; `tools`: what else the module needs on PATH."""
    from harness.gotools import binary

    require_node()
    require(*tools)
    kubelet, controllers, proxy = binary("kubelet"), binary("kube-controller-manager"), binary("kube-proxy")
    # Short: unix socket paths (containerd's, the shims') are limited to 108 bytes.
    work = Path(f"/tmp/cwn-{os.getpid()}")
    try:
        with node(kube, work, kubelet, controllers, proxy) as running:
            yield running
    finally:
        shutil.rmtree(work, ignore_errors=True)


def import_images(the_node: Node, work: Path, builder: ImageBuilder, tags: list[str]) -> None:
    """Save the images `tags` from the session's dockerd and import them into the node's containerd."""
    archive = work / "images.tar"
    subprocess.run(
        ["docker", "save", "--output", str(archive), *tags],
        check=True,
        capture_output=True,
        env=builder.env,
        timeout=600,
    )
    the_node.import_image(archive)


@dataclass
class Images:
    """The Dockerfile's targets by the names the node's containerd holds them under (normalised references)."""

    puller: str
    webhook: str


def import_dockerfile_images(
    the_node: Node, work: Path, builder: ImageBuilder, targets: dict[str, str], others: Sequence[str] = ()
) -> Images:
    """The Dockerfile's targets (`dockerfile_images`: tag by target) and `others` imported into the node."""
    import_images(the_node, work, builder, [*targets.values(), *others])
    return Images(normalise(targets["puller"]), normalise(targets["webhook"]))
