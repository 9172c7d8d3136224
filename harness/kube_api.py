"""The chart installed for real on the test control plane (harness/controlplane.py), and its webhook run the way
a kubelet would run the Deployment's pod: `ChartPods` starts the init container and the server as processes
of this checkout, with the rendered arguments, the ConfigMap's file, and the chart's ServiceAccount's token
(from the TokenRequest API), inside the control plane's network namespace, listening on the Service's
ClusterIP and port. The webhook runs this way in every test, those with a real node and kubelet
(harness/node.py) too: there the kubelet runs the pods the tests create, and the webhook's pod stays a
process of the test run, so coverage counts its lines and a test reads its log.

Tests talk to the API server as plain JSON over HTTPS (the server under test uses the `kubernetes`
client itself): what a test asserts is the object as the API server stores and returns it.
"""

from __future__ import annotations

import contextlib
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import pytest
import yaml

from harness.controlplane import NS_ADDRESS, ControlPlane
from harness.environment import child_env
from harness.node import publish_namespace_endpoint
from harness.server_process import stop_process

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "copilot-webhook"
Obj = dict[str, Any]
# The chart's podSecurity for a control plane started without PodSecurity defaults (the API server's own:
# privileged wherever no namespace label says otherwise).
PRIVILEGED_BY_DEFAULT: Obj = {"defaults": {"enforce": "privileged"}}
# A namespace labelled privileged: the chart assumes baseline where a namespace has no label, and the test API
# server enforces no default; the label says so, as an operator's would.
PRIVILEGED: Obj = {"pod-security.kubernetes.io/enforce": "privileged"}
# The real-node tests' failure policies, unless a test is about Ignore: a review the webhook could not
# answer, or could not decide, refuses the pod instead of admitting it unchanged.
FAIL: Obj = {"failurePolicy": "Fail", "webhook": {"failurePolicy": "Fail"}}


class KubeError(Exception):
    """A Status the API server answered with: its code, reason and message."""

    def __init__(self, status: int, body: Obj) -> None:
        self.status = status
        self.reason = str(body.get("reason", ""))
        self.message = str(body.get("message", body))
        super().__init__(f"{status} {self.reason}: {self.message}")


class Kube:
    """The API server as the admin (system:masters), or as a bearer token."""

    def __init__(self, plane: ControlPlane, token: str | None = None) -> None:
        self.plane = plane
        context = ssl.create_default_context(cafile=str(plane.ca_path))
        headers = {}
        if token is None:
            context.load_cert_chain(plane.workdir / "pki" / "admin.crt", plane.workdir / "pki" / "admin.key")
        else:
            headers["Authorization"] = f"Bearer {token}"
        self.http = httpx.Client(base_url=plane.url, verify=context, headers=headers, timeout=60)
        self._discovery: dict[str, dict[str, tuple[str, bool]]] = {}

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Obj:
        answer = self.http.request(method, path, json=body, **kwargs)
        result = answer.json() if answer.content else {}
        if answer.status_code >= 400:
            raise KubeError(answer.status_code, result if isinstance(result, dict) else {"message": result})
        assert isinstance(result, dict)
        return result

    def get(self, path: str, **params: str) -> Obj:
        return self.request("GET", path, params=params)

    def create(self, path: str, obj: Obj, *, dry_run: bool = False) -> Obj:
        return self.request("POST", path, obj, params={"dryRun": "All"} if dry_run else {})

    def patch(self, path: str, body: Any, kind: str = "merge") -> Obj:
        content_type = {"merge": "merge-patch+json", "json": "json-patch+json"}[kind]
        return self.request("PATCH", path, body, headers={"Content-Type": f"application/{content_type}"})

    def delete(self, path: str) -> Obj:
        return self.request("DELETE", path)

    def exists(self, path: str) -> bool:
        try:
            self.get(path)
        except KubeError as err:
            if err.status == 404:
                return False
            raise
        return True

    def path_of(self, obj: Obj) -> str:
        """An object's REST path, from the API server's own discovery of its kind."""
        api_version, kind = obj["apiVersion"], obj["kind"]
        prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        if prefix not in self._discovery:
            listing = self.get(prefix)["resources"]
            self._discovery[prefix] = {r["kind"]: (r["name"], r["namespaced"]) for r in listing if "/" not in r["name"]}
        plural, namespaced = self._discovery[prefix][kind]
        namespace = f"/namespaces/{obj['metadata'].get('namespace', 'default')}" if namespaced else ""
        return f"{prefix}{namespace}/{plural}/{obj['metadata']['name']}"

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        """A namespace and its `default` ServiceAccount (ServiceAccount admission needs it; no controller
        manager runs here to make it)."""
        try:
            self.create("/api/v1/namespaces", {"metadata": {"name": name, "labels": labels or {}}})
        except KubeError as err:
            if err.status != 409:
                raise
            self.patch(f"/api/v1/namespaces/{name}", {"metadata": {"labels": labels or {}}})
        with contextlib.suppress(KubeError):
            self.create(f"/api/v1/namespaces/{name}/serviceaccounts", {"metadata": {"name": "default"}})

    def create_pod(self, namespace: str, pod: Obj, *, dry_run: bool = False) -> Obj:
        return self.create(f"/api/v1/namespaces/{namespace}/pods", pod, dry_run=dry_run)

    def token(self, namespace: str, service_account: str, seconds: int = 3600) -> str:
        """A token from the TokenRequest API, as the kubelet projects one into a pod."""
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token"
        answer = self.create(path, {"spec": {"audiences": [], "expirationSeconds": seconds}})
        token = answer["status"]["token"]
        assert isinstance(token, str)
        return token


