"""One vocabulary for our labels and annotations: `disabled`/`false` are off and `enabled`/`true` on, on a pod
and on its namespace alike, in the server's check and the chart's namespaceSelector; every other value of
ours is named in a warning and counted, never ignored in silence."""

from __future__ import annotations

from typing import Any

import pytest

from tests.asgi import call, post_json
from tests.helpers import decoded_patch, pod, review
from tests.test_chart import render
from webhook.config import build_settings
from webhook.errors import ConfigError
from webhook.mutation.facts import Facts, RequestFacts, cluster_facts
from webhook.mutation.plan import plan
from webhook.mutation.vocabulary import OFF, ON
from webhook.web.server import WebhookApp

COPILOT = "flyte-1.15-bare.yaml"


def _pod(**annotations: str) -> dict[str, Any]:
    obj = pod(COPILOT)
    obj["metadata"].setdefault("annotations", {}).update(annotations)
    return obj


def _plan(obj: dict[str, Any], labels: dict[str, str] | None = None, **config: Any) -> Any:
    facts = Facts(RequestFacts("flyte"), cluster_facts(labels))
    return plan(obj, facts, build_settings(config))


@pytest.mark.parametrize("value", ["disabled", "false"])
def test_a_pod_switched_off_in_either_word_is_left_alone(value: str) -> None:
    decided = _plan(_pod(**{"copilot-webhook.io/inject": value}))
    assert decided.changes == []
    assert {o.reason for o in decided.outcomes.values()} == {"pod-opt-out"}
    assert decided.warnings == []


@pytest.mark.parametrize("value", ["disabled", "false"])
def test_a_namespace_switched_off_in_either_word_is_left_alone(value: str) -> None:
    decided = _plan(_pod(), {"copilot-webhook.io/inject": value})
    assert decided.changes == []
    assert {o.reason for o in decided.outcomes.values()} == {"namespace-opt-out"}


@pytest.mark.parametrize("value", ["enabled", "true"])
def test_switched_on_is_the_default_and_warns_of_nothing(value: str) -> None:
    decided = _plan(_pod(**{"copilot-webhook.io/inject": value}), {"copilot-webhook.io/inject": value})
    assert decided.changes, "served as without the switch"
    assert decided.warnings == []


@pytest.mark.parametrize("value", ["enabled", "true", "disabled", "false"])
def test_the_puller_annotation_takes_the_same_words(value: str) -> None:
    decided = _plan(_pod(**{"copilot-webhook.io/image-puller": value}), {}, podSecurity={"defaults": {}})
    assert decided.outcomes["image-puller"].mutated is (value in ON)
    assert decided.warnings == []


