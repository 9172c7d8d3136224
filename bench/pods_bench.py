"""Pod creation through the real kube-apiserver, at a fixed rate, with and without a mutating webhook in
the admission chain: what a user of the webhook feels, in one run on one control plane.

    python bench/pods_bench.py --anchors DIR [--pods 2000] [--rates 50,100] [--slices 5] [--connections 64]
                               [--same-answer] [--steal-bound 50] [--save RUN]
    python bench/pods_bench.py --pool RUN [RUN ...]

The control plane is the tests' (harness/controlplane.py: etcd and kube-apiserver built by `make go-tools`,
in a network namespace whose loopback answers for the Service range; needs root). The chart is installed
by Helm with default values and its server runs as its ServiceAccount (harness/kube_api.py), listening
on its Service's ClusterIP and port. Go-floor (DIR/go-floor, built with the installed Go) gets a Service,
a serving certificate for `<service>.<namespace>.svc` and a webhook of its own, a copy of the chart's
SYS_PTRACE webhook (rules, matchConditions, failure policy, timeout) with its clientConfig; our server's
`/mutate/ptrace` is registered the same way, so it is measured doing go-floor's work too, answering with
the annotation and audit annotation the spec asks for besides go-floor's one operation.

Targets, one namespace each per rate, the same pod in all of them:
  none         no webhook is called (the pods carry the label the chart's objectSelector exempts, and no
               other webhook selects the namespace)
  ours         the chart's MutatingWebhookConfiguration as installed: the SYS_PTRACE and image-puller
               webhooks, two calls per pod
  ours-ptrace  our server's /mutate/ptrace alone, registered like go-floor: one call per pod
  go-floor     the Go standard-library webhook, one call per pod
  go-same      with --same-answer, the control: go-floor's code giving ours-ptrace's answer (bench/go-same),
               registered like go-floor; what our answer's content costs through the API server, apart
               from our server, and how far two targets doing the same work spread in one run

At each rate, each target's `--pods` creates are sent in `--slices` turns, the targets taking turns in an
order from a Williams design (over as many turns as targets, twice that for an odd number, each target takes
each place and follows each other target equally often), so a neighbour's load on this machine, and a place
in the turn, fall on all of them alike. A slice starts with half a second of unmeasured warm-up at its rate
and sends on a schedule, open loop: a create starts when it is due, whatever the earlier ones are doing,
over a pool of keep-alive HTTPS connections (asyncio on uvloop, httptools parsing the answers). Latency is
from the start of the create (waiting for a free connection included) to the end of the API server's answer
(the stored pod); the slices' latencies are pooled. A slice sustains the rate when its creates were answered
at 97% of it or more (the API server was not falling behind); the client kept the schedule when it started
them at 97% or more, none 100 ms late. Each slice's pods are deleted after it (they are unscheduled, so the
API server removes them at once): a few hundred pods are stored at a time, and every create is a real one
(no dryRun).

CPU is read from /proc/<pid>/stat (user + system, children included) of each server process and its
descendants, over the measured part of each slice: the webhook's CPU per 1,000 pods created, and the API
server's and etcd's for scale. Beside it, from each thread's /proc/<pid>/task/<tid>/schedstat, how long the
processes' threads waited on a run queue for a CPU over the slice: where creates pile up in one slice, that
says whether the machine's CPUs were short then, and for whom. The machine's steal (CPU time its hypervisor
gave to others while it had work, from /proc/stat) is read the same way. A turn in which the hypervisor took
more than `--steal-bound` ms a second in any slice is run again, in the same order, up to `--slices` times
a rate: the figures are the undisturbed turns', and the report lists the turns run again.

The tail is reported three ways: the pooled p99.9, each target's worst slice (by p99), and beside every slice
our server's event loop over it, read from its /metrics (whatever the target, so a go-floor slice shows what
our idle server's loop did meanwhile): its stalls (a timer run over 100 ms late) and the worst lag's bucket.
The server logs what held the loop at each stall (at most a line a minute); the report ends with those lines.
Each ratio to go-floor is also given turn by turn: in how many turns the target's slice p99 was above
go-floor's slice of the same turn, seconds apart, and the median ratio. Each added-p99 ratio comes with its
spread over the turns: drawn again and again with replacement, whole, as many turns as ran give the range that
holds 90% of the ratios, and a goal inside that range is "not resolved" by the run. `--save` writes the run's
slices; `--pool` reports saved runs as one, their turns together, so several runs give a ratio one cannot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import httpx
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.load import build_go, build_go_floor  # noqa: E402 - the Go webhooks' builds
from bench.paced import Pool, percentile  # noqa: E402 - the open-loop client's connections
from certs.authority import ca_bundle, generate_ca, issue_serving, service_dns_names, write_atomic  # noqa: E402
from harness import gotools  # noqa: E402
from harness.controlplane import API_PORT, NS_ADDRESS, ControlPlane, control_plane  # noqa: E402
from harness.kube_api import ChartPods, Kube, Obj, Release, mwc_path, release, wait_for  # noqa: E402
from harness.server_process import stop_process  # noqa: E402

REVIEW = ROOT / "bench" / "data" / "flyte-1.15-review.json"
RELEASE = "cw"
TARGETS = ("none", "ours", "ours-ptrace", "go-floor")
SAME_ANSWER = "go-same"  # the control: go-floor's code giving our /mutate/ptrace's answer (bench/go-same)
TARGET_LABEL = "bench.copilot-webhook.io/webhook"  # selects a namespace for one of the bench's webhooks
BENCH_MWC = "copilot-webhook-bench"
GO_PORTS = {"go-floor": 8443, SAME_ANSWER: 8444}  # the chart's server has 443 on every address of the namespace
WARMUP_SECONDS = 0.5  # of each slice, at its rate, not measured
SETTLE_SECONDS = 1.0  # between slices, after the last one's pods are deleted
CREATE_TIMEOUT = 120.0  # seconds; a create still unanswered then counts as an error
# The added-p99 ratios the report gives, numerator over denominator, each over **none** at the same rate.
PAIRS = (("ours", "go-floor"), ("ours-ptrace", "go-floor"), (SAME_ANSWER, "go-floor"), ("ours-ptrace", SAME_ANSWER))
GOALS = {("ours", "go-floor"): 2.0, ("ours-ptrace", "go-floor"): 1.2}  # against go-floor: the chart, the same work
RESAMPLES = 1000  # draws of the turns behind each ratio's spread
SPREAD = (0.05, 0.95)  # the spread given: 90% of the draws' ratios lie within it


# --- CPU from /proc ------------------------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds: utime + stime + cutime + cstime) of every process."""
    tick = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # the command name may hold spaces and parentheses
        ppid = int(fields[1])
        ticks = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        table[int(entry)] = (ppid, ticks / tick)
    return table


