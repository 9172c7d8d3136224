"""The SYS_PTRACE policy where it is enforced: the real API server's Pod Security admission, its CEL
matchConditions and ValidatingAdmissionPolicy, and the chart's selectors for the opt-outs.

The release here runs ptrace.mode=drop with the ValidatingAdmissionPolicy, the hardened-cluster install."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.kube_api import ChartPods, Kube, KubeError, release, started, wait_for
from tests.test_chart import render
from tests.test_kube_install import pod, ptrace_holders

PODS = Path(__file__).parent / "golden" / "pods"
FLYTE_115 = PODS / "flyte-1.15.yaml"
PRIMARY = "ap7k2xq9wz-n0-0"
NAMESPACE = "cwdrop"
VALUES = {"ptrace": {"mode": "drop"}, "webhook": {"ptrace": {"validatingPolicy": True}}}
BASELINE = {"pod-security.kubernetes.io/enforce": "baseline"}
POLICY = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/cwdrop-copilot-webhook-ptrace-drop"


@pytest.fixture(scope="module")
def server(kube_admin: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChartPods]:
    work = tmp_path_factory.mktemp("drop")
    yield from started(release(kube_admin, NAMESPACE, work, VALUES), work / "pods")


def _requests(server: ChartPods, path: str) -> float:
    pattern = re.compile(rf'^copilot_webhook_requests_total\{{path="{re.escape(path)}",result="[a-z]+"\}} (\S+)$', re.M)
    return sum(float(value) for value in pattern.findall(server.metrics()))


def test_without_the_webhook_baseline_rejects_a_flyte_115_pod(kube_admin: Kube, server: ChartPods) -> None:
    kube_admin.create_namespace("psa-unwebhooked", {**BASELINE, "copilot-webhook.io/inject": "disabled"})
    with pytest.raises(KubeError) as refused:
        kube_admin.create_pod("psa-unwebhooked", pod(FLYTE_115, "no-webhook"))
    assert refused.value.status == 403
    assert 'violates PodSecurity "baseline:latest": non-default capabilities' in refused.value.message
    assert f'container "{PRIMARY}" must not include "SYS_PTRACE"' in refused.value.message


def test_with_drop_baseline_admits_the_pod_and_stores_it_without_sys_ptrace(
    kube_admin: Kube, server: ChartPods
) -> None:
    kube_admin.create_namespace("psa-baseline", BASELINE)
    stored = kube_admin.create_pod("psa-baseline", pod(FLYTE_115, "dropped"))
    assert ptrace_holders(stored) == []
    assert stored["metadata"]["annotations"]["copilot-webhook.io/mutated"].startswith("ptrace=drop")
    assert stored["spec"]["shareProcessNamespace"] is True, "drop leaves shareProcessNamespace as it is"


def test_match_conditions_keep_pods_without_copilot_from_the_webhook(kube_admin: Kube, server: ChartPods) -> None:
    kube_admin.create_namespace("plain-pods")
    before = _requests(server, "/mutate/ptrace")
    kube_admin.create_pod("plain-pods", pod(PODS / "plain.yaml", "plain"))
    assert _requests(server, "/mutate/ptrace") == before, "the API server did not call for it"
    # A copilot-named container is sent (CEL sees names; commands and images are the server's to judge),
    # and a look-alike with the wrong command and image is left as it is.
    lookalike = kube_admin.create_pod("plain-pods", pod(PODS / "lookalike.yaml", "lookalike"))
    assert "copilot-webhook.io/mutated" not in lookalike["metadata"].get("annotations", {})
    sent_lookalike = _requests(server, "/mutate/ptrace")
    assert sent_lookalike > before
    kube_admin.create_pod("plain-pods", pod(FLYTE_115, "copilot"))
    # At least once: the API server calls again (reinvocationPolicy IfNeeded) when the puller changed it.
    assert _requests(server, "/mutate/ptrace") > sent_lookalike


def test_the_validating_policy_compiles_and_holds_while_the_webhook_is_down(
    kube_admin: Kube, server: ChartPods
) -> None:
    # kube-controller-manager's status controller writes typeChecking; on a loaded machine it takes its time.
    checked = wait_for(lambda: "typeChecking" in kube_admin.get(POLICY).get("status", {}), timeout=120)
    policy = kube_admin.get(POLICY)
    assert checked, f"no typeChecking in the policy's status within 120 s: {policy.get('status')}"
    assert policy["status"]["typeChecking"].get("expressionWarnings") is None, policy["status"]
    kube_admin.create_namespace("vap")
    server.stop()
    try:
        with pytest.raises(KubeError) as denied:
            kube_admin.create_pod("vap", pod(FLYTE_115, "still-adding"))
        assert denied.value.status == 403
        assert "SYS_PTRACE is dropped from copilot and Flyte pods in this cluster" in denied.value.message
        assert f"still added by: {PRIMARY}" in denied.value.message
        opted_out = kube_admin.create_pod("vap", pod(FLYTE_115, "opted-out", **{"copilot-webhook.io/inject": "false"}))
        assert ptrace_holders(opted_out) == [PRIMARY]
    finally:
        server.run("replica-again")


@pytest.mark.parametrize(
    ("namespace", "labels"),
    [("opted-out-ns", {"copilot-webhook.io/inject": "disabled"}), ("kube-public", {}), (NAMESPACE, {})],
)
def test_opted_out_excluded_and_release_namespaces_are_not_sent(
    kube_admin: Kube, server: ChartPods, namespace: str, labels: dict[str, str]
) -> None:
    kube_admin.create_namespace(namespace, labels)
    before = _requests(server, "/mutate/ptrace")
    stored = kube_admin.create_pod(namespace, pod(FLYTE_115, f"in-{namespace}"))
    assert ptrace_holders(stored) == [PRIMARY]
    assert "copilot-webhook.io/mutated" not in stored["metadata"].get("annotations", {})
    assert _requests(server, "/mutate/ptrace") == before


def test_a_pod_annotated_out_is_left_as_it_is(kube_admin: Kube, server: ChartPods) -> None:
    kube_admin.create_namespace("annotated")
    stored = kube_admin.create_pod("annotated", pod(FLYTE_115, "annotated", **{"copilot-webhook.io/inject": "false"}))
    assert ptrace_holders(stored) == [PRIMARY]
    assert "copilot-webhook.io/mutated" not in stored["metadata"]["annotations"]


@pytest.mark.parametrize("prefix", ["a", "0", "flyte-copilot-", "x-" * 25, "a" + "-" * 49])
def test_every_allowed_name_prefix_compiles_on_the_real_server(kube_admin: Kube, prefix: str) -> None:
    """The schema allows [a-z0-9][-a-z0-9]{0,49}; the API server compiles the CEL written from it at create
    (dry run: nothing stored), for the webhook's matchConditions and the policy's expressions."""
    values = {**VALUES, "copilot": {"namePrefix": prefix}}
    objects = render(values, kube_version="1.35.4")
    for kind in ("MutatingWebhookConfiguration", "ValidatingAdmissionPolicy"):
        (obj,) = (o for key, o in objects.items() if key.startswith(f"{kind}/"))
        collection = kube_admin.path_of(obj).rsplit("/", 1)[0]
        kube_admin.create(collection, obj, dry_run=True)


def test_the_real_server_refuses_cel_that_does_not_compile(kube_admin: Kube) -> None:
    """The check above can fail: a matchCondition that does not compile is refused at create."""
    objects = render(VALUES, kube_version="1.35.4")
    (mwc,) = (o for key, o in objects.items() if key.startswith("MutatingWebhookConfiguration/"))
    mwc["webhooks"][0]["matchConditions"][0]["expression"] = "object.spec.containers.exists(c, c.name.startsWith("
    with pytest.raises(KubeError) as refused:
        kube_admin.create(kube_admin.path_of(mwc).rsplit("/", 1)[0], mwc, dry_run=True)
    assert refused.value.status == 422
    assert "compilation failed" in refused.value.message
