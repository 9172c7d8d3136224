"""Flyte's own flytepropeller runs raw-container (copilot) workflows on the real node (harness/node.py), every
task pod admitted through the chart-installed webhook (its webhooks failing closed).

Flytepropeller is Flyte 1.16.8's, built with the pod plugin alone (tests/flyte/propeller/, tool
flytepropeller-1.16), run as a process in the control plane's network namespace without flyteadmin or
datacatalog: events go to a file (one line per workflow, node and task event), the catalog is noop, the
admin launcher is off and the admin endpoint is a dead loopback port that nothing calls. It creates the
FlyteWorkflow CRD itself. Its store is flytestdlib's local stow store in a directory of the node, which a
default PodTemplate mounts at the same path in the copilot's containers (propeller hands the copilot its
own storage flags) and which binds the pods to the node (no scheduler runs here).

A workflow is a core.WorkflowClosure written here as the idl defines it (raw-container tasks: a container
with a data_config for the copilot), compiled by Flyte's compiler in Flyte's kubectl-flyte
(`kubectl-flyte create`, tool kubectl-flyte-1.16), which creates the FlyteWorkflow. The copilot is
Flyte's flytecopilot v1.16.8 (tests/flyte/copilot/) on the stand-in base, the task image the stand-in
base with Python (tests/node/copilot/).

What a user would notice is checked: the workflow's phase and error, the outputs in the store by value,
the pods as the API server stored them and what the webhook decided for each (its decision counters).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from harness.controlplane import ControlPlane
from harness.image_builds import ImageBuilder
from harness.kube_api import (
    ChartPods,
    Kube,
    KubeError,
    Obj,
    describe_pod,
    release,
    started,
    wait_for,
)
from harness.node import Node
from harness.node_setup import import_images, running_node
from harness.server_process import free_port, stop_process
from tests.test_kube_copilot import _decisions, _values, floats  # the same release values per setting

HERE = Path(__file__).parent
CONTEXT = HERE / "node" / "copilot"
NAMESPACE = "cwpr"  # the release's
PROJECT, DOMAIN = "flytesnacks", "development"
WORKFLOWS = f"{PROJECT}-{DOMAIN}"  # the namespace propeller runs the workflows' pods in
COPILOT_IMAGE = "localhost/flyteorg/flytecopilot:v1.16.8"
TASK_IMAGE = "localhost/flyteorg/rawcontainers-shell:circle"
COPILOT = "flyte-copilot-"
BUCKET = "flyte"  # the store's container
TEMPLATE = "flyte-template"  # the default PodTemplate
CRD = "/apis/flyte.lyft.com/v1alpha1"
FLYTE_OWNER = "flyte.lyft.com/v1alpha1"
RADIUS, HEIGHT = 2.5, 4.0
SETTINGS: dict[str, Obj] = {
    "drop": {"mode": "drop"},
    "add": {"mode": "add", "target": "primary"},
    "sidecar": {"mode": "add", "target": "sidecar"},
}
# What the webhook decides for a 1.16 copilot pod in each setting (docs/behaviour.md): it asks for no
# capability, and no setting grants one to a pod whose uploader is a native sidecar.
DECIDED = {"drop": "skipped: already-compliant", "add": "skipped: native-sidecar", "sidecar": "skipped: native-sidecar"}
# flytepropeller's WorkflowPhase (pkg/apis/flyteworkflow/v1alpha1/iface.go), by number.
PHASES = ("Ready", "Running", "Succeeding", "Success", "Failing", "Failed", "Aborted", "HandlingFailureNode")
DONE = {"Success", "Failed", "Aborted"}


# --- the workflows, as core.WorkflowClosure (flyteidl's JSON) -------------------------------------------


def _id(kind: str, name: str) -> Obj:
    return {"resourceType": kind, "project": PROJECT, "domain": DOMAIN, "name": name, "version": "v1"}


def _floats(*names: str) -> Obj:
    return {"variables": {n: {"type": {"simple": "FLOAT"}, "description": n} for n in names}}


def raw_container_task(
    name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], script: str, retries: int = 0
) -> Obj:
    """A raw-container task: the container reads each input from /var/inputs/<name> and writes each output
    to /var/outputs/<name>; Flyte's copilot downloads and uploads them (data_config)."""
    small = [{"name": "CPU", "value": "50m"}, {"name": "MEMORY", "value": "128Mi"}]
    return {
        "id": _id("TASK", name),
        "type": "raw-container",
        "metadata": {"runtime": {"type": "OTHER"}, "retries": {"retries": retries}},
        "interface": {"inputs": _floats(*inputs), "outputs": _floats(*outputs)},
        "container": {
            "image": TASK_IMAGE,
            "command": ["python3", "-c", script],
            "resources": {"requests": small, "limits": small},
            "dataConfig": {
                "enabled": True,
                "inputPath": "/var/inputs",
                "outputPath": "/var/outputs",
                "format": "JSON",
                "ioStrategy": {"downloadMode": "DOWNLOAD_EAGER", "uploadMode": "UPLOAD_ON_EXIT"},
            },
        },
    }


