"""Flyte's own flytecopilot in raw-container task pods on the real node (harness/node.py), each pod admitted
through the chart-installed webhook in one of its SYS_PTRACE settings: `ptrace.mode: add` with the default
`target: primary`, `add` with `target: sidecar` (the least-privilege choice: the watcher alone), and `drop`.

The copilot is Flyte's flytecopilot at v1.15.3 and v1.16.8, built from the copy of Flyte's source in
tests/flyte/copilot/ (harness/gotools.py: tools flytecopilot-1.15 and flytecopilot-1.16) and put on the
stand-in base at /bin/flyte-copilot (tests/node/copilot/). Its blob store is flytestdlib's local stow store
on a directory of the node (a hostPath volume): the test writes the task's inputs.pb there and reads the
uploader's outputs.pb back.

The pods are Flyte's: for 1.16.8 the pod Flyte's own code prints (tests/flyte/pods/v1.16/io.yaml: the
uploader a native sidecar with the `signal` watcher); for 1.15.3 the hand-derived pod of that tag
(tests/golden/flyte-src-1.15-io.yaml: the uploader a regular container with the `shared-process-ns`
watcher, SYS_PTRACE on the primary, a shared process namespace). What is changed, and only that: the
images are the locally built ones; the copilot's storage flags name the local store instead of S3, and
the store's volume is mounted at /blob in the copilot's containers; the copilot logs at info level (Flyte
runs it at warn), so each outcome's own lines are there to be read; the containers' resources are
removed (Flyte asks for 1.5 CPUs per pod, and the node has 2, so only one pod at a time would be
admitted); the pod is bound to the node. The 1.15.3 pod also gets the task and the interfaces of the
1.16.8 pod (a circle's area from its radius; the hand-derived pod's interfaces are placeholders, not
protobufs). The release's image puller is off: the images are on the node already, and the puller has
tests of its own (tests/test_kube_kubelet_pods.py).

The pods of each setting are created once the release runs in it (one replica answers at a time, its
webhooks failing closed), one by one, and then all of them run at once; the tests read what the webhook
decided for each pod (its decision counters before and after the pod's creation, as a user reads them from
/metrics) and what each pod did: its phase, the outputs in the store, the copilot's log, which containers
of the stored pod hold SYS_PTRACE, and which processes hold it as the kernel granted it: while the pods
run, a thread reads each running container's process (its host PID, containerd's task) from
/proc/<pid>/status, so the uploader's and the task's effective capabilities (CapEff) are those of the
live process.
"""

from __future__ import annotations

import contextlib
import math
import re
import shutil
import struct
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.controlplane import ControlPlane
from harness.image_builds import ImageBuilder
from harness.kube_api import (
    FAIL,
    PRIVILEGED_BY_DEFAULT,
    ChartPods,
    Kube,
    KubeError,
    Obj,
    describe_pod,
    pods_left,
    release,
    started,
)
from harness.node import Node, ProcessStatus, process_status
from harness.node_setup import import_images, running_node
from tests.helpers import load_yaml
from webhook.pull.clients import _field as protobuf_field  # the puller's protobuf encoding, for the store's files
from webhook.pull.clients import _varint as protobuf_varint

HERE = Path(__file__).parent
FLYTE_1_16 = HERE / "flyte" / "pods" / "v1.16" / "io.yaml"
FLYTE_1_15 = HERE / "golden" / "flyte-src-1.15-io.yaml"
CONTEXT = HERE / "node" / "copilot"
TAGS = {"1.15": "v1.15.3", "1.16": "v1.16.8"}  # Flyte's tag of each copy, tests/flyte/copilot/<tag>/
COPILOT = "flyte-copilot-"
UPLOADER = f"{COPILOT}uploader"
RADIUS = 2.5
NAMESPACE = "cwcp"  # the release's
PODS = "cwcp-pods"
# The release's `ptrace` values, by the name the cases use, in the order the pods are admitted: drop first,
# whose 1.16 pod in the legacy shape is watched longest.
SETTINGS: dict[str, Obj] = {
    "drop": {"mode": "drop"},
    "sidecar": {"mode": "add", "target": "sidecar"},
    "add": {"mode": "add", "target": "primary"},
}
# How long a 1.16.8 uploader in the legacy shape is watched after the task has exited: the uploaders that
# work upload within about 4 s of it.
WAITS = 30.0


