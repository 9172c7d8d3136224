"""Reviews are decoded into the shapes admission reads (review.load_json), skipping the metadata's
managedFields and the request's other fields; everything else is parsed whole. Every golden case must be
answered the same either way, and a body the whole parse refuses must still be refused."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from tests.helpers import GOLDEN, load_yaml, pod, review
from tests.test_golden import _cases, _run
from webhook.config import build_settings
from webhook.errors import RequestError
from webhook.review import decide, envelope, is_pod_create, load_json, read_review, response

MANAGED_FIELDS = [
    {
        "manager": "flytepropeller",
        "operation": "Update",
        "apiVersion": "v1",
        "time": "2026-12-01T00:00:00Z",
        "fieldsType": "FieldsV1",
        "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:node-id": {}}}, "f:spec": {"f:containers": {}}},
    }
]
USER_INFO = {"username": "system:serviceaccount:flyte:flytepropeller", "groups": ["system:serviceaccounts"]}


def _as_the_api_server_sends(obj: Any) -> bytes:
    """The review with what a real one carries and admission never reads."""
    obj = copy.deepcopy(obj)
    if isinstance(obj.get("metadata"), dict):
        obj["metadata"]["managedFields"] = MANAGED_FIELDS
    body = review(obj, userInfo=USER_INFO, options={"kind": "CreateOptions"}, oldObject=None)
    return orjson.dumps(body)


def _answer(data: Any, context: dict[str, Any]) -> dict[str, Any]:
    """The golden case's answer for the review's object as decoded, and what the envelope said."""
    parsed = read_review(data)
    return {"uid": parsed.uid, "pod create": is_pod_create(parsed.request), **_run(parsed.request["object"], context)}


@pytest.mark.parametrize("name", _cases())
def test_every_golden_case_is_answered_the_same_decoded_either_way(name: str) -> None:
    context_path = GOLDEN / f"{name}.context.yaml"
    context = (load_yaml(context_path) or {}) if context_path.exists() else {}
    source = GOLDEN / context["input"] if "input" in context else GOLDEN / f"{name}.yaml"
    obj = load_yaml(source)
    body = _as_the_api_server_sends(obj)
    shaped, whole = load_json(body), orjson.loads(body)
    assert "managedFields" not in shaped["request"]["object"]["metadata"], "the shapes were not used"
    assert "userInfo" not in shaped["request"]
    assert _answer(shaped, context) == _answer(whole, context)


def test_a_body_not_all_ascii_is_parsed_whole_and_answered_the_same() -> None:
    obj = pod("flyte-1.15-bare.yaml")
    obj["metadata"]["annotations"] = {"team": "données"}
    body = _as_the_api_server_sends(obj)
    assert not body.isascii()
    assert "managedFields" in load_json(body)["request"]["object"]["metadata"]
    settings = build_settings({})
    answers = []
    for data in (load_json(body), load_json(body.replace("données".encode(), b"donnees"))):
        parsed = read_review(data)
        answers.append(
            orjson.loads(envelope(parsed.api_version, response(parsed.uid, decide(parsed.request, settings), settings)))
        )
    assert answers[0] == answers[1]


@pytest.mark.parametrize(
    "body",
    [
        b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","userInfo":"\xff"}}',
        b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","userInfo":"\\ud800"}}',
        b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","options":NaN}}',
        b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u"}} trailing',
        b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","object":{"spec":1e400}}}',
    ],
    ids=["invalid UTF-8 where nothing is read", "a lone surrogate", "NaN", "trailing bytes", "a number out of range"],
)
def test_what_the_whole_parse_refuses_is_refused_with_its_message(body: bytes) -> None:
    with pytest.raises(orjson.JSONDecodeError) as whole:
        orjson.loads(body)
    with pytest.raises(RequestError) as refused:
        load_json(body)
    assert refused.value.status == 400
    assert refused.value.message == f"body is not valid JSON: {whole.value}"


def test_a_number_too_large_for_a_double_is_refused_where_it_is_read_and_passed_over_elsewhere() -> None:
    """orjson refuses 1e400 anywhere; the shapes skip what admission never reads without converting it, as
    they skip duplicate keys' earlier values. No API server sends either."""
    body = b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","userInfo":1e400}}'
    assert load_json(body) == {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u"}}


def test_reviews_that_do_not_fit_the_shapes_are_parsed_whole() -> None:
    """A DELETE's null object, a request that is not an object: what the checks after parsing refuse or pass
    over, exactly as before."""
    delete = orjson.dumps(review(None, operation="DELETE"))
    assert load_json(delete) == orjson.loads(delete)
    odd = b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":[1]}'
    assert load_json(odd) == {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": [1]}
