from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from certs.authority import generate_files
from harness.controlplane import ControlPlane
from harness.fake_apiserver import FakeAPIServer
from harness.image_builds import ImageBuilder
from harness.kube_api import Kube
from tests.skips import ALLOWED_SKIPS, SkipLedger
from tests.tiers import DESCRIPTIONS, TierGuard, assign


def pytest_configure(config: pytest.Config) -> None:
    """Every run ends with what it ran and skipped; under CI=true an unlisted skip fails it (tests/skips.py).
    Every test has one tier marker (tests/tiers.py), and a `pure` one is held to it while it runs."""
    config.pluginmanager.register(SkipLedger(ALLOWED_SKIPS), "skip-ledger")
    for tier, description in DESCRIPTIONS.items():
        config.addinivalue_line("markers", f"{tier}: {description}")
    config.pluginmanager.register(TierGuard(), "tier-guard")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test gets its tier from what its code and its fixtures reach (tests/tiers.py)."""
    assign(items)


@pytest.fixture(scope="session")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and a serving certificate for 127.0.0.1 and localhost, made fresh for this test run."""
    out = tmp_path_factory.mktemp("tls")
    generate_files(out, "copilot-webhook", "copilot-webhook", dns=["localhost"], ips=["127.0.0.1"])
    return out


@pytest.fixture
def api() -> Iterator[FakeAPIServer]:
    """A Kubernetes API server for nodes and namespaces, on a free loopback port."""
    server = FakeAPIServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd and kube-apiserver built from their Go modules, on loopback in a network namespace of the
    test run's own; the same one for the whole session (tests use namespaces and releases of their own)."""
    from harness.controlplane import control_plane, require_root
    from harness.gotools import binary

    require_root()
    etcd, apiserver, controllers = binary("etcd"), binary("kube-apiserver"), binary("kube-controller-manager")
    with control_plane(tmp_path_factory.mktemp("kube"), etcd, apiserver, controllers) as plane:
        _PLANES.append(plane)
        yield plane
        _PLANES.remove(plane)


_PLANES: list[ControlPlane] = []


@pytest.fixture(scope="session")
def kube_admin(kube: ControlPlane) -> Iterator[Kube]:
    """The control plane's API as its administrator (system:masters)."""
    admin = Kube(kube)
    yield admin
    admin.close()


@pytest.fixture(scope="session")
def image_builder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageBuilder]:
    """A real dockerd with the stand-in base (made from Debian's packages by mmdebstrap, most of an image
    build's time), the same one for the whole session: tests/test_images.py starts its images in it, and the
    node modules build theirs in it. It stops when the session ends."""
    from harness.image_builds import start_builder

    with start_builder(tmp_path_factory.mktemp("image-builder")) as builder:
        yield builder


@pytest.fixture(scope="session")
def dockerfile_images(image_builder: ImageBuilder, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The Dockerfile's targets (puller, webhook), built once for the session on the stand-in base: their tags
    by target, in the session's dockerd."""
    from harness.image_builds import build_targets

    return build_targets(tmp_path_factory.mktemp("dockerfile-images"), image_builder)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used the control plane carries its logs (they also stay in the tmp folder)."""
    report = yield
    if report.failed and "kube" in getattr(item, "fixturenames", ()) and _PLANES:
        report.sections.append(("control plane logs", _PLANES[-1].logs()))
    return report