def objects(manifest: str) -> dict[str, Obj]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(manifest) if d}


def mwc_path(name: str) -> str:
    return f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}"


@dataclass
class Release:
    kube: Kube
    name: str
    namespace: str
    kubeconfig: Path
    manifest: dict[str, Obj] = field(default_factory=dict)  # what the last install or upgrade rendered

    @property
    def fullname(self) -> str:
        return f"{self.name}-copilot-webhook"

    def helm(self) -> helm.Config:
        return helm.Config(kubeconfig_path=str(self.kubeconfig), namespace=self.namespace)

    def install(self, values: Obj | None = None, chart: Path = CHART) -> dict[str, Obj]:
        release = self.helm().install(str(chart), self.name, values or {}, namespace=self.namespace, timeout=60)
        self.manifest = objects(release["manifest"])
        return self.manifest

    def upgrade(self, values: Obj | None = None, chart: Path = CHART) -> dict[str, Obj]:
        release = self.helm().upgrade(str(chart), self.name, values or {}, namespace=self.namespace, timeout=60)
        self.manifest = objects(release["manifest"])
        return self.manifest

    def remove_webhooks(self) -> None:
        """What a test module leaves behind must not mutate or validate the next module's pods."""
        kube = self.kube
        policies = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolic"
        for path in (
            mwc_path(self.fullname),
            f"{policies}ybindings/{self.fullname}-ptrace-drop",
            f"{policies}ies/{self.fullname}-ptrace-drop",
        ):
            with contextlib.suppress(KubeError):
                kube.delete(path)

    def bundles(self) -> set[str]:
        """The caBundle of each webhook ("" where there is none)."""
        return {w["clientConfig"].get("caBundle", "") for w in self.kube.get(mwc_path(self.fullname))["webhooks"]}

    def policies(self) -> dict[str, str]:
        return {w["name"]: w["failurePolicy"] for w in self.kube.get(mwc_path(self.fullname))["webhooks"]}

    def wait_policies(self, policy: str, timeout: float = 60) -> None:
        """Every webhook's failurePolicy is `policy`: the chart renders Ignore until there is a caBundle, and the
        server patches the declared ones in once its listener verifies against it. Past `timeout`, a failure
        with the policies stored."""
        if not wait_for(lambda: set(self.policies().values()) == {policy}, timeout=timeout, interval=0.5):
            pytest.fail(
                f"{self.fullname}: the webhooks' failurePolicy not {policy} in {timeout:.0f} s: {self.policies()}"
            )


@dataclass
class Replica:
    """One replica of the chart's Deployment, run as its pod would run it."""

    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.process)


