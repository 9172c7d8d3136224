"""`inject: opt-in`, the canary roll-out, on the real API server: only namespaces labelled
copilot-webhook.io/inject=enabled (or true) are sent to the webhook, and the server, told the mode by the
chart's ConfigMap, serves no other namespace it knows even when asked directly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.kube_api import FAIL, PRIVILEGED_BY_DEFAULT, ChartPods, Kube, release, started, wait_for
from tests.helpers import decoded_patch, review
from tests.test_kube_install import pod, ptrace_holders
from tests.test_kube_policy import _requests

FLYTE_115 = Path(__file__).parent / "golden" / "pods" / "flyte-1.15.yaml"
PRIMARY = "ap7k2xq9wz-n0-0"
NAMESPACE = "cwcanary"
VALUES = {**FAIL, "inject": "opt-in", "ptrace": {"mode": "drop"}, "podSecurity": PRIVILEGED_BY_DEFAULT}


@pytest.fixture(scope="module")
def server(kube_admin: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChartPods]:
    work = tmp_path_factory.mktemp("canary")
    yield from started(release(kube_admin, NAMESPACE, work, VALUES), work / "pods", policy="Fail")


@pytest.mark.parametrize("value", ["enabled", "true"])
def test_a_namespace_labelled_on_gets_its_pods_mutated(kube_admin: Kube, server: ChartPods, value: str) -> None:
    namespace = f"canary-{value}"
    kube_admin.create_namespace(namespace, {"copilot-webhook.io/inject": value})
    stored = kube_admin.create_pod(namespace, pod(FLYTE_115, "served"))
    assert stored["metadata"]["annotations"]["copilot-webhook.io/mutated"].startswith("ptrace=drop")
    assert ptrace_holders(stored) == []


@pytest.mark.parametrize("labels", [{}, {"copilot-webhook.io/inject": "disabled"}])
def test_any_other_namespace_is_not_sent_and_its_pod_is_untouched(
    kube_admin: Kube, server: ChartPods, labels: dict[str, str]
) -> None:
    namespace = "canary-" + (labels.get("copilot-webhook.io/inject") or "unlabelled")
    kube_admin.create_namespace(namespace, labels)
    before = _requests(server, "/mutate/ptrace")
    stored = kube_admin.create_pod(namespace, pod(FLYTE_115, "untouched"))
    assert "copilot-webhook.io/mutated" not in stored["metadata"].get("annotations", {})
    assert ptrace_holders(stored) == [PRIMARY], "as Flyte created it"
    assert _requests(server, "/mutate/ptrace") == before, "the API server did not call for it"


def test_the_server_itself_serves_no_known_namespace_that_is_not_labelled_on(
    kube_admin: Kube, server: ChartPods
) -> None:
    kube_admin.create_namespace("canary-asked", {})
    kube_admin.create_namespace("canary-asked-on", {"copilot-webhook.io/inject": "enabled"})

    def patch(namespace: str) -> list[dict[str, object]]:
        body = review(pod(FLYTE_115, "direct"), namespace=namespace)
        return decoded_patch(server.https("POST", "/mutate/ptrace", json=body).json()["response"])

    # Until its namespace cache delivers a namespace created a moment ago, the server serves it (the API
    # server's selector chose it); once it knows the namespace is not labelled on, it serves it no more.
    assert wait_for(lambda: patch("canary-asked") == [], timeout=10)
    assert patch("canary-asked-on") != []
