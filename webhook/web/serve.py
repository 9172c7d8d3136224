"""Run the HTTPS server: uvicorn with our TLS context, plus reloads of certificate and configuration files.

Reloads are checked once a second from uvicorn's own tick, in the event loop thread, so a swap never
races a request: a request sees either the old settings or the new, whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import ssl
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

import uvicorn
from kubernetes.client import ApiClient
from pydantic.alias_generators import to_camel

from webhook.cluster.access import ClusterView, api_client
from webhook.cluster.certificates import CertificateManager, own_namespace
from webhook.cluster.errors import ClusterAccessError
from webhook.cluster.keeper import AdmissionKeeper
from webhook.config import ServerSettings, Settings, load_settings
from webhook.errors import ConfigError
from webhook.preview.workers import no_cluster_export
from webhook.review import no_cluster
from webhook.stamps import file_stamp
from webhook.web.connections import Limits, Unread, protocol_class
from webhook.web.metrics import Metrics
from webhook.web.server import DIRECT, MetricsApp, WebhookApp
from webhook.web.stalls import LoopMonitor
from webhook.web.tls import ReloadingTLS, TLSFiles

log = logging.getLogger(__name__)

RELOAD_EVERY_TICKS = 10  # uvicorn ticks every 0.1 s
# How long the API server keeps an idle connection to a webhook: client-go's transports take Go's
# http.DefaultTransport IdleConnTimeout. server.idleTimeoutSeconds must be longer (config.py).
API_SERVER_IDLE_SECONDS = 90
SWITCH_INTERVAL = 0.001


class ReloadingServer(uvicorn.Server):
    """uvicorn's server, plus file reloads (every second, and at once on SIGHUP) and a drain on SIGTERM.

    SIGTERM or SIGINT first drains for `server.drainSeconds`: readyz answers 503, every answer says
    `Connection: close`, and requests keep being served; then uvicorn stops accepting and finishes what is
    in flight (connections.py gives idle ones a moment to deliver a request already sent). A second signal
    stops at once. `monitor` watches the event loop while it serves (stalls.py).
    """

    def __init__(
        self,
        config: uvicorn.Config,
        reload: Callable[[], None],
        limits: Limits,
        *,
        drain_seconds: float,
        metrics: tuple[uvicorn.Server, Limits] | None = None,
        monitor: LoopMonitor | None = None,
    ) -> None:
        super().__init__(config)
        self._monitor = monitor
        self._reload = reload
        self._limits = limits
        # The metrics port drains with this one: a scrape answered during the drain closes its connection,
        # instead of holding the exit for the idle timeout.
        self._drained = [limits] if metrics is None else [limits, metrics[1]]
        self._drain_seconds = drain_seconds
        self._drain_until: float | None = None
        self._reload_now = False
        # The plain-HTTP /metrics listener, started and stopped with this one.
        self._metrics = metrics[0] if metrics else None
        self.listening = threading.Event()

    async def serve(self, sockets: list[Any] | None = None) -> None:
        if self._monitor is None:
            await super().serve(sockets)
            return
        self._monitor.start(asyncio.get_running_loop())
        try:
            await super().serve(sockets)
        finally:
            self._monitor.stop()

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        if self._metrics is not None and not self.should_exit:
            self._metrics.config.load()
            self._metrics.lifespan = self._metrics.config.lifespan_class(self._metrics.config)
            await self._metrics.startup()
        if self.started:
            self.listening.set()

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        if self._metrics is not None and self._metrics.started:
            await self._metrics.shutdown()
        await super().shutdown(sockets)

    def request_reload(self, _signal: int, _frame: FrameType | None) -> None:
        self._reload_now = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_until is not None or self._drain_seconds == 0:
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # uvicorn re-raises it at exit, so the exit status says why
        for limits in self._drained:
            limits.draining = True
        self._drain_until = time.monotonic() + self._drain_seconds
        log.info(
            "%s: draining for %g s (readyz answers 503, answers close their connection), then stopping",
            signal.Signals(sig).name,
            self._drain_seconds,
        )

    async def on_tick(self, counter: int) -> bool:
        if counter % RELOAD_EVERY_TICKS == 0 or self._reload_now:
            if self._reload_now:
                log.info("SIGHUP: reloading the configuration and certificate files now")
            self._reload_now = False
            try:
                self._reload()
            except Exception:  # a reload must never stop the server; the last good state stays in force
                log.exception("reload failed; the previous configuration and certificate stay in force")
        if self._drain_until is not None and time.monotonic() >= self._drain_until:
            self.should_exit = True
        return await super().on_tick(counter)


class Reloader:
    """Checks the certificate and configuration files and applies changes to the running app."""

    def __init__(
        self, app: WebhookApp, tls: ReloadingTLS, config_file: str | None, *, overrides: Mapping[str, Any]
    ) -> None:
        self.app, self.tls, self.config_file, self.overrides = app, tls, config_file, overrides
        self._config_stamp = file_stamp(config_file)
        app.metrics.certificate_expiry.set(tls.expires.timestamp())

    def __call__(self) -> None:
        reloaded = self.tls.reload_if_changed()
        if reloaded is not None:
            self.app.metrics.certificate_reloads.labels("ok" if reloaded else "refused").inc()
            self.app.metrics.certificate_expiry.set(self.tls.expires.timestamp())
        if self.config_file is None:
            return
        stamp = file_stamp(self.config_file)
        if stamp == self._config_stamp:
            return
        self._config_stamp = stamp
        try:
            new = load_settings(self.config_file, overrides=self.overrides)
        except (ConfigError, RecursionError, MemoryError) as exc:
            log.error("new configuration in %s refused, the previous one stays in force: %s", self.config_file, exc)
            self.app.metrics.config_reloads.labels("refused").inc()
            return
        old = self.app.settings
        # What the server was started with stays in force until the next start, as the log line says: the
        # listener, the connection limits and the cluster client exist once; body limits and deadlines are read
        # from the settings at each request, so a reload would otherwise apply them to half the server.
        started = old.image_puller
        puller = new.image_puller
        # A running labeller keeps the label it started with, and pin mode must select on that one.
        kept: dict[str, object] = {"labeller": started.labeller}
        if started.labeller:
            kept["runtime_label"] = started.runtime_label
        changed = [name for name in ("server", "cluster") if getattr(new, name) != getattr(old, name)]
        changed += [f"imagePuller.{to_camel(key)}" for key, value in kept.items() if getattr(puller, key) != value]
        if changed:
            log.warning(
                "%s changed %s: those take effect at the next start, the running values stay until then",
                self.config_file,
                ", ".join(changed),
            )
            new = new.model_copy(
                update={"server": old.server, "cluster": old.cluster, "image_puller": puller.model_copy(update=kept)}
            )
        self.app.settings = new
        self.app.metrics.config_reloads.labels("ok").inc()
        log.info("configuration reloaded from %s", self.config_file)


class ManagedTLS(NamedTuple):
    """The cluster objects the server looks after when it watches its own webhook configuration."""

    secret: str | None  # with a Secret, the server also keeps its own certificate there (self-signed TLS)
    webhook_config: str
    service: str
    days: int  # the certificate's validity
    dns: Sequence[str] = ()  # more names it covers (the node agent's Service)


def serve(
    settings: Settings,
    config_file: str | None,
    overrides: Mapping[str, Any],
    *,
    managed: ManagedTLS | None = None,
    check_address: tuple[str, int] | None = None,
) -> int:
    """Serve until a signal stops it; 1 when something needed to start is missing."""
    metrics = Metrics()
    keeper = None
    if managed is not None:
        keeper = _keeper(settings, managed, check_address, metrics=metrics)
        if keeper is None:
            return 1
    tls = _tls(settings.server)
    if tls is None:
        return 1
    try:
        api = api_client(settings.cluster)
    except ClusterAccessError as exc:
        log.error("%s", exc)
        return 1
    if settings.server.idle_timeout_seconds <= API_SERVER_IDLE_SECONDS:
        log.warning(
            "server.idleTimeoutSeconds %g s is not longer than the %d s the API server keeps an idle connection: "
            "a review it sends as we close one fails (EOF) and the pod is admitted or rejected by the failure policy",
            settings.server.idle_timeout_seconds,
            API_SERVER_IDLE_SECONDS,
        )
    limits = Limits(
        settings.server.max_connections,
        settings.server.idle_timeout_seconds,
        metrics.connections_refused.inc,
        deadline=settings.server.deadline_seconds,
    )
    view = _cluster_view(settings, api, metrics)
    app = WebhookApp(
        settings,
        metrics,
        namespaces=view if view is not None else no_cluster,
        readiness=[limits.readiness, tls.readiness, *([view.readiness] if view is not None else [])],
        facts_export=view.export if view is not None else no_cluster_export,
    )
    server = ReloadingServer(
        _https_config(app, settings.server, tls, limits=limits),
        Reloader(app, tls, config_file, overrides=overrides),
        limits,
        drain_seconds=settings.server.drain_seconds,
        metrics=_metrics_server(settings.server, metrics, limits.unread),
        monitor=LoopMonitor(metrics.event_loop_lag.observe, metrics.event_loop_stalls.inc),
    )
    with contextlib.suppress(ValueError):  # only the main thread may set handlers (tests run serve in threads)
        signal.signal(signal.SIGHUP, server.request_reload)
    log.info(
        "serving https://%s:%d (mode %s, ptrace.mode %s)",
        settings.server.host,
        settings.server.port,
        settings.mode,
        settings.ptrace.mode,
    )
    _run(server, app, view, keeper=keeper)
    return 0


def _tls(server: ServerSettings) -> ReloadingTLS | None:
    """The serving certificate, key and client CA, loaded now and reloaded when their files change."""
    files = TLSFiles(server.tls_cert, server.tls_key, server.client_ca, server.tls_min_version)
    try:
        return ReloadingTLS(files)
    except (OSError, ssl.SSLError, ValueError) as exc:
        log.error("cannot load the TLS certificate %s and key %s: %s", files.cert, files.key, exc)
        return None


def _cluster_view(settings: Settings, api: ApiClient | None, metrics: Metrics) -> ClusterView | None:
    """The namespace and node caches, filling in the background (requests never wait for them); none
    without cluster access."""
    if api is None:
        return None
    label = settings.image_puller.runtime_label if settings.image_puller.labeller else None
    view = ClusterView(api, label=label)
    view.start()
    metrics.watch_nodes(view.nodes.by_runtime)
    return view


def _https_config(app: WebhookApp, server: ServerSettings, tls: ReloadingTLS, *, limits: Limits) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        ssl_context_factory=lambda _config, _default: tls.context,
        http=protocol_class(limits, app, DIRECT),
        ws="none",  # no endpoint speaks websocket: an upgrade request is answered as plain HTTP (connections.py)
        lifespan="off",
        access_log=False,
        server_header=False,
        # No proxy stands between the API server and us: X-Forwarded-For from a loopback client is not read
        # as the client's address (and uvicorn's middleware is not run on every request).
        proxy_headers=False,
        log_config=None,
        # Endpoints are removed from the Service before SIGTERM reaches us (preStop); finish what is in flight.
        timeout_graceful_shutdown=10,
    )


def _metrics_server(server: ServerSettings, metrics: Metrics, unread: Unread) -> tuple[uvicorn.Server, Limits] | None:
    """The plain-HTTP /metrics listener, when `server.metricsPort` asks for one, and its connections' limits."""
    if not server.metrics_port:
        return None
    # Scrapers are few: 16 connections, and silent ones go at the idle timeout like anywhere.
    limits = Limits(
        16,
        server.idle_timeout_seconds,
        name="the metrics port's 16 connections",
        deadline=server.deadline_seconds,
        unread=unread,  # the admission port's: one budget for the process's memory
    )
    config = uvicorn.Config(
        MetricsApp(metrics),
        host=server.host,
        port=server.metrics_port,
        http=protocol_class(limits),
        ws="none",
        lifespan="off",
        access_log=False,
        server_header=False,
        proxy_headers=False,
        log_config=None,
        timeout_graceful_shutdown=10,  # as the admission port: a scrape in flight is finished, not waited on
    )
    return uvicorn.Server(config), limits