@dataclass(frozen=True)
class Case:
    name: str
    flyte: str  # 1.15 or 1.16
    setting: str  # a key of SETTINGS
    holders: tuple[str, ...]  # the containers holding SYS_PTRACE in the stored pod ("primary": the task's)
    decided: str  # what the webhook's decision counters say of the pod's review (see `_decisions`)
    uploads: bool = True
    legacy: bool = False  # a 1.16 pod with the uploader as a regular container (the 1.15 shape)
    uid: int | None = None  # the task's runAsUser

    @property
    def pod(self) -> str:
        return f"{self.name}-{self.setting}"


CASES = (
    # Flyte 1.15.3's own pod: the webhook's default leaves it as Flyte made it.
    Case("flyte-115", "1.15", "add", ("primary",), "skipped: already-compliant"),
    Case("flyte-115", "1.15", "sidecar", (UPLOADER,), "mutated: add"),
    Case("flyte-115", "1.15", "drop", (), "mutated: drop"),
    Case("flyte-115-uid", "1.15", "sidecar", (UPLOADER,), "mutated: add", uid=1000),
    Case("flyte-115-uid", "1.15", "drop", (), "mutated: drop", uid=1000),
    # 1.16.8 asks for no capability, and no setting grants one to a pod without a legacy watcher.
    Case("flyte-116", "1.16", "add", (), "skipped: native-sidecar"),
    Case("flyte-116", "1.16", "sidecar", (), "skipped: native-sidecar"),
    Case("flyte-116", "1.16", "drop", (), "skipped: already-compliant"),
    Case("flyte-116-legacy", "1.16", "drop", (), "skipped: already-compliant", uploads=False, legacy=True),
)


def _id(case: Case) -> str:
    return case.pod


# --- the copilot's store: flytestdlib's local stow store, a directory per pod --------------------------


def _message(number: int, payload: bytes) -> bytes:
    return protobuf_field(number, payload)


def literal_map(floats: dict[str, float]) -> bytes:
    """flyteidl's core.LiteralMap of float scalars: literals (1) -> Literal.scalar (1) -> Scalar.primitive
    (1) -> Primitive.float_value (2, a double)."""
    out = b""
    for name, value in floats.items():
        primitive = protobuf_varint(2 << 3 | 1) + struct.pack("<d", value)
        literal = _message(1, _message(1, primitive))
        out += _message(1, _message(1, name.encode()) + _message(2, literal))
    return out


def _fields(data: bytes) -> list[tuple[int, bytes | int]]:
    fields: list[tuple[int, bytes | int]] = []
    offset = 0

    def varint() -> int:
        nonlocal offset
        value = shift = 0
        while True:
            byte = data[offset]
            offset += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while offset < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields.append((number, varint()))
            continue
        size = {1: 8, 5: 4}.get(wire) or varint()
        fields.append((number, data[offset : offset + size]))
        offset += size
    return fields


def _field(data: bytes, number: int) -> bytes:
    (value,) = [v for n, v in _fields(data) if n == number]
    assert isinstance(value, bytes)
    return value


def floats(data: bytes) -> dict[str, float]:
    """The float scalars of a serialised core.LiteralMap (what literal_map writes)."""
    out = {}
    for number, entry in _fields(data):
        assert number == 1
        assert isinstance(entry, bytes)
        primitive = _field(_field(_field(entry, 2), 1), 1)
        out[_field(entry, 1).decode()] = struct.unpack("<d", _field(primitive, 2))[0]
    return out


def _store_path(store: Path, reference: str) -> Path:
    """Where the local stow store keeps `s3://<container>/<key>`: <path>/<container>/<key>."""
    parts = urlsplit(reference)
    return store / parts.netloc / parts.path.lstrip("/")


def _arg(container: Obj, flag: str) -> str:
    args = container["args"]
    return str(args[args.index(flag) + 1])


# --- the pods -----------------------------------------------------------------------------------------


@dataclass
class Images:
    copilot: dict[str, str]  # release line -> image
    task: str


INFO = "--logger.level=4"  # flytestdlib's levels: 3 warn, 4 info


