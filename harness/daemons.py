"""Real daemons for the puller's tests, from Debian's packages, on loopback and under temporary folders:
containerd (with its CRI plugin and `ctr`), dockerd, and the distribution registry (plain HTTP, TLS with a
CA of the test's own, htpasswd authentication). Images are built without network by umoci and pushed by
skopeo. `.ci/run` installs them; without them (a laptop) the tests skip, and under CI=true a skip fails.
"""

from __future__ import annotations

import http.client
import os
import platform
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

from harness.environment import unavailable
from harness.server_process import free_port, stop_process

ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
TOOLS = ("containerd", "ctr", "dockerd", "docker-registry", "skopeo", "umoci", "htpasswd")


def require(*tools: str) -> None:
    """Skip without the daemons; in CI a missing daemon is a failure, never a skip."""
    missing = [t for t in tools if shutil.which(t) is None]
    if os.geteuid() != 0:
        missing.append("root")
    if missing:
        unavailable(f"the real-daemon tests need {', '.join(missing)} (Debian packages; .ci/run installs them)")


def _wait(check: object, what: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not come up within {timeout} s:\n{log.read_text()[-3000:]}")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Registry:
    host: str  # host:port as images name it
    port: int
    ca: Path | None = None  # the CA that signs its certificate (TLS registries)
    user: tuple[str, str] | None = None

    def push(self, oci_layout: Path, tag: str, repository: str) -> str:
        """Push the umoci-built image `tag` as <host>/<repository>:<tag>; returns the reference."""
        reference = f"{self.host}/{repository}:{tag}"
        command = ["skopeo", "copy", "--quiet"]
        if self.ca is not None:
            certs = self.ca.parent / "skopeo-certs"
            certs.mkdir(exist_ok=True)
            shutil.copy(self.ca, certs / "ca.crt")
            command.append(f"--dest-cert-dir={certs}")
        else:
            command.append("--dest-tls-verify=false")
        if self.user is not None:
            command.append(f"--dest-creds={self.user[0]}:{self.user[1]}")
        command += [f"oci:{oci_layout}:{tag}", f"docker://{reference}"]
        subprocess.run(command, check=True, capture_output=True, timeout=60)
        return reference


@contextmanager
def registry(
    work: Path, tls: tuple[Path, Path, Path] | None = None, user: tuple[str, str] | None = None, name: str = ""
) -> Iterator[Registry]:
    """`tls`: (certificate, key, CA). `name`: the host name images use instead of 127.0.0.1."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = [
        "version: 0.1",
        "log: {level: warn}",
        f"storage: {{filesystem: {{rootdirectory: {work / 'data'}}}, delete: {{enabled: true}}}}",
        "http:",
        f"  addr: 127.0.0.1:{port}",
    ]
    if tls is not None:
        config.append(f"  tls: {{certificate: {tls[0]}, key: {tls[1]}}}")
    if user is not None:
        htpasswd = subprocess.run(
            ["htpasswd", "-Bbn", *user], check=True, capture_output=True, text=True, timeout=30
        ).stdout
        (work / "htpasswd").write_text(htpasswd)
        config.append(f"auth: {{htpasswd: {{realm: test, path: {work / 'htpasswd'}}}}}")
    (work / "config.yml").write_text("\n".join(config) + "\n")
    log = work / "registry.log"
    with log.open("wb") as out:
        process = subprocess.Popen(["docker-registry", "serve", str(work / "config.yml")], stdout=out, stderr=out)
    try:
        _wait(lambda: _listening(port), "docker-registry", process, log)
        yield Registry(f"{name or '127.0.0.1'}:{port}", port, tls[2] if tls else None, user)
    finally:
        stop_process(process)


@dataclass
class Containerd:
    socket: str
    root: Path
    certs_d: Path  # the CRI plugin's registry hosts directory

    def trust(self, host: str, plain_http: bool = False, ca: Path | None = None, upstream: str | None = None) -> None:
        """What a node's administrator configures: how the runtime itself reaches a registry; `upstream`
        serves the images named by `host` (a mirror, as for docker.io)."""
        directory = self.certs_d / host
        directory.mkdir(parents=True, exist_ok=True)
        scheme = "http" if plain_http else "https"
        server = f"{scheme}://{upstream or host}"
        lines = [f'server = "{server}"', f'[host."{server}"]', '  capabilities = ["pull", "resolve"]']
        if ca is not None:
            lines.append(f'  ca = "{ca}"')
        (directory / "hosts.toml").write_text("\n".join(lines) + "\n")

    def images(self) -> list[str]:
        """The images in the k8s.io namespace: what the kubelet's CRI sees."""
        done = subprocess.run(
            ["ctr", "--address", self.socket, "--namespace", "k8s.io", "images", "ls", "--quiet"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout.split()

    def remove(self, reference: str) -> None:
        subprocess.run(
            ["ctr", "--address", self.socket, "--namespace", "k8s.io", "images", "rm", reference],
            capture_output=True,
            timeout=30,
        )

    def tag(self, source: str, target: str) -> None:
        subprocess.run(
            ["ctr", "--address", self.socket, "--namespace", "k8s.io", "images", "tag", "--force", source, target],
            check=True,
            capture_output=True,
            timeout=30,
        )


@contextmanager
def containerd(work: Path) -> Iterator[Containerd]:
    work.mkdir(parents=True, exist_ok=True)
    sock = work / "containerd.sock"
    certs_d = work / "certs.d"
    certs_d.mkdir()
    (work / "config.toml").write_text(
        "\n".join(
            [
                "version = 2",
                f'root = "{work / "root"}"',
                f'state = "{work / "state"}"',
                "[grpc]",
                f'  address = "{sock}"',
                "[ttrpc]",
                f'  address = "{work / "ttrpc.sock"}"',
                '[plugins."io.containerd.grpc.v1.cri"]',
                "  disable_tcp_service = true",
                '  [plugins."io.containerd.grpc.v1.cri".registry]',
                f'    config_path = "{certs_d}"',
                '[plugins."io.containerd.internal.v1.opt"]',
                f'  path = "{work / "opt"}"',
            ]
        )
        + "\n"
    )
    log = work / "containerd.log"
    with log.open("wb") as out:
        process = subprocess.Popen(["containerd", "--config", str(work / "config.toml")], stdout=out, stderr=out)
    try:
        _wait(lambda: sock.exists() and "serving..." in log.read_text(), "containerd", process, log)
        yield Containerd(str(sock), work / "root", certs_d)
    finally:
        stop_process(process)


@dataclass
class Dockerd:
    socket: str

    def api(self, method: str, path: str) -> tuple[int, bytes]:
        """One call of the Engine API over the daemon's socket."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(60)
            sock.connect(self.socket)
            connection = http.client.HTTPConnection("localhost")
            connection.sock = sock
            connection.request(method, path)
            response = connection.getresponse()
            return response.status, response.read()

    def tag(self, source: str, target: str) -> None:
        repository, _, tag = target.rpartition(":")
        status, body = self.api("POST", f"/images/{quote(source, safe='/:')}/tag?repo={quote(repository)}&tag={tag}")
        assert status == 201, body

    def has(self, reference: str) -> bool:
        return self.api("GET", f"/images/{quote(reference, safe='/:')}/json")[0] == 200


@contextmanager
def dockerd(work: Path, storage: str = "vfs", mirror: str | None = None) -> Iterator[Dockerd]:
    """`storage`: vfs works everywhere; overlay2 builds images much faster where the kernel allows it,
    and falls back to vfs where it does not. `mirror`: a registry (host:port, plain HTTP) serving docker.io's
    images, as `--registry-mirror` configures a node."""
    try:
        with _dockerd(work / storage, storage, mirror) as daemon:
            yield daemon
    except DaemonDidNotStart:
        if storage == "vfs":
            raise
        with _dockerd(work / "vfs", "vfs", mirror) as daemon:
            yield daemon


class DaemonDidNotStart(RuntimeError):
    pass


@contextmanager
def _dockerd(work: Path, storage: str, mirror: str | None) -> Iterator[Dockerd]:
    # Short paths: a unix socket path is limited to 108 bytes, and dockerd nests sockets in exec-root.
    work.mkdir(parents=True, exist_ok=True)
    sock = work / "docker.sock"
    command = [
        "dockerd",
        "--iptables=false",
        "--ip6tables=false",
        "--bridge=none",
        f"--storage-driver={storage}",
        f"--host=unix://{sock}",
        f"--data-root={work / 'data'}",
        f"--exec-root={work / 'x'}",
        f"--pidfile={work / 'docker.pid'}",
        f"--containerd-namespace=cw-test-{storage}",
        f"--containerd-plugins-namespace=cw-test-{storage}-plugins",
    ]
    if mirror is not None:
        command.append(f"--registry-mirror=http://{mirror}")
    log = work / "dockerd.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=out)
    try:
        try:
            _wait(lambda: "API listen on" in log.read_text(), "dockerd", process, log, timeout=60)
        except RuntimeError as exc:
            raise DaemonDidNotStart(str(exc)) from None
        yield Dockerd(str(sock))
    finally:
        stop_process(process)


def build_image(layout: Path, tag: str, content: str) -> None:
    """A one-layer image holding /content.txt, built by umoci without any registry or network."""
    if not layout.exists():
        subprocess.run(["umoci", "init", "--layout", str(layout)], check=True, capture_output=True, timeout=30)
    payload = layout.parent / f"content-{tag}.txt"
    payload.write_text(content)
    image = f"{layout}:{tag}"
    for command in (
        ["umoci", "new", "--image", image],
        ["umoci", "insert", "--rootless", "--image", image, str(payload), "/content.txt"],
        ["umoci", "config", "--image", image, "--os", "linux", "--architecture", ARCH, "--config.cmd", "/bin/true"],
    ):
        subprocess.run(command, check=True, capture_output=True, timeout=60)


@contextmanager
def hanging_server() -> Iterator[int]:
    """A port that accepts connections and never answers: a registry that hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


@contextmanager
def trickling_registry(upstream: int, rate: int = 4096, threshold: int = 16384) -> Iterator[int]:
    """A front of the registry on port `upstream` that passes everything through, but sends a blob larger
    than `threshold` bytes at `rate` bytes a second: a registry (or a network) so slow that a pull keeps
    making progress long past any deadline, so the runtime keeps streaming progress to its client."""
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self._forward()

        def do_GET(self) -> None:
            self._forward()

        def _forward(self) -> None:
            connection = http.client.HTTPConnection("127.0.0.1", upstream, timeout=30)
            try:
                connection.putrequest(self.command, self.path)
                for name, value in self.headers.items():  # each of them: dockerd sends one Accept per media type
                    if name.lower() not in ("host", "connection"):
                        connection.putheader(name, value)
                connection.endheaders()
                response = connection.getresponse()
                body = response.read()
            finally:
                connection.close()
            self.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in ("connection", "transfer-encoding", "date", "server"):
                    self.send_header(name, value)
            self.end_headers()
            slow = "/blobs/" in self.path and len(body) > threshold
            step = rate // 4 if slow else max(len(body), 1)
            with suppress(OSError):  # the client gave up (its deadline): nothing more to send
                for start in range(0, len(body), step):
                    if stop.is_set():
                        return
                    self.wfile.write(body[start : start + step])
                    self.wfile.flush()
                    if slow:
                        time.sleep(0.25)

        def log_message(self, format: str, *args: object) -> None:
            pass  # the test's output is the puller's

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
