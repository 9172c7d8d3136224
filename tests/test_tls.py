from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from certs.authority import generate_ca, issue_serving, write_files
from webhook.web.tls import ReloadingTLS, TLSFiles


def _files(tmp_path: Path, days: int = 30, now: datetime | None = None) -> TLSFiles:
    ca = generate_ca(now=now)
    write_files(tmp_path, ca, issue_serving(ca, ["localhost"], days=days, now=now))
    return TLSFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))


def test_ready_until_the_certificate_expires(tmp_path: Path) -> None:
    tls = ReloadingTLS(_files(tmp_path, days=1))
    assert tls.readiness() is None
    reason = tls.readiness(now=datetime.now(UTC) + timedelta(days=2))
    assert reason is not None
    assert "expired" in reason


def test_a_broken_new_pair_is_refused_and_the_old_one_kept(tmp_path: Path) -> None:
    files = _files(tmp_path)
    tls = ReloadingTLS(files)
    before = tls.expires
    assert tls.reload_if_changed() is None
    time.sleep(0.01)
    Path(files.key).write_text("not a key")
    assert tls.reload_if_changed() is False
    assert tls.expires == before
    _files(tmp_path, days=90)
    assert tls.reload_if_changed() is True
    assert tls.expires > before
