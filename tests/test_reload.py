"""Configuration and certificate files replaced the way Kubernetes replaces mounted ConfigMaps and
Secrets: the file is a symlink through `..data`, and the kubelet swaps `..data` to a new directory."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

from certs.authority import generate_files
from tests.asgi import call
from tests.helpers import pod, review
from webhook.config import build_settings
from webhook.web.serve import Reloader
from webhook.web.server import WebhookApp
from webhook.web.tls import ReloadingTLS, TLSFiles


def _kubelet_volume(root: Path, files: dict[str, bytes], generation: int) -> None:
    """Write a new timestamped directory and atomically repoint ..data at it, as the kubelet does."""
    target = root / f"..2026_11_30_{generation:02d}"
    target.mkdir()
    for name, data in files.items():
        (target / name).write_bytes(data)
        link = root / name
        if not link.is_symlink():
            link.symlink_to(Path("..data") / name)
    tmp = root / "..data_tmp"
    tmp.symlink_to(target.name)
    os.replace(tmp, root / "..data")


def test_symlink_swapped_config_and_certificates_are_reloaded(tmp_path: Path) -> None:
    certs_a, certs_b = tmp_path / "a", tmp_path / "b"
    generate_files(certs_a, "svc", "ns", dns=["localhost"])
    generate_files(certs_b, "svc", "ns", dns=["localhost"], days=30)
    secret, config = tmp_path / "secret", tmp_path / "config"
    secret.mkdir()
    config.mkdir()

    def pair(folder: Path) -> dict[str, bytes]:
        return {n: (folder / n).read_bytes() for n in ("tls.crt", "tls.key")}

    _kubelet_volume(secret, pair(certs_a), 1)
    _kubelet_volume(config, {"config.yaml": b"ptrace:\n  mode: add\n"}, 1)

    tls = ReloadingTLS(TLSFiles(str(secret / "tls.crt"), str(secret / "tls.key")))
    app = WebhookApp(build_settings({}))
    reloader = Reloader(app, tls, str(config / "config.yaml"), overrides={})
    first_expiry = tls.expires

    _kubelet_volume(config, {"config.yaml": b"ptrace:\n  mode: drop\n"}, 2)
    _kubelet_volume(secret, pair(certs_b), 2)
    reloader()
    assert app.settings.ptrace.mode == "drop"
    assert tls.expires < first_expiry, "the 30-day certificate is served now"

    _kubelet_volume(config, {"config.yaml": b"ptrace:\n  mode: sometimes\n"}, 3)
    reloader()
    assert app.settings.ptrace.mode == "drop", "an invalid configuration is refused; the last good one stays"
    text = app.metrics.render().decode()
    assert 'copilot_webhook_config_reloads_total{result="ok"} 1.0' in text
    assert 'copilot_webhook_config_reloads_total{result="refused"} 1.0' in text
    assert 'copilot_webhook_certificate_reloads_total{result="ok"} 1.0' in text


def test_settings_read_only_at_start_keep_their_running_values_until_the_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The log says server, cluster and labeller changes take effect at the next start; the body limit and
    deadline used to take effect at once for admission but not for the connection limits, and a new
    runtimeLabel made pin mode select on a label the running labeller does not write."""
    certs = tmp_path / "certs"
    generate_files(certs, "svc", "ns", dns=["localhost"])
    config = tmp_path / "config"
    config.mkdir()
    first = b"server:\n  maxBodyBytes: 100000\nimagePuller:\n  labeller: true\n  runtimeLabel: example.com/runtime\n"
    _kubelet_volume(config, {"config.yaml": first}, 1)
    tls = ReloadingTLS(TLSFiles(str(certs / "tls.crt"), str(certs / "tls.key")))
    started = {
        "server": {"maxBodyBytes": 100000},
        "imagePuller": {"labeller": True, "runtimeLabel": "example.com/runtime"},
    }
    app = WebhookApp(build_settings(started))
    reloader = Reloader(app, tls, str(config / "config.yaml"), overrides={})

    second = b"ptrace:\n  mode: add\nserver:\n  maxBodyBytes: 10000\nimagePuller:\n  runtimeLabel: example.com/other\n"
    _kubelet_volume(config, {"config.yaml": second}, 2)
    reloader()

    assert app.settings.ptrace.mode == "add", "what a reload may change, it changes"
    assert app.at_head("POST", b"/mutate", [(b"content-type", b"application/json")]).limit == 100000
    body = orjson.dumps(review(pod("flyte-1.15-bare.yaml"), uid="big"))
    body += b" " * (50000 - len(body))  # over the new limit, within the running one
    assert call(app, "POST", "/mutate", body, content_type="application/json").status_code == 200
    assert (app.settings.image_puller.labeller, app.settings.image_puller.runtime_label) == (
        True,
        "example.com/runtime",
    )
    assert "changed server, imagePuller.labeller, imagePuller.runtimeLabel: those take effect at the next start" in (
        caplog.text
    )