class ChartPods:
    """Runs the rendered Deployment's init container and server container for a release."""

    def __init__(self, release: Release, workdir: Path, source: Path | None = None) -> None:
        """`source`: a checkout of another version of the server to run (an upgrade's starting point)."""
        self.source = source
        self.kube = release.kube
        self.plane = release.kube.plane
        self.release = release
        self.workdir = workdir
        self.replica: Replica | None = None  # the module's running replica, started by run()

    def run(self, name: str) -> Replica:
        """(Re)start the module's replica: the previous one is stopped first, as a rollout would."""
        self.stop()
        self.replica = self.start(name)
        return self.replica

    def stop(self) -> None:
        if self.replica is not None:
            self.replica.stop()
            self.replica = None

    def output(self) -> str:
        return self.replica.output() if self.replica else ""

    def _get(self, resource: str) -> Obj:
        return self.kube.get(f"/api/v1/namespaces/{self.release.namespace}/{resource}/{self.release.fullname}")

    def _pod_spec(self) -> Obj:
        path = f"/apis/apps/v1/namespaces/{self.release.namespace}/deployments/{self.release.fullname}"
        spec = self.kube.get(path)["spec"]["template"]["spec"]
        assert isinstance(spec, dict)
        return spec

    def _config_file(self, pod_dir: Path) -> Path:
        """The ConfigMap's file as the kubelet projects it, its paths into the pod's volumes made the pod's
        folder here (the server writes its certificate where server.tlsCert says)."""
        path = pod_dir / "etc" / "config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = self._get("configmaps")["data"]["config.yaml"]
        path.write_text(text.replace(" /tls/", f" {pod_dir / 'tls'}/"))
        assert "/tls/" not in text.replace(" /tls/", ""), "a path into the tls volume that is not localised"
        return path

    def service_address(self) -> tuple[str, int]:
        spec = self._get("services")["spec"]
        return spec["clusterIP"], next(int(p["port"]) for p in spec["ports"] if p["name"] == "https")

    def env(self, pod_dir: Path, service_account: str) -> dict[str, str]:
        token = self.kube.token(self.release.namespace, service_account)
        kubeconfig = self.plane.kubeconfig(pod_dir / "kubeconfig", token=token)
        host, port = self.service_address()
        env = child_env(
            KUBECONFIG=str(kubeconfig),
            POD_NAMESPACE=self.release.namespace,
            POD_IP=host,
            # The Service's port, on every address of the namespace (its ClusterIP, and the veth address the
            # tests reach it on): what kube-proxy would translate to the target port.
            COPILOT_WEBHOOK_SERVER__HOST="0.0.0.0",
            COPILOT_WEBHOOK_SERVER__PORT=str(port),
            HOME=str(pod_dir),
        )
        if self.source is not None:  # another version's code, not measured by this checkout's coverage
            env = {k: v for k, v in env.items() if not k.startswith("COVERAGE")} | {"PYTHONPATH": str(self.source)}
        return env

    def command(self, container: Obj, pod_dir: Path, config: Path) -> list[str]:
        """The container's arguments with its mounts replaced by the pod's folder on this machine."""
        mounts = {"=/tls": f"={pod_dir / 'tls'}", "=/etc/copilot-webhook/config.yaml": f"={config}"}
        args = []
        for arg in container.get("args") or []:
            for mount, local in mounts.items():
                arg = arg.replace(mount, local)
            args.append(arg)
        return self.plane.netns.command([sys.executable, "-m", "webhook", *args])

    def start(self, name: str) -> Replica:
        pod_dir = self.workdir / name
        (pod_dir / "tls").mkdir(parents=True, exist_ok=True)
        spec = self._pod_spec()
        config = self._config_file(pod_dir)
        env = self.env(pod_dir, spec["serviceAccountName"])
        for init in spec.get("initContainers") or []:
            done = subprocess.run(
                self.command(init, pod_dir, config), env=env, capture_output=True, text=True, timeout=60, check=False
            )
            assert done.returncode == 0, f"init container {init['name']}: {done.stdout}{done.stderr}"
        (server,) = spec["containers"]
        log = pod_dir / "server.log"
        with log.open("wb") as out:
            process = subprocess.Popen(self.command(server, pod_dir, config), env=env, stdout=out, stderr=out)
        replica = Replica(process, log)
        try:
            self._wait_listening(replica)
            publish_namespace_endpoint(self.kube, self.release.namespace, self.release.fullname)
        except BaseException:
            replica.stop()
            raise
        return replica

    def _wait_listening(self, replica: Replica, timeout: float = 30) -> None:
        _, port = self.service_address()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if replica.process.poll() is not None:
                raise RuntimeError(f"server exited: {replica.output()}")
            with contextlib.suppress(httpx.HTTPError), httpx.Client(verify=False, timeout=1) as probe:
                probe.get(f"https://{NS_ADDRESS}:{port}/healthz")
                return
            time.sleep(0.2)
        raise RuntimeError(f"server not listening on {port}: {replica.output()}")

    def metrics(self) -> str:
        """GET /metrics on the plain-HTTP metrics port."""
        (container,) = self._pod_spec()["containers"]
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
        answer = httpx.get(f"http://{NS_ADDRESS}:{port}/metrics", timeout=10)
        answer.raise_for_status()
        return answer.text

    def https(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """A request to the server's HTTPS port verifying the Service's name against the published
        caBundle, as the API server does."""
        import base64

        (bundle,) = self.release.bundles()
        context = ssl.create_default_context(cadata=base64.b64decode(bundle).decode())
        _, port = self.service_address()
        name = f"{self.release.fullname}.{self.release.namespace}.svc"
        with httpx.Client(base_url=f"https://{NS_ADDRESS}:{port}", verify=context, timeout=30) as client:
            return client.request(method, path, extensions={"sni_hostname": name}, **kwargs)

    def cli(self, service_account: str | None, *args: str) -> subprocess.CompletedProcess[str]:
        """A command of ours, run as a ServiceAccount (or as the admin: an operator at a terminal)."""
        work = self.workdir / f"cli-{time.monotonic_ns()}"
        if service_account is None:
            env = child_env(KUBECONFIG=str(self.plane.kubeconfig(work / "kubeconfig")), HOME=str(work))
        else:
            env = self.env(work, service_account)
        return subprocess.run(
            self.plane.netns.command([sys.executable, "-m", "webhook", *args]),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )


def wait_for(check: Callable[[], bool], timeout: float = 30, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return check()


# --- pods: waiting for a state, and what they showed when it did not come ------------------------------

EVENTS_SHOWN = 15  # the latest ones, in a failure's description


def events(kube: Kube, namespace: str, name: str) -> list[Obj]:
    """The events about an object, oldest first."""
    items: list[Obj] = kube.get(f"/api/v1/namespaces/{namespace}/events", fieldSelector=f"involvedObject.name={name}")[
        "items"
    ]
    items.sort(
        key=lambda e: (e.get("lastTimestamp") or e.get("eventTime") or "", int(e["metadata"]["resourceVersion"]))
    )
    return items


def _state(status: Obj) -> str:
    parts = []
    for key in ("state", "lastState"):
        for phase, detail in (status.get(key) or {}).items():
            fields = " ".join(f"{k}={detail[k]!r}" for k in ("reason", "exitCode", "message") if k in detail)
            parts.append(f"{'last ' if key == 'lastState' else ''}{phase} {fields}".rstrip())
    return f"{'; '.join(parts) or 'no state'}; restarts {status.get('restartCount', 0)}"


def _why(obj: Obj) -> str:
    return " ".join(str(obj[k]) for k in ("reason", "message") if obj.get(k))


def describe_pod(kube: Kube, namespace: str, name: str, pod: Obj | None = None) -> str:
    """What `kubectl describe` would show first: the pod's phase and conditions, each container's state
    (init containers first), and its latest events, as the API server has them now (or `pod`, as last seen)."""
    try:
        pod = pod or kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
    except KubeError as err:
        return f"pod {namespace}/{name}: {err}"
    status = pod.get("status", {})
    lines = [f"pod {namespace}/{name}: phase {status.get('phase')} {_why(status)}"]
    for condition in status.get("conditions") or []:
        if condition.get("status") != "True":
            lines.append(f"  {condition['type']}={condition['status']} {_why(condition)}")
    for field_name, kind in (("initContainerStatuses", "init "), ("containerStatuses", "")):
        for container in status.get(field_name) or []:
            lines.append(f"  {kind}container {container['name']}: {_state(container)}")
    seen = events(kube, namespace, name)
    lines.append(f"  events ({min(len(seen), EVENTS_SHOWN)} latest of {len(seen)}):")
    for event in seen[-EVENTS_SHOWN:]:
        when = event.get("lastTimestamp") or event.get("eventTime") or ""
        count = f" (x{event['count']})" if event.get("count", 1) > 1 else ""
        lines.append(f"    {when} {event.get('type')} {event['reason']}{count}: {event.get('message', '')}")
    return "\n".join(line.rstrip() for line in lines)


def wait_pod(
    kube: Kube,
    namespace: str,
    name: str,
    check: Callable[[Obj], bool],
    what: str,
    timeout: float = 120,
    more: Callable[[], str] | None = None,
) -> Obj:
    """The pod, once `check` holds for it. Past `timeout` the test fails: the pod was not `what`, with its
    last status and events (and `more`, e.g. the node's logs)."""
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"
    deadline = time.monotonic() + timeout
    while True:
        pod = kube.get(path)
        if check(pod):
            return pod
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    detail = describe_pod(kube, namespace, name, pod)
    pytest.fail(f"not {what} within {timeout:.0f} s: {detail}" + (f"\n{more()}" if more else ""))


def pods_left(kube: Kube, namespace: str, names: list[str], timeout: float = 60) -> str:
    """Waits for deleted pods to be gone: "" once they are, else a description of each pod left."""
    paths = {name: f"/api/v1/namespaces/{namespace}/pods/{name}" for name in names}
    if wait_for(lambda: not any(kube.exists(p) for p in paths.values()), timeout=timeout, interval=0.5):
        return ""
    left = [describe_pod(kube, namespace, name) for name, path in paths.items() if kube.exists(path)]
    return f"{len(left)} deleted pods still there after {timeout:.0f} s:\n" + "\n".join(left)


def release(kube: Kube, name: str, workdir: Path, values: Obj | None = None) -> Release:
    """`helm install` of the chart as `name` in a namespace of the same name."""
    kube.create_namespace(name)
    installed = Release(kube, name, name, kube.plane.kubeconfig(workdir / "admin.kubeconfig"))
    installed.install(values)
    return installed


def started(release: Release, workdir: Path, policy: str | None = None) -> Iterator[ChartPods]:
    """A module's running replica of `release`, once its webhooks' failurePolicy is `policy` (when given);
    its webhooks removed when the module is done."""
    pods = ChartPods(release, workdir)
    pods.run("replica")
    try:
        if policy is not None:
            release.wait_policies(policy)
        yield pods
    finally:
        pods.stop()
        release.remove_webhooks()


class Hooks:
    """Runs the Jobs Helm's hooks create, as their pods would run (the Job's ServiceAccount, its args), and
    records the outcome in the Job's status the way the Job controller would, so Helm's wait completes."""

    def __init__(self, pods: ChartPods) -> None:
        self.pods = pods
        self.ran: list[tuple[str, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Hooks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        jobs = f"/apis/batch/v1/namespaces/{self.pods.release.namespace}/jobs"
        seen: set[str] = set()
        while not self._stop.wait(0.2):
            for job in self.pods.kube.get(jobs)["items"]:
                if job["metadata"]["uid"] not in seen and not job.get("status", {}).get("conditions"):
                    seen.add(job["metadata"]["uid"])
                    self._run(f"{jobs}/{job['metadata']['name']}", job)

    def _run(self, path: str, job: Obj) -> None:
        spec = job["spec"]["template"]["spec"]
        pod_dir = self.pods.workdir / f"job-{job['metadata']['name']}"
        config = pod_dir / "etc" / "config.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text("{}\n")
        env = self.pods.env(pod_dir, spec["serviceAccountName"])
        (container,) = spec["containers"]
        started_at = _now()
        done = subprocess.run(
            self.pods.command(container, pod_dir, config),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        self.ran.append((job["metadata"]["name"], done.returncode, done.stdout + done.stderr))
        finished = _now()
        condition = {"status": "True", "lastProbeTime": finished, "lastTransitionTime": finished}
        status: Obj = {"startTime": started_at}
        if done.returncode == 0:
            # The Job controller of 1.35 sets SuccessCriteriaMet before Complete; validation requires both.
            conditions = [{"type": "SuccessCriteriaMet", **condition}, {"type": "Complete", **condition}]
            status.update(completionTime=finished, succeeded=1, conditions=conditions)
        else:
            conditions = [{"type": "FailureTarget", **condition}, {"type": "Failed", **condition}]
            status.update(failed=1, conditions=conditions)
        self.pods.kube.patch(f"{path}/status", {"status": status})


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
