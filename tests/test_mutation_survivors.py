"""Tests that kill mutants `make mutation` found surviving in webhook/mutation/ (docs/testing.md): each
asserts what a user of the webhook would notice, the patch, the warnings, the audit annotation or the
metrics an operator scrapes."""

from __future__ import annotations

from typing import Any

import pytest

from webhook.config import build_settings
from webhook.mutation.facts import Facts, RequestFacts, cluster_facts
from webhook.mutation.plan import KINDS, Plan, plan
from webhook.mutation.pointer import join
from webhook.web.metrics import Metrics

FLYTE_IMAGE = "cr.flyte.org/flyteorg/flytecopilot:v1.15.0"
OUTPUTS = {"name": "flyte-outputs", "mountPath": "/var/flyte/outputs"}
PRIMARY = {"name": "main", "image": "python:3.11", "volumeMounts": [OUTPUTS]}
UPLOADER = {
    "name": "flyte-copilot-uploader",
    "image": FLYTE_IMAGE,
    "args": ["sidecar", "--from-local-dir", "/var/flyte/outputs"],
    "volumeMounts": [OUTPUTS],
}


def _pod(*containers: dict[str, Any], annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "p", "namespace": "ns"}
    if annotations is not None:
        metadata["annotations"] = annotations
    body = {"containers": [dict(c) for c in containers or (PRIMARY, UPLOADER)], **spec}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": body}


def _plan(pod: dict[str, Any], labels: dict[str, str] | None = None, **settings: Any) -> Plan:
    return plan(pod, Facts(RequestFacts("ns"), cluster_facts(labels)), build_settings(settings))


def _scraped(decided: Plan) -> str:
    """The plan's counters as an operator scrapes them from /metrics."""
    metrics = Metrics()
    metrics.count_plan(decided, "Fail")
    return metrics.render().decode()


def test_patch_paths_escape_slash_and_tilde_as_rfc_6901_says() -> None:
    """The API server reads each operation's path as a JSON Pointer: the `/` of an annotation key is `~1`."""
    assert join("metadata", "annotations", "copilot-webhook.io/mutated") == (
        "/metadata/annotations/copilot-webhook.io~1mutated"
    )
    assert join("spec", "a~/b", 0) == "/spec/a~0~1b/0"


@pytest.mark.parametrize(
    ("annotations", "labels", "reason"),
    [
        ({"copilot-webhook.io/inject": "false"}, None, "pod-opt-out"),
        (None, {"copilot-webhook.io/inject": "disabled"}, "namespace-opt-out"),
    ],
)
def test_an_opted_out_pod_is_counted_as_skipped_for_each_kind(
    annotations: dict[str, str] | None, labels: dict[str, str] | None, reason: str
) -> None:
    decided = _plan(_pod(annotations=annotations), labels)
    assert (decided.changes, decided.warnings, decided.audit) == ([], [], {})
    scraped = _scraped(decided)
    for kind in KINDS:
        assert f'copilot_webhook_skips_total{{kind="{kind}",reason="{reason}"}} 1.0' in scraped
    assert "copilot_webhook_mutations_total{" not in scraped
