from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from certs.authority import generate_files
from tests.fake_apiserver import FakeAPIServer


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