def _python(body: str) -> str:
    return (
        "import math, os, sys, time\n"
        "def read(name): return float(open(f'/var/inputs/{name}').read())\n"
        "def write(name, value): open(f'/var/outputs/{name}', 'w').write(repr(value))\n" + body
    )


AREA = raw_container_task(
    "circle-area", ("radius",), ("area",), _python("time.sleep(2)\nwrite('area', math.pi * read('radius') ** 2)")
)
VOLUME = raw_container_task(
    "cylinder-volume", ("area", "height"), ("volume",), _python("write('volume', read('area') * read('height'))")
)
# A task reports its own error in the error file the copilot reads (flytecopilot's `_ERROR`, in the outputs
# directory); the copilot uploads it as errors.pb instead of the outputs.
FAILING_MESSAGE = "the radius is negative"
REPORT = f"open('/var/outputs/_ERROR', 'w').write({FAILING_MESSAGE!r})\n"
FAILING = raw_container_task("refuse-radius", ("radius",), ("area",), _python(REPORT))
# Reports the same error and exits 1.
EXITING = raw_container_task("exit-radius", ("radius",), ("area",), _python(f"{REPORT}sys.exit(1)"))
# Reports an error on its first attempt, succeeds on its one retry.
FLAKY = raw_container_task(
    "flaky-area",
    ("radius",),
    ("area",),
    _python(
        f"if os.environ['FLYTE_ATTEMPT_NUMBER'] == '0':\n    {REPORT}    sys.exit(0)\n"
        "write('area', math.pi * read('radius') ** 2)"
    ),
    retries=1,
)
# Runs until it is stopped. As a container's PID 1 it handles SIGTERM itself (the kernel ignores an unhandled one
# for PID 1, and Flyte's pods give a task 3600 s to stop).
SLOW = raw_container_task(
    "slow-area",
    ("radius",),
    ("area",),
    _python(
        "import signal\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\ntime.sleep(600)\nwrite('area', 0.0)"
    ),
)


def _promise(node: str, var: str) -> Obj:
    return {"promise": {"nodeId": node, "var": var}}


def _node(node_id: str, task: Obj, inputs: dict[str, Obj]) -> Obj:
    return {
        "id": node_id,
        "metadata": {"name": node_id, "retries": task["metadata"]["retries"]},
        "inputs": [{"var": var, "binding": binding} for var, binding in inputs.items()],
        "taskNode": {"referenceId": task["id"]},
    }


def closure(
    name: str, nodes: list[tuple[str, Obj, dict[str, Obj]]], inputs: tuple[str, ...], outputs: dict[str, Obj]
) -> Obj:
    tasks = {t["id"]["name"]: t for _, t, _ in nodes}
    return {
        "workflow": {
            "id": _id("WORKFLOW", name),
            "interface": {"inputs": _floats(*inputs), "outputs": _floats(*outputs)},
            "nodes": [_node(*n) for n in nodes],
            "outputs": [{"var": var, "binding": binding} for var, binding in outputs.items()],
        },
        "tasks": list(tasks.values()),
    }


