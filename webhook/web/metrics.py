"""Prometheus collectors, one registry per server (tests build as many as they like)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from certs.rotation import expiry
from webhook.mutation.plan import Plan
from webhook.web.stalls import INTERVAL, LOG_EVERY, STALL_SECONDS

# Admission answers are expected within milliseconds; the API server gives up at timeoutSeconds (<= 30).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Children:
    """prometheus_client's labels() takes a lock and builds a tuple on every call; the hot path looks its
    children up in a plain dict instead."""

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *labels: str) -> Any:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self._metric.labels(*labels)
        return child


class _NodeCollector(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "copilot_webhook_nodes", "Nodes in the cache by detected container runtime.", labels=["runtime"]
        )
        for runtime, count in sorted(self._counts().items()):
            family.add_metric([runtime], count)
        yield family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "copilot_webhook_requests",
            "HTTP requests by path and result.",
            # Not "endpoint": the Prometheus operator's target label of that name (the scraped port's) would
            # rename ours exported_endpoint, and every query on it would read the port instead.
            ["path", "result"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "copilot_webhook_request_duration_seconds",
            "Time from the first byte of a request to the last byte of its answer.",
            ["path"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.mutations = Counter(
            "copilot_webhook_mutations",
            "Pods mutated, by kind of mutation and what was applied (mode=shadow: computed, not applied).",
            ["kind", "reason", "mode"],
            registry=self.registry,
        )
        self.skips = Counter(
            "copilot_webhook_skips",
            "Pods left unchanged, by kind of mutation and reason.",
            ["kind", "reason"],
            registry=self.registry,
        )
        self.undecided = Counter(
            "copilot_webhook_undecided",
            "Reviews the webhook could not decide, answered per failurePolicy.",
            ["policy"],
            registry=self.registry,
        )
        self.ignored_values = Counter(
            "copilot_webhook_ignored_values",
            "Values of the webhook's own labels and annotations it did not understand and ignored, with a warning, "
            "per review: by where (pod, namespace) and key (inject, ptrace, image-puller, mode; unknown for any "
            "other annotation under copilot-webhook.io/).",
            ["source", "key"],
            registry=self.registry,
        )
        self.certificate_expiry = Gauge(
            "copilot_webhook_certificate_expiry_timestamp_seconds",
            "Unix time at which the served certificate expires.",
            registry=self.registry,
        )
        self.certificate_reloads = Counter(
            "copilot_webhook_certificate_reloads",
            "Certificate reloads from disk, by result.",
            ["result"],
            registry=self.registry,
        )
        self.certificate_renewals = Counter(
            "copilot_webhook_certificate_renewals",
            "Runs of the self-signed certificate renewal, by result (current, renewed, failed).",
            ["result"],
            registry=self.registry,
        )
        self.tls_self_check = Gauge(
            "copilot_webhook_tls_self_check",
            "1 when a handshake with our own listener, for the Service name, verified against the caBundle stored "
            "in the webhook configuration at the last check, 0 when it did not.",
            registry=self.registry,
        )
        self.ca_bundle_expiry = Gauge(
            "copilot_webhook_ca_bundle_expiry_timestamp_seconds",
            "Unix time at which the first CA of the published caBundle expires.",
            registry=self.registry,
        )
        self.ca_bundle_repairs = Counter(
            "copilot_webhook_ca_bundle_repairs",
            "Times the server re-asserted its caBundle after the webhook configuration drifted or the self-check "
            "failed.",
            registry=self.registry,
        )
        self.previews_in_flight = Gauge(
            "copilot_webhook_previews_in_flight",
            "Previews being planned and rendered off the event loop (at most preview.concurrency).",
            registry=self.registry,
        )
        self.connections_refused = Counter(
            "copilot_webhook_connections_refused",
            "Connections closed on arrival because server.maxConnections were open.",
            registry=self.registry,
        )
        self.event_loop_lag = Histogram(
            "copilot_webhook_event_loop_lag_seconds",
            f"How late the event loop ran a timer due every {INTERVAL * 1000:.0f} ms: the wait a request arriving "
            "then had before the loop read it.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.event_loop_stalls = Counter(
            "copilot_webhook_event_loop_stalls",
            f"Stalls: a timer run more than {STALL_SECONDS * 1000:.0f} ms late (the lag's {STALL_SECONDS:g} "
            f"bucket); logged with what held the loop, at most one line each {LOG_EVERY:g} s.",
            registry=self.registry,
        )
        self.config_reloads = Counter(
            "copilot_webhook_config_reloads",
            "Configuration reloads from disk, by result.",
            ["result"],
            registry=self.registry,
        )

        self.request = _Children(self.requests)
        self.mutation = _Children(self.mutations)
        self.skip = _Children(self.skips)

    def renewal(self, result: str) -> None:
        self.certificate_renewals.labels(result).inc()

    def self_check(self, failure: str | None) -> None:
        self.tls_self_check.set(0 if failure else 1)

    def bundle_repair(self) -> None:
        self.ca_bundle_repairs.inc()

    def bundle_expiry(self, bundle: bytes) -> None:
        end = expiry(bundle)
        if end is not None:
            self.ca_bundle_expiry.set(end.timestamp())

    def watch_nodes(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """copilot_webhook_nodes{runtime}: nodes in the cache by detected runtime, read at scrape time."""
        self.registry.register(_NodeCollector(counts))

    def count_plan(self, plan: Plan, failure_policy: str) -> None:
        if plan.undecided is not None:
            self.undecided.labels(failure_policy).inc()
        for ignored in plan.ignored:
            self.ignored_values.labels(ignored.source, ignored.key).inc()
        mode = "shadow" if plan.shadow else "enforce"
        for kind, outcome in plan.outcomes.items():
            if outcome.mutated:
                self.mutation(kind, outcome.reason, mode).inc()
            else:
                self.skip(kind, outcome.reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
