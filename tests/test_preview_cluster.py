"""Previews in worker processes against a server with a node cache: the worker holds no copy of the
nodes, it asks the server for the label-index entries and nodes a pod's constraints name. Every kind of
node selection must answer exactly what the same preview answers in-process with the whole table."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from harness.environment import eventually
from harness.fake_apiserver import FakeAPIServer, node
from harness.server_process import running_server
from tests.helpers import PODS
from webhook.cluster.nodes import project_node
from webhook.config import build_settings
from webhook.mutation.facts import ClusterFacts, node_snapshot
from webhook.preview.render import PreviewQuery, preview

NODES = "/api/v1/nodes"
POD = yaml.safe_load((PODS / "flyte-1.15-bare.yaml").read_bytes())
FLEET = [
    node("c-1", "containerd://1.7.11", {"pool": "gpu", "zone": "a"}),
    node("c-2", "containerd://1.7.11", {"pool": "gpu", "zone": "b"}),
    node("c-3", "containerd://1.7.11", {"pool": "cpu", "zone": "a"}),
    node("d-1", "docker://24.0.7", {"pool": "legacy", "zone": "a"}),
    node("u-1", "", {"pool": "cpu", "zone": "c"}),
]


def _pod(spec: dict[str, Any]) -> bytes:
    pod = copy.deepcopy(POD)
    pod["spec"].update(spec)
    return orjson.dumps(pod)


def _terms(*terms: list[dict[str, Any]]) -> dict[str, Any]:
    required = {"nodeSelectorTerms": [{"matchExpressions": t} for t in terms]}
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}}


CASES: dict[str, tuple[bytes, str]] = {
    "anywhere (runtime groups)": (_pod({}), ""),
    "nodeSelector (label index)": (_pod({"nodeSelector": {"pool": "gpu"}}), ""),
    "nodeSelector, two pairs": (_pod({"nodeSelector": {"pool": "cpu", "zone": "a"}}), ""),
    "nodeSelector, nobody": (_pod({"nodeSelector": {"pool": "none"}}), ""),
    "nodeName": (_pod({"nodeName": "d-1"}), ""),
    "one term with In (label index)": (
        _pod(_terms([{"key": "pool", "operator": "In", "values": ["legacy", "gpu"]}])),
        "",
    ),
    "two terms (every node)": (
        _pod(_terms([{"key": "zone", "operator": "NotIn", "values": ["a"]}], [{"key": "pool", "operator": "Exists"}])),
        "",
    ),
    "node what-if, known": (_pod({}), "node=c-3"),
    "node what-if, unknown": (_pod({}), "node=nope"),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tls_dir: Path) -> Any:
    api = FakeAPIServer().start()
    api.put_many(NODES, copy.deepcopy(FLEET))
    work = tmp_path_factory.mktemp("preview-cluster")
    config = f"cluster:\n  kubeconfig: {api.kubeconfig(work / 'kc')}\n"
    with running_server(tls_dir, work / "srv", config=config) as server:
        with server.client() as client:
            assert eventually(lambda: client.get("/readyz").status_code == 200)
        yield server
    api.stop()


@pytest.mark.parametrize("case", CASES)
def test_a_worker_asking_for_nodes_answers_as_the_whole_table_does(served: Any, case: str) -> None:
    body, query = CASES[case]
    with served.client() as client:
        remote = client.post(f"/preview?{query}", content=body, headers={"Content-Type": "application/json"})
    assert remote.status_code == 200, remote.text
    snapshot = node_snapshot({n["metadata"]["name"]: project_node(n) for n in FLEET})
    params = dict(p.split("=", 1) for p in query.split("&") if p)
    local = preview(
        body,
        "application/json",
        PreviewQuery.of(params),
        settings=build_settings({}),
        namespaces=lambda _ns: ClusterFacts({}, snapshot, "synced"),
    )
    assert remote.json() == orjson.loads(local.content)
    assert remote.json()["runtime"]  # the puller's decision is in the answer, whichever it is