def _local_storage(command: list[str]) -> list[str]:
    """Flyte's storage flags with the S3 store swapped for the local one at /blob, and the log level info."""
    out = []
    for arg in command:
        if arg.startswith("region="):
            arg = "path=/blob"
        elif arg == "--storage.stow.kind=s3":
            arg = "--storage.stow.kind=local"
        if not arg.startswith("--logger.level="):
            out.append(arg)
    assert out.count("path=/blob") == 1, command
    assert "--storage.stow.kind=local" in out, command
    return [*out, INFO]


def _containers(spec: Obj) -> list[Obj]:
    return [*(spec.get("initContainers") or []), *spec["containers"]]


def task_pod(case: Case, the_node: Node, images: Images, store: Path) -> Obj:
    pod: Obj = load_yaml(FLYTE_1_16 if case.flyte == "1.16" else FLYTE_1_15)
    pod.pop("status", None)
    pod["metadata"].pop("namespace")
    pod["metadata"]["name"] = case.pod
    spec = pod["spec"]
    spec["nodeName"] = the_node.name
    generated = {c["name"]: c for c in load_yaml(FLYTE_1_16)["spec"]["initContainers"]}
    interfaces = {
        "--interface": _arg(generated[UPLOADER], "--interface"),
        "--input-interface": _arg(generated[f"{COPILOT}downloader"], "--input-interface"),
    }
    for container in _containers(spec):
        container.pop("resources", None)
        if not container["name"].startswith(COPILOT):
            container["image"] = images.task
            container["command"][0] = "./calculate-circle-area.sh"  # 1.15's pod names the ellipse's script
            if case.uid is not None:
                container.setdefault("securityContext", {})["runAsUser"] = case.uid
            continue
        container["image"] = images.copilot[case.flyte]
        container["command"] = _local_storage(container["command"])
        container["volumeMounts"].append({"name": "flyte-blob", "mountPath": "/blob"})
        args = container["args"]
        for flag, value in interfaces.items():
            if flag in args:
                args[args.index(flag) + 1] = value
    spec["volumes"].append({"name": "flyte-blob", "hostPath": {"path": str(store), "type": "Directory"}})
    if case.legacy:  # the uploader a regular container, as up to 1.15
        (uploader,) = [c for c in spec["initContainers"] if c["name"] == UPLOADER]
        spec["initContainers"].remove(uploader)
        del uploader["restartPolicy"]
        spec["containers"].append(uploader)
    return pod


# --- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def copilots() -> dict[str, Path]:
    from harness.gotools import binary

    return {line: binary(f"flytecopilot-{line}") for line in TAGS}


@pytest.fixture(scope="module")
def the_node(kube: ControlPlane, copilots: dict[str, Path]) -> Iterator[Node]:
    yield from running_node(kube, "dockerd", "docker", "mmdebstrap")


@pytest.fixture(scope="module")
def images(
    the_node: Node,
    copilots: dict[str, Path],
    image_builder: ImageBuilder,
    tmp_path_factory: pytest.TempPathFactory,
) -> Images:
    """The copilots and the task, built in the session's dockerd on the stand-in base and imported into the node."""
    work = tmp_path_factory.mktemp("copilot-images")
    context = work / "context"
    shutil.copytree(CONTEXT, context)
    for line, path in copilots.items():
        shutil.copy(path, context / f"flytecopilot-{line}")
    copilot = {line: f"localhost/flyteorg/flytecopilot:{tag}" for line, tag in TAGS.items()}
    task = "localhost/flyteorg/rawcontainers-shell:circle"
    targets = [("task", task, ())] + [
        ("copilot", tag, ("--build-arg", f"BINARY=flytecopilot-{line}")) for line, tag in copilot.items()
    ]
    for target, tag, args in targets:
        subprocess.run(
            ["docker", "build", "--quiet", "--network", "none", "--target", target, "--tag", tag,
             "--build-arg", f"BASE={image_builder.base}", *args, str(context)],
            check=True, capture_output=True, env=image_builder.env, timeout=300,
        )  # fmt: skip
    import_images(the_node, work, image_builder, [task, *copilot.values()])
    return Images(copilot, task)