CASES = {
    "pod inject": (
        {"copilot-webhook.io/inject": "no"},
        None,
        "copilot-webhook.io/inject='no' ignored: expected enabled, true, disabled or false",
        ("pod", "inject"),
    ),
    "pod image-puller": (
        {"copilot-webhook.io/image-puller": "off"},
        None,
        "copilot-webhook.io/image-puller='off' ignored: expected enabled, true, disabled or false",
        ("pod", "image-puller"),
    ),
    "pod ptrace": (
        {"copilot-webhook.io/ptrace": "dorp"},
        None,
        "copilot-webhook.io/ptrace='dorp' ignored: expected add, drop or keep",
        ("pod", "ptrace"),
    ),
    "misspelt key": (
        {"copilot-webhook.io/injcet": "false"},
        None,
        "unknown annotation copilot-webhook.io/injcet ignored: ours are inject, ptrace, image-puller",
        ("pod", "unknown"),
    ),
    "namespace inject": (
        {},
        {"copilot-webhook.io/inject": "Disabled"},
        "namespace label copilot-webhook.io/inject='Disabled' ignored: expected enabled, true, disabled or false",
        ("namespace", "inject"),
    ),
    "namespace mode": (
        {},
        {"copilot-webhook.io/mode": "dry-run"},
        "namespace label copilot-webhook.io/mode='dry-run' ignored: expected shadow or enforce",
        ("namespace", "mode"),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_value_not_understood_is_warned_of_and_counted(case: str) -> None:
    annotations, labels, warning, (source, key) = CASES[case]
    app = WebhookApp(build_settings({}), namespaces=lambda _ns: cluster_facts(labels))
    answer = post_json(app, "/mutate", review(_pod(**annotations)))
    response = answer.json()["response"]
    assert f"copilot-webhook: {warning}" in response["warnings"]
    assert decoded_patch(response), "ignored: the pod is served as without it"
    metrics = call(app, "GET", "/metrics").text
    assert f'copilot_webhook_ignored_values_total{{key="{key}",source="{source}"}} 1.0' in metrics


def test_a_warning_quotes_at_most_20_characters_of_a_value_or_key() -> None:
    decided = _plan(_pod(**{"copilot-webhook.io/inject": "n" * 500, "copilot-webhook.io/" + "k" * 500: "x"}))
    assert decided.warnings == [
        f"copilot-webhook.io/inject={'n' * 20!r} ignored: expected enabled, true, disabled or false",
        f"unknown annotation copilot-webhook.io/{'k' * 20} ignored: ours are inject, ptrace, image-puller",
    ]


def test_annotations_of_others_and_our_own_record_are_not_warned_of() -> None:
    decided = _plan(_pod(**{"example.com/inject": "nope", "copilot-webhook.io/mutated": "anything"}))
    assert decided.warnings == []


def test_each_webhook_warns_of_the_annotation_it_reads() -> None:
    obj = _pod(**{"copilot-webhook.io/ptrace": "dorp", "copilot-webhook.io/image-puller": "off"})
    facts = Facts(RequestFacts("flyte"))
    ptrace = plan(obj, facts, build_settings({}), kinds=("ptrace",))
    puller = plan(obj, facts, build_settings({}), kinds=("image-puller",))
    assert [w.split("=")[0] for w in ptrace.warnings] == ["copilot-webhook.io/ptrace"]
    assert [w.split("=")[0] for w in puller.warnings] == ["copilot-webhook.io/image-puller"]


def test_opt_in_serves_only_namespaces_switched_on() -> None:
    for labels, served in (
        ({"copilot-webhook.io/inject": "enabled"}, True),
        ({"copilot-webhook.io/inject": "true"}, True),
        ({}, False),
        ({"copilot-webhook.io/inject": "disabled"}, False),
        (None, True),  # not known here: the API server's namespaceSelector chose it
    ):
        decided = _plan(_pod(), labels, inject="opt-in")
        assert bool(decided.changes) is served, labels
        if labels == {}:
            assert {o.reason for o in decided.outcomes.values()} == {"namespace-not-opted-in"}


def test_inject_takes_opt_out_or_opt_in_only() -> None:
    assert build_settings({}).inject == "opt-out"
    with pytest.raises(ConfigError, match="inject: 'on' is not allowed; expected 'opt-out' or 'opt-in'"):
        build_settings({"inject": "on"})


def _selector(obj: dict[str, Any]) -> dict[str, Any]:
    found: list[dict[str, Any]] = [e for e in obj["matchExpressions"] if e["key"] == "copilot-webhook.io/inject"]
    (selector,) = found
    return selector


@pytest.mark.parametrize(("mode", "operator", "words"), [("opt-out", "NotIn", OFF), ("opt-in", "In", ON)])
def test_the_charts_selectors_take_the_servers_words(mode: str, operator: str, words: tuple[str, ...]) -> None:
    values = {"inject": mode, "ptrace": {"mode": "drop"}, "webhook": {"ptrace": {"validatingPolicy": True}}}
    rendered = render(values)
    hooks = rendered["MutatingWebhookConfiguration/cw-copilot-webhook"]["webhooks"]
    selectors = [_selector(h["namespaceSelector"]) for h in hooks]
    binding = rendered["ValidatingAdmissionPolicyBinding/cw-copilot-webhook-ptrace-drop"]
    selectors.append(_selector(binding["spec"]["matchResources"]["namespaceSelector"]))
    assert selectors == [{"key": "copilot-webhook.io/inject", "operator": operator, "values": list(words)}] * 3
    policy = rendered["ValidatingAdmissionPolicy/cw-copilot-webhook-ptrace-drop"]
    (opted_out,) = [c for c in policy["spec"]["matchConditions"] if c["name"] == "not-opted-out"]
    assert f"in {list(OFF)}" in opted_out["expression"]
    assert "inject: " + mode in rendered["ConfigMap/cw-copilot-webhook"]["data"]["config.yaml"]


def test_the_chart_refuses_another_inject_mode() -> None:
    with pytest.raises(Exception, match="inject"):
        render({"inject": "canary"})


def test_the_install_notes_name_the_switch_of_the_mode() -> None:
    from tests.test_chart import notes

    assert "kubectl label namespace NAME copilot-webhook.io/inject=disabled" in notes()
    opt_in = notes({"inject": "opt-in"})
    assert "kubectl label namespace NAME copilot-webhook.io/inject=enabled" in opt_in
    assert "inject=disabled" not in opt_in