START = "start-node"
CHAIN = closure(
    "cylinder",
    [
        ("area", AREA, {"radius": _promise(START, "radius")}),
        ("volume", VOLUME, {"area": _promise("area", "area"), "height": _promise(START, "height")}),
    ],
    ("radius", "height"),
    {"volume": _promise("volume", "volume")},
)
EXITS = closure(
    "exits", [("area", EXITING, {"radius": _promise(START, "radius")})], ("radius",), {"area": _promise("area", "area")}
)
FAILS = closure(
    "refuse",
    [("area", FAILING, {"radius": _promise(START, "radius")})],
    ("radius",),
    {"area": _promise("area", "area")},
)
RETRIES = closure(
    "flaky", [("area", FLAKY, {"radius": _promise(START, "radius")})], ("radius",), {"area": _promise("area", "area")}
)
ABORTS = closure(
    "slow", [("area", SLOW, {"radius": _promise(START, "radius")})], ("radius",), {"area": _promise("area", "area")}
)


def literal_inputs(values: dict[str, float]) -> Obj:
    return {"literals": {k: {"scalar": {"primitive": {"floatValue": v}}} for k, v in values.items()}}


# --- flytepropeller -------------------------------------------------------------------------------------


@dataclass
class Propeller:
    plane: ControlPlane
    kubectl_flyte: Path
    kubeconfig: Path
    store: Path
    events: Path
    work: Path
    process: subprocess.Popen[bytes]
    log: Path

    def create(self, name: str, workflow: Obj, inputs: dict[str, float]) -> None:
        """`kubectl-flyte create`: Flyte's compiler turns the closure into the FlyteWorkflow `name`."""
        closure_file, inputs_file = self.work / f"{name}.json", self.work / f"{name}-inputs.json"
        closure_file.write_text(json.dumps(workflow))
        inputs_file.write_text(json.dumps(literal_inputs(inputs)))
        command = [
            str(self.kubectl_flyte), "create", f"--kubeconfig={self.kubeconfig}", f"--namespace={WORKFLOWS}",
            "--format=json", f"--proto-path={closure_file}", f"--input-path={inputs_file}", f"--execution-id={name}",
        ]  # fmt: skip
        done = subprocess.run(
            self.plane.netns.command(command), capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, f"kubectl-flyte create {name}: {done.stdout}\n{done.stderr}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def event_lines(self, name: str) -> list[str]:
        text = self.events.read_text() if self.events.exists() else ""
        return [line for line in text.splitlines() if f'name:"{name}"' in line]


def propeller_config(kubeconfig: Path, store: Path, events: Path) -> Obj:
    return {
        "propeller": {
            "kube-config": str(kubeconfig),
            # One: the file event sink flushes its buffer outside its lock, and two workers publishing at once
            # corrupt it (every later event fails with `short write`, and so does each workflow's round).
            "workers": 1,
            "workflow-reeval-duration": "2s",
            "downstream-eval-duration": "2s",
            "limit-namespace": WORKFLOWS,
            "metadata-prefix": "metadata/propeller",
            "rawoutput-prefix": f"s3://{BUCKET}/raw",
            "enable-admin-launcher": False,
            "create-flyteworkflow-crd": True,
            "leader-election": {"enabled": False},
            "prof-port": free_port(),
            "queue": {
                "type": "batch",
                "batching-interval": "1s",
                "queue": {"type": "maxof", "rate": 100, "capacity": 100, "base-delay": "1s", "max-delay": "5s"},
                "sub-queue": {"type": "bucket", "rate": 100, "capacity": 100},
            },
        },
        # Built, never called: no launch plan or signal node runs here.
        "admin": {"endpoint": f"dns:///127.0.0.1:{free_port()}", "insecure": True},
        "event": {"type": "file", "file-path": str(events), "rate": 500, "capacity": 1000},
        "catalog-cache": {"type": "noop"},
        "storage": {"type": "stow", "container": BUCKET, "stow": {"kind": "local", "config": {"path": str(store)}}},
        "tasks": {"task-plugins": {"enabled-plugins": ["container", "sidecar"]}},
        "plugins": {
            "k8s": {
                "co-pilot": {"image": COPILOT_IMAGE, "name": COPILOT, "cpu": "50m", "memory": "128Mi"},
                "default-pod-template-name": TEMPLATE,
            }
        },
        "logger": {"level": 4, "show-source": True},
    }


def pod_template(store: Path, node_name: str) -> Obj:
    """The default PodTemplate: the pods on the node, and the store mounted where propeller keeps it, in
    every init container (the copilot's downloader and uploader)."""
    mount = {"name": "flyte-store", "mountPath": str(store)}
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": TEMPLATE},
        "template": {
            "spec": {
                "nodeName": node_name,
                "containers": [{"name": "default", "image": TASK_IMAGE}],
                "initContainers": [{"name": "default-init", "image": COPILOT_IMAGE, "volumeMounts": [mount]}],
                "volumes": [{"name": "flyte-store", "hostPath": {"path": str(store), "type": "Directory"}}],
            }
        },
    }