def accepted(pid: int) -> int:
    """TCP connections accepted so far in the network namespace of `pid` (the control plane's): past the
    load generator's first connections, the API server's new connections to the webhooks."""
    lines = Path(f"/proc/{pid}/net/snmp").read_text().splitlines()
    names, values = (line.split() for line in lines if line.startswith("Tcp:"))
    return int(values[names.index("PassiveOpens")])


def _thread_waits(pid: int) -> dict[int, int]:
    """Nanoseconds each living thread of `pid` has waited on a run queue for a CPU so far (the second field of
    its schedstat); a thread that exits takes its count with it."""
    waits: dict[int, int] = {}
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return waits
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as handle:
                waits[int(tid)] = int(handle.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return waits


class Usage(NamedTuple):
    """What each named process and its living descendants have used so far: CPU seconds (exited descendants
    are counted in their parent's cutime/cstime once reaped), and each thread's wait for a CPU."""

    cpu: dict[str, float]
    waits: dict[str, dict[int, int]]  # name -> thread id -> nanoseconds on a run queue
    steal: float = 0.0  # seconds the hypervisor ran something else on this machine's CPUs, all CPUs added up

    def since(self, earlier: Usage) -> tuple[dict[str, float], dict[str, float]]:
        """CPU seconds and seconds spent waiting for a CPU since `earlier`, by name, and the machine's steal
        as "steal". A thread started since then waited all of its count meanwhile; one that exited since is
        left out."""
        cpu = {name: self.cpu[name] - earlier.cpu.get(name, 0.0) for name in self.cpu}
        waited = {}
        for name, threads in self.waits.items():
            before = earlier.waits.get(name, {})
            # A thread id reused within the interval would count less than nothing: its share is taken as none.
            waited[name] = sum(max(0, ns - before.get(tid, 0)) for tid, ns in threads.items()) / 1e9
        waited["steal"] = self.steal - earlier.steal
        return cpu, waited


def steal_seconds() -> float:
    """The machine's steal time so far (/proc/stat's first line, eighth value): CPU time the hypervisor gave
    to others while this machine had work for it."""
    with open("/proc/stat", "rb") as handle:
        fields = handle.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def usage(roots: dict[str, int]) -> Usage:
    """CPU so far of each named process and its descendants, and of this one (the load generator) as
    "client"; and how long each of their threads has waited for a CPU."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    cpu: dict[str, float] = {}
    waits: dict[str, dict[int, int]] = {}
    for name, root in roots.items():
        total, stack, threads = 0.0, [root], dict[int, int]()
        while stack:
            pid = stack.pop()
            if pid in table:
                total += table[pid][1]
                threads.update(_thread_waits(pid))
                stack.extend(children.get(pid, ()))
        cpu[name], waits[name] = total, threads
    cpu["client"], waits["client"] = time.process_time(), _thread_waits(os.getpid())
    return Usage(cpu, waits, steal_seconds())


# --- the pods --------------------------------------------------------------------------------------


def template() -> Obj:
    """The anchors' Flyte 1.15 copilot pod (bench/data, the body `make bench` posts): the primary container
    has no securityContext, so every webhook here has the same work, SYS_PTRACE on it."""
    pod = json.loads(REVIEW.read_text())["request"]["object"]
    pod["metadata"].pop("namespace", None)
    assert isinstance(pod, dict)
    return pod


def bodies(pod: Obj, prefix: str, count: int, labels: dict[str, str]) -> list[bytes]:
    out = []
    for i in range(count):
        obj = copy.deepcopy(pod)
        obj["metadata"]["name"] = f"{prefix}-{i:05d}"
        obj["metadata"].setdefault("labels", {}).update(labels)
        out.append(json.dumps(obj, separators=(",", ":")).encode())
    return out


class Durations(NamedTuple):
    """A duration histogram's observations so far (webhook calls, the loop's wake-ups): their total seconds and
    the cumulative bucket counts by upper bound, every series matched added up."""

    seconds: float
    buckets: dict[float, float]

    @property
    def observed(self) -> float:
        return self.buckets.get(float("inf"), 0.0)

    def since(self, earlier: Durations) -> Durations:
        buckets = {bound: count - earlier.buckets.get(bound, 0.0) for bound, count in self.buckets.items()}
        return Durations(self.seconds - earlier.seconds, buckets)

    def plus(self, other: Durations) -> Durations:
        buckets = {b: self.buckets.get(b, 0.0) + other.buckets.get(b, 0.0) for b in self.buckets | other.buckets}
        return Durations(self.seconds + other.seconds, buckets)

    def over(self, bound: float) -> float:
        """Observations longer than `bound` (one of the histogram's bounds)."""
        return self.observed - self.buckets.get(bound, self.observed)

    def worst(self) -> float:
        """The upper bound of the bucket holding the longest observation (NaN: none was observed). Buckets are
        cumulative: the smallest bound holding every observation."""
        if not self.observed:
            return float("nan")
        return min(b for b, count in self.buckets.items() if count >= self.observed)

    def describe(self) -> str:
        mean = self.seconds / self.observed * 1000 if self.observed else float("nan")
        return (
            f"{self.observed:.0f} calls, mean {mean:.1f} ms, {self.over(0.025):.0f} over 25 ms, "
            f"{self.over(0.1):.0f} over 100 ms, the slowest <= {self.worst() * 1000:g} ms"
        )

    @classmethod
    def parse(cls, metrics: str, family: str, match: str = "") -> Durations:
        """The series of the histogram `family` whose labels hold `match`, added up."""
        seconds = 0.0
        buckets: dict[float, float] = {}
        for line in metrics.splitlines():
            if not line.startswith(family) or match not in line:
                continue
            name, value = line.rsplit(" ", 1)
            if name.startswith(f"{family}_sum"):
                seconds += float(value)
            elif name.startswith(f"{family}_bucket"):
                bound = float(name.split('le="', 1)[1].split('"', 1)[0])
                buckets[bound] = buckets.get(bound, 0.0) + float(value)
        return cls(seconds, buckets)


API_WEBHOOK = "apiserver_admission_webhook_admission_duration_seconds"
OURS_DURATION = "copilot_webhook_request_duration_seconds"


def _calls(kube: Kube, pods: ChartPods) -> tuple[Durations, Durations]:
    """Every webhook call so far as the API server timed it (a slice calls its target's webhooks alone), and
    our server's admission requests as it timed them."""
    seen = Durations.parse(kube.http.get("/metrics").text, API_WEBHOOK, 'type="admit"')
    return seen, Durations.parse(pods.metrics(), OURS_DURATION, 'path="/mutate')


# --- one phase -------------------------------------------------------------------------------------


@dataclass
class Phase:
    target: str
    rate: int
    slice: int
    latencies: list[float] = field(default_factory=list)  # seconds, measured creates answered 201
    errors: Counter[str] = field(default_factory=Counter)
    mutated: int = 0  # measured pods stored with SYS_PTRACE
    sent_rate: float = 0.0  # measured creates started per second
    sent_count: int = 0  # creates sent, warm-up included
    answered_rate: float = 0.0  # measured creates answered per second, from the first start to the last answer
    late: float = 0.0  # the latest start behind schedule, seconds
    max_in_flight: int = 0
    connections: int = 0  # connections the phase opened
    waited: int = 0  # creates that waited for a free connection
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds over the measured part
    cpu_wait: dict[str, float] = field(default_factory=dict)  # seconds on a run queue over the measured part
    measured: float = 0.0  # seconds from the first measured start to the last answer
    attempt: int = 0  # the turn's first run, or how many times it ran before
    repeated: bool = False  # the turn was disturbed and run again: this slice is not in the figures
    calls: float = 0.0  # our server's admission requests per pod created (warm-up included)
    accepted: int = 0  # TCP connections accepted in the control plane's namespace, warm-up included
    stalls: float = 0.0  # our server's event-loop stalls over the slice, warm-up included
    worst_lag: float = 0.0  # the upper bound of the lag histogram's highest bucket the slice reached, seconds
    # The slice's admission calls as the API server timed them (connection and TLS included) and as our server
    # timed them (first byte to last): the difference is the way between them.
    calls_seen: Durations = field(default_factory=lambda: Durations(0.0, {}))
    ours_seen: Durations = field(default_factory=lambda: Durations(0.0, {}))

    def pct(self, q: float) -> float:
        return percentile(sorted(self.latencies), q) * 1000

    def wait_rate(self, name: str) -> float:
        """How long `name`'s threads waited for a CPU over the measured part (for "steal", how long the hypervisor
        took the CPUs, all added up), in ms a second of it; NaN for a slice with no measured part."""
        return self.cpu_wait.get(name, 0.0) * 1000 / self.measured if self.measured else float("nan")

    @property
    def sent(self) -> bool:
        """The load generator kept the schedule."""
        return self.sent_rate >= 0.97 * self.rate and self.late < 0.1

    @property
    def sustained(self) -> bool:
        """The API server answered at the target rate (within 3%): it was not falling behind."""
        return self.answered_rate >= 0.97 * self.rate


async def drive(
    pool: Pool, path: str, load: Sequence[bytes], warmup: int, rate: int, phase: Phase, processes: dict[str, int]
) -> None:
    """Send `load` at `rate` a second, open loop; the first `warmup` creates are not measured."""
    in_flight = 0
    starts: list[float] = []
    answered: list[float] = []
    opened, waited = pool.opened, pool.waited

    async def one(index: int, body: bytes) -> None:
        nonlocal in_flight
        measured = index >= warmup
        in_flight += 1
        phase.max_in_flight = max(phase.max_in_flight, in_flight)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(CREATE_TIMEOUT):
                status, content = await pool.post(path, body)
        except (OSError, TimeoutError) as err:
            if measured:
                phase.errors[type(err).__name__] += 1
            return
        finally:
            in_flight -= 1
        ended = time.perf_counter()
        elapsed = ended - started
        if not measured:
            return
        answered.append(ended)
        if status != 201:
            phase.errors[str(status)] += 1
            return
        phase.latencies.append(elapsed)
        phase.mutated += b'"SYS_PTRACE"' in content

    tasks = []
    t0 = time.perf_counter() + 0.05
    before = Usage({}, {}, steal_seconds())
    for index, body in enumerate(load):
        due = t0 + index / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if index == warmup:
            before = usage(processes)
        now = time.perf_counter()
        if index >= warmup:
            starts.append(now)
            phase.late = max(phase.late, now - due)
        tasks.append(asyncio.create_task(one(index, body)))
    await asyncio.gather(*tasks)
    phase.cpu, phase.cpu_wait = usage(processes).since(before)
    read = time.perf_counter()
    phase.connections, phase.waited = pool.opened - opened, pool.waited - waited
    phase.sent_count = len(load)
    phase.measured, phase.answered_rate = _measured(starts, answered, read)
    phase.sent_rate = (len(starts) - 1) / (starts[-1] - starts[0]) if len(starts) > 1 else 0.0


# --- the webhooks ----------------------------------------------------------------------------------


@contextlib.contextmanager
def go_webhook(kube: Kube, plane: ControlPlane, name: str, binary: Path, work: Path) -> Iterator[tuple[Obj, int]]:
    """A Go webhook (go-floor or the control) behind a Service of its own, both named `name`, listening in the
    control plane's namespace on the Service port; yields its clientConfig and pid."""
    port = GO_PORTS[name]
    kube.create_namespace(name)
    service = {
        "metadata": {"name": name},
        "spec": {"ports": [{"name": "https", "port": port, "targetPort": port}], "selector": {"app": name}},
    }
    kube.create(f"/api/v1/namespaces/{name}/services", service)
    ca = generate_ca(f"{name} bench CA")
    serving = issue_serving(ca, service_dns_names(name, name))
    cert, key = work / f"{name}.crt", work / f"{name}.key"
    write_atomic(cert, serving.cert_pem, 0o600)
    write_atomic(key, serving.key_pem, 0o600)
    log = work / f"{name}.log"
    with log.open("wb") as out:
        argv = [str(binary), "-addr", f"0.0.0.0:{port}", "-cert", str(cert), "-key", str(key)]
        process = subprocess.Popen(plane.netns.command(argv), stdout=out, stderr=out)
    try:
        listening = wait_for(lambda: _answers(f"https://{NS_ADDRESS}:{port}/mutate"), timeout=30)
        assert listening, f"{name} did not start: {log.read_text()}"
        config = {
            "service": {"name": name, "namespace": name, "path": "/mutate", "port": port},
            "caBundle": ca_bundle(ca),
        }
        yield config, process.pid
    finally:
        stop_process(process)


def _answers(url: str) -> bool:
    try:
        httpx.get(url, verify=False, timeout=1)
    except httpx.HTTPError:
        return False
    return True


def register(kube: Kube, chart: Release, go_configs: dict[str, Obj]) -> None:
    """One webhook for our /mutate/ptrace and one for each Go webhook, each a copy of the chart's SYS_PTRACE
    webhook (as the server has promoted it) with its own clientConfig, selecting its own namespaces."""
    installed = kube.get(mwc_path(chart.fullname))["webhooks"]
    (ptrace,) = (w for w in installed if w["name"].startswith("ptrace."))
    ours_config = copy.deepcopy(ptrace["clientConfig"])
    ours_config["service"]["path"] = "/mutate/ptrace"
    webhooks = []
    for target, config in {"ours-ptrace": ours_config, **go_configs}.items():
        webhook = {k: v for k, v in ptrace.items() if k not in {"name", "clientConfig", "objectSelector"}}
        webhook.update(
            name=f"{target}.bench.copilot-webhook.io",
            clientConfig=config,
            namespaceSelector={"matchLabels": {TARGET_LABEL: target}},
        )
        webhooks.append(webhook)
    kube.create(
        "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
        {"metadata": {"name": BENCH_MWC}, "webhooks": webhooks},
    )


# --- the run ---------------------------------------------------------------------------------------


def _binaries() -> tuple[Path, Path]:
    version = gotools.go_version()
    paths = [gotools.cached_path(gotools.TOOLS[n], version) for n in ("etcd", "kube-apiserver")] if version else []
    if len(paths) != 2 or not all(p.exists() for p in paths):
        sys.exit(f"etcd and kube-apiserver are not built: run `{gotools.MAKE_TARGET}` (needs Go)")
    return paths[0], paths[1]


def _preflight(anchors: Path, same_answer: bool) -> dict[str, Path]:
    missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root")
    if missing:
        sys.exit(f"the control plane needs {', '.join(missing)}")
    # Every control plane puts the same addresses on its veth pair: two at once would take each other's traffic.
    others = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    if any(name.startswith("cwk") for name in others):
        sys.exit("another test control plane is running on this machine (ip netns list): try again when it ends")
    binaries = {"go-floor": build_go_floor(anchors)}
    if same_answer:
        binaries[SAME_ANSWER] = build_go(ROOT / "bench" / SAME_ANSWER, SAME_ANSWER)
    if None in binaries.values():
        sys.exit("go-floor needs Go")
    return {name: path for name, path in binaries.items() if path is not None}


def _cleanup(kube: Kube, namespace: str) -> None:
    """Delete the phase's pods (unscheduled pods go at once) and wait until none is left."""
    kube.delete(f"/api/v1/namespaces/{namespace}/pods")
    gone = wait_for(lambda: not kube.get(f"/api/v1/namespaces/{namespace}/pods", limit="1")["items"], timeout=120)
    assert gone, f"the pods of {namespace} were not deleted"


class LoopState(NamedTuple):
    """Our server's event-loop metrics at one moment: its stall count and its lag histogram."""

    stalls: float
    lag: Durations

    @classmethod
    def read(cls, pods: ChartPods) -> LoopState:
        return cls.parse(pods.metrics())

    @classmethod
    def parse(cls, metrics: str) -> LoopState:
        stalls = 0.0
        for line in metrics.splitlines():
            if line.startswith("copilot_webhook_event_loop_stalls_total "):
                stalls = float(line.rsplit(" ", 1)[1])
        return cls(stalls, Durations.parse(metrics, "copilot_webhook_event_loop_lag_seconds"))

    def since(self, earlier: LoopState) -> tuple[float, float]:
        """Stalls since `earlier`, and the upper bound of the highest bucket a wake-up reached since then."""
        return self.stalls - earlier.stalls, self.lag.since(earlier.lag).worst()


def admission_requests(pods: ChartPods) -> float:
    """Our server's /mutate* requests so far, from its /metrics."""
    total = 0.0
    for line in pods.metrics().splitlines():
        if line.startswith("copilot_webhook_requests_total{") and 'path="/mutate' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.contextmanager
def _sampled(pid: int, output: Path | None) -> Iterator[None]:
    """With `output`, py-spy samples our server meanwhile (250 a second, without pausing it, only the thread
    holding the interpreter lock, by thread) and writes the counts of each stack there (`raw`: one line per
    stack, a flame graph's input)."""
    if output is None:
        yield
        return
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    argv = [spy, "record", "--pid", str(pid), "--rate", "250", "--nonblocking", "--gil", "--threads"]
    process = subprocess.Popen([*argv, "--format", "raw", "--output", str(output)], stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        process.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        process.wait(timeout=60)


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def targets(args: argparse.Namespace) -> tuple[str, ...]:
    return (*TARGETS, SAME_ANSWER) if args.same_answer else TARGETS


def turns(names: Sequence[str], count: int) -> list[tuple[str, ...]]:
    """The order of the targets in each of `count` turns: a Williams design, so that over len(names) turns
    (twice that for an odd number of targets) each target takes each place in a turn equally often and
    follows each other target equally often. Where a target runs, and after which, moves its tail: the
    run's first and last places, and the slice after the heaviest target, fall on all of them alike."""
    n = len(names)
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [tuple(names[(i + k) % n] for i in first) for k in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [rows[t % len(rows)] for t in range(count)]


async def run(args: argparse.Namespace, go: dict[str, Path], work: Path) -> tuple[list[Phase], dict[str, str]]:
    etcd, apiserver = _binaries()
    info: dict[str, str] = {"load before": _loadavg()}
    with control_plane(work / "kube", etcd, apiserver) as plane:
        kube = Kube(plane)
        # This control plane enforces no PodSecurity default: told so, the chart injects the puller it measures.
        chart = release(kube, RELEASE, work, {"podSecurity": {"defaults": {"enforce": "privileged"}}})
        pods = ChartPods(chart, work)
        pods.run("replica")
        try:
            assert wait_for(lambda: "" not in chart.bundles(), timeout=60), pods.output()
            info["chart webhooks"] = ", ".join(f"{n} ({p})" for n, p in chart.policies().items())
            with contextlib.ExitStack() as webhooks:
                started = {name: webhooks.enter_context(go_webhook(kube, plane, name, go[name], work)) for name in go}
                register(kube, chart, {name: config for name, (config, _) in started.items()})
                processes = {
                    "ours": pods.replica.process.pid if pods.replica else 0,
                    **{name: pid for name, (_, pid) in started.items()},
                    **{p.name: p.popen.pid for p in plane.processes},
                }
                with _sampled(processes["ours"], args.profile):
                    phases = await _phases(args, kube, plane, pods, processes)
            info["stall lines"] = "\n".join(line for line in pods.output().splitlines() if "stall bound" in line)
        finally:
            pods.stop()
            kube.close()
    info["load after"] = _loadavg()
    return phases, info


async def _phases(
    args: argparse.Namespace, kube: Kube, plane: ControlPlane, pods: ChartPods, processes: dict[str, int]
) -> list[Phase]:
    """Every slice sent, the turns run again included (marked `repeated`)."""
    pod = template()
    exempt = {"copilot-webhook.io/webhook-release": pods.release.fullname}  # the chart's objectSelector skips these
    per_slice = -(-args.pods // args.slices)
    phases: list[Phase] = []
    for rate in args.rates:
        for target in targets(args):
            labels = {} if target in {"none", "ours"} else {TARGET_LABEL: target}
            kube.create_namespace(f"{target}-{rate}", labels)
        await asyncio.sleep(1)  # the namespaces reach the server's namespace cache
        pool = Pool(NS_ADDRESS, API_PORT, plane.ssl_context(), args.connections)

        async def send(phase: Phase, rate: int = rate, pool: Pool = pool) -> None:
            load = bodies(pod, f"s{phase.slice}a{phase.attempt}", int(WARMUP_SECONDS * rate) + per_slice,
                          {} if phase.target == "ours" else exempt)  # fmt: skip
            await _slice(pool, kube, pods, processes, phase, load)

        repeats = args.slices  # at most as many turns again as the rate has
        for index, order in enumerate(turns(targets(args), args.slices)):
            sent, repeats = await run_turn(order, rate, index + 1, send, args.steal_bound, repeats)
            phases += sent
        await pool.close()
    return phases


async def run_turn(
    order: Sequence[str],
    rate: int,
    number: int,
    send: Callable[[Phase], Awaitable[None]],
    bound: float,
    repeats: int,
) -> tuple[list[Phase], int]:
    """One turn, its targets' slices in `order`, run again in the same order (so the design stays balanced)
    while disturbed and `repeats` last; returns every slice sent, those of the runs set aside marked
    `repeated`, and the repeats left."""
    sent: list[Phase] = []
    while True:
        turn = [Phase(target, rate, number, attempt=len(sent) // len(order)) for target in order]
        for phase in turn:
            await send(phase)
        sent += turn
        if not disturbed(turn, bound) or repeats <= 0:
            return sent, repeats
        repeats -= 1
        for phase in turn:
            phase.repeated = True
        print(f"turn {number} at {rate}/s disturbed (steal over {bound:g} ms/s): run again", file=sys.stderr)


def disturbed(turn: Sequence[Phase], bound: float) -> bool:
    """Whether the hypervisor took more than `bound` ms a second of this machine's CPUs in a slice of the turn.
    Negative: never."""
    return bound >= 0 and any(p.wait_rate("steal") > bound for p in turn)


async def _slice(
    pool: Pool, kube: Kube, pods: ChartPods, processes: dict[str, int], phase: Phase, load: list[bytes]
) -> None:
    """One target's slice: its creates, and what our server, the API server and the machine did meanwhile."""
    namespace = f"{phase.target}-{phase.rate}"
    warmup = int(WARMUP_SECONDS * phase.rate)
    calls, loop = admission_requests(pods), LoopState.read(pods)
    seen, ours = _calls(kube, pods)
    opens = accepted(processes["kube-apiserver"])  # after this bench's own reads of /metrics
    await drive(pool, f"/api/v1/namespaces/{namespace}/pods", load, warmup, phase.rate, phase, processes)
    phase.accepted = accepted(processes["kube-apiserver"]) - opens
    phase.stalls, phase.worst_lag = LoopState.read(pods).since(loop)
    seen_after, ours_after = _calls(kube, pods)
    phase.calls_seen, phase.ours_seen = seen_after.since(seen), ours_after.since(ours)
    phase.calls = (admission_requests(pods) - calls) / len(load)
    print(_line(phase), file=sys.stderr, flush=True)
    _cleanup(kube, namespace)
    await asyncio.sleep(SETTLE_SECONDS)


def _again(p: Phase) -> str:
    return f" (run {p.attempt + 1})" if p.attempt else ""


def _measured(starts: list[float], answered: list[float], read: float) -> tuple[float, float]:
    """The measured part's seconds, from the first measured start to the last answer (with none, to `read`,
    when the last create had failed), and the answers a second over it."""
    if not starts:
        return 0.0, 0.0
    seconds = (max(answered) if answered else read) - starts[0]
    return seconds, len(answered) / seconds if answered else 0.0


def _line(p: Phase) -> str:
    return (
        f"slice {p.slice}{_again(p)} {p.rate}/s {p.target}: p50 {p.pct(0.5):.1f} ms p99 {p.pct(0.99):.1f} ms, "
        f"sent {p.sent_rate:.1f}/s, answered {p.answered_rate:.1f}/s, late {p.late * 1000:.0f} ms, "
        f"in flight {p.max_in_flight}, connections opened {p.connections}, waited {p.waited}, "
        f"our server's calls per pod {p.calls:.2f}, connections accepted {p.accepted}, "
        f"mutated {p.mutated}/{len(p.latencies)}, our loop: stalls {p.stalls:.0f}, "
        f"worst lag <= {p.worst_lag * 1000:g} ms, "
        f"the API server's webhook calls: {p.calls_seen.describe()}, our server's: {p.ours_seen.describe()}, "
        f"errors {dict(p.errors)}, CPU: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in p.cpu.items())
        + f", waited for a CPU: {_waits(p)}"
    )


def _waits(p: Phase) -> str:
    """Each process's wait on a run queue over the slice's measured part, in ms per second of it."""
    return ", ".join(f"{name} {p.wait_rate(name):.0f}" for name in p.cpu_wait) + " ms/s"


# --- the report ------------------------------------------------------------------------------------


@dataclass
class Totals:
    """One target at one rate, its slices pooled."""

    slices: list[Phase]

    @property
    def latencies(self) -> list[float]:
        return sorted(x for p in self.slices for x in p.latencies)

    def pct(self, q: float) -> float:
        return percentile(self.latencies, q) * 1000

    def worst(self) -> Phase:
        """The slice with the highest p99."""
        return max(self.slices, key=lambda p: p.pct(0.99))

    def against(self, other: Totals) -> str:
        """Slice by slice: each of these slices' p99 over the other target's in the same turn (the two ran
        seconds apart, so the machine's drift over a run falls on both): in how many it is above, and the
        median ratio. A real difference shows in most turns; noise puts about half on each side."""
        theirs = {p.slice: p.pct(0.99) for p in other.slices}
        ratios = [p.pct(0.99) / theirs[p.slice] for p in self.slices if theirs.get(p.slice)]
        if not ratios:
            return "no turns to pair"
        above = sum(r > 1 for r in ratios)
        return f"slice by slice above in {above} of {len(ratios)} turns (median ratio {statistics.median(ratios):.2f}x)"

    def accepted(self) -> float:
        """Connections accepted per 1,000 pods sent (warm-up included)."""
        return sum(p.accepted for p in self.slices) * 1000 / max(1, sum(p.sent_count for p in self.slices))

    def cpu(self, process: str) -> float:
        """CPU seconds per 1,000 pods created."""
        count = sum(len(p.latencies) + sum(p.errors.values()) for p in self.slices)
        return sum(p.cpu[process] for p in self.slices) * 1000 / max(1, count)


def _server(target: str) -> str:
    return "ours" if target.startswith("ours") else target


def report(phases: list[Phase], args: argparse.Namespace, info: dict[str, str]) -> str:
    kept = [p for p in phases if not p.repeated]
    _, _, totals = _pooled(kept)
    lines = [
        f"{args.pods} pods per target and rate, in {args.slices} slices each preceded by {WARMUP_SECONDS} s of "
        f"unmeasured warm-up, the targets in turn (a Williams design's order; {_rerun_rule(args)}); {args.connections} "
        f"connections; {os.cpu_count()} CPUs, load average {info['load before']} before and {info['load after']} "
        f"after; Python {platform.python_version()}",
        f"chart webhooks (failure policy): {info['chart webhooks']}",
        "",
        "| rate | target | p50 ms | p99 ms | p99.9 ms | worst slice p99 ms | added p50 ms | added p99 ms "
        "| webhook CPU s / 1,000 pods | kube-apiserver CPU s / 1,000 | etcd CPU s / 1,000 | client CPU s / 1,000 "
        "| our server's calls / pod | connections accepted / 1,000 pods | slices sustaining the rate "
        "| most in flight | mutated | errors | our loop's stalls | our loop's worst lag ms |",
        "|---:|---|" + "---:|" * 18,
    ]
    for rate in args.rates:
        lines += [_row(rate, target, totals) for target in targets(args)]
    lines.append("")
    for rate in args.rates:
        lines += _ratios(rate, totals, spread(by_turn(kept, rate)))
    lines += _where(args, totals)
    lines += (
        _repeated(args, phases) if args.steal_bound >= 0 else ["", "No turn was run again (--steal-bound negative)."]
    )
    lines += ["", "Our server's stall lines (at most one a minute):", info.get("stall lines") or "(none)"]
    return "\n".join(lines)


def _rerun_rule(args: argparse.Namespace) -> str:
    if args.steal_bound < 0:
        return "no turn run again"
    return f"a turn run again when the hypervisor took more than {args.steal_bound:g} ms a second in one of its slices"


def _repeated(args: argparse.Namespace, phases: list[Phase]) -> list[str]:
    """The turns run again because the hypervisor took more than the bound in one of their slices, and the
    kept turns it disturbed all the same (the repeats used up)."""
    lines = ["", f"Turns run again, the hypervisor having taken more than {args.steal_bound:g} ms a second in one "
             "of their slices (each slice's p99, and the steal in ms a second):"]  # fmt: skip
    for rate in args.rates:
        runs: dict[tuple[int, int], list[Phase]] = {}
        for p in phases:
            if p.rate == rate:
                runs.setdefault((p.slice, p.attempt), []).append(p)
        again = [(i, t) for (i, _), t in runs.items() if t[0].repeated]
        still = [(i, t) for (i, _), t in runs.items() if not t[0].repeated and disturbed(t, args.steal_bound)]
        lines.append(f"- {rate}/s: {len(again)} run again" + "".join(f"; turn {i}: {_turn(t)}" for i, t in again))
        if still:
            lines.append(f"- {rate}/s, kept though disturbed (the repeats used up): "
                         + "; ".join(f"turn {i}: {_turn(t)}" for i, t in still))  # fmt: skip
    return lines


def _turn(turn: list[Phase]) -> str:
    return ", ".join(f"{p.target} {p.pct(0.99):.1f} ms ({p.wait_rate('steal'):.0f})" for p in turn)


def _where(args: argparse.Namespace, totals: dict[tuple[str, int], Totals]) -> list[str]:
    """Where the time went: the webhook calls as both ends timed them, and who waited for a CPU in each
    target's worst slice."""
    lines = ["", "Where the time went: each webhook call as the API server timed it (connection and TLS included), "
             "and our server's admission requests as it timed them (first byte to last):"]  # fmt: skip
    for rate in args.rates:
        lines += [_calls_line(rate, target, totals[target, rate]) for target in targets(args) if target != "none"]
    lines += ["", "Each target's worst slice, and how long each process waited for a CPU in it, in ms per second "
              "of the slice (a process's threads added up; steal: the CPU time the hypervisor took, all CPUs), "
              "against the target's median slice:"]  # fmt: skip
    for rate in args.rates:
        lines += [_worst_line(rate, target, totals[target, rate]) for target in targets(args)]
    return lines


def _row(rate: int, target: str, totals: dict[tuple[str, int], Totals]) -> str:
    """One target's line of the table at one rate."""
    base, t = totals["none", rate], totals[target, rate]
    p50, p99 = t.pct(0.5), t.pct(0.99)
    added = " | " if target == "none" else f"{p50 - base.pct(0.5):.1f} | {p99 - base.pct(0.99):.1f}"
    cpu = "" if target == "none" else f"{t.cpu(_server(target)):.2f}"
    calls = statistics.median(p.calls for p in t.slices)
    sustained = f"{sum(p.sustained for p in t.slices)}/{len(t.slices)}"
    if not all(p.sent for p in t.slices):
        sustained += f" (the client fell behind in {sum(not p.sent for p in t.slices)})"
    mutated = f"{sum(p.mutated for p in t.slices)}/{len(t.latencies)}"
    errors = sum(sum(p.errors.values()) for p in t.slices)
    return (
        f"| {rate}/s | {target} | {p50:.1f} | {p99:.1f} | {t.pct(0.999):.1f} | {t.worst().pct(0.99):.1f} "
        f"| {added} | {cpu} | {t.cpu('kube-apiserver'):.2f} "
        f"| {t.cpu('etcd'):.2f} | {t.cpu('client'):.2f} | {calls:.2f} | {t.accepted():.0f} | {sustained} "
        f"| {max(p.max_in_flight for p in t.slices)} | {mutated} | {errors} | {_loop_cells(t)} |"
    )


def _calls_line(rate: int, target: str, t: Totals) -> str:
    seen, ours = (
        functools.reduce(Durations.plus, (getattr(p, kind) for p in t.slices)) for kind in ("calls_seen", "ours_seen")
    )
    line = f"- {rate}/s, {target}: the API server's {seen.describe()}"
    return line + (f"; our server's {ours.describe()}" if target.startswith("ours") else "")


def _worst_line(rate: int, target: str, t: Totals) -> str:
    worst = t.worst()
    waits = ", ".join(
        f"{name} {worst.wait_rate(name):.0f} ({statistics.median(p.wait_rate(name) for p in t.slices):.0f})"
        for name in worst.cpu_wait
    )
    return (
        f"- {rate}/s, {target}: turn {worst.slice}, p99 {worst.pct(0.99):.1f} ms, most in flight "
        f"{worst.max_in_flight}; waited {waits or 'not read'}"
    )


def _loop_cells(t: Totals) -> str:
    """Our server's loop over the target's slices: its stalls, and the worst lag's bucket in ms."""
    lags = [p.worst_lag for p in t.slices if p.worst_lag == p.worst_lag]  # NaN: no wake-up was counted
    return f"{sum(p.stalls for p in t.slices):.0f} | " + (f"{max(lags) * 1000:g}" if lags else "")


def _ratios(rate: int, totals: dict[tuple[str, int], Totals], spreads: Spreads) -> list[str]:
    """Ours against go-floor at one rate, each with its goal: added p99 (1.2x for the same work, 2x for the
    chart's two calls) with its spread over the turns, webhook CPU (2x), and every slice's p99 within 2x
    go-floor's worst slice."""
    floor = totals["go-floor", rate]
    floor_cpu = floor.cpu("go-floor")
    floor_worst = floor.worst().pct(0.99)
    added = added_ratios({t: x.latencies for (t, r), x in totals.items() if r == rate})
    lines = []
    for (target, _), goal in GOALS.items():
        t = totals[target, rate]
        ratio_cpu = t.cpu("ours") / floor_cpu if floor_cpu > 0 else float("inf")
        worst = t.worst().pct(0.99)
        lines.append(
            f"- {rate}/s, {target} ÷ go-floor: added p99 {added[target, 'go-floor']:.2f}x (goal {goal:g}x), "
            f"{_spread(spreads, (target, 'go-floor'), goal)}, "
            f"webhook CPU {ratio_cpu:.2f}x (goal 2x), worst slice p99 {worst:.1f} ms against go-floor's "
            f"{floor_worst:.1f} ms: {worst / floor_worst:.2f}x (goal 2x); p99 {t.against(floor)}"
        )
    if (SAME_ANSWER, rate) in totals:
        lines += _same_answer(rate, totals, added, spreads)
    return lines


def _same_answer(
    rate: int, totals: dict[tuple[str, int], Totals], added: dict[tuple[str, str], float], spreads: Spreads
) -> list[str]:
    """The control against both: ours-ptrace ÷ go-same is our server against Go giving the same answer;
    go-same ÷ go-floor is what our answer's longer content costs through the API server, from Go alike."""
    apiserver = {t: totals[t, rate].cpu("kube-apiserver") for t in ("ours-ptrace", SAME_ANSWER, "go-floor")}

    def ratio(a: str, b: str) -> str:
        paired = totals[a, rate].against(totals[b, rate])
        return (
            f"added p99 {added[a, b]:.2f}x ({_spread(spreads, (a, b))}), "
            f"kube-apiserver CPU {apiserver[a] / apiserver[b]:.2f}x; p99 {paired}"
        )

    return [
        f"- {rate}/s, ours-ptrace ÷ {SAME_ANSWER} (the same answer): {ratio('ours-ptrace', SAME_ANSWER)}",
        f"- {rate}/s, {SAME_ANSWER} ÷ go-floor (our answer against go-floor's, both from Go): "
        f"{ratio(SAME_ANSWER, 'go-floor')}",
    ]


# --- how far a ratio spreads over the turns ----------------------------------------------------------

Spreads = dict[tuple[str, str], tuple[float, float]]


def added_ratios(latencies: Mapping[str, list[float]]) -> dict[tuple[str, str], float]:
    """Each pair's added p99 ratio from the targets' sorted latencies: (a's p99 - none's) / (b's - none's);
    infinite where b adds nothing. Pairs with a target missing are left out."""
    p99 = {target: percentile(values, 0.99) for target, values in latencies.items()}
    ratios = {}
    for a, b in PAIRS:
        if {a, b, "none"} <= p99.keys():
            over = p99[b] - p99["none"]
            ratios[a, b] = (p99[a] - p99["none"]) / over if over > 0 else float("inf")
    return ratios


def by_turn(phases: Sequence[Phase], rate: int) -> list[dict[str, list[float]]]:
    """The kept slices at `rate`, grouped by turn: each turn's targets' latencies, which ran seconds apart."""
    grouped: dict[int, dict[str, list[float]]] = {}
    for p in phases:
        if p.rate == rate and not p.repeated:
            grouped.setdefault(p.slice, {})[p.target] = p.latencies
    return [grouped[turn] for turn in sorted(grouped)]


def spread(turns: Sequence[Mapping[str, Sequence[float]]], resamples: int = RESAMPLES, seed: int = 0) -> Spreads:
    """How far each added-p99 ratio moves with the turns that make it: `resamples` times, as many turns as
    there are are drawn with replacement, whole (a turn's targets stay together, so each draw still compares
    targets that ran seconds apart), their creates pooled and the ratios computed; the SPREAD quantiles of
    the draws. Where the spread holds the goal, the run cannot tell whether the goal is met."""
    if not turns:
        return {}
    draw = random.Random(seed)
    values: dict[tuple[str, str], list[float]] = {}
    for _ in range(resamples):
        drawn = draw.choices(turns, k=len(turns))
        pooled = {t: sorted(x for turn in drawn for x in turn.get(t, ())) for t in turns[0]}
        for pair, ratio in added_ratios(pooled).items():
            values.setdefault(pair, []).append(ratio)
    spreads = {}
    for pair, drawn_ratios in values.items():
        ordered = sorted(r for r in drawn_ratios if r == r)  # NaN: a draw in which a target had no answered create
        spreads[pair] = (percentile(ordered, SPREAD[0]), percentile(ordered, SPREAD[1]))
    return spreads


def _spread(spreads: Spreads, pair: tuple[str, str], goal: float | None = None) -> str:
    """The pair's spread over the turns, and against `goal`: met (all of it at or under), missed (all of it
    over) or not resolved."""
    if pair not in spreads:
        return "no spread"
    low, high = spreads[pair]
    text = f"{round((SPREAD[1] - SPREAD[0]) * 100)}% of turn draws {_times(low)} to {_times(high)}"
    if goal is None:
        return text
    verdict = "met" if high <= goal else "missed" if low > goal else "not resolved"
    return f"{text}: {verdict}"


def _times(ratio: float) -> str:
    """A ratio as the report writes it; "no bound" where the denominator added nothing in some draws."""
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "no bound"


# --- runs saved and pooled ------------------------------------------------------------------------


def save(path: Path, phases: Sequence[Phase]) -> None:
    """Each slice's target, rate, turn and latencies, and whether its turn was set aside: what --pool needs."""
    slices = [
        {"target": p.target, "rate": p.rate, "turn": p.slice, "repeated": p.repeated,
         "latencies": [round(x, 6) for x in p.latencies]}
        for p in phases
    ]  # fmt: skip
    write_atomic(path, json.dumps({"slices": slices}).encode(), 0o644)


def load(path: Path, run: int) -> list[Phase]:
    """A saved run's slices, each turn numbered `run` * 1000 + its own, so pooled runs pair only slices of one
    turn of one run."""
    try:
        slices = json.loads(path.read_bytes())["slices"]
        return [
            Phase(s["target"], int(s["rate"]), run * 1000 + int(s["turn"]),
                  latencies=[float(x) for x in s["latencies"]], repeated=bool(s["repeated"]))
            for s in slices
        ]  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as err:
        sys.exit(f"{path}: not a run saved by --save ({err})")


def pool_report(runs: Sequence[Sequence[Phase]]) -> str:
    """The runs' kept turns as one: each target's pooled p99 and added p99, each ratio with its spread over the
    turns of all the runs and turn by turn, and the worst-slice goal run by run (it is stated on one run)."""
    kept = [p for run in runs for p in run if not p.repeated]
    rates, names, totals = _pooled(kept)
    lines = [f"{len(runs)} runs pooled, the turns run again left out", ""]
    lines += _pooled_table(rates, names, totals)
    lines.append("")
    for rate in rates:
        lines += _pooled_ratios(rate, {t: totals[t, rate] for t in names}, by_turn(kept, rate))
    lines += ["", "Each run's worst slice of ours against go-floor's worst slice of the same run (goal 2x):"]
    lines += [_worst_of_run(number, run, rate) for number, run in enumerate(runs, start=1) for rate in rates]
    return "\n".join(lines)


def _pooled(kept: Sequence[Phase]) -> tuple[list[int], list[str], dict[tuple[str, int], Totals]]:
    """The rates and targets that ran, and each target's slices at each rate."""
    rates = sorted({p.rate for p in kept})
    names = [t for t in (*TARGETS, SAME_ANSWER) if any(p.target == t for p in kept)]
    return (
        rates,
        names,
        {(t, r): Totals([p for p in kept if (p.target, p.rate) == (t, r)]) for t in names for r in rates},
    )


def _pooled_table(rates: Sequence[int], names: Sequence[str], totals: dict[tuple[str, int], Totals]) -> list[str]:
    lines = [
        "| rate | target | turns | creates | p99 ms | p99.9 ms | added p99 ms |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for rate in rates:
        base = totals["none", rate].pct(0.99)
        for t in names:
            x = totals[t, rate]
            added = "" if t == "none" else f"{x.pct(0.99) - base:.1f}"
            lines.append(f"| {rate}/s | {t} | {len(x.slices)} | {len(x.latencies)} | {x.pct(0.99):.1f} "
                         f"| {x.pct(0.999):.1f} | {added} |")  # fmt: skip
    return lines


def _pooled_ratios(
    rate: int, totals: Mapping[str, Totals], turns: Sequence[Mapping[str, Sequence[float]]]
) -> list[str]:
    ratios, spreads = added_ratios({t: x.latencies for t, x in totals.items()}), spread(turns)
    lines = []
    for a, b in (pair for pair in PAIRS if pair in ratios):
        goal = GOALS.get((a, b))
        stated = f" (goal {goal:g}x)" if goal else ""
        lines.append(
            f"- {rate}/s, {a} ÷ {b}: added p99 {ratios[a, b]:.2f}x{stated}, {_spread(spreads, (a, b), goal)} "
            f"({len(turns)} turns); p99 {totals[a].against(totals[b])}"
        )
    return lines


def _worst_of_run(number: int, run: Sequence[Phase], rate: int) -> str:
    worst = {
        t: max((p.pct(0.99) for p in run if (p.target, p.rate) == (t, rate) and not p.repeated), default=math.nan)
        for t in ("ours", "ours-ptrace", "go-floor")
    }
    return (
        f"- run {number}, {rate}/s: ours {worst['ours'] / worst['go-floor']:.2f}x, ours-ptrace "
        f"{worst['ours-ptrace'] / worst['go-floor']:.2f}x (go-floor's worst {worst['go-floor']:.1f} ms)"
    )


def _quiet_closed(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
    """A create that timed out closed its connection; the TLS layer's late write to it is no news."""
    if isinstance(context.get("exception"), RuntimeError) and "handler is closed" in str(context["exception"]):
        return
    loop.default_exception_handler(context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--anchors", type=Path, help="the folder holding go-floor/ (every run needs it)")
    parser.add_argument("--pods", type=int, default=2000, help="measured creates per phase")
    parser.add_argument("--rates", type=lambda s: [int(r) for r in s.split(",")], default=[50, 100])
    parser.add_argument("--slices", type=int, default=5, help="each target's pods are sent in this many turns")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument(
        "--steal-bound",
        type=float,
        default=50.0,
        help="ms a second the hypervisor may take in a slice before its turn is run again (negative: never)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs of every process)")
    parser.add_argument("--profile", type=Path, help="sample our server with py-spy over the slices into this file")
    parser.add_argument(
        "--same-answer",
        action="store_true",
        help=f"add the control {SAME_ANSWER}: go-floor's code answering what our /mutate/ptrace answers",
    )
    parser.add_argument("--save", type=Path, help="write the run's slices here, for --pool")
    parser.add_argument(
        "--pool", type=Path, nargs="+", metavar="RUN", help="report runs saved with --save as one, and run nothing"
    )
    args = parser.parse_args()
    if args.pool:
        print(pool_report([load(path, number) for number, path in enumerate(args.pool, start=1)]))
        return
    if args.anchors is None:
        parser.error("--anchors is needed to run (or --pool to report saved runs)")
    if args.save and not args.save.resolve().parent.is_dir():
        parser.error(f"--save {args.save}: no such folder")
    go = _preflight(args.anchors.resolve(), args.same_answer)
    work = Path(tempfile.mkdtemp(prefix="copilot-webhook-pods-bench-"))
    started = time.monotonic()
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.get_loop().set_exception_handler(_quiet_closed)
            phases, info = runner.run(run(args, go, work))
    finally:
        if args.keep:
            print(f"work folder kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(report(phases, args, info))
    print(f"\n(the run took {time.monotonic() - started:.0f} s)")
    if args.save:
        save(args.save, phases)


if __name__ == "__main__":
    main()
