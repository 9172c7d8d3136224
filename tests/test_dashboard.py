"""The Grafana dashboard's queries and the PrometheusRule's alerts, run by a real Prometheus (Debian's package)
over the server's metrics as they arrive through the Prometheus operator's relabelling of the chart's
ServiceMonitor. The operator adds target labels (`namespace`, `service`, `pod`, `container`, `job`, and
`endpoint`: the port's name), and without honorLabels a label of ours with one of those names is renamed
`exported_<name>`, so a panel that reads it reads the scrape's value instead of ours. The alerts' timing,
labels and annotations are unit-tested by `promtool test rules` over synthetic series. `.ci/run` installs
Prometheus (and promtool with it); without it (a laptop) the tests skip, and under CI=true a skip fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from harness.server_process import free_port, stop_process
from tests.test_chart import VARIANTS, render
from webhook.web.metrics import CONTENT_TYPE, Metrics

SCRAPES = 3  # rate() needs two samples; a third makes every window hold an increase


def _advance(metrics: Metrics) -> None:
    """What a serving replica does between two scrapes, with the label values the server uses."""
    metrics.request("/mutate/ptrace", "patched").inc()
    metrics.request("/mutate/image-puller", "unchanged").inc()
    metrics.request("/healthz", "ok").inc()
    metrics.latency.labels("/mutate/ptrace").observe(0.002)
    metrics.latency.labels("/mutate/image-puller").observe(0.004)
    metrics.latency.labels("/healthz").observe(0.0005)
    metrics.mutation("ptrace", "add", "enforce").inc()
    metrics.skip("image-puller", "not-copilot").inc()
    metrics.undecided.labels("Ignore").inc()
    metrics.bundle_repair()
    metrics.event_loop_lag.observe(0.0004)
    metrics.event_loop_lag.observe(0.3)
    metrics.event_loop_stalls.inc(5)  # a replica that keeps stalling: its alert's expression holds


@contextmanager
def _exporter(metrics: Metrics) -> Iterator[int]:
    """The server's /metrics on a loopback port; every scrape first advances the counters."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            _advance(metrics)
            body = metrics.render()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _scrape_config(monitor: dict[str, Any], target: str) -> dict[str, Any]:
    """The scrape job the operator writes for the ServiceMonitor's first endpoint (prometheus-operator,
    pkg/prometheus/promcfg.go, generateServiceMonitorConfig), with the endpoints discovery it would do replaced
    by one static target: the same target labels, set from what discovery would have found."""
    endpoint = monitor["spec"]["endpoints"][0]
    namespace, service = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    found = {
        "namespace": namespace,
        "service": service,
        "pod": f"{service}-7c9d8b6f5-x2k4q",
        "container": "webhook",
        "job": service,  # no jobLabel: the Service's name
        "endpoint": endpoint["port"],  # the port's name, always added
    }
    return {
        "job_name": f"serviceMonitor/{namespace}/{service}/0",
        "honor_labels": endpoint.get("honorLabels", False),
        "scrape_interval": "1s",
        "metrics_path": endpoint["path"],
        "scheme": endpoint["scheme"],
        "static_configs": [{"targets": [target]}],
        "relabel_configs": [{"target_label": k, "replacement": v} for k, v in found.items()],
    }


def _require_prometheus(program: str = "prometheus") -> str:
    found = shutil.which(program)
    if found is None:
        message = f"needs {program} (Debian's prometheus package; .ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the dashboard test: {message}")
        pytest.skip(message)
    return found


@contextmanager
def _prometheus(tmp_path: Path, job: dict[str, Any]) -> Iterator[httpx.Client]:
    binary = _require_prometheus()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [job]}))
    port = free_port()
    log = tmp_path / "prometheus.log"
    command = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as api:
            _wait_for_scrapes(api, process, log)
            yield api
    finally:
        stop_process(process)