# --- fixtures -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tools:
    propeller: Path
    kubectl_flyte: Path
    copilot: Path


@pytest.fixture(scope="module")
def tools() -> Tools:
    from harness.gotools import binary

    return Tools(binary("flytepropeller-1.16"), binary("kubectl-flyte-1.16"), binary("flytecopilot-1.16"))


@pytest.fixture(scope="module")
def the_node(kube: ControlPlane, tools: Tools) -> Iterator[Node]:
    yield from running_node(kube, "dockerd", "docker", "mmdebstrap")


@pytest.fixture(scope="module")
def images(the_node: Node, tools: Tools, image_builder: ImageBuilder, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Flyte's copilot and the task image, built in the session's dockerd on the stand-in base and imported into
    the node."""
    work = tmp_path_factory.mktemp("propeller-images")
    context = work / "context"
    shutil.copytree(CONTEXT, context)
    shutil.copy(tools.copilot, context / "flytecopilot-1.16")
    for target, tag, args in (
        ("task", TASK_IMAGE, ()),
        ("copilot", COPILOT_IMAGE, ("--build-arg", "BINARY=flytecopilot-1.16")),
    ):
        subprocess.run(
            ["docker", "build", "--quiet", "--network", "none", "--target", target, "--tag", tag,
             "--build-arg", f"BASE={image_builder.base}", *args, str(context)],
            check=True, capture_output=True, env=image_builder.env, timeout=300,
        )  # fmt: skip
    import_images(the_node, work, image_builder, [TASK_IMAGE, COPILOT_IMAGE])


@pytest.fixture(scope="module")
def webhook(kube_admin: Kube, the_node: Node, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChartPods]:
    """The release, in the first setting (`drop`); `chains` upgrades it to each of the others in turn."""
    work = tmp_path_factory.mktemp("propeller-webhook")
    yield from started(release(kube_admin, NAMESPACE, work, _values(next(iter(SETTINGS)))), work / "pods", "Fail")


@pytest.fixture(scope="module")
def propeller(
    kube: ControlPlane, kube_admin: Kube, the_node: Node, tools: Tools, images: None, webhook: ChartPods
) -> Iterator[Propeller]:
    work = the_node.work / "propeller"
    store = the_node.work / "flyte-store"
    (store / BUCKET).mkdir(parents=True)
    work.mkdir()
    kube_admin.create_namespace(WORKFLOWS)
    kube_admin.create(f"/api/v1/namespaces/{WORKFLOWS}/podtemplates", pod_template(store, the_node.name))
    kubeconfig = kube.kubeconfig(work / "kubeconfig")
    events = work / "events.txt"
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(propeller_config(kubeconfig, store, events)))
    log = work / "propeller.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            kube.netns.command([str(tools.propeller), f"--config={config}"]), stdout=out, stderr=subprocess.STDOUT
        )
    running = Propeller(kube, tools.kubectl_flyte, kubeconfig, store, events, work, process, log)
    try:
        crd = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/flyteworkflows.flyte.lyft.com"
        if not wait_for(lambda: kube_admin.exists(crd) and process.poll() is None, timeout=60, interval=0.5):
            pytest.fail(f"flytepropeller did not create the FlyteWorkflow CRD within 60 s:\n{running.output()[-6000:]}")
        yield running
    finally:
        with contextlib.suppress(KubeError):  # what an abort or a failure left: the node stops only without pods
            for pod in kube_admin.get(f"/api/v1/namespaces/{WORKFLOWS}/pods")["items"]:
                path = f"/api/v1/namespaces/{WORKFLOWS}/pods/{pod['metadata']['name']}"
                kube_admin.request("DELETE", path, {"gracePeriodSeconds": 1})
        stop_process(process)


# --- following a workflow ------------------------------------------------------------------------------


class PodRecorder:
    """Every POLL s, from a thread: the pods of the workflows' namespace, each as first seen (the pod as
    admitted: its spec does not change after) and as last seen (its status). Propeller deletes the pod of a
    failed attempt before it retries, so the pods are recorded while they exist."""

    POLL = 0.3

    def __init__(self, plane: ControlPlane) -> None:
        self.first: dict[str, Obj] = {}
        self.last: dict[str, Obj] = {}
        self._kube = Kube(plane)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.POLL):
            with contextlib.suppress(KubeError, httpx.HTTPError):
                for pod in self._kube.get(f"/api/v1/namespaces/{WORKFLOWS}/pods")["items"]:
                    self.first.setdefault(pod["metadata"]["name"], pod)
                    self.last[pod["metadata"]["name"]] = pod

    def of(self, execution: str) -> dict[str, Obj]:
        """The pods of a workflow (propeller's `execution-id` label), as first seen, by name."""
        return {n: p for n, p in sorted(self.first.items()) if p["metadata"]["labels"].get("execution-id") == execution}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._kube.close()


@dataclass
class Run:
    name: str
    workflow: Obj  # the FlyteWorkflow when it was done
    phase: str
    seconds: float
    pods: dict[str, Obj] = field(default_factory=dict)  # as admitted, by name
    final: dict[str, Obj] = field(default_factory=dict)  # the same, as last seen
    decided: dict[str, int] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)


def _workflow(kube: Kube, name: str) -> Obj | None:
    try:
        return kube.get(f"{CRD}/namespaces/{WORKFLOWS}/flyteworkflows/{name}")
    except KubeError as err:
        if err.status == 404:
            return None
        raise


def _phase(workflow: Obj) -> str:
    return PHASES[int(workflow.get("status", {}).get("phase", 0))]


def _pods_of(kube: Kube, name: str) -> dict[str, Obj]:
    pods = kube.get(f"/api/v1/namespaces/{WORKFLOWS}/pods", labelSelector=f"execution-id={name}")["items"]
    return {p["metadata"]["name"]: p for p in pods}


def _explain(kube: Kube, propeller: Propeller, name: str) -> str:
    workflow = _workflow(kube, name)
    pods = "\n".join(describe_pod(kube, WORKFLOWS, p) for p in _pods_of(kube, name))
    status = json.dumps((workflow or {}).get("status"), indent=1)[-4000:]
    return f"workflow {name}: {status}\npods:\n{pods}\npropeller:\n{propeller.output()[-6000:]}"


FOLLOW = 240.0  # s a workflow is followed until it is done
SETTLE = 30.0  # s its pods are given to finish after that (propeller declares a task done once its containers are)


def follow(kube: Kube, propeller: Propeller, recorder: PodRecorder, name: str, started_at: float) -> Run:
    """The workflow until its phase is Success, Failed or Aborted, then its pods until none is running; past
    FOLLOW s, a failure with the workflow's status, its pods and propeller's log."""
    deadline = time.monotonic() + FOLLOW
    while True:
        workflow = _workflow(kube, name)
        if workflow is not None and _phase(workflow) in DONE:
            break
        if time.monotonic() >= deadline:
            pytest.fail(f"workflow {name} not done within {FOLLOW:.0f} s:\n{_explain(kube, propeller, name)}")
        time.sleep(0.5)
    seconds = time.monotonic() - started_at
    wait_for(lambda: all(p["status"].get("phase") in ("Succeeded", "Failed") for p in _pods_of(kube, name).values()),
             timeout=SETTLE, interval=0.5)  # fmt: skip
    time.sleep(PodRecorder.POLL * 2)
    pods = recorder.of(name)
    return Run(name, workflow, _phase(workflow), seconds, pods, {n: recorder.last[n] for n in pods})


@pytest.fixture(scope="module")
def recorder(kube: ControlPlane, propeller: Propeller) -> Iterator[PodRecorder]:
    recording = PodRecorder(kube)
    yield recording
    recording.close()


class Settings:
    """The release's setting now: upgraded (its replica restarted, one answering at a time) when a fixture
    needs another."""

    def __init__(self, webhook: ChartPods) -> None:
        self.webhook = webhook
        self.current = next(iter(SETTINGS))

    def use(self, setting: str) -> None:
        if setting == self.current:
            return
        self.webhook.release.upgrade(_values(setting))
        self.webhook.run(f"replica-{setting}")
        self.webhook.release.wait_policies("Fail")
        self.current = setting


@pytest.fixture(scope="module")
def settings(webhook: ChartPods) -> Settings:
    return Settings(webhook)


@pytest.fixture(scope="module")
def chains(
    kube_admin: Kube, propeller: Propeller, recorder: PodRecorder, webhook: ChartPods, settings: Settings
) -> dict[str, Run]:
    """The two-task workflow, once in each setting, one at a time: the webhook's decision counters move for
    its pods alone."""
    runs = {}
    for setting in SETTINGS:
        settings.use(setting)
        name = f"cylinder-{setting}"
        before = _decisions(webhook)
        started_at = time.monotonic()
        propeller.create(name, CHAIN, {"radius": RADIUS, "height": HEIGHT})
        run = follow(kube_admin, propeller, recorder, name, started_at)
        run.decided = dict(_decisions(webhook) - before)
        run.events = propeller.event_lines(name)
        runs[setting] = run
    return runs


@dataclass
class Abort:
    running: Obj  # the task's pod once it ran
    workflow: Obj  # the FlyteWorkflow then
    deleted_after: float  # s from the FlyteWorkflow's deletion until it was gone
    left: list[str]  # the workflow's pods still there then
    gone_after: float | None  # s from the deletion until the last pod was gone
    events: list[str]


@dataclass
class Drops:
    """The workflows run under `drop` alongside each other: two that fail, one retried, one aborted."""

    fails: Run
    exits: Run
    retried: Run
    aborted: Abort
    pods: int  # how many pods they had, all told
    decided: dict[str, int]  # the webhook's decisions for all their pods


def _running_pod(kube: Kube, name: str) -> Obj | None:
    for pod in _pods_of(kube, name).values():
        statuses = pod.get("status", {}).get("containerStatuses") or []
        if any("running" in s["state"] for s in statuses):
            return pod
    return None


ABORT_WAIT = 120.0


def _abort(kube: Kube, propeller: Propeller, name: str) -> Abort:
    """Deleting a running FlyteWorkflow is how flyteadmin aborts it: propeller, whose finalizer the workflow
    holds, aborts its nodes (the task's pod is deleted) and then lifts the finalizer."""
    deadline = time.monotonic() + FOLLOW
    while True:
        running, workflow = _running_pod(kube, name), _workflow(kube, name)
        if running is not None and workflow is not None and workflow["metadata"].get("finalizers"):
            break
        if time.monotonic() >= deadline:
            pytest.fail(f"{name}: no pod running within {FOLLOW:.0f} s:\n{_explain(kube, propeller, name)}")
        time.sleep(0.5)
    kube.delete(f"{CRD}/namespaces/{WORKFLOWS}/flyteworkflows/{name}")
    deleted = time.monotonic()
    if not wait_for(lambda: _workflow(kube, name) is None, timeout=ABORT_WAIT, interval=0.5):
        pytest.fail(f"{name}: still there {ABORT_WAIT:.0f} s after its deletion:\n{_explain(kube, propeller, name)}")
    deleted_after = time.monotonic() - deleted
    left = list(_pods_of(kube, name))
    gone = wait_for(lambda: not _pods_of(kube, name), timeout=ABORT_WAIT, interval=0.5)
    gone_after = time.monotonic() - deleted if gone else None
    return Abort(running, workflow, deleted_after, left, gone_after, propeller.event_lines(name))


@pytest.fixture(scope="module")
def drops(
    kube_admin: Kube, propeller: Propeller, recorder: PodRecorder, webhook: ChartPods, settings: Settings
) -> Drops:
    settings.use("drop")
    before = _decisions(webhook)
    started_at = time.monotonic()
    for name, workflow in (("refuse", FAILS), ("exits", EXITS), ("flaky", RETRIES), ("slow", ABORTS)):
        propeller.create(name, workflow, {"radius": RADIUS})
    aborted = _abort(kube_admin, propeller, "slow")
    runs = [follow(kube_admin, propeller, recorder, name, started_at) for name in ("refuse", "exits", "flaky")]
    for run in runs:
        run.events = propeller.event_lines(run.name)
    pods = sum(len(recorder.of(name)) for name in ("refuse", "exits", "flaky", "slow"))
    fails, exits, retried = runs
    return Drops(fails, exits, retried, aborted, pods, dict(_decisions(webhook) - before))


def _data(propeller: Propeller, name: str, node: str) -> Path:
    """Where propeller keeps a node's data (propeller.metadata-prefix, then <namespace>-<execution>/<node>/data),
    in the local store."""
    return propeller.store / BUCKET / "metadata" / "propeller" / f"{WORKFLOWS}-{name}" / node / "data"


def _store_files(propeller: Propeller, name: str) -> str:
    top = _data(propeller, name, "").parent
    return "\n".join(str(p.relative_to(propeller.store)) for p in sorted(top.rglob("*")) if p.is_file())


def _outputs(propeller: Propeller, run: Run, node: str, attempt: int = 0) -> dict[str, float]:
    path = _data(propeller, run.name, node) / str(attempt) / "outputs.pb"
    assert path.exists(), f"no {path.name} for {node}; the store holds:\n{_store_files(propeller, run.name)}"
    return floats(path.read_bytes())


def _containers(pod: Obj) -> list[Obj]:
    spec = pod["spec"]
    return [*(spec.get("initContainers") or []), *spec["containers"]]


def _capabilities(pod: Obj, primary: str | None = None) -> dict[str, Obj]:
    """Each container's securityContext.capabilities, as stored; the task's container (named after its pod)
    under `primary` when given."""
    return {
        primary if primary and c["name"] == pod["metadata"]["name"] else c["name"]: (
            c.get("securityContext") or {}
        ).get("capabilities")
        or {}
        for c in _containers(pod)
    }


def _ptrace_holders(pod: Obj) -> list[str]:
    return [
        name
        for name, capabilities in _capabilities(pod).items()
        if any(str(c).upper().removeprefix("CAP_") in ("SYS_PTRACE", "ALL") for c in capabilities.get("add") or [])
    ]


def _phases(events: list[str], kind: str) -> list[str]:
    """The phases of a workflow's events of a kind (WF, NODE, TASK), in the order propeller wrote them."""
    return [line.rsplit("Phase: ", 1)[1].split(",")[0] for line in events if line.startswith(f"[--{kind} EVENT--]")]


# --- the tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_two_task_copilot_workflow_succeeds_passing_outputs_to_inputs(
    setting: str, chains: dict[str, Run], propeller: Propeller, kube_admin: Kube
) -> None:
    """radius -> circle-area -> area, area and height -> cylinder-volume -> volume: each value the copilot
    uploaded is read back from the store, and the workflow's events say it succeeded."""
    run = chains[setting]
    assert run.phase == "Success", _explain(kube_admin, propeller, run.name)
    assert _outputs(propeller, run, "area") == {"area": pytest.approx(math.pi * RADIUS**2)}
    assert _outputs(propeller, run, "volume") == {"volume": pytest.approx(math.pi * RADIUS**2 * HEIGHT)}
    assert _phases(run.events, "WF")[-1] == "SUCCEEDED", run.events
    assert [p["metadata"]["labels"]["node-id"] for p in run.pods.values()] == ["area", "volume"], list(run.pods)
    assert [p["status"]["phase"] for p in run.final.values()] == ["Succeeded", "Succeeded"]


@pytest.mark.parametrize("setting", SETTINGS)
def test_propellers_pods_are_reviewed_and_left_without_sys_ptrace(setting: str, chains: dict[str, Run]) -> None:
    """Flyte 1.16's pods: the uploader a native sidecar, no container asking for SYS_PTRACE, no shared process
    namespace. The webhook reviewed each (failing closed: a review it could not answer refuses the pod) and, in
    every setting, leaves it as Flyte made it: `add` never re-grants what Flyte removed."""
    run = chains[setting]
    assert run.decided == {DECIDED[setting]: 2}, run.decided
    for name, pod in run.pods.items():
        uploader = next(c for c in pod["spec"]["initContainers"] if c["name"] == f"{COPILOT}uploader")
        assert uploader.get("restartPolicy") == "Always", name
        assert _ptrace_holders(pod) == [], (name, _capabilities(pod))
        assert pod["spec"].get("shareProcessNamespace") is None, name
        assert "copilot-webhook.io/mutated" not in (pod["metadata"].get("annotations") or {}), name
        (owner,) = pod["metadata"]["ownerReferences"]
        assert (owner["apiVersion"], owner["kind"], owner["name"]) == (FLYTE_OWNER, "flyteworkflow", run.name)


def test_a_task_that_reports_an_error_fails_the_workflow_but_propeller_never_reads_the_copilots_error(
    drops: Drops, propeller: Propeller, kube_admin: Kube
) -> None:
    """The task writes its error to the copilot's error file (`_ERROR`) and exits 0: the copilot uploads
    errors.pb (its --err-output-name) instead of outputs, but Flyte 1.16.8's propeller reads error.pb (flyteplugins'
    ioutils.ErrorsSuffix) and does not pass that flag: it fails the workflow for want of outputs, and the task's
    message reaches no status."""
    run = drops.fails
    assert run.phase == "Failed", _explain(kube_admin, propeller, run.name)
    data = _data(propeller, run.name, "area") / "0"
    assert (data / "errors.pb").exists(), _store_files(propeller, run.name)
    assert f"User Error: {FAILING_MESSAGE}".encode() in (data / "errors.pb").read_bytes()
    assert not (data / "error.pb").exists()
    error = run.workflow["status"]["nodeStatus"]["area"]["error"]
    assert error["code"] == "RetriesExhausted|OutputsNotFound", error
    assert "Outputs not generated by task execution" in error["message"], error
    assert FAILING_MESSAGE not in json.dumps(run.workflow["status"])
    assert _phases(run.events, "WF")[-1] == "FAILED", run.events
    assert len(run.pods) == 1, list(run.pods)


def test_a_task_that_exits_non_zero_fails_the_workflow_with_its_exit_code(
    drops: Drops, propeller: Propeller, kube_admin: Kube
) -> None:
    """The task reports the same error and exits 1: the pod fails, and propeller reads the pod, not errors.pb
    (the copilot still writes it): a system failure naming the exit code, retried as such."""
    run = drops.exits
    assert run.phase == "Failed", _explain(kube_admin, propeller, run.name)
    error = run.workflow["status"]["nodeStatus"]["area"]["error"]
    assert "terminated with exit code (1)" in error["message"], error
    assert FAILING_MESSAGE not in error["message"], error
    assert _phases(run.events, "WF")[-1] == "FAILED", run.events
    errors = _data(propeller, run.name, "area") / "0" / "errors.pb"
    assert f"User Error: {FAILING_MESSAGE}".encode() in errors.read_bytes()


def test_a_retried_task_succeeds_and_each_attempts_pod_is_reviewed_alike(
    drops: Drops, propeller: Propeller, kube_admin: Kube
) -> None:
    run = drops.retried
    assert run.phase == "Success", _explain(kube_admin, propeller, run.name)
    assert list(run.pods) == ["flaky-area-0", "flaky-area-1"], list(run.pods)
    first, second = run.pods.values()
    assert _capabilities(first, primary="primary") == _capabilities(second, primary="primary")
    assert _ptrace_holders(first) == _ptrace_holders(second) == []
    assert FAILING_MESSAGE.encode() in (_data(propeller, run.name, "area") / "0" / "errors.pb").read_bytes()
    assert _outputs(propeller, run, "area", attempt=1) == {"area": pytest.approx(math.pi * RADIUS**2)}


def test_the_webhook_decided_every_pod_of_the_drop_workflows(drops: Drops) -> None:
    """Every pod of the failing, retried and aborted workflows was reviewed, one decision each."""
    assert drops.decided == {DECIDED["drop"]: drops.pods}, drops.decided


def test_an_aborted_workflow_leaves_no_pod_behind(drops: Drops) -> None:
    aborted = drops.aborted
    assert _ptrace_holders(aborted.running) == []
    assert aborted.gone_after is not None, f"pods left after the abort: {aborted.left}"
    assert _phases(aborted.events, "WF")[-1] == "ABORTED", aborted.events
