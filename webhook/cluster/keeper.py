"""In the server: keep our own MutatingWebhookConfiguration trustworthy.

- It watches the configuration (a list+watch narrowed to its name), so drift is seen within a second.
- It checks that this pod's own listener (its pod IP, with the Service's DNS name as server name, the way
  the API server dials) verifies against the caBundle published there: once the server listens, every
  `check_every` seconds, and after every change of the configuration.
- Self-signed TLS (`out` given): it renews the certificate through `ensure` every `renew_every` seconds,
  and re-asserts the caBundle at once when the configuration stops carrying ours (blanked, replaced by a
  foreign CA, or a webhook added without it) or when the self-check fails. Repeated drift backs off, so
  a misconfigured injector fighting us cannot turn the API server into a busy loop.
- Any TLS mode: after a check passed, it patches in the failure policies the chart declared (see
  certificates.py: fail open until trusted).
"""

from __future__ import annotations

import base64
import functools
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from webhook import objects
from webhook.cluster.certificates import CertificateManager, handshake_verifies
from webhook.cluster.errors import described
from webhook.cluster.informer import Informer

log = logging.getLogger(__name__)

Projection = tuple[tuple[tuple[str, str, str], ...], str]  # ((name, caBundle, failurePolicy), ...), annotation


class Report(Protocol):
    def renewal(self, result: str) -> None: ...
    def self_check(self, failure: str | None) -> None: ...
    def bundle_expiry(self, bundle: bytes) -> None: ...
    def bundle_repair(self) -> None: ...


def _project(obj: objects.WebhookConfiguration) -> Projection:
    hooks = tuple(
        (str(h.get("name")), str((h.get("clientConfig") or {}).get("caBundle") or ""), str(h.get("failurePolicy")))
        for h in obj.get("webhooks") or ()
    )
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return hooks, str(annotations)


