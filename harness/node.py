"""A node that runs the pods: Debian's containerd with its CRI plugin, the kubelet and kube-proxy built from
the same Kubernetes module as the API server (harness/gotools.py), all inside the control plane's network
namespace (harness/controlplane.py); the kubelet and kube-proxy hold client certificates of their own (the
Node authorizer is on). Nothing is pulled from the internet: the sandbox (pause) image is built from Kubernetes' own
build/pause/linux/pause.c read from the Go module cache, compiled with `gcc -Os -static`, packed by umoci
and imported into containerd; the images under test are built by dockerd and imported the same way.

Pods run with `hostNetwork: true` (the namespace's network: the API server, the webhook's ClusterIP, a
registry on 127.0.0.1), or on a bridge of Debian's CNI plugins. The node's kube-controller-manager runs
the controllers pods and Services need: root-ca-cert-publisher (kube-root-ca.crt, read by every service
account volume), daemonset, endpointslice, and nodelifecycle (it lifts the not-ready taint the API server
puts on a new Node once its kubelet reports Ready; no DaemonSet selects a node that keeps it). No
kube-scheduler runs: a DaemonSet's pods are bound to the node their required node affinity names
(`DaemonSetBinder`), the one part of scheduling they need.

Services are routed by the real kube-proxy (iptables mode, its cluster CIDR the pods' range): its rules
decide for every Service, the `kubernetes` one too (the API server publishes its EndpointSlice), and honour
internalTrafficPolicy: Local (an endpoint on another node is never used from here; none here, dropped).
Bridged traffic reaches those rules through br_netfilter; where the kernel has no br_netfilter, kube-proxy
masquerades every Service connection instead, so a reply between two pods of the bridge still passes back
through the namespace to be translated. The namespace's loopback answers for the whole Service range
(harness/controlplane.py), so a connection kube-proxy does not translate is delivered locally instead of
forwarded: kube-proxy's filter chain of Services (its rejects and drops) is jumped to from INPUT as well.

A Service whose server is a process in the namespace rather than a pod (the chart's webhook,
harness/kube_api.py) has no endpoint the EndpointSlice controller could publish, and kube-proxy rejects
connections to a Service without endpoints. Such a server listens on every address of the namespace, as a
hostNetwork pod would, so `publish_namespace_endpoint` writes the EndpointSlice that pod would have: the
node's address and the Service's ports, under a manager name of its own that the EndpointSlice controller
leaves alone. Without a node (no kube-proxy), the namespace's loopback route over the Service range answers
for the ClusterIP itself, and the EndpointSlice is read by nobody.

The cluster DNS is a small server of our own at 10.96.0.10, no Service (`ServiceDNS`): it answers the names
in its `records`, and `<service>.<namespace>.svc.cluster.local` of any Service with a ClusterIP from the API.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from harness.controlplane import NS_ADDRESS, ControlPlane, Process, client_certificate
from harness.daemons import ARCH
from harness.environment import unavailable
from harness.gotools import KUBERNETES_VERSION, TOOLS
from harness.server_process import stop_process

NODE_NAME = "cw-node"
POD_CIDR = "10.224.0.0/24"  # the CNI bridge's pods
BRIDGE_GATEWAY = "10.224.0.1"
DNS_ADDRESS = "10.96.0.10"  # inside the Service range, so the namespace's loopback answers for it
KUBERNETES_SERVICE = "10.96.0.1"  # the first address of the range: the `kubernetes` Service
# The manager named on the EndpointSlices of servers run as processes in the namespace; the EndpointSlice
# controller manages only slices that name it.
NAMESPACE_ENDPOINTS = "copilot-webhook-tests"
CNI_BIN = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
NODE_TOOLS = (
    "containerd", "ctr", "runc", "gcc", "umoci", "go", "iptables", "iptables-save", "iptables-restore", "nsenter", "ip",
)  # fmt: skip

if TYPE_CHECKING:
    from harness.kube_api import Kube

Obj = dict[str, Any]


def require_node() -> None:
    """Skip without what the node needs; under CI=true its absence is a failure, never a skip."""
    missing = [t for t in NODE_TOOLS if shutil.which(t) is None]
    missing += [str(CNI_BIN / p) for p in ("bridge", "host-local", "loopback") if not (CNI_BIN / p).exists()]
    if os.geteuid() != 0:
        missing.append("root")
    if missing:
        unavailable(f"the node needs {', '.join(missing)} (Debian packages and Go; .ci/run installs them)")


def cgroup_v1() -> bool:
    """cgroup v2 mounts the unified hierarchy at /sys/fs/cgroup itself, with its controllers file."""
    return not Path("/sys/fs/cgroup/cgroup.controllers").exists()


# --- the sandbox image ----------------------------------------------------------------------------------


def kubernetes_module() -> Path:
    done = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True, timeout=60)
    module = Path(done.stdout.strip()) / f"k8s.io/kubernetes@{KUBERNETES_VERSION}"
    if not module.is_dir():  # the module's source arrives with `go mod download` (make go-tools does it)
        subprocess.run(
            ["go", "mod", "download", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"],
            cwd=TOOLS["kubelet"].module_dir,
            check=True,
            capture_output=True,
            timeout=600,
        )
    return module


def pause_tag(module: Path) -> str:
    """The tag Kubernetes' own build gives the image (build/pause/Makefile's TAG)."""
    match = re.search(r"^TAG \?= (\S+)$", (module / "build" / "pause" / "Makefile").read_text(), re.M)
    assert match, "build/pause/Makefile has no TAG"
    return match.group(1)


def oci_archive(layout: Path, archive: Path) -> Path:
    """An OCI image layout as the tar `ctr images import` reads."""
    with tarfile.open(archive, "w") as tar:
        for entry in sorted(layout.iterdir()):
            tar.add(entry, arcname=entry.name)
    return archive


def build_pause_image(work: Path) -> tuple[str, Path]:
    """registry.k8s.io/pause:<TAG> from pause.c, exactly as build/pause/Makefile compiles it (its -Wall
    -Werror too), one static binary in an otherwise empty image that runs as 65535."""
    module = kubernetes_module()
    tag = pause_tag(module)
    work.mkdir(parents=True, exist_ok=True)
    binary = work / "pause"
    subprocess.run(
        ["gcc", "-Os", "-Wall", "-Werror", "-static", f"-DVERSION=v{tag}-copilot-webhook-tests", "-o", str(binary),
         str(module / "build" / "pause" / "linux" / "pause.c")],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    layout = work / "oci"
    image = f"{layout}:{tag}"
    for command in (
        ["umoci", "init", "--layout", str(layout)],
        ["umoci", "new", "--image", image],
        ["umoci", "insert", "--rootless", "--image", image, str(binary), "/pause"],
        ["umoci", "config", "--image", image, "--os", "linux", "--architecture", ARCH,
         "--config.entrypoint", "/pause", "--config.user", "65535:65535"],
    ):  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, timeout=60)
    return f"registry.k8s.io/pause:{tag}", oci_archive(layout, work / "pause.tar")


# --- containerd -----------------------------------------------------------------------------------------


def _containerd_config(work: Path, sandbox_image: str) -> str:
    cri = '[plugins."io.containerd.grpc.v1.cri"]'
    runc = '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]'
    return "\n".join(
        [
            "version = 2",
            f'root = "{work / "root"}"',
            f'state = "{work / "state"}"',
            "[grpc]",
            f'  address = "{work / "containerd.sock"}"',
            "[ttrpc]",
            f'  address = "{work / "ttrpc.sock"}"',
            cri,
            "  disable_tcp_service = true",
            f'  sandbox_image = "{sandbox_image}"',
            # The kubelet asks for oom_score_adj -998 on sandboxes; lowering a score needs CAP_SYS_RESOURCE,
            # which a machine (a container itself) may not grant root: runc then fails every pod with
            # "nsexec: failed to update /proc/self/oom_score_adj: Permission denied". Restricted, containerd
            # clamps the score to its own, as it does for rootless nodes.
            f"  restrict_oom_score_adj = {'false' if _has_sys_resource() else 'true'}",
            runc,
            '  runtime_type = "io.containerd.runc.v2"',
            runc[:-1] + ".options]",
            "  SystemdCgroup = false",  # the kubelet's cgroupDriver is cgroupfs: both must agree
            cri[:-1] + ".cni]",
            f'  bin_dir = "{CNI_BIN}"',
            f'  conf_dir = "{work / "cni"}"',
            cri[:-1] + ".registry]",
            f'  config_path = "{work / "certs.d"}"',
            '[plugins."io.containerd.internal.v1.opt"]',
            f'  path = "{work / "opt"}"',
        ]
    )


def _has_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)  # CAP_SYS_RESOURCE
    return False


def _cni_config(work: Path) -> str:
    return json.dumps(
        {
            "cniVersion": "0.4.0",
            "name": "cw-pods",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cw0",
                    "isGateway": True,
                    "isDefaultGateway": True,  # every address, the Service range too, goes to the node's namespace
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR, "gateway": BRIDGE_GATEWAY}]],
                        "dataDir": str(work / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
    )


# --- the kubelet ----------------------------------------------------------------------------------------


def kubelet_config(work: Path, containerd_socket: Path, ca: Path) -> Obj:
    config: Obj = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": f"unix://{containerd_socket}",
        "cgroupDriver": "cgroupfs",  # containerd's runc runs with SystemdCgroup = false
        "failSwapOn": False,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "AlwaysAllow"},  # only holders of a cluster certificate get this far
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "clusterDNS": [DNS_ADDRESS],
        "clusterDomain": "cluster.local",
        "podLogsDir": str(work / "pod-logs"),
        "volumePluginDir": str(work / "volume-plugins"),  # not /usr/libexec/kubernetes: the machine is shared
        "resolvConf": str(work / "resolv.conf"),
        # A shared test machine's disk is what it is: evict only when it is truly exhausted, and never
        # garbage-collect the images the tests imported.
        "evictionHard": {
            "memory.available": "50Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "syncFrequency": "5s",
        "fileCheckFrequency": "5s",
        "nodeStatusUpdateFrequency": "5s",
        "volumeStatsAggPeriod": "0s",
    }
    if cgroup_v1():
        config["failCgroupV1"] = False  # 1.35 refuses cgroup v1 unless told, and these machines run it
    return config


# --- the cluster DNS ------------------------------------------------------------------------------------


class ServiceDNS:
    """Answers A queries for the names in `records` (name -> IPv4), then for those `lookup` finds (a
    Service's name), NXDOMAIN for anything else: the part of a cluster DNS the tests' pods use. Its socket
    is bound inside the node's network namespace."""

    def __init__(
        self, netns: str, address: str = DNS_ADDRESS, lookup: Callable[[str], str | None] | None = None
    ) -> None:
        self.records: dict[str, str] = {}
        self.queries: list[str] = []
        self._lookup = lookup
        self._sock = _socket_in(netns, socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((address, 53))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, peer = self._sock.recvfrom(512)
            except TimeoutError:
                continue
            with contextlib.suppress(ValueError, IndexError, struct.error, OSError):
                self._sock.sendto(self._answer(query), peer)

    def _answer(self, query: bytes) -> bytes:
        (ident,) = struct.unpack("!H", query[:2])
        labels, offset = [], 12
        while query[offset]:
            length = query[offset]
            labels.append(query[offset + 1 : offset + 1 + length].decode().lower())
            offset += 1 + length
        question = query[12 : offset + 5]
        qtype = struct.unpack("!H", query[offset + 1 : offset + 3])[0]
        name = ".".join(labels)
        self.queries.append(name)
        address = self.records.get(name)
        if address is None and self._lookup is not None:
            address = self._lookup(name)
        if address is None:
            return struct.pack("!HHHHHH", ident, 0x8183, 1, 0, 0, 0) + question  # NXDOMAIN
        if qtype != 1:  # the name exists, without records of that type (AAAA)
            return struct.pack("!HHHHHH", ident, 0x8180, 1, 0, 0, 0) + question
        answer = struct.pack("!HHHLH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(address)
        return struct.pack("!HHHHHH", ident, 0x8180, 1, 1, 0, 0) + question + answer

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def service_address(plane: ControlPlane, name: str) -> str | None:
    """The ClusterIP of the Service `<service>.<namespace>.svc.cluster.local` names, as the API server has
    it; None for any other name, a Service that does not exist, or a headless one."""
    parts = name.split(".")
    if len(parts) != 5 or parts[2:] != ["svc", "cluster", "local"] or not all(_LABEL.fullmatch(p) for p in parts[:2]):
        return None
    try:
        with plane.urlopen(f"/api/v1/namespaces/{parts[1]}/services/{parts[0]}") as answer:
            cluster_ip = json.loads(answer.read())["spec"].get("clusterIP")
    except OSError:  # 404 included (HTTPError)
        return None
    return cluster_ip if isinstance(cluster_ip, str) and cluster_ip not in ("", "None") else None


def connects_in(netns: str, host: str, port: int, timeout: float = 2) -> bool:
    """A TCP connection from inside `netns` (the host network of the node's pods) is accepted."""
    with _socket_in(netns, socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect((host, port))
        except OSError:
            return False
        return True


def _socket_in(netns: str, family: int, kind: int) -> socket.socket:
    """A socket of `netns`: created by a thread that entered it (setns moves the calling thread only)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    made: list[socket.socket] = []
    errors: list[int] = []

    def make() -> None:
        with open(f"/run/netns/{netns}") as handle:
            if libc.setns(handle.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
                errors.append(ctypes.get_errno())
                return
        made.append(socket.socket(family, kind))

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if errors:
        raise OSError(errors[0], f"setns into {netns}")
    return made[0]


# --- the node -------------------------------------------------------------------------------------------


@dataclass
class Node:
    plane: ControlPlane
    work: Path
    name: str
    containerd_socket: Path
    sandbox_image: str
    dns: ServiceDNS
    processes: list[Process] = field(default_factory=list)
    # kube-proxy masquerades every Service connection (no br_netfilter): a pod's own address is not what the
    # endpoint sees.
    masquerades_pods: bool = False

    @property
    def pod_logs(self) -> Path:
        return self.work / "pod-logs"

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = ["ctr", "--address", str(self.containerd_socket), "--namespace", "k8s.io", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, check=check)

    def import_image(self, archive: Path, base_name: str | None = None) -> None:
        args = ["images", "import"]
        if base_name is not None:
            args.append(f"--base-name={base_name}")
        self.ctr(*args, str(archive))

    def images(self) -> list[str]:
        return self.ctr("images", "ls", "--quiet").stdout.split()

    def references(self, reference: str) -> list[str]:
        """The names containerd holds for `reference`'s repository: its tags and the digests CRI adds."""
        repository = _repository(reference)
        return [name for name in self.images() if _repository(name) == repository]

    def remove_image(self, reference: str) -> None:
        """Every name of `reference`'s repository; the kubelet then finds the image absent."""
        names = self.references(reference)
        if names:
            self.ctr("images", "rm", *names)

    def trust(self, host: str, server: str) -> None:
        """How containerd itself reaches a registry (hosts.toml): a plain-HTTP one on loopback."""
        directory = self.work / "containerd" / "certs.d" / host
        directory.mkdir(parents=True, exist_ok=True)
        lines = [f'server = "{server}"', f'[host."{server}"]', '  capabilities = ["pull", "resolve"]']
        (directory / "hosts.toml").write_text("\n".join(lines) + "\n")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.log.read_text(errors='replace')[-6000:]}" for p in self.processes)

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        """What the container wrote, from the kubelet's log files (the API server has no kubelet client
        certificate here, so `pods/log` is not served)."""
        texts = [
            p.read_text(errors="replace") for p in sorted(self.pod_logs.glob(f"{namespace}_{pod}_*/{container}/*.log"))
        ]
        return "".join(texts)

    def iptables_rules(self) -> str:
        """The rules of the node's network namespace (kube-proxy's among them), as iptables-save prints them."""
        command = self.plane.netns.command(["iptables-save"])
        return subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout

    def containerd_log(self) -> str:
        (process,) = (p for p in self.processes if p.name == "containerd")
        return process.log.read_text(errors="replace")

    def running_tasks(self) -> dict[str, int]:
        """containerd's running tasks: container ID -> the host PID of the container's process."""
        out = {}
        for line in self.ctr("tasks", "ls").stdout.splitlines()[1:]:  # TASK PID STATUS
            task, pid, status = line.split()
            if status == "RUNNING":
                out[task] = int(pid)
        return out

    def container_labels(self, container_id: str) -> dict[str, str]:
        """The labels containerd's CRI gave a container: its pod's namespace and name, and (not for a
        sandbox) its container's name, under io.kubernetes.*."""
        labels: dict[str, str] = json.loads(self.ctr("containers", "info", container_id).stdout).get("Labels") or {}
        return labels


# Linux's capabilities by bit number (linux/capability.h), as /proc/<pid>/status masks them.
CAPABILITIES = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
    "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
    "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
    "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
    "CHECKPOINT_RESTORE",
)  # fmt: skip


def capability_names(mask: int) -> frozenset[str]:
    """The capabilities of a mask, by name (a bit beyond the table as CAP_<bit>)."""
    bits = [bit for bit in range(mask.bit_length()) if mask >> bit & 1]
    return frozenset(CAPABILITIES[bit] if bit < len(CAPABILITIES) else f"CAP_{bit}" for bit in bits)


@dataclass(frozen=True)
class ProcessStatus:
    """A container's process as the kernel shows it in /proc/<pid>/status."""

    pid: int
    name: str  # the command name (comm, at most 15 characters)
    uid: int  # the effective uid
    effective: int  # CapEff

    @property
    def capabilities(self) -> frozenset[str]:
        return capability_names(self.effective)


def process_status(pid: int, container_id: str) -> ProcessStatus | None:
    """/proc/<pid>/status of a container's process, read in one go; None if the PID is gone or is not in
    that container's cgroup (read after the status, so the status is of the container's process)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if container_id not in cgroups:
        return None
    fields = {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}
    uids = fields["Uid"].split()  # real, effective, saved, filesystem
    return ProcessStatus(pid, fields["Name"], int(uids[1]), int(fields["CapEff"], 16))


def _repository(reference: str) -> str:
    """`host:port/path:tag` or `host:port/path@sha256:...` without its tag or digest."""
    name = reference.partition("@")[0]
    last = name.rpartition("/")[2]
    return name.rpartition(":")[0] if ":" in last else name


@dataclass
class NodeRegistry:
    """The distribution registry on the node's loopback (127.0.0.1 inside the namespace): what the
    node's containerd pulls from. Images are pushed by skopeo from inside the namespace too."""

    node: Node
    port: int
    user: tuple[str, str] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def push(self, layout: Path, tag: str, repository: str) -> str:
        reference = f"{self.host}/{repository}:{tag}"
        command = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false"]
        if self.user is not None:
            command.append(f"--dest-creds={self.user[0]}:{self.user[1]}")
        command += [f"oci:{layout}:{tag}", f"docker://{reference}"]
        subprocess.run(self.node.plane.netns.command(command), check=True, capture_output=True, timeout=120)
        return reference


@contextlib.contextmanager
def node_registry(the_node: Node, user: tuple[str, str] | None = None) -> Iterator[NodeRegistry]:
    """A plain-HTTP registry (with htpasswd authentication when `user` is given), trusted by containerd."""
    import random

    port = random.randrange(20000, 30000)  # the namespace is ours: any port is free in it
    work = the_node.work / f"registry-{port}"
    work.mkdir(parents=True)
    config = [
        "version: 0.1",
        "log: {level: info, accesslog: {disabled: false}}",
        f"storage: {{filesystem: {{rootdirectory: {work / 'data'}}}, delete: {{enabled: true}}}}",
        f"http: {{addr: '127.0.0.1:{port}'}}",
    ]
    if user is not None:
        htpasswd = subprocess.run(["htpasswd", "-Bbn", *user], check=True, capture_output=True, text=True).stdout
        (work / "htpasswd").write_text(htpasswd)
        config.append(f"auth: {{htpasswd: {{realm: test, path: {work / 'htpasswd'}}}}}")
    (work / "config.yml").write_text("\n".join(config) + "\n")
    processes: list[Process] = []
    process = _spawn(
        processes,
        the_node.plane,
        the_node.work,
        f"registry-{port}",
        ["docker-registry", "serve", str(work / "config.yml")],
    )
    try:
        _wait(lambda: _listening_in(the_node.plane.netns.name, port), "docker-registry", process, 30)
        the_node.trust(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}")
        yield NodeRegistry(the_node, port, user)
    finally:
        stop_process(process.popen)


def _listening_in(netns: str, port: int) -> bool:
    with _socket_in(netns, socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _spawn(node_processes: list[Process], plane: ControlPlane, work: Path, name: str, argv: Sequence[str]) -> Process:
    log = work / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(plane.netns.command(argv), stdout=out, stderr=subprocess.STDOUT)
    process = Process(name, popen, log)
    node_processes.append(process)
    return process


def _wait(check: Callable[[], bool], what: str, process: Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.popen.returncode}:\n{process.log.read_text()[-4000:]}")
        if check():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready within {timeout} s:\n{process.log.read_text()[-4000:]}")


def _iptables(plane: ControlPlane, *args: str) -> None:
    subprocess.run(plane.netns.command(["iptables", "-w", *args]), check=True, capture_output=True, timeout=30)


# --- kube-proxy -------------------------------------------------------------------------------------------


def kube_proxy_config(kubeconfig: Path, name: str, masquerade_all: bool) -> Obj:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": name,  # the endpoints of internalTrafficPolicy: Local are those of this nodeName
        "mode": "iptables",
        "clusterCIDR": POD_CIDR,
        "detectLocalMode": "ClusterCIDR",
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "oomScoreAdj": 0,  # lowering it needs CAP_SYS_RESOURCE
        # The machine's conntrack table size and timeouts stay as they are (0: untouched); the machine is shared.
        "conntrack": {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "iptables": {"masqueradeAll": masquerade_all, "localhostNodePorts": False},
    }


def _bridge_netfilter(plane: ControlPlane) -> bool:
    """Bridged frames pass the namespace's iptables (br_netfilter, per network namespace): a pod's reply to
    another pod of the bridge, which reached it through a ClusterIP, is translated back. False where the
    kernel has no br_netfilter."""
    setting = "/proc/sys/net/bridge/bridge-nf-call-iptables"
    done = subprocess.run(
        plane.netns.command(["sh", "-c", f"test -e {setting} && echo 1 > {setting}"]),
        capture_output=True,
        timeout=30,
        check=False,
    )
    return done.returncode == 0


def _routes_kubernetes(plane: ControlPlane) -> bool:
    """kube-proxy has written the `kubernetes` Service's rule: its first sync is done."""
    done = subprocess.run(
        plane.netns.command(["iptables", "-w", "-t", "nat", "-S", "KUBE-SERVICES"]),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return f"-d {KUBERNETES_SERVICE}/32" in done.stdout


def _start_kube_proxy(processes: list[Process], plane: ControlPlane, work: Path, binary: Path, name: str) -> bool:
    """kube-proxy, once it routes the `kubernetes` Service; whether it masquerades every Service connection."""
    proxy_work = work / "kube-proxy"
    proxy_work.mkdir()
    certificate = client_certificate(plane.ca, "system:kube-proxy")  # bound to system:node-proxier by default
    kubeconfig = plane.kubeconfig(proxy_work / "kubeconfig", client=certificate)
    masquerade_all = not _bridge_netfilter(plane)
    config = kube_proxy_config(kubeconfig, name, masquerade_all)
    (proxy_work / "config.yaml").write_text(yaml.safe_dump(config))
    process = _spawn(
        processes, plane, work, "kube-proxy", [str(binary), f"--config={proxy_work / 'config.yaml'}", "--v=2"]
    )
    _wait(lambda: _routes_kubernetes(plane), "kube-proxy", process, 60)
    # The namespace's loopback answers for the whole Service range, so a pod's connection to a ClusterIP that
    # kube-proxy does not translate is delivered here (INPUT) rather than forwarded (FORWARD, where kube-proxy
    # rejects or drops it): kube-proxy's verdicts apply to INPUT as well.
    _iptables(plane, "-A", "INPUT", "-m", "conntrack", "--ctstate", "NEW", "-j", "KUBE-SERVICES")
    return masquerade_all


def publish_namespace_endpoint(kube: Kube, namespace: str, service: str, timeout: float = 30) -> None:
    """The EndpointSlice of a Service whose server is a process of the namespace listening on the Service's
    own ports on every address: the node's address, as a hostNetwork pod's endpoint. Returns once a
    connection to the ClusterIP reaches the server (kube-proxy, where it runs, has taken the endpoint)."""
    from harness.kube_api import KubeError, wait_for

    spec = kube.get(f"/api/v1/namespaces/{namespace}/services/{service}")["spec"]
    ports = [
        {"name": p.get("name", ""), "port": p["port"], "protocol": p.get("protocol", "TCP")} for p in spec["ports"]
    ]
    content: Obj = {"endpoints": [{"addresses": [NS_ADDRESS], "conditions": {"ready": True}}], "ports": ports}
    labels = {"kubernetes.io/service-name": service, "endpointslice.kubernetes.io/managed-by": NAMESPACE_ENDPOINTS}
    path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
    name = f"{service}-namespace"
    try:
        kube.create(path, {"metadata": {"name": name, "labels": labels}, "addressType": "IPv4", **content})
    except KubeError as err:
        if err.status != 409:
            raise
        kube.patch(f"{path}/{name}", content)
    address, port = spec["clusterIP"], int(spec["ports"][0]["port"])
    if not wait_for(lambda: connects_in(kube.plane.netns.name, address, port), timeout=timeout, interval=0.3):
        raise RuntimeError(f"{namespace}/{service}: {address}:{port} refused {timeout:.0f} s after its EndpointSlice")


class DaemonSetBinder:
    """What kube-scheduler does for a DaemonSet's pod: a Binding to the node its required node affinity
    names (the DaemonSet controller writes `metadata.name In [<node>]`), when that node is this one."""

    def __init__(self, plane: ControlPlane, node_name: str, interval: float = 0.3) -> None:
        from harness.kube_api import Kube

        self.node_name = node_name
        self.bound: list[str] = []  # namespace/name
        self._kube = Kube(plane)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import httpx

        from harness.kube_api import KubeError

        while not self._stop.wait(self._interval):
            try:
                pending = self._kube.get("/api/v1/pods", fieldSelector="spec.nodeName=")["items"]
            except (KubeError, httpx.HTTPError):
                continue
            for pod in pending:
                meta = pod["metadata"]
                owners = [o for o in meta.get("ownerReferences") or [] if o.get("controller")]
                if [o["kind"] for o in owners] != ["DaemonSet"] or self.node_name not in _affinity_nodes(pod):
                    continue
                binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"]},
                           "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name}}  # fmt: skip
                with contextlib.suppress(KubeError, httpx.HTTPError):
                    self._kube.create(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding", binding)
                    self.bound.append(f"{meta['namespace']}/{meta['name']}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._kube.close()


def _affinity_nodes(pod: Obj) -> set[str]:
    """The node names a pod's required node affinity allows by `metadata.name In`."""
    required = (
        (pod["spec"].get("affinity") or {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution")
    )
    names: set[str] = set()
    for term in (required or {}).get("nodeSelectorTerms") or []:
        for field_ in term.get("matchFields") or []:
            if field_.get("key") == "metadata.name" and field_.get("operator") == "In":
                names.update(field_.get("values") or [])
    return names


def _node_ready(plane: ControlPlane, name: str) -> bool:
    try:
        with plane.urlopen(f"/api/v1/nodes/{name}") as answer:
            node = json.loads(answer.read())
    except OSError:
        return False
    conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
    return conditions.get("Ready") == "True"


def unmount_under(root: Path) -> None:
    """Whatever the kubelet and containerd left mounted under `root` (secret volumes, rootfs, shm)."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == str(root) or point.startswith(f"{root}/"):
            mounts.append(point)
    for point in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False, timeout=30)


def _remove_cgroups(name: str) -> None:
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / name
        if not top.is_dir():
            continue
        for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def _make_cgroup_root(name: str) -> None:
    """The kubelet's cgroupRoot must exist in every hierarchy; one of the node's own keeps its pods apart
    from anything else on the machine."""
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        if hierarchy.is_dir() and not hierarchy.is_symlink() and hierarchy.name != "unified":
            (hierarchy / name).mkdir(exist_ok=True)


@contextlib.contextmanager
def node(
    plane: ControlPlane, work: Path, kubelet: Path, controller_manager: Path, proxy: Path, name: str = NODE_NAME
) -> Iterator[Node]:
    """containerd, the kubelet and kube-proxy, started in the control plane's network namespace, the
    controllers of the node's pods and Services, and the binder of its DaemonSets' pods."""
    work.mkdir(parents=True, exist_ok=True)
    processes: list[Process] = []
    cgroup = f"cwk{os.getpid()}"
    dns: ServiceDNS | None = None
    binder: DaemonSetBinder | None = None
    try:
        sandbox_image, pause_archive = build_pause_image(work / "pause")
        ctd = work / "containerd"
        for directory in ("certs.d", "cni", "opt"):
            (ctd / directory).mkdir(parents=True, exist_ok=True)
        (ctd / "cni" / "10-cw-pods.conflist").write_text(_cni_config(ctd))
        (ctd / "config.toml").write_text(_containerd_config(ctd, sandbox_image) + "\n")
        socket_path = ctd / "containerd.sock"
        containerd = _spawn(processes, plane, work, "containerd", ["containerd", "--config", str(ctd / "config.toml")])
        _wait(lambda: socket_path.exists() and "serving..." in containerd.log.read_text(), "containerd", containerd, 60)
        dns = ServiceDNS(plane.netns.name, lookup=lambda n: service_address(plane, n))
        the_node = Node(plane, work, name, socket_path, sandbox_image, dns, processes)
        the_node.import_image(pause_archive, base_name="registry.k8s.io/pause")
        _start_controllers(processes, plane, work, controller_manager)
        kubelet_work = work / "kubelet"
        kubelet_work.mkdir()
        (work / "resolv.conf").write_text(f"nameserver {DNS_ADDRESS}\n")
        config = kubelet_config(work, socket_path, plane.ca_path)
        _make_cgroup_root(cgroup)
        config["cgroupRoot"] = f"/{cgroup}"
        (kubelet_work / "config.yaml").write_text(yaml.safe_dump(config))
        node_certificate = client_certificate(plane.ca, f"system:node:{name}", ["system:nodes"])
        kubeconfig = plane.kubeconfig(kubelet_work / "kubeconfig", client=node_certificate)
        kubelet_process = _spawn(
            processes,
            plane,
            work,
            "kubelet",
            [
                str(kubelet),
                f"--config={kubelet_work / 'config.yaml'}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={kubelet_work / 'root'}",
                f"--cert-dir={kubelet_work / 'pki'}",
                f"--hostname-override={name}",
                f"--node-ip={NS_ADDRESS}",
                "--v=2",
            ],
        )
        _wait(lambda: _node_ready(plane, name), "kubelet", kubelet_process, 120)
        the_node.masquerades_pods = _start_kube_proxy(processes, plane, work, proxy, name)
        binder = DaemonSetBinder(plane, name)
        yield the_node
    finally:
        if binder is not None:
            binder.close()
        problems = _stop(processes, plane, work, cgroup, name)
        if dns is not None:
            dns.close()
    if problems:  # reached when the node's user raised nothing: an error of its own stays the one reported
        raise RuntimeError("the node did not stop cleanly: " + "\n".join(problems))


def _start_controllers(processes: list[Process], plane: ControlPlane, work: Path, binary: Path) -> None:
    kubeconfig = plane.kubeconfig(work / "controller-manager.kubeconfig")
    _spawn(
        processes,
        plane,
        work,
        "kube-controller-manager",
        [str(binary), f"--kubeconfig={kubeconfig}",
         "--controllers=root-ca-cert-publisher,daemonset,endpointslice,nodelifecycle", "--leader-elect=false",
         "--secure-port=0", "--v=1"],
    )  # fmt: skip


def _drain(plane: ControlPlane, name: str, timeout: float = 90) -> str:
    """Every pod bound to the node deleted at once, and the kubelet left to stop them: it tears down their
    sandboxes (network namespaces, bridge addresses, mounts) as it would on a real node. "" once they are
    gone, else what each pod left showed."""
    from harness.kube_api import Kube, KubeError, describe_pod, wait_for

    kube = Kube(plane)
    try:
        selector = {"fieldSelector": f"spec.nodeName={name}"}
        for pod in kube.get("/api/v1/pods", **selector)["items"]:
            meta = pod["metadata"]
            with contextlib.suppress(KubeError):
                # Graceful (not 0, which the API server deletes at once): the object stays until the
                # kubelet has stopped the pod's containers and sandbox, so its absence means they are gone.
                kube.request(
                    "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", {"gracePeriodSeconds": 1}
                )
        if wait_for(lambda: not kube.get("/api/v1/pods", **selector)["items"], timeout=timeout, interval=0.5):
            return ""
        left = kube.get("/api/v1/pods", **selector)["items"]
        described = [describe_pod(kube, p["metadata"]["namespace"], p["metadata"]["name"], p) for p in left]
        return f"the kubelet did not stop {len(left)} pods within {timeout:.0f} s:\n" + "\n".join(described)
    finally:
        kube.close()


def _forget(plane: ControlPlane, name: str) -> None:
    """The Node object goes with its kubelet: later tests of the session see the nodes they made only."""
    import httpx

    from harness.kube_api import Kube, KubeError

    kube = Kube(plane)
    try:
        with contextlib.suppress(KubeError, httpx.HTTPError):
            kube.delete(f"/api/v1/nodes/{name}")
    finally:
        kube.close()


def _stop(processes: list[Process], plane: ControlPlane, work: Path, cgroup: str, name: str) -> list[str]:
    """The controllers (a DaemonSet's pod deleted is not made again), the pods (by the kubelet), the kubelet
    and kube-proxy, then every container left (their shims outlive containerd), then containerd, and the
    namespace's iptables rules. The whole way, always; returns what did not stop when asked."""
    problems = []
    for process in [p for p in processes if p.name == "kube-controller-manager"]:
        stop_process(process.popen)
    kubelet = [p for p in processes if p.name == "kubelet"]
    if kubelet and kubelet[0].popen.poll() is None:
        try:
            problems.append(_drain(plane, name))
        except Exception as err:  # the rest of the teardown runs regardless
            problems.append(f"draining the node: {err!r}")
    for process in [p for p in processes if p.name != "containerd"]:
        stop_process(process.popen)
    _forget(plane, name)
    containerd = [p for p in processes if p.name == "containerd"]
    if containerd and containerd[0].popen.poll() is None:
        problems.append(_remove_containers(work / "containerd" / "containerd.sock"))
    for process in containerd:
        stop_process(process.popen)
    for table in ("nat", "filter", "mangle"):  # kube-proxy's and the kubelet's chains; the namespace is ours
        with contextlib.suppress(subprocess.CalledProcessError, OSError):
            _iptables(plane, "-t", table, "-F")
            _iptables(plane, "-t", table, "-X")
    unmount_under(work)
    _remove_cgroups(cgroup)
    # The kubelet links every container's log into /var/log/containers (a fixed path): ours go with us.
    for link in Path("/var/log/containers").glob("*.log"):
        with contextlib.suppress(OSError):
            if link.is_symlink() and os.readlink(link).startswith(f"{work}/"):
                link.unlink()
    return [p for p in problems if p]


def _remove_containers(socket_path: Path, timeout: float = 30) -> str:
    """Every task killed and deleted, then every container: "" once no task is left, else the ones left."""
    base = ["ctr", "--address", str(socket_path), "--namespace", "k8s.io"]

    def run(*args: str) -> str:
        done = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60, check=False)
        return done.stdout

    for task in run("tasks", "ls", "--quiet").split():
        run("tasks", "kill", "--signal", "SIGKILL", task)
    deadline = time.monotonic() + timeout
    while run("tasks", "ls", "--quiet").split() and time.monotonic() < deadline:
        for task in run("tasks", "ls", "--quiet").split():
            run("tasks", "delete", "--force", task)
        time.sleep(0.2)
    left = run("tasks", "ls") if run("tasks", "ls", "--quiet").split() else ""
    for container in run("containers", "ls", "--quiet").split():
        run("containers", "delete", container)
    return f"containerd tasks left after {timeout:.0f} s of kills:\n{left}" if left else ""
