"""The HTTP adapter in-process: routing, status codes, error bodies, metrics, answers per failurePolicy."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.asgi import call, post_json
from tests.helpers import apply, decoded_patch, pod, review, validate
from webhook.config import build_settings
from webhook.mutation.facts import ClusterFacts, cluster_facts
from webhook.web.server import WebhookApp


def _app(**settings: Any) -> WebhookApp:
    return WebhookApp(build_settings(settings))


def test_mutate_image_puller_alone() -> None:
    obj = pod("flyte-1.15-bare.yaml")
    answer = post_json(_app(), "/mutate/image-puller", review(obj)).json()["response"]
    assert answer["auditAnnotations"] == {"image-puller": "containerd:/run/containerd/containerd.sock"}
    mutated = apply(obj, decoded_patch(answer))
    validate(mutated)
    assert "capabilities" not in mutated["spec"]["containers"][0]["securityContext"]
    assert mutated["spec"]["initContainers"][0]["name"] == "copilot-webhook-image-puller"


def test_mutate_v1_answers_with_patch_and_echoes_uid() -> None:
    obj = pod("flyte-1.15-bare.yaml")
    res = post_json(_app(), "/mutate", review(obj, uid="uid-123"))
    assert res.status_code == 200
    body = res.json()
    assert body["apiVersion"] == "admission.k8s.io/v1"
    assert body["kind"] == "AdmissionReview"
    answer = body["response"]
    assert answer["uid"] == "uid-123"
    assert answer["allowed"] is True
    assert answer["auditAnnotations"] == {
        "ptrace": "add:primary",
        "image-puller": "containerd:/run/containerd/containerd.sock",
    }
    mutated = apply(obj, decoded_patch(answer))
    validate(mutated)
    assert mutated["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] == ["SYS_PTRACE"]
    assert mutated["spec"]["shareProcessNamespace"] is True


def test_v1beta1_is_answered_in_v1beta1() -> None:
    res = post_json(
        _app(), "/mutate/ptrace", review(pod("flyte-1.15-bare.yaml"), api_version="admission.k8s.io/v1beta1")
    )
    assert res.json()["apiVersion"] == "admission.k8s.io/v1beta1"
    assert res.json()["response"]["patchType"] == "JSONPatch"


@pytest.mark.parametrize(
    "request_fields",
    [
        {"operation": "UPDATE"},
        {"operation": "DELETE", "object": None},
        {"kind": {"group": "apps", "version": "v1", "kind": "Deployment"}},
        {"subResource": "ephemeralcontainers"},
    ],
)
def test_anything_but_a_pod_create_is_allowed_without_patch(request_fields: dict[str, Any]) -> None:
    res = post_json(_app(), "/mutate", review(pod("flyte-1.15-bare.yaml"), **request_fields))
    assert res.status_code == 200
    assert res.json()["response"] == {"uid": "a1b2c3", "allowed": True}


def test_shadow_mode_reports_but_does_not_patch() -> None:
    res = post_json(_app(mode="shadow"), "/mutate/ptrace", review(pod("flyte-1.15-bare.yaml")))
    answer = res.json()["response"]
    assert "patch" not in answer
    assert answer["auditAnnotations"] == {"ptrace": "add:primary"}
    assert any("shadow mode" in w for w in answer["warnings"])


def test_namespace_facts_reach_the_plan() -> None:
    labels = {"flytesnacks-development": {"copilot-webhook.io/inject": "disabled"}}

    def namespaces(name: str) -> ClusterFacts:
        return cluster_facts(labels.get(name))

    app = WebhookApp(build_settings({}), namespaces=namespaces)
    answer = post_json(app, "/mutate", review(pod("flyte-1.15-bare.yaml")))
    assert answer.json()["response"] == {"uid": "a1b2c3", "allowed": True}


def _undecidable() -> dict[str, Any]:
    obj = pod("flyte-1.15-bare.yaml")
    obj["metadata"]["annotations"] = {"primary_container_name": "ghost"}
    return review(obj)


def test_undecided_with_failure_policy_ignore_admits_unchanged_with_warning() -> None:
    answer = post_json(_app(), "/mutate/ptrace", _undecidable()).json()["response"]
    assert answer["allowed"] is True
    assert "patch" not in answer
    assert "primary_container_name 'ghost'" in answer["warnings"][0]


def test_undecided_part_is_left_out_of_mutate_under_ignore() -> None:
    """/mutate does both kinds: an undecidable ptrace part does not hold back the puller."""
    answer = post_json(_app(), "/mutate", _undecidable()).json()["response"]
    assert answer["allowed"] is True
    ops = decoded_patch(answer)
    assert [op["path"] for op in ops if "securityContext" in op["path"]] == []
    assert ops[0]["value"]["name"] == "copilot-webhook-image-puller"
    assert "cannot decide: primary_container_name 'ghost'" in answer["warnings"][-1]


def test_undecided_with_failure_policy_fail_denies_naming_the_cause() -> None:
    res = post_json(_app(failurePolicy="Fail"), "/mutate", _undecidable())
    assert res.status_code == 200
    answer = res.json()["response"]
    assert answer["allowed"] is False
    assert answer["status"]["code"] == 403
    assert "primary_container_name 'ghost'" in answer["status"]["message"]


def test_an_internal_error_follows_failure_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    import webhook.review

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(webhook.review, "plan", broken)
    for policy, allowed in (("Ignore", True), ("Fail", False)):
        res = post_json(_app(failurePolicy=policy), "/mutate", review(pod("flyte-1.15-bare.yaml")))
        assert res.status_code == 200
        assert res.json()["response"]["allowed"] is allowed
        assert "internal error (RuntimeError)" in orjson.dumps(res.json()).decode()


BAD = [
    (b"{not json", "application/json", 400, "body is not valid JSON"),
    (b"[1, 2]", "application/json", 400, "expected an AdmissionReview object, got array"),
    (b'{"apiVersion": "v1", "kind": "Pod"}', "application/json", 400, "expected kind AdmissionReview"),
    (b'{"apiVersion": "admission.k8s.io/v2", "kind": "AdmissionReview"}', "application/json", 400, "apiVersion"),
    (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}', "application/json", 400, "request must be"),
    (
        b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":""}}',
        "application/json",
        400,
        "request.uid is required",
    ),
    (b"{}", "text/plain", 415, "Content-Type must be application/json"),
    (b"{}", "", 415, "got 'none'"),
]


@pytest.mark.parametrize(("body", "content_type", "status", "message"), BAD)
def test_bad_requests_get_a_json_error_naming_the_problem(
    body: bytes, content_type: str, status: int, message: str
) -> None:
    headers = {"content_type": content_type} if content_type else {}
    res = call(_app(), "POST", "/mutate", body, **headers)
    assert res.status_code == status
    assert res.headers["content-type"] == "application/json"
    assert message in res.json()["error"]


OUT = {"name": "flyte-outputs", "mountPath": "/out"}


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ("a pod", "request.object must be a Pod object, got string"),
        ({"metadata": {}, "spec": {"containers": {}}}, "spec.containers must be an array, not object"),
        ({"spec": {"containers": [{"name": 3}]}}, r"containers[0].name must be a string"),
        (
            {"spec": {"containers": [{"name": "a", "securityContext": [], "volumeMounts": [OUT]}]}},
            "securityContext must be an object",
        ),
    ],
)
def test_unreadable_pods_in_a_review_are_bad_requests(obj: Any, message: str) -> None:
    data = review({"spec": {}})
    data["request"]["object"] = obj
    if isinstance(obj, dict) and "securityContext" in str(obj):
        data["request"]["object"]["spec"]["containers"].append(
            {
                "name": "flyte-copilot-uploader",
                "image": "a/flyteorg/flytecopilot:1",
                "args": ["sidecar", "--from-local-dir", "/out"],
                "volumeMounts": [OUT],
            }
        )
    res = post_json(_app(ptrace={"target": "all"}), "/mutate", data)
    assert res.status_code == 400
    assert message in res.json()["error"]


def test_body_over_the_limit_is_refused_before_reading() -> None:
    app = _app(server={"maxBodyBytes": 2048})
    res = call(app, "POST", "/mutate", b"x" * 4096, content_type="application/json")
    assert res.status_code == 413
    assert "server.maxBodyBytes (2048)" in res.json()["error"]


def test_routing_errors() -> None:
    app = _app()
    assert call(app, "GET", "/mutate").status_code == 405
    assert call(app, "GET", "/mutate").headers["allow"] == "POST"
    assert call(app, "POST", "/healthz").status_code == 405
    assert call(app, "POST", "/healthz").headers["allow"] == "GET, HEAD", "a GET endpoint answers HEAD too"
    assert call(app, "POST", "/healthz").json() == {"error": "/healthz takes GET, HEAD, not POST"}
    missing = call(app, "GET", "/nope")
    assert missing.status_code == 404
    assert "POST /mutate" in missing.json()["error"]
    assert (
        call(_app(preview={"enabled": False}), "POST", "/preview", b"{}", content_type="application/json").status_code
        == 404
    )


def test_health_readiness_and_metrics() -> None:
    reasons: list[str | None] = ["certificate not loaded"]
    app = WebhookApp(build_settings({}), readiness=[lambda: reasons[0]])
    assert call(app, "GET", "/healthz").json() == {"status": "ok"}
    not_ready = call(app, "GET", "/readyz")
    assert not_ready.status_code == 503
    assert not_ready.json()["reasons"] == ["certificate not loaded"]
    reasons[0] = None
    assert call(app, "GET", "/readyz").status_code == 200

    post_json(app, "/mutate", review(pod("flyte-1.15-bare.yaml")))
    post_json(app, "/mutate", review(pod("plain.yaml")))
    call(app, "POST", "/mutate", b"nope", content_type="application/json")
    text = call(app, "GET", "/metrics").text
    assert 'copilot_webhook_requests_total{path="/mutate",result="patched"} 1.0' in text
    assert 'copilot_webhook_requests_total{path="/mutate",result="unchanged"} 1.0' in text
    assert 'copilot_webhook_requests_total{path="/mutate",result="bad_request"} 1.0' in text
    assert 'copilot_webhook_mutations_total{kind="ptrace",mode="enforce",reason="add"} 1.0' in text
    assert 'copilot_webhook_skips_total{kind="ptrace",reason="not-copilot"} 1.0' in text
    assert 'copilot_webhook_request_duration_seconds_bucket{le="0.001",path="/mutate"}' in text