class AdmissionKeeper:
    def __init__(
        self,
        manager: CertificateManager,
        report: Report,
        check_address: tuple[str, int],
        *,
        listening: threading.Event,
        out: Path | None = None,
        bundle: bytes | None = None,
        renew_every: float = 600.0,
        check_every: float = 60.0,
    ) -> None:
        """`out`: where the served certificate lives, when we keep it (self-signed TLS); `bundle`: the
        caBundle the first `ensure` published."""
        self.manager, self.report, self.out = manager, report, out
        self.server_name = manager.names[2]  # <svc>.<ns>.svc, the name the API server dials
        self.server: str = manager.admission.api_client.configuration.host  # the API server, named in failures
        self.check_address, self.listening = check_address, listening
        self.renew_every, self.check_every = renew_every, check_every
        self.expected = bundle
        self.stopping = threading.Event()
        self.wake = threading.Event()
        self.repairs = 0
        self._last_repair = 0.0
        self._repair_pause = 1.0
        self._seen: Projection | None = None
        self._drift = False
        self.informer: Informer[Projection] = Informer(
            "webhook-configuration",
            functools.partial(
                manager.admission.list_mutating_webhook_configuration,
                field_selector=f"metadata.name={manager.webhook_config}",
            ),
            _project,
            on_change=self._changed,
            backoff=(0.5, 10.0),
            resource=f"the MutatingWebhookConfiguration {manager.webhook_config}",
            server=self.server,
        )
        self.informer.stopping = self.stopping

    def _changed(self, items: Mapping[str, Projection], _names: frozenset[str] | None) -> None:
        seen = items.get(self.manager.webhook_config)
        if seen != self._seen:
            self._seen = seen
            self.wake.set()

    # --- the three actions ----------------------------------------------------------------------------
    def renew(self) -> None:
        if self.out is None:
            return
        try:
            state = self.manager.ensure(self.out)
        except Exception as exc:  # the served certificate stays; try again next round
            why, ours = described(exc)
            log.warning("certificate renewal failed: %s", why, exc_info=exc if ours else None)
            self.report.renewal("failed")
            return
        self.expected = state.bundle
        self.report.renewal("renewed" if state.changed else "current")
        if state.changed:
            log.info("certificate: %s", state.note)

    def check(self) -> str | None:
        """None when our listener verifies against the published caBundle; otherwise why not."""
        try:
            bundle = self.manager.published(self.manager.read_webhook_config())
        except Exception as exc:  # said once, in the self-check's line below
            reason, ours = described(exc)
            if ours:
                log.warning("cannot read %s for the self-check", self.manager.webhook_config, exc_info=exc)
            why: str | None = f"cannot read the webhook configuration from {self.server}: {reason}"
        else:
            why = (
                "the webhook configuration has no caBundle"
                if not bundle
                else handshake_verifies(self.check_address, self.server_name, bundle)
            )
            if bundle:
                self.report.bundle_expiry(bundle)
        self.report.self_check(why)
        if why:
            log.warning("TLS self-check of %s:%d failed: %s", *self.check_address, why)
        return why

    def drifted(self) -> bool:
        """Self-signed TLS: does any webhook carry a caBundle other than the one we published?"""
        if self.out is None or self.expected is None or self._seen is None:
            return False
        ours = base64.b64encode(self.expected).decode()
        return any(bundle != ours for _name, bundle, _policy in self._seen[0])

    def repair(self, why: str) -> None:
        now = time.monotonic()
        # Drift again soon after a repair: someone is fighting us; the pause doubles, up to a minute.
        self._repair_pause = min(60.0, self._repair_pause * 2) if now - self._last_repair < 10 else 1.0
        self._last_repair = now
        log.warning("re-asserting the caBundle of %s: %s", self.manager.webhook_config, why)
        self.repairs += 1
        self.report.bundle_repair()
        self.renew()

    def _repair_due(self) -> float:
        return self._last_repair + self._repair_pause if self._last_repair else 0.0

    def promote(self) -> None:
        try:
            changed = self.manager.promote_policies()
        except Exception as exc:
            why, ours = described(exc)
            log.warning(
                "cannot patch the declared failure policies into %s: %s",
                self.manager.webhook_config,
                why,
                exc_info=exc if ours else None,
            )
            return
        if changed:
            log.info("the caBundle verified: failure policies now %s", ", ".join(changed))

    # --- the loop -------------------------------------------------------------------------------------
    def step(self, now: float, next_renew: float, next_check: float) -> tuple[float, float]:
        if self.wake.is_set():
            self.wake.clear()
            self._drift = self.drifted()
            next_check = min(next_check, now + 0.2)  # verify what changed, then promote
        if self._drift and now >= self._repair_due():
            self._drift = False
            self.repair("it no longer carries the CA in our Secret")
        if self.out is not None and now >= next_renew:
            self.renew()
            next_renew = now + self.renew_every
        if self.listening.is_set() and now >= next_check:
            why = self.check()
            next_check = now + self.check_every
            if why and self.out is not None:
                self.repair(f"the self-check failed ({why})")
                # The server reloads the rewritten files within a second: look again soon, less often
                # while it keeps failing (the repair back-off).
                next_check = now + max(2.0, self._repair_pause)
            elif not why:
                self.promote()
        return next_renew, next_check

    def run(self) -> None:
        # The first renewal ran before the server started; the first check waits until it listens.
        next_renew = time.monotonic() + self.renew_every
        next_check = time.monotonic()
        while not self.stopping.is_set():
            next_renew, next_check = self.step(time.monotonic(), next_renew, next_check)
            wait = min(next_renew if self.out is not None else next_check, next_check) - time.monotonic()
            if self._drift:
                wait = min(wait, self._repair_due() - time.monotonic())
            if not self.listening.is_set():
                wait = min(wait, 0.1)
            self.wake.wait(max(0.05, wait))

    def start(self) -> None:
        self.informer.start()
        threading.Thread(target=self.run, name="admission-keeper", daemon=True).start()

    def close(self) -> None:
        self.stopping.set()
        self.wake.set()
