from __future__ import annotations

from pathlib import Path

import pytest

from certs.authority import generate_files


@pytest.fixture(scope="session")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and a serving certificate for 127.0.0.1 and localhost, made fresh for this test run."""
    out = tmp_path_factory.mktemp("tls")
    generate_files(out, "copilot-webhook", "copilot-webhook", dns=["localhost"], ips=["127.0.0.1"])
    return out
