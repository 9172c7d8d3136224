"""The AdmissionReview envelope (admission.k8s.io/v1 and v1beta1): parse, decide, answer.

Transport errors (a body that is not a review) raise RequestError and become 4xx answers; everything
about a well-formed review is answered with an AdmissionReview, never with an HTTP error. The pod is
never round-tripped through a typed model: unknown fields would be lost (kubebuilder#510).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Required, TypedDict

import msgspec
import orjson

from webhook.config import Settings
from webhook.documents import shaped
from webhook.errors import RequestError
from webhook.mutation.errors import PodShapeError
from webhook.mutation.facts import NO_CLUSTER, ClusterFacts, Facts, RequestFacts
from webhook.mutation.plan import KINDS, Plan, plan
from webhook.mutation.pod import type_name
from webhook.mutation.pointer import Operation
from webhook.objects import Pod

log = logging.getLogger(__name__)

API_VERSIONS = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")
WARNING_PREFIX = "copilot-webhook: "
WARNING_LIMIT = 120  # the API server truncates longer warnings; we cut them ourselves, visibly


def _warning(text: str) -> str:
    text = WARNING_PREFIX + text
    return text if len(text) <= WARNING_LIMIT else text[: WARNING_LIMIT - 1] + "…"


NamespaceFacts = Callable[[str], ClusterFacts]


def no_cluster(_namespace: str) -> ClusterFacts:
    return NO_CLUSTER


# The review as admission reads it: msgspec decodes these shapes and skips every other key without building
# it: the metadata's managedFields (the API server records the create's before admission: one entry
# naming every field the creator set), the request's userInfo, resource kinds, options and oldObject. The
# pod's spec is kept whole, so what admission never reads costs no objects. A review that does not fit the
# shapes (a DELETE's null object, a hostile body) is parsed whole.
class _ObjectMeta(TypedDict, total=False):
    """Every field of ObjectMeta but managedFields."""

    name: Any
    generateName: Any
    namespace: Any
    selfLink: Any
    uid: Any
    resourceVersion: Any
    generation: Any
    creationTimestamp: Any
    deletionTimestamp: Any
    deletionGracePeriodSeconds: Any
    labels: Any
    annotations: Any
    ownerReferences: Any
    finalizers: Any


class _Object(TypedDict, total=False):
    apiVersion: Any
    kind: Any
    metadata: _ObjectMeta
    spec: Any
    status: Any


class _Request(TypedDict, total=False):
    uid: Any
    kind: Any
    subResource: Any
    name: Any
    namespace: Any
    operation: Any
    object: _Object
    dryRun: Any


class _Review(TypedDict, total=False):
    apiVersion: Any
    kind: Any
    request: _Request


_REVIEW = msgspec.json.Decoder(_Review)


def load_json(body: bytes) -> Any:
    """The review, parsed. msgspec validates UTF-8 only in what it builds, so a body that is not all ASCII
    (valid UTF-8, then) is parsed whole by orjson, which checks every byte, as is anything msgspec refuses:
    what is refused, and the message, stay orjson's."""
    try:
        return shaped(_REVIEW, body) if body.isascii() else orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"body is not valid JSON: {exc}") from None


class AdmissionRequest(TypedDict, total=False):
    """admission.k8s.io/v1 AdmissionRequest, the fields we read. Only `uid` is checked on arrival; each of
    the others is checked where it is read (the values are the sender's, so they stay Any)."""

    uid: Required[str]
    kind: Any  # {group, version, kind}: a Pod CREATE is all we act on
    subResource: Any
    operation: Any
    namespace: Any
    object: Any


@dataclass(slots=True)
class Review:
    api_version: str
    uid: str
    request: AdmissionRequest


def read_review(data: Any) -> Review:
    if type(data) is not dict:
        raise RequestError(400, f"expected an AdmissionReview object, got {type_name(data)}")
    api_version, kind = data.get("apiVersion"), data.get("kind")
    if kind != "AdmissionReview" or api_version not in API_VERSIONS:
        raise RequestError(
            400,
            f"expected kind AdmissionReview with apiVersion {' or '.join(API_VERSIONS)}, "
            f"got kind={kind!r} apiVersion={api_version!r}",
        )
    request = data.get("request")
    if type(request) is not dict:
        raise RequestError(400, f"AdmissionReview.request must be an object, got {type_name(request)}")
    uid = request.get("uid")
    if type(uid) is not str or not uid:
        raise RequestError(400, "AdmissionReview.request.uid is required: a non-empty string to echo in the response")
    return Review(api_version, uid, request)  # type: ignore[arg-type] # its uid checked just above


def is_pod_create(request: AdmissionRequest) -> bool:
    kind = request.get("kind")
    return (
        request.get("operation") == "CREATE"
        and type(kind) is dict
        and kind.get("kind") == "Pod"
        and kind.get("group", "") == ""
        and not request.get("subResource")
    )


def request_facts(
    request: AdmissionRequest,
    pod: Pod,
    namespaces: NamespaceFacts,
    *,
    runtime: str | None = None,
    node: str | None = None,
    pod_security: str | None = None,
) -> Facts:
    namespace = request.get("namespace")
    if type(namespace) is not str or not namespace:
        metadata = pod.get("metadata")
        namespace = metadata.get("namespace") if type(metadata) is dict else None
        namespace = namespace if type(namespace) is str else ""
    return Facts(RequestFacts(namespace, runtime, node, pod_security), namespaces(namespace))


def decide(
    request: AdmissionRequest,
    settings: Settings,
    namespaces: NamespaceFacts = no_cluster,
    *,
    kinds: Collection[str] = KINDS,
    runtime: str | None = None,
    node: str | None = None,
    pod_security: str | None = None,
) -> Plan | None:
    """The plan for a review's request; None when the request is not a Pod CREATE (nothing to do)."""
    if not is_pod_create(request):
        return None
    pod = request.get("object")
    if type(pod) is not dict:
        raise RequestError(400, f"AdmissionReview.request.object must be a Pod object, got {type_name(pod)}")
    facts = request_facts(request, pod, namespaces, runtime=runtime, node=node, pod_security=pod_security)
    return plan_or_undecided(pod, facts, settings, kinds=kinds, where="AdmissionReview.request.object")


def plan_or_undecided(pod: Any, facts: Facts, settings: Settings, *, kinds: Collection[str], where: str) -> Plan:
    """The plan; a pod we cannot read is a bad request naming `where`; a bug is logged with its traceback and
    answered as undecided, so failurePolicy decides and no HTTP error ever answers a well-formed request."""
    try:
        return plan(pod, facts, settings, kinds=kinds)
    except PodShapeError as exc:
        raise RequestError(400, f"{where}: {exc}") from None
    except Exception as exc:
        log.exception("planning failed for %s", where)
        return Plan(undecided=f"internal error ({type(exc).__name__})")


class Decision(NamedTuple):
    """What is answered for a plan under the failure policy, once: the admission response and the
    preview both read it."""

    allowed: bool
    patch: list[Operation]  # the operations applied: none in shadow mode, when denied, or with nothing to do
    warnings: list[str]  # prefixed and cut to the API server's 120 characters
    denial: str | None  # why the pod is refused (failurePolicy Fail and undecidable)
    audit: dict[str, str]


NOTHING_TO_DO = Decision(allowed=True, patch=[], warnings=[], denial=None, audit={})


def decision(decided: Plan | None, settings: Settings) -> Decision:
    if decided is None:
        return NOTHING_TO_DO
    warnings = [_warning(w) for w in decided.warnings]
    denial = None
    if decided.undecided is not None:
        if settings.failure_policy == "Fail":
            denial = f"copilot-webhook cannot decide (failurePolicy Fail): {decided.undecided}"
        else:
            warnings.append(_warning(f"left unchanged, cannot decide: {decided.undecided}"))
    patch = [c.op for c in decided.changes] if not decided.shadow and denial is None else []
    return Decision(denial is None, patch, warnings, denial, dict(decided.audit))


class Status(TypedDict):
    code: int
    message: str


class AdmissionResponse(TypedDict, total=False):
    """admission.k8s.io/v1 AdmissionResponse, as far as we answer it."""

    uid: Required[str]
    allowed: Required[bool]
    status: Status
    patchType: Literal["JSONPatch"]
    patch: str  # base64 of the JSON Patch
    auditAnnotations: dict[str, str]
    warnings: list[str]


def response(uid: str, decided: Plan | None, settings: Settings) -> AdmissionResponse:
    return admission_response(uid, decision(decided, settings))


def admission_response(uid: str, verdict: Decision) -> AdmissionResponse:
    answer: AdmissionResponse = {"uid": uid, "allowed": verdict.allowed}
    if verdict.denial is not None:
        answer["status"] = {"code": 403, "message": verdict.denial}
    if verdict.patch:
        answer["patchType"] = "JSONPatch"
        answer["patch"] = base64.b64encode(orjson.dumps(verdict.patch)).decode("ascii")
    if verdict.audit:
        answer["auditAnnotations"] = verdict.audit
    if verdict.warnings:
        answer["warnings"] = verdict.warnings
    return answer


def envelope(api_version: str, answer: AdmissionResponse) -> bytes:
    return orjson.dumps({"apiVersion": api_version, "kind": "AdmissionReview", "response": answer})