def _values(setting: str) -> Obj:
    return {
        "ptrace": SETTINGS[setting],
        "imagePuller": {"enabled": False},
        "podSecurity": PRIVILEGED_BY_DEFAULT,
        **FAIL,
    }


@pytest.fixture(scope="module")
def webhook(kube_admin: Kube, the_node: Node, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChartPods]:
    """The release, in the first setting; `runs` upgrades it to each of the others in turn."""
    kube_admin.create_namespace(PODS)
    work = tmp_path_factory.mktemp("copilot-webhook")
    yield from started(release(kube_admin, NAMESPACE, work, _values(next(iter(SETTINGS)))), work / "pods", "Fail")


@dataclass
class Run:
    stored: Obj  # the pod as the API server stored it, after admission
    final: Obj  # the pod when it was done
    seconds: float  # from creation to done
    outputs: bytes | None
    errors: bytes | None
    logs: dict[str, str]  # the copilot's containers'
    decided: dict[str, int]  # how the pod's review moved the webhook's decision counters
    processes: dict[str, list[ProcessStatus]]  # container -> its processes as the kernel showed them
    watched: str  # what the process watch saw of the pod, for a failure to show


# --- the processes on the node ------------------------------------------------------------------------

WATCH_PERIOD = 0.25  # s between two readings of containerd's tasks; the shortest process, the task, lives 6 s
RUNC_INIT = "runc:"  # the comm of runc's init before it executes the container's process


class ProcessWatch:
    """Every WATCH_PERIOD s, from a thread: containerd's running tasks, and for each container of the pods'
    namespace not read yet, its process's /proc/<pid>/status, once the process is the container's own
    (runc's init executed it: before that, its capabilities are runc's setup, not the kernel's grant).
    What it saw of each pod, the tasks it found and their states, is kept for a failure to show."""

    def __init__(self, the_node: Node) -> None:
        self.node = the_node
        self.processes: dict[tuple[str, str], list[ProcessStatus]] = {}  # (pod, container) -> its processes
        self.saw: dict[str, list[str]] = {}  # pod -> what was seen of it
        self.errors: list[str] = []
        self._labels: dict[str, dict[str, str]] = {}
        self._read: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> ProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """The thread stopped: what it saw is then read without it."""
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the process watch did not stop within 60 s"

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_PERIOD):
            try:
                self._sample()
            except Exception as err:  # kept for the tests to show; the watch goes on
                if len(self.errors) < 20:
                    self.errors.append(repr(err))

    def _sample(self) -> None:
        for container_id, pid in self.node.running_tasks().items():
            if container_id in self._read:
                continue
            if container_id not in self._labels:
                self._labels[container_id] = self.node.container_labels(container_id)
            labels = self._labels[container_id]
            name = labels.get("io.kubernetes.container.name")
            if labels.get("io.kubernetes.pod.namespace") != PODS or name is None:  # another's, or a sandbox
                self._read.add(container_id)
                continue
            pod = labels["io.kubernetes.pod.name"]
            status = process_status(pid, container_id)
            saw = self.saw.setdefault(pod, [])
            if status is None or status.name.startswith(RUNC_INIT):
                line = f"{name} ({container_id[:12]}): task pid {pid} running, its process {status}"
                if line not in saw:  # once each: a task not yet executed is read again every period
                    saw.append(line)
                continue
            saw.append(f"{name} ({container_id[:12]}): {status}, CapEff {sorted(status.capabilities)}")
            self.processes.setdefault((pod, name), []).append(status)
            self._read.add(container_id)

    def of(self, pod: str) -> tuple[dict[str, list[ProcessStatus]], str]:
        """The pod's containers' processes, and what the watch saw of the pod."""
        processes = {name: seen for (owner, name), seen in self.processes.items() if owner == pod}
        watched = f"the process watch saw of {pod}:\n" + "\n".join(self.saw.get(pod, ["nothing"]))
        if self.errors:
            watched += "\nand failed with:\n" + "\n".join(self.errors)
        return processes, watched