def _run(server: ReloadingServer, app: WebhookApp, view: ClusterView | None, *, keeper: AdmissionKeeper | None) -> None:
    """Run the server until it stops, then stop the threads that served it."""
    # Everything made so far lives as long as the process: out of the collector's way, every collection of
    # the oldest generation skips it (6% more /mutate/ptrace throughput, measured side by side).
    gc.collect()
    gc.freeze()
    if view is not None:
        # The caches' threads parse lists beside the event loop: a request waits for them at most 1 ms, not
        # the interpreter's default 5 (docs/performance.md). Without them there is no thread to switch to.
        sys.setswitchinterval(SWITCH_INTERVAL)
    if keeper is not None:
        keeper.listening = server.listening
        keeper.start()
    try:
        server.run()
    finally:
        app.previewer.stop()
        if view is not None:
            view.stop()
        if keeper is not None:
            keeper.close()


def _keeper(
    settings: Settings,
    managed: ManagedTLS,
    check_address: tuple[str, int] | None,
    *,
    metrics: Metrics,
) -> AdmissionKeeper | None:
    """Watch our webhook configuration; with a Secret, make sure a certificate is on disk before serving."""
    secret, webhook_config, service, days, dns = managed
    namespace = own_namespace()
    try:
        api = api_client(settings.cluster)
        if api is None or namespace is None:
            raise ClusterAccessError("--webhook-config needs cluster access and the pod's namespace ($POD_NAMESPACE)")
        manager = CertificateManager(
            api, secret or "", namespace, webhook_config=webhook_config, service=service, days=days, dns=dns
        )
        if check_address is None:
            # Our own listener, as the API server would dial it: not whichever replica the Service picks.
            pod_ip = os.environ.get("POD_IP")
            check_address = (pod_ip, settings.server.port) if pod_ip else (manager.names[2], 443)
        out = Path(settings.server.tls_cert).parent if secret else None
        bundle = None
        if out is not None:
            state = manager.ensure(out)
            metrics.renewal("renewed" if state.changed else "current")
            bundle = state.bundle
    except Exception:
        log.exception("cannot ensure the serving certificate in %s", secret or webhook_config)
        return None
    return AdmissionKeeper(manager, metrics, check_address, listening=threading.Event(), out=out, bundle=bundle)
