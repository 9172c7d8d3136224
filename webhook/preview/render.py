"""Dry-run previews (POST /preview, `copilot-webhook preview`): what the webhook would do to an object.

Takes Pods, AdmissionReviews, workloads with a pod template, Lists and multi-document YAML; answers
with the patch, the mutated object, the reason for every operation and the warnings. Any other kind of
object passes through unchanged. Side-effect free.
"""

from __future__ import annotations

import difflib
import io
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypedDict, get_args

import jsonpatch
import orjson
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from typing_extensions import TypeAliasType

from webhook.config import FLAVOURS, LEVELS, Flavour, PodSecurityLevel, Settings
from webhook.documents import decode_text, load_json_document, load_yaml_documents
from webhook.errors import DocumentError, RequestError
from webhook.mutation.facts import Facts, RequestFacts
from webhook.mutation.plan import KINDS, PTRACE, Plan
from webhook.mutation.pod import type_name
from webhook.mutation.pointer import Operation
from webhook.objects import JSONObject
from webhook.review import (
    WARNING_PREFIX,
    NamespaceFacts,
    decide,
    decision,
    no_cluster,
    plan_or_undecided,
    read_review,
)

TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}
PASSED_THROUGH = "skipped(no-pod-template)"  # the decisions on an object passed through unchanged
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
# A named alias, so that the OpenAPI description has one Output schema for the parameter.
Output = TypeAliasType("Output", Literal["json", "yaml", "patch", "diff"])


class PreviewQuery(BaseModel):
    """What a preview asks besides its body: the answer's form and what to assume of the cluster. The
    query parameters of POST /preview, the options of `copilot-webhook preview`, and a worker's job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    output: Output = Field("json", description="The answer's form")
    runtime: Flavour | None = Field(None, description="What if the node ran this runtime")
    node: str | None = Field(None, pattern=DNS_SUBDOMAIN, description="What if the pod ran here")
    namespace: str | None = Field(None, pattern=DNS_LABEL, description="The namespace to assume")
    podSecurity: PodSecurityLevel | None = Field(
        None, description="What if this Pod Security level were in force (else the namespace's, as admission decides)"
    )

    @classmethod
    def of(cls, params: Mapping[str, str]) -> PreviewQuery:
        """The query of these parameters; RequestError (400) worded as `query_error` words it."""
        try:
            return cls.model_validate(params)
        except ValidationError as exc:
            raise RequestError(400, query_error(exc.errors())) from None


def query_error(errors: Sequence[Mapping[str, Any]]) -> str:
    """What is wrong with a query, from pydantic's errors: unknown parameters first, then the first
    parameter (in the model's order) whose value was refused."""
    unknown = sorted(str(e["loc"][-1]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        return f"unknown query parameter(s) {', '.join(unknown)}; known: runtime, node, namespace, podSecurity, output"
    refused = {str(e["loc"][-1]): e for e in errors}
    for name in PreviewQuery.model_fields:
        if name in refused:
            value = refused[name].get("input")
            if name in ("output", "runtime", "podSecurity"):
                allowed = {"output": get_args(Output.__value__), "runtime": FLAVOURS}.get(name) or LEVELS
                return f"{name}={value!r} is not allowed; expected one of {', '.join(allowed)}"
            what = "node name (a DNS subdomain)" if name == "node" else "namespace name (a DNS label)"
            return f"{name}={value!r} is not a valid {what}"
    first = errors[0]
    return f"query parameter {'.'.join(str(p) for p in first['loc'])}: {first['msg']}"


def load_documents(body: bytes, content_type: str) -> list[Any]:
    """JSON values only (no YAML aliases, tags or integers JSON cannot carry), at most MAX_DEPTH deep."""
    try:
        if content_type == "application/json":
            docs = [load_json_document(body)]
        else:
            docs = load_yaml_documents(decode_text(body))
    except DocumentError as exc:
        raise RequestError(400, f"body is {exc}" if str(exc).startswith("not ") else f"body: {exc}") from None
    if not docs:
        raise RequestError(400, "body holds no object; expected a Pod, a workload, an AdmissionReview or a List")
    return docs


def _is_list(doc: Any) -> bool:
    """`List` (what kubectl prints for several objects) or a typed list such as `PodList`."""
    if not isinstance(doc, dict):
        return False
    kind = doc.get("kind")
    return isinstance(kind, str) and (kind == "List" or (kind.endswith("List") and "items" in doc))


def _objects(docs: list[Any]) -> Iterator[tuple[str, Any]]:
    for i, doc in enumerate(docs):
        where = f"document {i + 1}" if len(docs) > 1 else "object"
        if _is_list(doc):
            items = doc.get("items")
            if not isinstance(items, list):
                raise RequestError(400, f"{where}: a List must have an array of items")
            for j, item in enumerate(items):
                yield f"{where} item {j + 1}", item
        else:
            yield where, doc


def _name(obj: JSONObject) -> str:
    metadata = obj.get("metadata")
    if isinstance(metadata, dict):
        name = metadata.get("name") or metadata.get("generateName")
        if isinstance(name, str):
            return name
    return ""


def _namespace(obj: JSONObject, query: PreviewQuery) -> str:
    if query.namespace:
        return query.namespace
    metadata = obj.get("metadata")
    namespace = metadata.get("namespace") if isinstance(metadata, dict) else None
    return namespace if isinstance(namespace, str) and namespace else "default"


def _entry(kind: str, obj: JSONObject, decided: Plan | None, *, prefix: str, settings: Settings) -> PreviewEntry:
    verdict = decision(decided, settings)
    planned = [] if decided is None else decided.changes
    reasons: list[ChangeAnswer] = [
        {"op": c.op["op"], "path": prefix + c.op["path"], "reason": c.reason} for c in planned
    ]
    applied = bool(verdict.patch)  # all of the plan's operations, or none (shadow mode, refused)
    patch: list[Operation] = [{**c.op, "path": prefix + c.op["path"]} for c in planned] if applied else []
    # A JSON value is copied by an orjson round trip, cheaper than deepcopy; unpatched, the object is only
    # read from here on, so it needs no copy.
    mutated = jsonpatch.apply_patch(orjson.loads(orjson.dumps(obj)), patch, in_place=True) if patch else obj
    return {
        "kind": kind,
        "name": _name(obj),
        "allowed": verdict.allowed,
        "decisions": _decisions(decided),
        "patch": patch,
        "object": mutated,
        "changes": reasons if applied else [],
        "notApplied": [] if applied else reasons,
        "warnings": verdict.warnings + ([verdict.denial] if verdict.denial is not None else []),
        "runtime": _runtime(decided),
        "_before": obj,
        "_warnings": verdict.warnings,
        "_refusal": verdict.denial,
    }


class RuntimeAnswer(TypedDict):
    """Which runtime the puller would speak to, and what decided it."""

    flavour: str | None
    socket: str | None
    source: str


class ChangeAnswer(TypedDict):
    op: str
    path: str
    reason: str


class PreviewEntry(TypedDict):
    """One object's preview: the JSON answer's keys, and the `_` keys that are never sent (what the diff
    output and the notes beside every output read)."""

    kind: str
    name: str
    allowed: bool
    decisions: dict[str, str]  # per kind of mutation, as /mutate's audit annotation says it, or why none
    patch: list[Operation]
    object: JSONObject  # the object as it would be admitted: any JSON object
    changes: list[ChangeAnswer]  # one per operation of `patch`, in its order
    notApplied: list[ChangeAnswer]  # computed but not in `patch`: shadow mode, or the object refused
    warnings: list[str]  # the admission response's warnings, then the refusal's message
    runtime: RuntimeAnswer
    _before: JSONObject
    _warnings: list[str]  # the admission response's warnings alone
    _refusal: str | None  # why admission would refuse the object (failurePolicy Fail and undecidable)


def _passed_through(kind: str, obj: JSONObject) -> PreviewEntry:
    """An object with no pod template (a Service, a ConfigMap, a custom resource): answered unchanged, so
    that a whole bundle of manifests can be previewed, as `istioctl kube-inject` passes such objects on."""
    return {
        "kind": kind,
        "name": _name(obj),
        "allowed": True,
        "decisions": dict.fromkeys(KINDS, PASSED_THROUGH),
        "patch": [],
        "object": obj,
        "changes": [],
        "notApplied": [],
        "warnings": [],
        "runtime": {"flavour": None, "socket": None, "source": "no pod template"},
        "_before": obj,
        "_warnings": [],
        "_refusal": None,
    }


def _nothing_applies(entries: list[PreviewEntry]) -> None:
    """When no object of the answer has a pod template, each says so in a warning: a file of nothing the
    webhook acts on is more likely a mistake than a bundle's other half."""
    for entry in entries:
        note = (
            f"{WARNING_PREFIX}{entry['kind']} passed through unchanged: the webhook acts on Pods alone "
            f"(a Pod, the pod template of a {', '.join(TEMPLATE_PATHS)}, an AdmissionReview)"
        )
        entry["warnings"].append(note)
        entry["_warnings"].append(note)


def _decisions(decided: Plan | None) -> dict[str, str]:
    """What /mutate's audit annotations say for each kind (`add:none(native-sidecar)`); where they say nothing,
    `skipped(<reason>)`, the reason as the skips metric names it, or `skipped(not-pod-create)`."""
    if decided is None:
        return dict.fromkeys(KINDS, "skipped(not-pod-create)")
    decisions: dict[str, str] = {}
    for kind in KINDS:
        outcome = decided.outcomes.get(kind)
        decisions[kind] = decided.audit.get(kind) or f"skipped({outcome.reason if outcome else 'undecided'})"
    return decisions


def _runtime(decided: Plan | None) -> RuntimeAnswer:
    runtime = decided.runtime if decided is not None else None
    if runtime is None:
        note = decided.runtime_note if decided is not None else "not a Pod CREATE"
        return {"flavour": None, "socket": None, "source": note}
    return {"flavour": runtime.flavour, "socket": runtime.socket, "source": runtime.source}


def preview_one(
    where: str, obj: Any, settings: Settings, *, query: PreviewQuery, namespaces: NamespaceFacts
) -> PreviewEntry:
    if not isinstance(obj, dict):
        raise RequestError(400, f"{where}: expected a Kubernetes object, got {type_name(obj)}")
    kind = obj.get("kind")
    if not isinstance(kind, str):
        raise RequestError(400, f"{where}: kind must be a string such as Pod or Deployment, got {type_name(kind)}")
    if kind == "AdmissionReview":
        review = read_review(obj)
        request = review.request
        if query.namespace:
            request = {**request, "namespace": query.namespace}
        pod = request.get("object")
        return _entry(
            "AdmissionReview",
            pod if isinstance(pod, dict) else {},
            decide(
                request, settings, namespaces, runtime=query.runtime, node=query.node, pod_security=query.podSecurity
            ),
            prefix="",
            settings=settings,
        )
    if kind == "Pod":
        pod, prefix = obj, ""
    elif kind in TEMPLATE_PATHS:
        pod = obj
        for key in TEMPLATE_PATHS[kind]:
            pod = pod.get(key) if isinstance(pod, dict) else None
        if not isinstance(pod, dict):
            raise RequestError(400, f"{where}: {kind} has no pod template at {'.'.join(TEMPLATE_PATHS[kind])}")
        prefix = "/" + "/".join(TEMPLATE_PATHS[kind])
    else:
        return _passed_through(kind, obj)
    namespace = _namespace(obj, query)
    facts = Facts(RequestFacts(namespace, query.runtime, query.node, query.podSecurity), namespaces(namespace))
    decided = plan_or_undecided(pod, facts, settings, kinds=KINDS, where=where)
    return _entry(kind, obj, decided, prefix=prefix, settings=settings)


_STR, _MAP, _SEQ = "tag:yaml.org,2002:str", "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"
_REPRESENTER = yaml.SafeDumper(io.StringIO())  # for what is not a string, number, boolean or null
_SCALARS: dict[type, tuple[str, Callable[[Any], str]]] = {
    bool: ("tag:yaml.org,2002:bool", lambda v: "true" if v else "false"),
    int: ("tag:yaml.org,2002:int", str),
    float: ("tag:yaml.org,2002:float", lambda v: str(_REPRESENTER.represent_float(v).value)),
    type(None): ("tag:yaml.org,2002:null", lambda _v: "null"),
}


class _Dumper(yaml.CSafeDumper if yaml.__with_libyaml__ else yaml.SafeDumper):  # type: ignore[misc]
    """PyYAML's safe dumper, made cheaper where a yaml or diff preview spends most of its time, writing YAML:
    libyaml's emitter, and the question "would this plain scalar read back as a string?" asked
    once per distinct scalar of a preview rather than twice per scalar (keys and images repeat)."""

    resolved: dict[str, str]

    def resolve(self, kind: type[yaml.Node], value: Any, implicit: tuple[bool, bool]) -> Any:
        if kind is not yaml.ScalarNode:
            return super().resolve(kind, value, implicit)
        if not implicit[0]:
            return _STR  # the tag of a quoted scalar: always a string
        tag = self.resolved.get(value)
        if tag is None:
            tag = self.resolved[value] = super().resolve(kind, value, implicit)
        return tag


def _node(value: Any) -> yaml.Node:
    """The node SafeRepresenter makes of a JSON value (block style, no anchors), without its dispatch and
    alias bookkeeping."""
    if isinstance(value, str):
        return yaml.ScalarNode(_STR, value)
    if isinstance(value, dict):
        return yaml.MappingNode(_MAP, [(_node(k), _node(v)) for k, v in value.items()], flow_style=False)
    if isinstance(value, list):
        return yaml.SequenceNode(_SEQ, [_node(v) for v in value], flow_style=False)
    scalar = _SCALARS.get(type(value))
    if scalar is None:
        node: yaml.Node = _REPRESENTER.represent_data(value)
        return node
    tag, text = scalar
    return yaml.ScalarNode(tag, text(value))


def _yaml(obj: Any, resolved: dict[str, str]) -> str:
    """What `yaml.safe_dump(obj, sort_keys=False, default_flow_style=False)` writes: byte for byte where the
    text needs no escapes, as Kubernetes objects' text does; elsewhere the same values written libyaml's
    way (`'': x` for `? ''`, long escaped strings folded elsewhere). Seeded tests check both. `resolved` is
    shared by the objects of one answer."""
    out = io.StringIO()
    dumper = _Dumper(out, default_flow_style=False, sort_keys=False)
    dumper.resolved = resolved
    dumper.open()
    dumper.serialize(_node(obj))
    dumper.close()
    return out.getvalue()


def _diff(entry: PreviewEntry, resolved: dict[str, str]) -> str:
    if not entry["patch"]:
        return ""  # unchanged: nothing to write, nothing to compare
    label = f"{entry['kind']}/{entry['name']}"
    return "".join(
        difflib.unified_diff(
            _yaml(entry["_before"], resolved).splitlines(keepends=True),
            _yaml(entry["object"], resolved).splitlines(keepends=True),
            fromfile=f"{label} (before)",
            tofile=f"{label} (after)",
        )
    )


def render(entries: list[PreviewEntry], output: str, as_list: bool) -> tuple[bytes, str]:
    """The answer's bytes and content type for the requested output."""
    resolved: dict[str, str] = {}
    if output == "yaml":
        return "---\n".join(_yaml(e["object"], resolved) for e in entries).encode(), "application/yaml"
    if output == "diff":
        return "".join(_diff(e, resolved) for e in entries).encode(), "text/x-diff; charset=utf-8"
    if output == "patch":
        patches = [e["patch"] for e in entries]
        return orjson.dumps(patches if as_list else patches[0]), "application/json-patch+json"
    public = [{k: v for k, v in e.items() if not k.startswith("_")} for e in entries]
    return orjson.dumps(public if as_list else public[0], option=orjson.OPT_INDENT_2), "application/json"


def _label(entry: PreviewEntry) -> str:
    return f"{entry['kind']}/{entry['name']}" if entry["name"] else entry["kind"]


class Notes(NamedTuple):
    """What a preview says beside its body, whatever the output: the command line writes it to stderr,
    POST /preview into headers. A warning names its object only when the answer holds several (one object's
    read as the API server sends them); a refusal and a decision always do. Each line once, in the objects'
    order."""

    warnings: tuple[str, ...]
    refusals: tuple[str, ...]
    decisions: tuple[str, ...]  # `Pod/x: ptrace=add:primary;image-puller=...`, one per object
    changed: bool  # some object's patch has operations


def notes_of(entries: Sequence[PreviewEntry], as_list: bool) -> Notes:
    warnings = [f"{_label(e)}: {w}" if as_list else w for e in entries for w in e["_warnings"]]
    refusals = [f"{_label(e)} would be refused: {e['_refusal']}" for e in entries if e["_refusal"] is not None]
    decisions = [f"{_label(e)}: {';'.join(f'{k}={v}' for k, v in e['decisions'].items())}" for e in entries]
    changed = any(e["patch"] for e in entries)
    return Notes(
        tuple(dict.fromkeys(warnings)), tuple(dict.fromkeys(refusals)), tuple(dict.fromkeys(decisions)), changed
    )


class Previewed(NamedTuple):
    """A preview's answer: its body, the body's media type, and the notes said beside it (plain data, so a
    worker sends it whole through its pipe)."""

    content: bytes
    media_type: str
    notes: Notes


def preview(
    body: bytes,
    content_type: str,
    query: PreviewQuery,
    *,
    settings: Settings,
    namespaces: NamespaceFacts = no_cluster,
) -> Previewed:
    docs = load_documents(body, content_type)
    objects = list(_objects(docs))
    entries = [preview_one(where, obj, settings, query=query, namespaces=namespaces) for where, obj in objects]
    if all(e["decisions"][PTRACE] == PASSED_THROUGH for e in entries):
        _nothing_applies(entries)
    as_list = len(docs) > 1 or len(objects) != 1 or any(_is_list(d) for d in docs)
    content, media_type = render(entries, query.output, as_list)
    return Previewed(content, media_type, notes_of(entries, as_list))