def _decisions(webhook: ChartPods) -> Counter[str]:
    """The webhook's SYS_PTRACE decisions so far, from its metrics as Prometheus reads them: "mutated: <reason>"
    (copilot_webhook_mutations_total, mode enforce), "skipped: <reason>" (copilot_webhook_skips_total)."""
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(webhook.metrics()):
        for sample in family.samples:
            if sample.labels.get("kind") != "ptrace":
                continue
            if sample.name == "copilot_webhook_mutations_total":
                mode = {"enforce": "mutated", "shadow": "shadowed"}[sample.labels["mode"]]
                out[f"{mode}: {sample.labels['reason']}"] += int(sample.value)
            elif sample.name == "copilot_webhook_skips_total":
                out[f"skipped: {sample.labels['reason']}"] += int(sample.value)
    return out


def _primary(pod: Obj) -> str:
    (name,) = [str(c["name"]) for c in pod["spec"]["containers"] if not c["name"].startswith(COPILOT)]
    return name


def _terminated(pod: Obj, name: str) -> bool:
    statuses = [*(pod["status"].get("initContainerStatuses") or []), *(pod["status"].get("containerStatuses") or [])]
    return any(s["name"] == name and "terminated" in s["state"] for s in statuses)


@pytest.fixture(scope="module")
def runs(kube_admin: Kube, the_node: Node, images: Images, webhook: ChartPods) -> Iterator[dict[str, Run]]:
    """Every case's pod, admitted in its setting (the release upgraded and its replica restarted between
    settings, one replica answering at a time), all running at once, each followed until it is done:
    Succeeded or Failed, or (a case that does not upload) still running WAITS s after the task exited."""
    stores = {_id(c): the_node.work / "blob" / _id(c) for c in CASES}
    pods = {_id(c): task_pod(c, the_node, images, stores[_id(c)]) for c in CASES}
    for case in CASES:
        downloader = next(c for c in pods[_id(case)]["spec"]["initContainers"] if c["name"].endswith("downloader"))
        inputs = _store_path(stores[_id(case)], _arg(downloader, "--from-remote"))
        inputs.parent.mkdir(parents=True)
        inputs.write_bytes(literal_map({"radius": RADIUS}))
    stored: dict[str, Obj] = {}
    started: dict[str, float] = {}
    decided: dict[str, dict[str, int]] = {}
    try:
        with ProcessWatch(the_node) as watch:  # from before the first pod until every pod is done
            for index, setting in enumerate(SETTINGS):
                if index:
                    webhook.release.upgrade(_values(setting))
                    webhook.run(f"replica-{setting}")
                    webhook.release.wait_policies("Fail")
                for case in (c for c in CASES if c.setting == setting):
                    before = _decisions(webhook)  # one pod at a time: the counters move for it alone
                    started[_id(case)] = time.monotonic()
                    stored[_id(case)] = kube_admin.create_pod(PODS, pods[_id(case)])
                    decided[_id(case)] = dict(_decisions(webhook) - before)
            runs = _follow(kube_admin, the_node, stored, stores, started, decided, watch)
        yield runs
    finally:
        for case in CASES:
            with contextlib.suppress(KubeError):
                kube_admin.request("DELETE", f"/api/v1/namespaces/{PODS}/pods/{case.pod}", {"gracePeriodSeconds": 1})
        left = pods_left(kube_admin, PODS, [c.pod for c in CASES])
    if left:  # reached when following raised nothing: a failure of its own stays the one reported
        pytest.fail(left)


FOLLOW = 240.0  # how long the pods are followed, all at once


def _not_done(kube: Kube, the_node: Node, case: Case, stored: dict[str, Obj]) -> str:
    awaited = f"its task's container terminated {WAITS:.0f} s ago" if not case.uploads else "Succeeded or Failed"
    return (
        f"{case.pod}, awaited {awaited}:\n{describe_pod(kube, PODS, case.pod)}\n{_copilot_logs(the_node, case, stored)}"
    )


