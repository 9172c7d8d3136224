"""Run the HTTPS server: the admission listener with our TLS context, the human API behind it, and reloads
of the certificate and configuration files.

Reloads are checked once a second in the event loop thread, so a swap never races a request: a request
sees either the old settings or the new, whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

from kubernetes.client import Configuration
from pydantic.alias_generators import to_camel

from webhook.cluster.access import ClusterView, client_without_retries, load_configuration
from webhook.cluster.certificates import CertificateManager, own_namespace
from webhook.cluster.errors import ClusterAccessError, described
from webhook.cluster.keeper import AdmissionKeeper
from webhook.config import ServerSettings, Settings, load_settings
from webhook.errors import ConfigError
from webhook.preview.workers import no_cluster_export
from webhook.review import no_cluster
from webhook.stamps import file_stamp
from webhook.web.admission import Listener
from webhook.web.limits import Limits
from webhook.web.metrics import Metrics
from webhook.web.reading import Stalls, Unread
from webhook.web.relay import HumanApi
from webhook.web.server import MetricsApp, WebhookApp
from webhook.web.stalls import LoopMonitor
from webhook.web.tls import ReloadingTLS, TLSFiles

log = logging.getLogger(__name__)

TICK_SECONDS = 0.1
RELOAD_EVERY_TICKS = 10  # files are checked once a second
GRACEFUL_SECONDS = 10.0  # what is in flight when the drain ends has this long to finish
BACKLOG = 2048  # pending connections the kernel queues for accept()
# How long the API server keeps an idle connection to a webhook: client-go's transports take Go's
# http.DefaultTransport IdleConnTimeout. server.idleTimeoutSeconds must be longer (config.py).
API_SERVER_IDLE_SECONDS = 90
SWITCH_INTERVAL = 0.001


class Process:
    """The running server: the admission listener (and the metrics port's), the human API behind it, file
    reloads (every second, and at once on SIGHUP), and the drain.

    SIGTERM or SIGINT first drains for `server.drainSeconds`: readyz answers 503, every answer says
    `Connection: close`, and requests keep being served. Then the listeners stop accepting, an idle
    connection gets a moment to deliver a request already sent (admission.py), and what is in flight has
    GRACEFUL_SECONDS to finish. A second signal stops at once. The process then exits by the signal, so
    its status says why it stopped.
    """

    def __init__(
        self,
        app: WebhookApp,
        server: ServerSettings,
        tls: ReloadingTLS,
        reload: Callable[[], None],
        *,
        monitor: LoopMonitor | None = None,
    ) -> None:
        self.app, self.settings, self.tls, self._reload = app, server, tls, reload
        self._monitor = monitor
        self.limits = Limits(
            server.max_connections,
            server.idle_timeout_seconds,
            deadline=server.deadline_seconds,
            on_refused=app.metrics.connections_refused.inc,
        )
        # Scrapers are few: 16 connections, and silent ones go at the idle timeout like anywhere.
        self.metrics_limits = Limits(
            16, server.idle_timeout_seconds, deadline=server.deadline_seconds, name="the metrics port's 16 connections"
        )
        self.listening = threading.Event()
        self.signalled: int | None = None
        self.failed = False  # it could not start serving
        self._drain_until: float | None = None
        self._reload_now = False
        self._stop_now = False

    def run(self) -> None:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(self.main())

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        if self._monitor is not None:
            self._monitor.start(loop)
        human = HumanApi(self.app, on_signal=self.signal, timeout_graceful_shutdown=int(GRACEFUL_SECONDS))
        try:
            await human.start()
            listeners, servers = await self._listen(human)
        except (OSError, RuntimeError) as exc:  # a port in use, no address, no private directory for the socket
            log.error("%s", exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
            self.failed = True
            listeners, servers = [], []
        try:
            if servers:
                self.listening.set()
                log.info(
                    "serving https://%s:%d (mode %s, ptrace.mode %s)",
                    self.settings.host,
                    self.settings.port,
                    self.app.settings.mode,
                    self.app.settings.ptrace.mode,
                )
                await self._tick()
            await _stop(servers, listeners)
        finally:
            await human.stop()
            if self._monitor is not None:
                self._monitor.stop()

    async def _listen(self, human: HumanApi) -> tuple[list[Listener], list[asyncio.Server]]:
        """The admission listener and, with server.metricsPort, the metrics port's."""
        loop, server = asyncio.get_running_loop(), self.settings
        unread, stalls = Unread(), Stalls()  # one budget for the process's memory
        listeners = [Listener(self.app, self.limits, unread=unread, stalls=stalls, human=human)]
        servers = [await _bound(loop, listeners[0], server.host, server.port, self.tls.context)]
        if server.metrics_port:
            metrics = MetricsApp(self.app.metrics)
            listeners.append(Listener(metrics, self.metrics_limits, unread=unread, stalls=stalls))
            try:
                servers.append(await _bound(loop, listeners[1], server.host, server.metrics_port, None))
            except OSError:
                servers[0].close()
                raise
        return listeners, servers

    async def _tick(self) -> None:
        """Reload every RELOAD_EVERY_TICKS (at once after SIGHUP) until the drain ends."""
        counter = 0
        while not self._stop_now:
            if counter % RELOAD_EVERY_TICKS == 0 or self._reload_now:
                if self._reload_now:
                    log.info("SIGHUP: reloading the configuration and certificate files now")
                self._reload_now = False
                try:
                    self._reload()
                except Exception:  # a reload must never stop the server; the last good state stays in force
                    log.exception("reload failed; the previous configuration and certificate stay in force")
            if self._drain_until is not None and time.monotonic() >= self._drain_until:
                return
            counter += 1
            await asyncio.sleep(TICK_SECONDS)

    def request_reload(self, _signal: int, _frame: FrameType | None) -> None:
        self._reload_now = True

    def signal(self, sig: int) -> None:
        """SIGTERM or SIGINT: the first drains, a second stops at once."""
        if self._drain_until is not None or self.settings.drain_seconds == 0:
            self._stop_now = True
            self.signalled = self.signalled or sig
            self._drain_until = time.monotonic()
            return
        self.signalled = sig
        self.limits.draining = self.metrics_limits.draining = True
        self._drain_until = time.monotonic() + self.settings.drain_seconds
        log.info(
            "%s: draining for %g s (readyz answers 503, answers close their connection), then stopping",
            signal.Signals(sig).name,
            self.settings.drain_seconds,
        )


async def _bound(
    loop: asyncio.AbstractEventLoop, listener: Listener, host: str, port: int, context: ssl.SSLContext | None
) -> asyncio.Server:
    try:
        return await loop.create_server(listener, host, port, ssl=context, backlog=BACKLOG)
    except socket.gaierror as exc:  # its errno is a resolver code, which os.strerror does not know
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {host} does not resolve ({exc.strerror})") from None
    except OSError as exc:
        why = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {why}") from None


async def _stop(servers: Sequence[asyncio.Server], listeners: Sequence[Listener]) -> None:
    """Stop accepting, let what is in flight finish within GRACEFUL_SECONDS, then close the rest."""
    for server in servers:
        server.close()
    for listener in listeners:
        listener.stop()
    until = time.monotonic() + GRACEFUL_SECONDS
    while any(listener.connections for listener in listeners) and time.monotonic() < until:
        await asyncio.sleep(TICK_SECONDS)
    for listener in listeners:
        listener.abort()
    for server in servers:
        await server.wait_closed()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (as uvicorn picks it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


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
    try:
        cluster = load_configuration(settings.cluster)  # says once where the access comes from
    except ClusterAccessError as exc:
        log.error("%s", exc)
        return 1
    keeper = None
    if managed is not None:
        keeper = _keeper(settings, managed, cluster, check_address, metrics=metrics)
        if keeper is None:
            return 1
    tls = _tls(settings.server)
    if tls is None:
        return 1
    if settings.server.idle_timeout_seconds <= API_SERVER_IDLE_SECONDS:
        log.warning(
            "server.idleTimeoutSeconds %g s is not longer than the %d s the API server keeps an idle connection: "
            "a review it sends as we close one fails (EOF) and the pod is admitted or rejected by the failure policy",
            settings.server.idle_timeout_seconds,
            API_SERVER_IDLE_SECONDS,
        )
    view = _cluster_view(settings, cluster, metrics)
    app = WebhookApp(
        settings,
        metrics,
        namespaces=view if view is not None else no_cluster,
        facts_export=view.export if view is not None else no_cluster_export,
    )
    reloader = Reloader(app, tls, config_file, overrides=overrides)
    process = Process(
        app,
        settings.server,
        tls,
        reloader,
        monitor=LoopMonitor(metrics.event_loop_lag.observe, metrics.event_loop_stalls.inc),
    )
    app.readiness[:0] = [process.limits.readiness, tls.readiness, *([view.readiness] if view is not None else [])]
    with contextlib.suppress(ValueError):  # only the main thread may set handlers (tests run serve in threads)
        signal.signal(signal.SIGHUP, process.request_reload)
    _run(process, view, keeper=keeper)
    return 1 if process.failed else 0


def _tls(server: ServerSettings) -> ReloadingTLS | None:
    """The serving certificate, key and client CA, loaded now and reloaded when their files change."""
    files = TLSFiles(server.tls_cert, server.tls_key, server.client_ca, server.tls_min_version)
    try:
        return ReloadingTLS(files)
    except (OSError, ssl.SSLError, ValueError) as exc:
        log.error("cannot load the TLS certificate %s and key %s: %s", files.cert, files.key, exc)
        return None


def _cluster_view(settings: Settings, cluster: Configuration | None, metrics: Metrics) -> ClusterView | None:
    """The namespace and node caches, filling in the background (requests never wait for them); none
    without cluster access. Their requests are not retried by urllib3: the caches back off themselves."""
    if cluster is None:
        return None
    label = settings.image_puller.runtime_label if settings.image_puller.labeller else None
    view = ClusterView(client_without_retries(cluster), label=label)
    view.start()
    metrics.watch_nodes(view.nodes.by_runtime)
    return view


def _run(process: Process, view: ClusterView | None, *, keeper: AdmissionKeeper | None) -> None:
    """Run the server until it stops, then stop the threads that served it; exit by the signal that stopped it."""
    # Everything made so far lives as long as the process: out of the collector's way, every collection of
    # the oldest generation skips it.
    gc.collect()
    gc.freeze()
    if view is not None:
        # The caches' threads parse lists beside the event loop: a request waits for them at most 1 ms, not
        # the interpreter's default 5. Without them there is no thread to switch to.
        sys.setswitchinterval(SWITCH_INTERVAL)
    if keeper is not None:
        keeper.listening = process.listening
        keeper.start()
    try:
        process.run()
    finally:
        process.app.previewer.stop()
        if view is not None:
            view.stop()
        if keeper is not None:
            keeper.close()
    if process.signalled is not None and threading.current_thread() is threading.main_thread():
        # Through a handler the process started with (one that saves state first, as a coverage tool's
        # does, then exits by the signal). Python's own SIGINT handler would raise instead, and a signal
        # ignored at start (SIGINT in a background job) was acted on all the same: both exit by the default.
        started_with = signal.getsignal(process.signalled)
        if not callable(started_with) or started_with is signal.default_int_handler:
            signal.signal(process.signalled, signal.SIG_DFL)
        signal.raise_signal(process.signalled)


def _keeper(
    settings: Settings,
    managed: ManagedTLS,
    cluster: Configuration | None,
    check_address: tuple[str, int] | None,
    *,
    metrics: Metrics,
) -> AdmissionKeeper | None:
    """Watch our webhook configuration; with a Secret, make sure a certificate is on disk before serving."""
    secret, webhook_config, service, days, dns = managed
    namespace = own_namespace()
    try:
        if cluster is None or namespace is None:
            raise ClusterAccessError("--webhook-config needs cluster access and the pod's namespace ($POD_NAMESPACE)")
        manager = CertificateManager(
            client_without_retries(cluster),  # it tries again itself: the informer's back-off, the next round
            secret or "",
            namespace,
            webhook_config=webhook_config,
            service=service,
            days=days,
            dns=dns,
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
    except Exception as exc:
        why, ours = described(exc)
        log.error("cannot ensure the serving certificate in %s: %s", secret or webhook_config, why, exc_info=ours)
        return None
    return AdmissionKeeper(manager, metrics, check_address, listening=threading.Event(), out=out, bundle=bundle)
