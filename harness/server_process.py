"""Start the real `copilot-webhook serve` in a child process on a free port, and talk to it over TLS."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """What the API server does: verify the serving certificate against the caBundle."""
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key) if key else None)
    return context


class Server:
    def __init__(self, process: subprocess.Popen[bytes], port: int, workdir: Path, log: Path) -> None:
        self.process, self.port, self.workdir, self.log = process, port, workdir, log
        self.url = f"https://127.0.0.1:{port}"

    @property
    def ca(self) -> Path:
        return self.workdir / "ca.crt"

    def connect(self, timeout: float | None = 5, receive_buffer: int | None = None) -> ssl.SSLSocket:
        """A raw TLS connection, for tests that write HTTP themselves; `receive_buffer` (SO_RCVBUF, set before
        it connects so the window follows it) makes a client that does not read fill up soon."""
        # Wrapped before it connects: wrapping a connected socket the server has already reset (it is shutting
        # down) raises from inside ssl without closing the socket it made, and nothing here could close it.
        conn = client_context(self.ca).wrap_socket(socket.socket(socket.AF_INET), server_hostname="localhost")
        if receive_buffer is not None:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        conn.settimeout(timeout)
        try:
            conn.connect(("127.0.0.1", self.port))
        except BaseException:
            conn.close()  # a connection or handshake the server cut short leaves nothing open
            raise
        return conn

    def client(self, **kwargs: object) -> httpx.Client:
        options: dict[str, object] = {"timeout": 10, **kwargs}
        return httpx.Client(base_url=self.url, verify=client_context(self.ca), **options)  # type: ignore[arg-type]

    def output(self) -> str:
        return self.log.read_text()


def open_port(
    served: tuple[Server, int], port: str, timeout: float = 5, receive_buffer: int | None = None
) -> socket.socket:
    """A raw connection to the server's TLS port (`port` "admission") or its plain metrics port ("metrics")."""
    server, metrics_port = served
    if port == "admission":
        return server.connect(timeout, receive_buffer)
    # The metrics listener starts beside the admission port's, which is what readiness waits for: a refused
    # connection is tried again until `timeout`.
    deadline = time.monotonic() + timeout
    while True:
        conn = socket.socket()
        if receive_buffer is not None:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        conn.settimeout(timeout)
        try:
            conn.connect(("127.0.0.1", metrics_port))
        except ConnectionRefusedError:
            conn.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        except BaseException:
            conn.close()
            raise
        return conn


def status_kb(pid: int, field: str = "VmRSS") -> int:
    """A memory figure of a running process from /proc/<pid>/status (VmRSS, VmHWM), in KB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for process {pid}")


@contextmanager
def running_server(
    tls_dir: Path,
    workdir: Path,
    *args: str,
    config: str | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> Iterator[Server]:
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("ca.crt", "tls.crt", "tls.key"):
        shutil.copy(tls_dir / name, workdir / name)
    command = [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1"]
    port = port or free_port()
    command += ["--port", str(port), "--tls-cert", str(workdir / "tls.crt"), "--tls-key", str(workdir / "tls.key")]
    if config is not None:
        (workdir / "config.yaml").write_text(config)
        command += ["--config", str(workdir / "config.yaml")]
    command += list(args)
    log = workdir / "server.log"
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("COPILOT_WEBHOOK_") and k != "KUBECONFIG"}
    env["HOME"] = str(workdir)  # no stray ~/.kube/config: cluster access only where a test configures it
    env["COPILOT_WEBHOOK_SERVER__DRAIN_SECONDS"] = "0.2"  # a short drain at every stop; the drain test sets its own
    env.update(extra)
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(process, port, workdir, log)
    try:
        _wait_ready(server)
        yield server
    finally:
        stop_process(process)


class Reader:
    """HTTP/1.1 answers read one at a time from a socket: (status, headers, body)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer = conn, b""
        self._taken = b""  # the bytes of the answer being read, for whole()

    def answer(self) -> tuple[int, dict[bytes, bytes], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._more()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        self._taken = head + b"\r\n\r\n"
        lines = head.split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
        length = int(headers[b"content-length"])
        while len(self.buffer) < length:
            self._more()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        self._taken += body
        return int(lines[0].split()[1]), headers, body

    def _more(self) -> None:
        chunk = self.conn.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed with {self.buffer[:200]!r} unread")
        self.buffer += chunk

    def whole(self) -> bytes:
        """The next answer's bytes, head and body; or what came before the server closed the connection."""
        self._taken = b""
        try:
            self.answer()
        except ConnectionError:
            taken, self._taken, self.buffer = self._taken + self.buffer, b"", b""
            return taken
        return self._taken


def stop_process(process: subprocess.Popen[Any]) -> None:
    """SIGTERM, as Kubernetes does, then SIGKILL if it has not stopped within 15 s."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _wait_ready(server: Server, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.output()}")
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server did not listen within {timeout} s:\n{server.output()}")
