"""A real Kubernetes control plane for tests: etcd and kube-apiserver, built from their own Go modules
(harness/gotools.py), started the way controller-runtime's envtest starts them, inside a network namespace
of the test's own.

Why a network namespace: the API server calls a webhook registered by `service:` at the Service's
ClusterIP and port. A ClusterIP cannot be a loopback address (the API server refuses them), so the
namespace's loopback interface carries the ClusterIP range instead, and the webhook listens there on the
Service port, as a kube-proxy'd pod would be reached. The test process reaches the API server over a veth
pair into that namespace; nothing leaves the machine.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certs.authority import KeyPair, generate_ca, issue_serving, write_atomic
from harness.environment import unavailable
from harness.server_process import free_port, stop_process


def _veth_addresses() -> tuple[str, str]:
    """A /30 of 10.223.0.0/16 for this test process's veth pair (host side, namespace side), chosen from
    its process id and not used by any interface: test runs side by side on one machine never share one."""
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False).stdout
    base = int(ipaddress.ip_address("10.223.0.0"))
    for step in range(16384):
        index = (os.getpid() + step) % 16384
        host, inside = (str(ipaddress.ip_address(base + 4 * index + offset)) for offset in (1, 2))
        if f" {host}/" not in used and f" {inside}/" not in used:
            return host, inside
    raise RuntimeError("no free /30 in 10.223.0.0/16 for the control plane's veth pair")


# The host's side of the veth pair and the namespace's side (where the API server listens), and the
# Service range whose addresses the namespace's loopback interface answers for.
HOST_ADDRESS, NS_ADDRESS = _veth_addresses() if shutil.which("ip") else ("10.223.255.1", "10.223.255.2")
SERVICE_RANGE = "10.96.0.0/24"
API_PORT = 6443


def client_certificate(ca: KeyPair, user: str, groups: Sequence[str] = (), days: int = 30) -> KeyPair:
    """What the API server's x509 authenticator reads: the user from CN, the groups from O."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
    subject = x509.Name([*attributes, x509.NameAttribute(NameOID.COMMON_NAME, user)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return KeyPair(key, cert)


class NetworkNamespace:
    """`ip netns` with a veth pair to the host and the Service range on its loopback interface."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.host_link = f"{name[:10]}h"
        self._ip("netns", "add", name)
        try:
            self.exec_ip("link", "set", "lo", "up")
            network = ipaddress.ip_network(SERVICE_RANGE)
            # A local route answers for every address of the range, as kube-proxy's rules would.
            self.exec_ip("route", "add", "local", str(network), "dev", "lo")
            self._ip("link", "add", self.host_link, "type", "veth", "peer", "name", "eth0", "netns", name)
            self._ip("addr", "add", f"{HOST_ADDRESS}/30", "dev", self.host_link)
            self._ip("link", "set", self.host_link, "up")
            self.exec_ip("addr", "add", f"{NS_ADDRESS}/30", "dev", "eth0")
            self.exec_ip("link", "set", "eth0", "up")
        except BaseException:
            self.delete()
            raise

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def exec_ip(self, *args: str) -> None:
        self._ip("-n", self.name, *args)

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv run inside the namespace (network only: files, users and processes stay shared)."""
        return ["nsenter", f"--net=/run/netns/{self.name}", "--", *argv]

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_link], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


@dataclass
class ControlPlane:
    """etcd and kube-apiserver in `netns`, with an admin (system:masters) client certificate."""

    workdir: Path
    netns: NetworkNamespace
    etcd_binary: Path
    apiserver_binary: Path
    controller_manager_binary: Path | None = None
    authorization: str = "Node,RBAC"
    processes: list[Process] = field(default_factory=list)
    # The PodSecurityConfiguration of the API server's AdmissionConfiguration (defaults, exemptions); None:
    # the API server's own, privileged everywhere but where a namespace label says otherwise.
    pod_security: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        return f"https://{NS_ADDRESS}:{API_PORT}"

    @property
    def ca_path(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    def start(self) -> ControlPlane:
        pki = self.workdir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        self.ca = generate_ca("copilot-webhook test cluster CA")
        serving = issue_serving(
            self.ca,
            ["kubernetes", "kubernetes.default", "kubernetes.default.svc", "localhost"],
            [NS_ADDRESS, "127.0.0.1", str(next(ipaddress.ip_network(SERVICE_RANGE).hosts()))],
        )
        self.admin = client_certificate(self.ca, "admin", ["system:masters"])
        sa_key = ec.generate_private_key(ec.SECP256R1())
        for name, data in {
            "ca.crt": self.ca.cert_pem,
            "ca.key": self.ca.key_pem,
            "apiserver.crt": serving.cert_pem,
            "apiserver.key": serving.key_pem,
            "admin.crt": self.admin.cert_pem,
            "admin.key": self.admin.key_pem,
            "sa.key": sa_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
            "sa.pub": sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        }.items():
            write_atomic(pki / name, data, 0o600)
        try:
            self._start_etcd()
            self._start_apiserver(pki)
            self._wait_ready()
            if self.controller_manager_binary is not None:
                self._start_controller_manager()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: Sequence[str]) -> Process:
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(self.netns.command(argv), stdout=out, stderr=subprocess.STDOUT)
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def _start_etcd(self) -> None:
        # Data on tmpfs and no fsync: the tests want speed, not durability.
        data = Path(tempfile.mkdtemp(prefix="cw-etcd-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        self._etcd_data = data
        self.etcd_port = free_port()
        self._spawn(
            "etcd",
            [
                str(self.etcd_binary),
                f"--data-dir={data}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{free_port()}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self, pki: Path) -> None:
        self._spawn(
            "kube-apiserver",
            [
                str(self.apiserver_binary),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=0.0.0.0",
                f"--advertise-address={NS_ADDRESS}",
                f"--secure-port={API_PORT}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--authorization-mode={self.authorization}",
                f"--audit-policy-file={self._audit_policy()}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
                *self._admission_flags(),
            ],
        )

    def _admission_flags(self) -> list[str]:
        if self.pod_security is None:
            return []
        configuration = {
            "apiVersion": "pod-security.admission.config.k8s.io/v1",
            "kind": "PodSecurityConfiguration",
            **self.pod_security,
        }
        admission = {
            "apiVersion": "apiserver.config.k8s.io/v1",
            "kind": "AdmissionConfiguration",
            "plugins": [{"name": "PodSecurity", "configuration": configuration}],
        }
        path = self.workdir / "admission.yaml"
        path.write_text(yaml.safe_dump(admission))
        return [f"--admission-control-config-file={path}"]

    def _start_controller_manager(self) -> None:
        # Only the controllers whose work the tests read: the one that type-checks ValidatingAdmissionPolicies
        # and writes the warnings into their status.
        self._spawn(
            "kube-controller-manager",
            [
                str(self.controller_manager_binary),
                f"--kubeconfig={self.kubeconfig(self.workdir / 'controller-manager.kubeconfig')}",
                "--controllers=validatingadmissionpolicy-status-controller",
                "--leader-elect=false",
                "--secure-port=0",
                "--v=1",
            ],
        )

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    def _audit_policy(self) -> Path:
        """Every request a ServiceAccount makes, with its verb, resource and answer: what RBAC tests read."""
        policy = {
            "apiVersion": "audit.k8s.io/v1",
            "kind": "Policy",
            "omitStages": ["RequestReceived"],
            "rules": [{"level": "Metadata", "userGroups": ["system:serviceaccounts"]}, {"level": "None"}],
        }
        path = self.workdir / "audit-policy.yaml"
        path.write_text(yaml.safe_dump(policy))
        return path

    def audit_events(self, user: str) -> list[dict[str, Any]]:
        events = []
        for line in self.audit_log.read_text().splitlines():
            event = json.loads(line)
            if event["user"]["username"] == user and event["stage"] == "ResponseComplete":
                events.append(event)
        return events

    def etcd(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """etcd's JSON gateway, from inside the namespace where it listens."""
        script = (
            "import sys, urllib.request; "
            f"r = urllib.request.urlopen(urllib.request.Request('http://127.0.0.1:{self.etcd_port}{path}', "
            "data=sys.stdin.buffer.read(), method='POST')); print(r.read().decode())"
        )
        done = subprocess.run(
            self.netns.command([sys.executable, "-c", script]),
            input=json.dumps(body).encode(),
            capture_output=True,
            timeout=30,
            check=True,
        )
        result = json.loads(done.stdout)
        assert isinstance(result, dict)
        return result

    def compact_etcd(self) -> None:
        """etcd forgets every revision before now, as its periodic compaction does: a watch or a continue
        token from before gets 410 Gone."""
        revision = int(self.etcd("/v3/kv/range", {"key": "AA=="})["header"]["revision"])
        self.etcd("/v3/kv/compaction", {"revision": revision, "physical": True})

    def restart_apiserver(self) -> None:
        """Every watch ends; clients resume from the resourceVersion they last saw."""
        (process,) = (p for p in self.processes if p.name == "kube-apiserver")
        stop_process(process.popen)
        self.processes.remove(process)
        self._start_apiserver(self.workdir / "pki")
        self._wait_ready()

    def enforce_pod_security(self, configuration: dict[str, Any] | None) -> None:
        """Restart the API server with this PodSecurityConfiguration (None: its own defaults)."""
        self.pod_security = configuration
        self.restart_apiserver()

    def _wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for process in self.processes:
                if process.popen.poll() is not None:
                    raise RuntimeError(f"{process.name} exited: {process.log.read_text()[-3000:]}")
            try:
                with self.urlopen("/readyz") as answer:
                    if answer.status == 200:
                        return
            except OSError as err:
                last = str(err)
            time.sleep(0.3)
        raise RuntimeError(f"kube-apiserver not ready in {timeout} s: {last}")

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_path))
        context.load_cert_chain(self.workdir / "pki" / "admin.crt", self.workdir / "pki" / "admin.key")
        return context

    def urlopen(self, path: str) -> Any:
        return urllib.request.urlopen(self.url + path, context=self.ssl_context(), timeout=5)

    def kubeconfig(self, path: Path, *, token: str | None = None, client: KeyPair | None = None) -> Path:
        """A kubeconfig for a bearer token (a ServiceAccount's), a client certificate (a kubelet's), or by
        default the admin certificate."""
        user: dict[str, str]
        if token is not None:
            user = {"token": token}
        else:
            pair = client or self.admin
            user = {
                "client-certificate-data": base64.b64encode(pair.cert_pem).decode(),
                "client-key-data": base64.b64encode(pair.key_pem).decode(),
            }
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority-data": base64.b64encode(self.ca.cert_pem).decode(),
                    },
                }
            ],
            "users": [{"name": "user", "user": user}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "user"}}],
            "current-context": "test",
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, yaml.safe_dump(config).encode(), 0o600)
        return path

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.log.read_text(errors='replace')[-4000:]}" for p in self.processes)

    def stop(self) -> None:
        for process in reversed(self.processes):
            stop_process(process.popen)
        self.processes.clear()
        data = getattr(self, "_etcd_data", None)
        if data is not None:
            shutil.rmtree(data, ignore_errors=True)


def require_root() -> None:
    """Network namespaces need root and iproute2; under CI=true their absence fails the run."""
    missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root")
    if missing:
        unavailable(f"the control plane needs {', '.join(missing)}")


@contextlib.contextmanager
def control_plane(
    workdir: Path, etcd: Path, apiserver: Path, controller_manager: Path | None = None, authorization: str = "Node,RBAC"
) -> Iterator[ControlPlane]:
    netns = NetworkNamespace(f"cwk{os.getpid()}")
    plane = ControlPlane(workdir, netns, etcd, apiserver, controller_manager, authorization)
    try:
        yield plane.start()
    finally:
        plane.stop()
        netns.delete()
