"""The runtime clients of the puller, each speaking a runtime's own API, never a CLI's argument parser:

- `cri`: the CRI ImageService over gRPC on the runtime socket (`ImageStatus`, `PullImage` with
  `AuthConfig`), what the kubelet and crictl call; served by containerd, CRI-O and cri-dockerd alike.
- `docker`: the Docker Engine API over its unix socket (`GET /images/{name}/json`,
  `POST /images/create` with `X-Registry-Auth`), what `docker image inspect` and `docker pull` call.
- `native` (native.py): containerd's own client `ctr`, for registries only the pod network reaches.

The CRI messages are encoded by hand (a few length-delimited fields) instead of generated stubs: field
numbers from kubernetes/cri-api pkg/apis/runtime/v1/api.proto (ImageSpec.image = 1; PullImageRequest.image
= 1, .auth = 2; AuthConfig.username = 1, .password = 2; ImageStatusRequest.image = 1;
ImageStatusResponse.image = 1). AuthConfig.server_address (4) is left out; see pull().
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from typing import Protocol
from urllib.parse import quote

import grpc

from webhook.pull.errors import Cancelled, PullError
from webhook.pull.keyring import Credential

BODY_LIMIT = 64 * 1024  # bytes of an answer's body, or of one line of a stream, ever held: Docker's are a line


class Client(Protocol):
    def present(self, reference: str, timeout: float) -> bool: ...

    def pull(self, reference: str, credential: Credential | None, timeout: float) -> None: ...

    def cancel(self) -> None: ...


def _field(number: int, data: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _image_spec(reference: str) -> bytes:
    return _field(1, reference.encode())


class CRIClient:
    def __init__(self, socket_path: str) -> None:
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._status = self._channel.unary_unary("/runtime.v1.ImageService/ImageStatus")
        self._pull = self._channel.unary_unary("/runtime.v1.ImageService/PullImage")
        self._calls: set[grpc.Future] = set()
        self._lock = threading.Lock()
        self._cancelled = False

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: bytes, timeout: float) -> bytes:
        with self._lock:
            if self._cancelled:
                raise Cancelled
            future = method.future(request, timeout=timeout)
            self._calls.add(future)
        try:
            response: bytes = future.result()
            return response
        except grpc.FutureCancelledError:
            raise Cancelled from None
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.CANCELLED:
                raise Cancelled from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise PullError("timed out", permanent=True) from None
            permanent = True if code in _PERMANENT_CODES else None
            raise PullError(f"{code.name}: {exc.details()}", permanent) from None
        finally:
            with self._lock:
                self._calls.discard(future)

    def present(self, reference: str, timeout: float) -> bool:
        response = self._call(self._status, _field(1, _image_spec(reference)), timeout)
        return response.startswith(b"\x0a")  # field 1 (the Image) is there: the runtime has it

    def pull(self, reference: str, credential: Credential | None, timeout: float) -> None:
        request = _field(1, _image_spec(reference))
        if credential is not None:
            # No server_address: the credential is already matched to this registry, and containerd parses
            # that field as a URL, so a bare `host:port` key (valid in a docker config) fails the pull.
            auth = _field(1, credential.username.encode()) + _field(2, credential.password.encode())
            request += _field(2, auth)
        self._call(self._pull, request, timeout)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            for future in self._calls:
                future.cancel()
        self._channel.close()


_PERMANENT_CODES = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
}


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class DockerClient:
    API = "/v1.41"  # Docker 20.10; every later engine still serves it

    def __init__(self, socket_path: str) -> None:
        self._path = socket_path
        self._open: set[_UnixConnection] = set()
        self._lock = threading.Lock()
        self._cancelled = False

    @contextlib.contextmanager
    def _exchange(
        self, method: str, url: str, timeout: float, *, headers: dict[str, str] | None = None
    ) -> Iterator[http.client.HTTPResponse]:
        """One request and its response, read inside the block: whatever the socket answers (garbage, a
        response cut short, the connection shut by cancel()) ends as PullError or Cancelled."""
        connection = _UnixConnection(self._path, timeout)
        with self._lock:
            if self._cancelled:
                raise Cancelled
            self._open.add(connection)
        try:
            connection.request(method, self.API + url, headers=headers or {})
            yield connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            if self._cancelled:
                raise Cancelled from None
            if isinstance(exc, TimeoutError):
                raise PullError("timed out", permanent=True) from None
            if isinstance(exc, OSError):
                raise PullError(f"docker socket {self._path}: {exc}") from None
            raise PullError(f"docker socket {self._path}: not an HTTP answer ({type(exc).__name__}: {exc})") from None
        finally:
            with self._lock:
                self._open.discard(connection)
            connection.close()

    def present(self, reference: str, timeout: float) -> bool:
        with self._exchange("GET", f"/images/{quote(reference, safe='/:@')}/json", timeout) as response:
            if response.status == 404:
                return False
            if response.status != 200:
                raise PullError(_message(response.read(BODY_LIMIT), response.status))
            return True  # the inspection itself is not needed: it is not read

    def pull(self, reference: str, credential: Credential | None, timeout: float) -> None:
        headers = {}
        if credential is not None:
            auth = {"username": credential.username, "password": credential.password, "serveraddress": credential.key}
            headers["X-Registry-Auth"] = base64.urlsafe_b64encode(json.dumps(auth).encode()).decode()
        url = f"/images/create?fromImage={quote(reference, safe='')}"
        with self._exchange("POST", url, timeout, headers=headers) as response:
            if response.status != 200:
                body = response.read(BODY_LIMIT)
                raise PullError(_message(body, response.status), permanent=True if response.status == 404 else None)
            last = _last_line(response)
        if self._cancelled:  # the stream ended because cancel() shut the socket, not because the pull did
            raise Cancelled
        # A pull that fails midway still answers 200; the error is the stream's last message, and a pull that
        # succeeded ends with a status: anything else is not dockerd's answer.
        try:
            message = json.loads(last)
        except (ValueError, RecursionError):
            message = None
        if not isinstance(message, dict):
            raise PullError(f"docker socket {self._path}: the pull's answer ended without a status")
        if message.get("error"):
            raise PullError(str(message["error"]))

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            for connection in self._open:
                if connection.sock is not None:
                    with contextlib.suppress(OSError):  # already closed: nothing to cancel
                        connection.sock.shutdown(socket.SHUT_RDWR)


def _last_line(response: http.client.HTTPResponse) -> bytes:
    """The last non-empty line of a progress stream, holding one line at a time: a pull streams a message
    per layer and per update, and a socket that never stops must not grow the puller's memory."""
    last = b""
    while line := response.readline(BODY_LIMIT):
        if line.strip():
            last = line
    return last


def _message(body: bytes, status: int) -> str:
    try:
        data = json.loads(body)
        return str(data.get("message") or data) if isinstance(data, dict) else f"HTTP {status}"
    except (ValueError, RecursionError):
        return f"HTTP {status}: {body[:200].decode(errors='replace')}"
