"""bench/go-same, the control `make bench-pods` can run beside go-floor, gives our /mutate/ptrace's answer: the
same operations, audit annotations and verdict for the pods the bench sends, so what the API server spends on
our answer's content is measured apart from our server. Built with the installed Go, as the bench builds it."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench.load import build_go, go_toolchain
from harness.environment import unavailable
from tests.helpers import decoded_patch
from webhook.config import Settings
from webhook.mutation.plan import PTRACE
from webhook.review import decide, response

ROOT = Path(__file__).resolve().parent.parent
REVIEW = ROOT / "bench" / "data" / "flyte-1.15-review.json"


@pytest.fixture(scope="module")
def go_same() -> Path:
    if go_toolchain() is None:
        unavailable("go-same needs Go, the toolchain `make go-tools` builds with")
    binary = build_go(ROOT / "bench" / "go-same", "go-same")
    assert binary is not None
    return binary


def _theirs(binary: Path, review: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run([str(binary), "-answer"], input=json.dumps(review).encode(), capture_output=True, check=True)
    answer = json.loads(done.stdout)
    assert (answer["kind"], answer["apiVersion"]) == ("AdmissionReview", review["apiVersion"])
    return dict(answer["response"])


def _ours(review: dict[str, Any]) -> dict[str, Any]:
    settings = Settings()
    return dict(response(review["request"]["uid"], decide(review["request"], settings, kinds=[PTRACE]), settings))


def _bench_review() -> dict[str, Any]:
    review = json.loads(REVIEW.read_text())
    assert isinstance(review, dict)
    return review


def _without_annotations() -> dict[str, Any]:
    review = _bench_review()
    del review["request"]["object"]["metadata"]["annotations"]
    return review


def _not_copilot() -> dict[str, Any]:
    review = _bench_review()
    pod = review["request"]["object"]
    pod["spec"]["containers"] = [c for c in pod["spec"]["containers"] if not c["name"].startswith("flyte-copilot-")]
    return review


@pytest.mark.parametrize("make", [_bench_review, _without_annotations, _not_copilot])
def test_go_same_answers_what_our_ptrace_endpoint_answers(go_same: Path, make: Any) -> None:
    review = make()
    ours, theirs = _ours(copy.deepcopy(review)), _theirs(go_same, review)
    assert decoded_patch(theirs) == decoded_patch(ours)
    assert {k: v for k, v in theirs.items() if k != "patch"} == {k: v for k, v in ours.items() if k != "patch"}


def test_the_bench_pod_gets_a_patch_and_an_audit_annotation(go_same: Path) -> None:
    theirs = _theirs(go_same, _bench_review())
    assert [op["path"] for op in decoded_patch(theirs)] == [
        "/spec/containers/0/securityContext",
        "/metadata/annotations/copilot-webhook.io~1mutated",
    ]
    assert theirs["auditAnnotations"] == {"ptrace": "add:primary"}
