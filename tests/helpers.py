"""Plain helpers of the tests: loading pods and golden files, building AdmissionReviews, applying and validating
what the webhook emits. What starts servers, daemons or a cluster is in harness/."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonpatch
import kubernetes_validate
import orjson
import yaml

if TYPE_CHECKING:
    from webhook.mutation.plan import Plan

HERE = Path(__file__).parent
GOLDEN = HERE / "golden"
PODS = GOLDEN / "pods"
# The oldest and newest Kubernetes versions we claim (native sidecars are GA from 1.29).
K8S_VERSIONS = ("1.29.0", "1.37.0")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def pod(name: str) -> dict[str, Any]:
    data = load_yaml(PODS / name)
    assert isinstance(data, dict)
    return data


def review(obj: Any, uid: str = "a1b2c3", api_version: str = "admission.k8s.io/v1", **request: Any) -> dict[str, Any]:
    body = {
        "uid": uid,
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": obj.get("metadata", {}).get("namespace", "default") if isinstance(obj, dict) else "default",
        "operation": "CREATE",
        "object": obj,
        "dryRun": False,
    }
    body.update(request)
    return {"apiVersion": api_version, "kind": "AdmissionReview", "request": body}


def decoded_patch(answer: dict[str, Any]) -> list[dict[str, Any]]:
    if "patch" not in answer:
        return []
    assert answer["patchType"] == "JSONPatch"
    ops = orjson.loads(base64.b64decode(answer["patch"]))
    assert isinstance(ops, list)
    return ops


def apply(obj: dict[str, Any], ops: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Apply as the API server would: strictly, to the exact object sent; the original is left untouched."""
    result = jsonpatch.JsonPatch(ops).apply(obj, in_place=False)
    assert isinstance(result, dict)
    return result


def reasons(decided: Plan) -> list[tuple[str, str]]:
    """Each operation's path and reason, as /preview lists them."""
    return [(c.op["path"], c.reason) for c in decided.changes]


def validate(obj: dict[str, Any]) -> None:
    """The object must be one the API server accepts, for every Kubernetes version we claim."""
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)