def _follow(
    kube: Kube,
    the_node: Node,
    stored: dict[str, Obj],
    stores: dict[str, Path],
    started: dict[str, float],
    decided: dict[str, dict[str, int]],
    watch: ProcessWatch,
) -> dict[str, Run]:
    """Each case's pod until it is done (see `runs`); past FOLLOW s, a failure with what every pod not done
    showed: its status, its events and its copilot's logs."""
    by_id = {_id(c): c for c in CASES}
    done: dict[str, tuple[Obj, float]] = {}
    exited: dict[str, float] = {}
    deadline = time.monotonic() + FOLLOW
    while len(done) < len(CASES):
        if time.monotonic() >= deadline:
            pending = [c for key, c in by_id.items() if key not in done]
            described = [_not_done(kube, the_node, c, stored) for c in pending]
            pytest.fail(f"{len(pending)} of {len(CASES)} pods not done within {FOLLOW:.0f} s:\n" + "\n".join(described))
        time.sleep(0.5)
        for key, case in by_id.items():
            if key in done:
                continue
            pod = kube.get(f"/api/v1/namespaces/{PODS}/pods/{case.pod}")
            now = time.monotonic()
            if pod["status"].get("phase") in ("Succeeded", "Failed"):
                done[key] = (pod, now - started[key])
            elif not case.uploads and _terminated(pod, _primary(pod)):
                exited.setdefault(key, now)
                if now - exited[key] >= WAITS:
                    done[key] = (pod, now - started[key])
    watch.stop()  # every pod is done: its processes were read while they ran
    runs = {}
    for key, case in by_id.items():
        pod, seconds = done[key]
        upload = next(c for c in _containers(stored[key]["spec"]) if c["name"] == UPLOADER)
        prefix = _store_path(stores[key], _arg(upload, "--to-output-prefix"))
        logs = _logs(the_node, case, stored)
        outputs, errors = prefix / "outputs.pb", prefix / "errors.pb"
        processes, watched = watch.of(case.pod)
        runs[key] = Run(
            stored[key],
            pod,
            seconds,
            outputs.read_bytes() if outputs.exists() else None,
            errors.read_bytes() if errors.exists() else None,
            logs,
            decided[key],
            processes,
            watched,
        )
    return runs


def _logs(the_node: Node, case: Case, stored: dict[str, Obj]) -> dict[str, str]:
    """The copilot's containers' logs, by container."""
    spec = stored[_id(case)]["spec"]
    return {
        c["name"]: the_node.container_log(PODS, case.pod, c["name"])
        for c in _containers(spec)
        if c["name"].startswith(COPILOT)
    }


def _copilot_logs(the_node: Node, case: Case, stored: dict[str, Obj]) -> str:
    return "\n".join(f"--- {name} ---\n{text[-3000:]}" for name, text in _logs(the_node, case, stored).items())


def _explain(run: Run) -> str:
    logs = "\n".join(f"--- {name} ---\n{text[-3000:]}" for name, text in run.logs.items())
    return f"after {run.seconds:.0f} s: {run.final['status']}\nerrors.pb: {run.errors!r}\n{logs}"


def _said(log: str, level: str, text: str) -> list[str]:
    """The lines of a copilot's log at `level` that contain `text`."""
    marker = re.compile(rf'level(=|":"){level}\b')
    return [line for line in log.splitlines() if marker.search(line) and text in line]


def _complaints(log: str) -> list[str]:
    """The warnings and errors in a copilot's log (flytestdlib's JSON lines, or logrus's text ones)."""
    return [line for line in log.splitlines() if re.search(r'level(=|":")(warn|warning|error|fatal|panic)\b', line)]


def _holders(pod: Obj) -> list[str]:
    primary = _primary(pod)
    out = []
    for container in _containers(pod["spec"]):
        added = container.get("securityContext", {}).get("capabilities", {}).get("add") or []
        if "SYS_PTRACE" in added:
            out.append("primary" if container["name"] == primary else container["name"])
    return out


# --- the tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_sys_ptrace_is_held_where_the_setting_puts_it(case: Case, runs: dict[str, Run]) -> None:
    stored = runs[_id(case)].stored
    assert _holders(stored) == list(case.holders)
    # Flyte's shared process namespace is left as Flyte set it (up to 1.15 only), in every setting.
    assert stored["spec"].get("shareProcessNamespace") is (True if case.flyte == "1.15" else None)
    mutated = stored["metadata"].get("annotations", {}).get("copilot-webhook.io/mutated")
    changed = case.flyte == "1.15" and case.setting != "add"
    assert mutated == ({"sidecar": "ptrace=add:sidecar", "drop": "ptrace=drop"}[case.setting] if changed else None)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_the_webhook_reviewed_the_pod_and_counted_its_decision(case: Case, runs: dict[str, Run]) -> None:
    """Left unchanged is told apart from never reviewed: the pod's review moved the webhook's decision
    counters by one, the row's decision. (The webhooks fail closed: a review never answered refuses the pod.)"""
    assert runs[_id(case)].decided == {case.decided: 1}