def _wait_for_scrapes(api: httpx.Client, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            result = _query(api, "sum(count_over_time(up[5m]))")
        except httpx.HTTPError:
            result = []
        if result and float(result[0]["value"][1]) >= SCRAPES:
            return
        time.sleep(0.5)
    raise RuntimeError(f"prometheus did not scrape {SCRAPES} times within 60 s:\n{log.read_text()[-3000:]}")


def _query(api: httpx.Client, expr: str) -> list[dict[str, Any]]:
    answer = api.get("/api/v1/query", params={"query": expr}).raise_for_status().json()
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def _exported_values(metrics: Metrics) -> dict[str, set[str]]:
    """Label name -> every value the server itself exports under that name."""
    values: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            for name, value in sample.labels.items():
                values.setdefault(name, set()).add(value)
    return values


def _alerts(objects: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rule = objects["PrometheusRule/cw-copilot-webhook"]
    return [r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r]


def test_every_panel_and_alert_sees_the_servers_series_behind_the_prometheus_operator(tmp_path: Path) -> None:
    objects = render(VARIANTS["monitoring"])
    monitor = objects["ServiceMonitor/cw-copilot-webhook"]
    dashboard = orjson.loads(objects["ConfigMap/cw-copilot-webhook-dashboard"]["data"]["copilot-webhook.json"])
    metrics = Metrics()
    metrics.watch_nodes(lambda: {"containerd": 3, "docker": 1})
    metrics.certificate_expiry.set(time.time() + 60 * 86400)
    metrics.ca_bundle_expiry.set(time.time() + 3650 * 86400)
    metrics.self_check(None)
    with _exporter(metrics) as port, _prometheus(tmp_path, _scrape_config(monitor, f"127.0.0.1:{port}")) as api:
        namespaces = api.get(
            "/api/v1/label/namespace/values", params={"match[]": "copilot_webhook_requests_total"}
        ).json()["data"]
        assert namespaces == ["flyte"], "the dashboard's namespace variable"
        exported = _exported_values(metrics)
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$namespace", "flyte")
                series = _query(api, expr)
                assert series, f"panel {panel['title']!r} shows nothing: {expr}"
                # A label a legend names must be the server's, with the server's values, not the scrape's.
                for label in re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", "")):
                    shown = {s["metric"].get(label) for s in series}
                    assert shown <= exported.get(label, set()), (panel["title"], label, shown)
        # The scrape stalls: each alert's expression holds, for the scraped replica, named by its target labels.
        for alert in _alerts(objects):
            (alerting,) = _query(api, alert["expr"])
            assert alerting["metric"] == {"namespace": "flyte", "pod": "cw-copilot-webhook-7c9d8b6f5-x2k4q"}, alert


def _stalls(pod: str, values: str, namespace: str = "flyte") -> dict[str, str]:
    series = f'copilot_webhook_event_loop_stalls_total{{namespace="{namespace}", pod="{pod}"}}'
    return {"series": series, "values": values}


def test_the_stall_alert_fires_for_a_replica_that_keeps_stalling_only(tmp_path: Path) -> None:
    """promtool evaluates the rendered rule minute by minute: a replica stalling once a minute is alerted on
    after its 15 minutes pending; one burst (a relist) and another namespace's replica are not."""
    promtool = _require_prometheus("promtool")
    objects = render(VARIANTS["monitoring"])
    rule = objects["PrometheusRule/cw-copilot-webhook"]
    (alert,) = _alerts(objects)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))

    def fired(pod: str) -> dict[str, Any]:
        annotations = {
            key: text.replace("{{ $labels.pod }}", pod)
            .replace("{{ $labels.namespace }}", "flyte")
            .replace("{{ $value | humanize }}", "10")
            for key, text in alert["annotations"].items()
        }
        labels = {"namespace": "flyte", "pod": pod, "severity": "warning"}
        return {"exp_labels": labels, "exp_annotations": annotations}

    def at(minute: int, *pods: str) -> dict[str, Any]:
        return {"eval_time": f"{minute}m", "alertname": alert["alert"], "exp_alerts": [fired(pod) for pod in pods]}

    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    _stalls("steady", "0+1x60"),  # one stall a minute
                    _stalls("burst", "0x4 20x55"),  # 20 in one minute, then none
                    _stalls("quiet", "0x60"),
                    _stalls("elsewhere", "0+1x60", namespace="other"),
                ],
                # Pending from about minute 4: not yet at 15, firing at 25 and still at 45; the burst never.
                "alert_rule_test": [at(10), at(15), at(25, "steady"), at(45, "steady")],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    checked = subprocess.run([promtool, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr
