"""POST /preview and the preview function: every input form and output format, and its errors."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest
import yaml

from tests.asgi import call, post_json
from tests.helpers import GOLDEN, PODS, apply, pod, review, validate
from webhook.config import build_settings
from webhook.web.api import warning_header
from webhook.web.server import WebhookApp

APP = WebhookApp(build_settings({}))
POD_YAML = (PODS / "flyte-1.15-bare.yaml").read_bytes()


def _preview(body: bytes, content_type: str = "application/yaml", query: str = "") -> Any:
    return call(APP, "POST", "/preview" + query, body, content_type=content_type)


def test_pod_yaml_preview_has_patch_object_changes_and_reasons() -> None:
    res = _preview(POD_YAML)
    assert res.status_code == 200
    entry = res.json()
    assert set(entry) == {
        "kind",
        "name",
        "allowed",
        "decisions",
        "patch",
        "object",
        "changes",
        "notApplied",
        "warnings",
        "runtime",
    }
    assert (entry["kind"], entry["name"], entry["allowed"]) == ("Pod", "bq2m4-n1-0", True)
    original = yaml.safe_load(POD_YAML)
    assert apply(original, entry["patch"]) == entry["object"]
    validate(entry["object"])
    reasons = {c["path"]: c["reason"] for c in entry["changes"]}
    assert "primary container gets SYS_PTRACE" in reasons["/spec/containers/0/securityContext/capabilities"]
    assert entry["runtime"] == {
        "flavour": "containerd",
        "socket": "/run/containerd/containerd.sock",
        "source": "imagePuller.defaultRuntime",
    }


def test_pod_json_and_admission_review_give_the_same_patch() -> None:
    obj = yaml.safe_load(POD_YAML)
    as_json = _preview(orjson.dumps(obj), "application/json").json()
    as_review = _preview(orjson.dumps(review(obj)), "application/json").json()
    assert as_json["patch"] == as_review["patch"] != []
    assert as_review["kind"] == "AdmissionReview"


def test_deployment_template_paths_are_relative_to_the_workload() -> None:
    template = yaml.safe_load(POD_YAML)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "flyte"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {"metadata": {"labels": {"a": "b"}}, "spec": template["spec"]},
        },
    }
    entry = _preview(orjson.dumps(deployment), "application/json").json()
    assert entry["kind"] == "Deployment"
    assert all(op["path"].startswith("/spec/template/") for op in entry["patch"])
    assert apply(deployment, entry["patch"]) == entry["object"]
    validate(entry["object"])


def test_cronjob_template_is_found() -> None:
    spec = yaml.safe_load(POD_YAML)["spec"]
    cronjob = {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {"name": "c"},
        "spec": {"schedule": "* * * * *", "jobTemplate": {"spec": {"template": {"spec": spec}}}},
    }
    entry = _preview(orjson.dumps(cronjob), "application/json").json()
    assert entry["patch"][0]["path"].startswith("/spec/jobTemplate/spec/template/spec/containers/0/")
    validate(entry["object"])


def test_multi_document_yaml_and_lists_answer_in_order() -> None:
    body = POD_YAML + b"\n---\n" + (PODS / "plain.yaml").read_bytes()
    entries = _preview(body).json()
    assert [e["name"] for e in entries] == ["bq2m4-n1-0", "web"]
    assert entries[0]["patch"]
    assert not entries[1]["patch"]
    listed = {"apiVersion": "v1", "kind": "List", "items": [yaml.safe_load(POD_YAML)]}
    as_list = _preview(orjson.dumps(listed), "application/json").json()
    assert isinstance(as_list, list)
    assert len(as_list) == 1


def test_output_formats() -> None:
    mutated = yaml.safe_load(_preview(POD_YAML, query="?output=yaml").text)
    assert mutated["spec"]["shareProcessNamespace"] is True
    patch = _preview(POD_YAML, query="?output=patch")
    assert patch.headers["content-type"] == "application/json-patch+json"
    assert {"op": "add", "path": "/spec/shareProcessNamespace", "value": True} in patch.json()
    diff = _preview(POD_YAML, query="?output=diff").text
    assert diff.startswith("--- Pod/bq2m4-n1-0 (before)\n+++ Pod/bq2m4-n1-0 (after)\n")
    assert "+  shareProcessNamespace: true\n" in diff


def test_namespace_query_is_used_and_shadow_previews_list_what_they_would_apply_apart() -> None:
    app = WebhookApp(build_settings({"mode": "shadow"}))
    entry = call(app, "POST", "/preview?namespace=team-a", POD_YAML, content_type="text/yaml").json()
    assert entry["patch"] == entry["changes"] == []
    assert {"op": "add", "path": "/spec/shareProcessNamespace"} in [
        {"op": c["op"], "path": c["path"]} for c in entry["notApplied"]
    ]
    assert entry["object"] == yaml.safe_load(POD_YAML)
    assert entry["warnings"] == ["copilot-webhook: shadow mode: 5 patch operation(s) computed but not applied"]


DORP = yaml.safe_load(POD_YAML)
DORP["metadata"]["annotations"] = {"copilot-webhook.io/ptrace": "dorp"}
DORP_WARNING = "copilot-webhook: copilot-webhook.io/ptrace='dorp' ignored: expected add, drop or keep"
REFUSED = (GOLDEN / "primary-missing-fail.yaml").read_bytes()
REFUSAL = (
    "Pod/no-primary would be refused: copilot-webhook cannot decide (failurePolicy Fail): primary_container_name "
    "'does-not-exist' names no regular container"
)


@pytest.mark.parametrize("output", ["json", "yaml", "patch", "diff"])
def test_warnings_and_refusals_are_warning_headers_in_every_output(output: str) -> None:
    warned = _preview(orjson.dumps(DORP), "application/json", f"?output={output}")
    assert warned.status_code == 200
    assert warned.headers.get_list("warning") == [f'299 - "{DORP_WARNING}"']
    assert _preview(POD_YAML, query=f"?output={output}").headers.get_list("warning") == []
    app = WebhookApp(build_settings({"failurePolicy": "Fail"}))
    refused = call(app, "POST", f"/preview?output={output}", REFUSED, content_type="application/yaml")
    assert refused.status_code == 200
    assert refused.headers.get_list("warning") == [f'299 - "{REFUSAL}"']


def test_warnings_of_several_objects_name_their_object() -> None:
    body = POD_YAML + b"---\n" + yaml.safe_dump(DORP).encode() + b"---\n" + REFUSED
    app = WebhookApp(build_settings({"failurePolicy": "Fail"}))
    answer = call(app, "POST", "/preview?output=diff", body, content_type="application/yaml")
    assert answer.headers.get_list("warning") == [f'299 - "{REFUSAL}"', f'299 - "Pod/bq2m4-n1-0: {DORP_WARNING}"']


def test_warning_headers_are_quoted_as_the_api_server_quotes_them() -> None:
    """Quotes and backslashes escaped, UTF-8 (a warning cut at 120 characters ends with an ellipsis), no
    control character."""
    odd = yaml.safe_load(POD_YAML)
    odd["metadata"]["annotations"] = {"copilot-webhook.io/ptrace": 'say "hi" \\'}
    headers = _preview(orjson.dumps(odd), "application/json").headers.get_list("warning")
    assert headers == [
        '299 - "copilot-webhook: copilot-webhook.io/ptrace=\'say \\"hi\\" \\\\\\\\\' ignored: '
        'expected add, drop or keep"'
    ]
    odd["metadata"]["annotations"] = {"primary_container_name": "é" * 200}
    (header,) = _preview(orjson.dumps(odd), "application/json").headers.get_list("warning")
    assert header.startswith("299 - \"copilot-webhook: left unchanged, cannot decide: primary_container_name 'ééé")
    assert header.endswith('é…"')
    assert warning_header("a\nb\tc\x7f") == b'299 - "a b c "'


def test_warning_headers_stop_at_4_kib_of_text_and_say_how_many_were_left_out() -> None:
    items = [{**DORP, "metadata": {**DORP["metadata"], "name": f"p{i:02}"}} for i in range(100)]
    answer = _preview(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": items}), "application/json")
    *kept, last = answer.headers.get_list("warning")
    assert kept[0] == f'299 - "Pod/p00: {DORP_WARNING}"'
    assert 4096 - len(kept[0]) < sum(len(h) - len('299 - ""') for h in kept) <= 4096
    assert last == f'299 - "copilot-webhook: {100 - len(kept)} more warning(s) left out; output=json has them all"'
    assert all(entry["warnings"] == [DORP_WARNING] for entry in answer.json())


@pytest.mark.parametrize(
    "settings",
    [{}, {"mode": "shadow"}, {"failurePolicy": "Fail"}, {"ptrace": {"mode": "drop"}}, {"failurePolicy": "Ignore"}],
)
@pytest.mark.parametrize("body", [POD_YAML, REFUSED, yaml.safe_dump(DORP).encode()])
def test_the_json_answers_patch_and_changes_name_the_same_operations(settings: dict[str, Any], body: bytes) -> None:
    entry = call(WebhookApp(build_settings(settings)), "POST", "/preview", body, content_type="application/yaml").json()
    assert [(op["op"], op["path"]) for op in entry["patch"]] == [(c["op"], c["path"]) for c in entry["changes"]]
    assert not (entry["changes"] and entry["notApplied"])
    if not entry["allowed"]:
        assert entry["patch"] == []
        assert entry["notApplied"], "a refused object's operations are listed apart"


def test_runtime_query_is_reported() -> None:
    entry = _preview(POD_YAML, query="?runtime=cri-o&node=node-1").json()
    assert entry["runtime"]["flavour"] == "cri-o"
    assert entry["runtime"]["source"] == "query"


@pytest.mark.parametrize("body", [POD_YAML, orjson.dumps(review(yaml.safe_load(POD_YAML)))])
def test_a_pod_security_what_if_leaves_out_what_that_level_forbids(body: bytes) -> None:
    """The settings' default is privileged (a server that was not told); the what-if answers as admission
    would in a namespace where baseline is in force, and names its source."""
    assert _preview(body, query="?output=patch").json() != []
    entry = _preview(body, query="?podSecurity=baseline").json()
    assert entry["patch"] == []
    assert entry["warnings"] == [
        "copilot-webhook: SYS_PTRACE not added: Pod Security 'baseline' (what-if) forbids it",
        "copilot-webhook: no image puller: Pod Security 'baseline' (what-if) forbids its hostPath socket volume",
    ]
    assert _preview(body, query="?podSecurity=privileged").json()["patch"] == _preview(body).json()["patch"]


SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}}
CONFIG_MAP = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}, "data": {"a": "1"}}
WORKFLOW = {"apiVersion": "flyte.lyft.com/v1alpha1", "kind": "FlyteWorkflow", "metadata": {"name": "f7a9"}}
PASS_NOTE = (
    "copilot-webhook: {} passed through unchanged: the webhook acts on Pods alone (a Pod, the pod template of a "
    "Deployment, StatefulSet, DaemonSet, ReplicaSet, Job, CronJob, an AdmissionReview)"
)


def test_a_bundle_passes_every_object_without_a_pod_template_through_unchanged() -> None:
    """As istioctl kube-inject: the YAML answer is the whole bundle, ready for kubectl apply."""
    pod = yaml.safe_load(POD_YAML)
    docs = [SERVICE, pod, CONFIG_MAP, {"apiVersion": "v1", "kind": "List", "items": [WORKFLOW, SERVICE]}]
    body = b"---\n".join(yaml.safe_dump(d).encode() for d in docs)
    answer = _preview(body, query="?output=yaml")
    assert answer.status_code == 200
    assert answer.headers.get_list("warning") == []
    mutated = list(yaml.safe_load_all(answer.text))
    assert mutated == [SERVICE, _preview(POD_YAML).json()["object"], CONFIG_MAP, WORKFLOW, SERVICE]
    entries = _preview(body).json()
    assert [(e["kind"], e["name"]) for e in entries] == [
        ("Service", "web"),
        ("Pod", "bq2m4-n1-0"),
        ("ConfigMap", "settings"),
        ("FlyteWorkflow", "f7a9"),
        ("Service", "web"),
    ]
    passed = entries[0]
    assert (passed["allowed"], passed["patch"], passed["changes"], passed["warnings"]) == (True, [], [], [])
    assert passed["object"] == SERVICE
    assert "+  shareProcessNamespace: true" in _preview(body, query="?output=diff").text
    assert _preview(body, query="?output=patch").json()[0] == []


def test_an_answer_of_objects_without_a_pod_template_says_nothing_applies() -> None:
    alone = _preview(orjson.dumps(SERVICE), "application/json", "?output=diff")
    assert alone.status_code == 200
    assert alone.text == ""
    assert alone.headers.get_list("warning") == [f'299 - "{PASS_NOTE.format("Service")}"']
    assert _preview(orjson.dumps(SERVICE), "application/json").json()["object"] == SERVICE
    both = _preview(yaml.safe_dump(SERVICE).encode() + b"---\n" + yaml.safe_dump(CONFIG_MAP).encode())
    assert both.headers.get_list("warning") == [
        f'299 - "Service/web: {PASS_NOTE.format("Service")}"',
        f'299 - "ConfigMap/settings: {PASS_NOTE.format("ConfigMap")}"',
    ]


def _opted_out() -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load(POD_YAML)
    obj["metadata"]["annotations"] = {"copilot-webhook.io/inject": "false"}
    return obj


@pytest.mark.parametrize(
    ("obj", "settings", "query", "decisions"),
    [
        (yaml.safe_load(POD_YAML), {}, "", ("add:primary", "containerd:/run/containerd/containerd.sock")),
        (pod("flyte-1.16.yaml"), {}, "", ("add:none(native-sidecar)", "containerd:/run/containerd/containerd.sock")),
        (
            yaml.safe_load(POD_YAML),
            {"ptrace": {"mode": "drop"}},
            "?runtime=docker",
            ("drop", "docker:/var/run/docker.sock"),
        ),
        (
            yaml.safe_load(POD_YAML),
            {},
            "?podSecurity=baseline",
            ("add:skipped(pod-security=baseline)", "skipped(pod-security)"),
        ),
        (
            yaml.safe_load(POD_YAML),
            {"mode": "shadow"},
            "",
            ("add:primary", "containerd:/run/containerd/containerd.sock"),
        ),
        (pod("plain.yaml"), {}, "", ("skipped(not-copilot)", "skipped(not-copilot)")),
        (_opted_out(), {}, "", ("skipped(pod-opt-out)", "skipped(pod-opt-out)")),
        (
            yaml.safe_load(REFUSED),
            {"failurePolicy": "Fail"},
            "",
            ("skipped(undecided)", "containerd:/run/containerd/containerd.sock"),
        ),
    ],
)
def test_every_answer_names_the_decisions_mutate_audits(
    obj: dict[str, Any], settings: dict[str, Any], query: str, decisions: tuple[str, str]
) -> None:
    """The values of /mutate's audit annotations; where it writes none, why nothing was decided."""
    app = WebhookApp(build_settings(settings))
    entry = call(app, "POST", "/preview" + query, orjson.dumps(obj), content_type="application/json").json()
    assert entry["decisions"] == {"ptrace": decisions[0], "image-puller": decisions[1]}
    if not query:
        audited = post_json(app, "/mutate", review(obj)).json()["response"].get("auditAnnotations", {})
        assert {kind: entry["decisions"][kind] for kind in audited} == audited
        assert all(v.startswith("skipped(") for k, v in entry["decisions"].items() if k not in audited)
    label = f"{entry['kind']}/{entry['name']}"
    for output in ("yaml", "patch", "diff", "json"):
        answer = call(
            app,
            "POST",
            f"/preview{query}{'&' if query else '?'}output={output}",
            orjson.dumps(obj),
            content_type="application/json",
        )
        assert answer.headers.get_list("copilot-webhook-decision") == [
            f"{label}: ptrace={decisions[0]};image-puller={decisions[1]}"
        ]


def test_objects_that_are_not_pod_creates_name_why_nothing_was_decided() -> None:
    update = review(yaml.safe_load(POD_YAML), operation="UPDATE")
    assert _preview(orjson.dumps(update), "application/json").json()["decisions"] == {
        "ptrace": "skipped(not-pod-create)",
        "image-puller": "skipped(not-pod-create)",
    }
    bundle = _preview(
        orjson.dumps({"apiVersion": "v1", "kind": "List", "items": [SERVICE, yaml.safe_load(POD_YAML)]}),
        "application/json",
    )
    assert bundle.json()[0]["decisions"] == {
        "ptrace": "skipped(no-pod-template)",
        "image-puller": "skipped(no-pod-template)",
    }
    assert bundle.headers.get_list("copilot-webhook-decision") == [
        "Service/web: ptrace=skipped(no-pod-template);image-puller=skipped(no-pod-template)",
        "Pod/bq2m4-n1-0: ptrace=add:primary;image-puller=containerd:/run/containerd/containerd.sock",
    ]


def test_decision_headers_stop_at_4_kib_of_text_and_say_how_many_were_left_out() -> None:
    items = [{**SERVICE, "metadata": {"name": f"s{i:03}"}} for i in range(100)]
    answer = _preview(orjson.dumps({"apiVersion": "v1", "kind": "List", "items": items}), "application/json")
    *kept, last = answer.headers.get_list("copilot-webhook-decision")
    assert kept[0] == "Service/s000: ptrace=skipped(no-pod-template);image-puller=skipped(no-pod-template)"
    assert 4096 - len(kept[0]) < sum(len(h) for h in kept) <= 4096
    assert last == f"{100 - len(kept)} more object(s) left out; output=json has each one's decisions"


@pytest.mark.parametrize(
    ("body", "content_type", "query", "status", "message"),
    [
        (POD_YAML, "application/yaml", "?output=xml", 400, "output='xml' is not allowed"),
        (POD_YAML, "application/yaml", "?runtime=podman", 400, "runtime='podman' is not allowed"),
        (POD_YAML, "application/yaml", "?node=Bad_Node", 400, "not a valid node name"),
        (POD_YAML, "application/yaml", "?namespace=a.b", 400, "not a valid namespace name"),
        (POD_YAML, "application/yaml", "?colour=blue", 400, "unknown query parameter(s) colour"),
        (POD_YAML, "application/yaml", "?podSecurity=Baseline", 400, "podSecurity='Baseline' is not allowed"),
        (POD_YAML, "text/plain", "", 415, "Content-Type must be application/json or application/yaml"),
        (b"kind: 3\n", "application/yaml", "", 400, "object: kind must be a string such as Pod or Deployment"),
        (
            b"kind: Deployment\nspec: {}\n",
            "application/yaml",
            "",
            400,
            "Deployment has no pod template at spec.template",
        ),
        (b"a: [1, 2\n", "application/yaml", "", 400, "body is not valid YAML"),
        (b"", "application/yaml", "", 400, "body holds no object"),
        (b"- 1\n- 2\n", "application/yaml", "", 400, "expected a Kubernetes object, got array"),
        (b"kind: Pod\nspec: {containers: 3}\n", "application/yaml", "", 400, "spec.containers must be an array"),
        (b"\xff\xfe", "application/yaml", "", 400, "not UTF-8"),
        (b"a: &x [1]\nb: *x\n", "application/yaml", "", 400, "YAML aliases are not accepted"),
        (b"{", "application/json", "", 400, "body is not valid JSON"),
    ],
)
def test_preview_errors(body: bytes, content_type: str, query: str, status: int, message: str) -> None:
    res = _preview(body, content_type, query)
    assert res.status_code == status
    assert message in res.json()["error"]


# --- the gate in front of FastAPI: a worker, the body's limit and deadline -------------------------------------


def _gated(app: WebhookApp, receive: Any, content_type: str = "application/json") -> list[dict[str, Any]]:
    """POST /preview straight through the ASGI app, with this receive; what the app sent."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/preview",
        "raw_path": b"/preview",
        "query_string": b"",
        "headers": [(b"content-type", content_type.encode())],
    }
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


async def _unread() -> dict[str, Any]:
    raise AssertionError("the body was read")


def _requests(result: str) -> str:
    return f'copilot_webhook_requests_total{{path="/preview",result="{result}"}} 1.0'


def test_a_busy_preview_is_refused_with_retry_after_before_its_body_is_read() -> None:
    app = WebhookApp(build_settings({}))
    held = [app.previewer.take() for _ in range(app.previewer.slots)]
    start, body = _gated(app, _unread)
    assert start["status"] == 503
    assert (b"retry-after", b"1") in start["headers"]
    assert "preview.concurrency" in orjson.loads(body["body"])["error"]
    assert _requests("busy") in call(app, "GET", "/metrics").text
    for worker in held:
        assert worker is not None
        app.previewer.give_back(worker)
    assert call(app, "POST", "/preview", POD_YAML, content_type="application/yaml").status_code == 200


def test_a_preview_body_late_past_the_deadline_is_408_and_gives_its_worker_back() -> None:
    app = WebhookApp(build_settings({"server": {"deadlineSeconds": 0.2}}))

    async def never() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    started = time.monotonic()
    start, body = _gated(app, never)
    assert start["status"] == 408
    assert orjson.loads(body["body"]) == {"error": "body not received within server.deadlineSeconds (0.2 s)"}
    assert time.monotonic() - started < 2
    metrics = call(app, "GET", "/metrics").text
    assert _requests("timeout") in metrics
    assert "copilot_webhook_previews_in_flight 0.0" in metrics
    assert app.previewer.take() is not None, "the worker was given back"


def test_a_client_gone_mid_preview_body_is_counted_and_gives_its_worker_back() -> None:
    app = WebhookApp(build_settings({}))
    sequence: list[dict[str, Any]] = [
        {"type": "http.request", "body": b"{", "more_body": True},
        {"type": "http.disconnect"},
    ]
    messages = iter(sequence)

    async def leaving() -> dict[str, Any]:
        return next(messages)

    assert _gated(app, leaving) == []
    assert _requests("client_gone") in call(app, "GET", "/metrics").text
    assert app.previewer.take() is not None


def test_the_gate_reads_the_settings_a_reload_put_in_place() -> None:
    app = WebhookApp(build_settings({}))
    app.settings = build_settings({"preview": {"maxBodyBytes": 4096}})
    res = call(app, "POST", "/preview", b"x" * 5000, content_type="application/json")
    assert res.status_code == 413
    assert "preview.maxBodyBytes (4096)" in res.json()["error"]
    app.settings = build_settings({"preview": {"enabled": False}})
    assert call(app, "POST", "/preview", POD_YAML, content_type="application/yaml").status_code == 404