@pytest.mark.parametrize("case", [c for c in CASES if c.uploads], ids=_id)
def test_the_uploader_sees_the_task_exit_and_uploads_its_outputs(case: Case, runs: dict[str, Run]) -> None:
    run = runs[_id(case)]
    assert run.final["status"]["phase"] == "Succeeded", _explain(run)
    assert run.errors is None, _explain(run)
    assert run.outputs is not None, _explain(run)
    assert floats(run.outputs) == {"area": pytest.approx(math.pi * RADIUS * RADIUS)}
    # The uploader's own account, at info: it saw the task exit and wrote the outputs where the pod told
    # it to, with no warning or error on the way.
    log = run.logs[UPLOADER]
    (upload,) = [c for c in _containers(run.stored["spec"]) if c["name"] == UPLOADER]
    assert _said(log, "info", "Container Exited! uploading data."), _explain(run)
    assert _said(log, "info", f"Uploaded final outputs to [{_arg(upload, '--to-output-prefix')}"), _explain(run)
    assert _said(log, "info", "Uploader completed successfully!"), _explain(run)
    assert not _complaints(log), _explain(run)
    if case.flyte == "1.15":
        # The watcher saw the task start: had it missed it, it would have warned and waited out
        # --start-timeout (1m40s) first.
        assert run.seconds < 100, _explain(run)


def test_a_1_16_uploader_in_the_legacy_shape_waits_for_a_signal_that_never_comes(runs: dict[str, Run]) -> None:
    """The 1.16 copilot's watcher waits for the SIGTERM the kubelet sends a native sidecar when the task
    exits; as a regular container it never gets one, and the pod does not finish."""
    (case,) = [c for c in CASES if not c.uploads]
    run = runs[_id(case)]
    pod = run.final
    assert _terminated(pod, _primary(pod)), _explain(run)
    assert pod["status"]["phase"] == "Running", _explain(run)
    (uploader,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == UPLOADER]
    assert "running" in uploader["state"], _explain(run)
    assert _said(run.logs[UPLOADER], "info", "Waiting for Container to exit."), _explain(run)
    assert not _said(run.logs[UPLOADER], "info", "Container Exited!"), _explain(run)
    assert run.outputs is None
    assert run.errors is None


# What each container's process is (its comm): the copilot's binary, and the task's script run by sh.
COMMANDS = {UPLOADER: "flyte-copilot", "primary": "calculate-circl"}
# What containerd's CRI grants a container's root process without a pod's `add`.
RUNTIME_DEFAULT = frozenset(
    {"CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID", "SETFCAP", "SETPCAP",
     "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE"}
)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_the_kernel_grants_sys_ptrace_where_the_stored_pod_adds_it_to_a_root_process(
    case: Case, runs: dict[str, Run]
) -> None:
    """The watcher's and the task's processes, read from /proc/<pid>/status while they ran: a root process
    holds the runtime's default set, and SYS_PTRACE (bit 19) where the stored pod adds it to its container. A
    process of another uid holds no capability at all, whatever the pod adds: the runtime sets no ambient
    capabilities, and executing its command clears the effective set of a non-root process."""
    run = runs[_id(case)]
    granted = _holders(run.stored)
    for container in (UPLOADER, _primary(run.stored)):
        role = "primary" if container == _primary(run.stored) else container
        seen = run.processes.get(container)
        assert seen, f"{container}'s process was never read running:\n{run.watched}\n{_explain(run)}"
        (process,) = seen  # one process per container: none restarted
        assert process.name == COMMANDS[role], run.watched
        uid = case.uid if role == "primary" and case.uid is not None else 0
        assert process.uid == uid, run.watched
        if uid:
            assert process.capabilities == frozenset(), run.watched
        else:
            assert process.capabilities - {"SYS_PTRACE"} == RUNTIME_DEFAULT, run.watched
            assert ("SYS_PTRACE" in process.capabilities) is (role in granted), run.watched
