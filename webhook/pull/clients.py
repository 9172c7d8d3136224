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

An answer counts only when read to its end within its bounds and it is the message the API documents: a
Docker Engine body to its declared length or its chunked end, then parsed as the JSON documented for it; a
CRI response parsed whole as the protobuf message documented for it. Anything else fails the image (a
transient failure, retried), named for what it is.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import re
import socket
import threading
from collections.abc import Iterator
from typing import Protocol, TypeAlias
from urllib.parse import quote

import grpc

from webhook.pull.errors import Cancelled, PullError
from webhook.pull.keyring import Credential

BODY_LIMIT = 64 * 1024  # bytes of an error answer's body, or of one line of a stream, ever read: Docker's are a line
INSPECT_LIMIT = 1024 * 1024  # bytes of an image inspect answer ever read: a few KB, more with large labels
CRI_ANSWER_LIMIT = 4 * 1024 * 1024  # bytes of a CRI response (grpc's default receive limit, stated)


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
        self._channel = grpc.insecure_channel(
            f"unix://{socket_path}", options=[("grpc.max_receive_message_length", CRI_ANSWER_LIMIT)]
        )
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
        return _image_status(response)

    def pull(self, reference: str, credential: Credential | None, timeout: float) -> None:
        request = _field(1, _image_spec(reference))
        if credential is not None:
            # No server_address: the credential is already matched to this registry, and containerd parses
            # that field as a URL, so a bare `host:port` key (valid in a docker config) fails the pull.
            auth = _field(1, credential.username.encode()) + _field(2, credential.password.encode())
            request += _field(2, auth)
        _image_ref(self._call(self._pull, request, timeout))

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            for future in self._calls:
                future.cancel()
        self._channel.close()


# The CRI messages read, by field number: the wire type and kind of each field (kubernetes/cri-api
# pkg/apis/runtime/v1/api.proto). Fields not listed (a newer runtime's) need only be well-formed.
_Kind: TypeAlias = "str | dict[int, _Kind]"  # "varint", "string" (UTF-8), or a message's fields
_STRING_MAP_ENTRY: dict[int, _Kind] = {1: "string", 2: "string"}
_IMAGE_SPEC: dict[int, _Kind] = {1: "string", 2: _STRING_MAP_ENTRY, 18: "string", 19: "string"}
_IMAGE: dict[int, _Kind] = {
    1: "string",  # id
    2: "string",  # repo_tags
    3: "string",  # repo_digests
    4: "varint",  # size
    5: {1: "varint"},  # uid (Int64Value)
    6: "string",  # username
    7: _IMAGE_SPEC,  # spec
    8: "varint",  # pinned
}
_IMAGE_STATUS_RESPONSE: dict[int, _Kind] = {1: _IMAGE, 2: _STRING_MAP_ENTRY}  # image, info
_PULL_IMAGE_RESPONSE: dict[int, _Kind] = {1: "string"}  # image_ref
_WIRE = {"varint": 0, "string": 2}  # a message field is length-delimited (2) too


def _image_status(response: bytes) -> bool:
    """Whether an ImageStatusResponse holds the image. An Image without its id or size is no image (the
    kubelet refuses it the same way); a response that is not the message is no answer."""
    fields = _protobuf(response, _IMAGE_STATUS_RESPONSE, "ImageStatus")
    if 1 not in fields:
        return False  # no Image: the runtime does not have it
    image = _protobuf(b"".join(_bytes(fields[1])), _IMAGE, "ImageStatus")  # a message field's occurrences merge
    if not _string(image.get(1, []), "ImageStatus") or not image.get(4, [0])[-1]:
        raise PullError("the CRI answer to ImageStatus holds an image without its id or size", permanent=False)
    return True


def _image_ref(response: bytes) -> str:
    """The image a PullImageResponse names: a pull that names none did not pull (the kubelet's rule too)."""
    reference = _string(_protobuf(response, _PULL_IMAGE_RESPONSE, "PullImage").get(1, []), "PullImage")
    if not reference:
        raise PullError("the CRI answer to PullImage names no image (its image_ref is empty)", permanent=False)
    return reference


def _protobuf(data: bytes, schema: dict[int, _Kind], call: str) -> dict[int, list[int | bytes]]:
    """A protobuf message's fields: each number's values in order, a varint's as its number, a
    length-delimited one's as its bytes. The bytes must be wire format to their last byte, every field
    listed in `schema` of its kind (a message's bytes a message of its own), or the answer is refused."""
    fields: dict[int, list[int | bytes]] = {}
    at = 0
    while at < len(data):
        key, at = _read_varint(data, at, call)
        number, wire = key >> 3, key & 7
        if not 0 < number < 1 << 29:
            raise _malformed(call, f"field number {number}")
        value, at = _read_value(data, at, wire, call)
        kind = schema.get(number)
        if kind is not None:
            if wire != (_WIRE[kind] if isinstance(kind, str) else 2):
                raise _malformed(call, f"field {number} of wire type {wire}")
            if isinstance(kind, dict):
                _protobuf(_bytes([value])[0], kind, call)
            elif kind == "string":
                _string([value], call)
        fields.setdefault(number, []).append(value)
    return fields


def _read_value(data: bytes, at: int, wire: int, call: str) -> tuple[int | bytes, int]:
    if wire == 0:
        return _read_varint(data, at, call)
    if wire == 2:
        length, at = _read_varint(data, at, call)
        size = length
    elif wire in (1, 5):
        size = 8 if wire == 1 else 4
    else:
        raise _malformed(call, f"wire type {wire}")  # 3 and 4 (groups) are not in proto3; 6 and 7 do not exist
    if at + size > len(data):
        raise _malformed(call, f"a field of {size} bytes where {len(data) - at} are left")
    return data[at : at + size], at + size


def _read_varint(data: bytes, at: int, call: str) -> tuple[int, int]:
    value = 0
    for shift in range(0, 70, 7):
        if at >= len(data):
            raise _malformed(call, "a number cut short")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if value >> 64:
                break
            return value, at
    raise _malformed(call, "a number over 64 bits")


def _bytes(values: list[int | bytes]) -> list[bytes]:
    return [value for value in values if isinstance(value, bytes)]


def _string(values: list[int | bytes], call: str) -> str:
    """The last of a string field's values (proto3: the last one counts), which must be UTF-8."""
    if not values:
        return ""
    try:
        return _bytes(values)[-1].decode()
    except UnicodeDecodeError:
        raise _malformed(call, "a string that is not UTF-8") from None


def _malformed(call: str, what: str) -> PullError:
    return PullError(f"the CRI answer to {call} is not its protobuf message ({what})", permanent=False)


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
        self.unix: socket.socket | None = None  # kept for cancel(): http.client drops `sock` on `Connection: close`

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        self.unix = sock
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
        except PullError:
            if self._cancelled:  # the answer ended because cancel() shut the socket
                raise Cancelled from None
            raise
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
            if response.status not in (200, 404):
                raise _refusal(response, "image inspect")
            answer = _json_object(_Body(response, "image inspect", INSPECT_LIMIT).whole(), "image inspect")
        if response.status == 404:
            return False
        image = answer.get("Id")
        if not isinstance(image, str) or not image:
            raise PullError(
                "the Docker Engine answer to image inspect is an object without a string Id", permanent=False
            )
        return True

    def pull(self, reference: str, credential: Credential | None, timeout: float) -> None:
        headers = {}
        if credential is not None:
            auth = {"username": credential.username, "password": credential.password, "serveraddress": credential.key}
            headers["X-Registry-Auth"] = base64.urlsafe_b64encode(json.dumps(auth).encode()).decode()
        url = f"/images/create?fromImage={quote(reference, safe='')}"
        with self._exchange("POST", url, timeout, headers=headers) as response:
            if response.status != 200:
                raise _refusal(response, "image pull", permanent=True if response.status == 404 else None)
            _pulled(_Body(response, "image pull", BODY_LIMIT))

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            for connection in self._open:
                if connection.unix is not None:
                    with contextlib.suppress(OSError):  # already closed: nothing to cancel
                        connection.unix.shutdown(socket.SHUT_RDWR)


class _Body:
    """An answer's body, read from the socket to its declared end (its Content-Length, or the last, empty
    chunk of its chunked encoding) and never past `limit` bytes held: the whole body for `whole`, one line
    for `lines`. A body that declares neither end cannot be told from one cut short, and is refused."""

    PIECE = 64 * 1024  # bytes asked of the socket at once
    FRAMING = 1024  # bytes of a chunk's size line, or of a trailer line
    TRAILERS = 64  # trailer lines after the last chunk

    def __init__(self, response: http.client.HTTPResponse, what: str, limit: int) -> None:
        self.what, self.limit = what, limit
        self._fp = response.fp
        self.received = 0  # bytes of the body (not of its framing) read so far
        length = response.getheader("Content-Length")
        if response.chunked:
            self.length: int | None = None
        elif length is not None and length.isascii() and length.isdigit():
            self.length = int(length)
        else:
            raise self.broken("declares neither its length nor chunks, so its end cannot be told from a cut")

    def broken(self, problem: str) -> PullError:
        return PullError(f"the Docker Engine answer to {self.what} {problem}", permanent=False)

    def whole(self) -> bytes:
        if self.length is not None and self.length > self.limit:
            raise self.broken(f"declares {self.length} bytes, more than the {self.limit} read of it")
        body = bytearray()
        for piece in self._pieces():
            body += piece
            if len(body) > self.limit:
                raise self.broken(f"runs past {self.limit} bytes, more than are read of it")
        return bytes(body)

    def lines(self) -> Iterator[bytes]:
        """Each line as it arrives, the last one to the body's end; none past `limit` bytes."""
        held = b""
        for piece in self._pieces():
            held += piece
            while (end := held.find(b"\n")) >= 0:
                yield self._line(held[:end])
                held = held[end + 1 :]
            self._line(held)
        if held:
            yield held

    def _line(self, line: bytes) -> bytes:
        if len(line) > self.limit:
            raise self.broken(f"has a line past {self.limit} bytes, more than are read of one")
        return line

    def _pieces(self) -> Iterator[bytes]:
        if self.length is not None:
            yield from self._counted(self.length)
            return
        while size := self._chunk_size():
            yield from self._counted(size)
            end = self._fp.read(2)
            if end != b"\r\n":
                raise (
                    self._cut()
                    if b"\r\n".startswith(end)
                    else self.broken(f"has a malformed chunk after {self.received} bytes")
                )
        for _ in range(self.TRAILERS):
            line = self._fp.readline(self.FRAMING)
            if line.strip() == b"":  # the end, or the connection closed right after the last chunk
                return
        raise self.broken(f"has more than {self.TRAILERS} trailer lines")

    def _counted(self, size: int) -> Iterator[bytes]:
        left = size
        while left:
            piece = self._fp.read1(min(left, self.PIECE))
            if not piece:
                raise self._cut()
            self.received += len(piece)
            left -= len(piece)
            yield piece

    def _chunk_size(self) -> int:
        line = self._fp.readline(self.FRAMING)
        if not line.endswith(b"\n"):
            raise self._cut() if len(line) < self.FRAMING else self.broken("has a chunk size line too long")
        size = _CHUNK_SIZE.fullmatch(line)
        if size is None:
            raise self.broken(f"has a malformed chunk size after {self.received} bytes")
        return int(size[1], 16)

    def _cut(self) -> PullError:
        if self.length is not None:
            return self.broken(f"was cut short after {self.received} of {self.length} bytes")
        return self.broken(f"was cut short after {self.received} bytes, before its last chunk")


_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})(?:;[^\r\n]*)?\r?\n")  # size, then extensions (ignored)


def _refusal(response: http.client.HTTPResponse, what: str, permanent: bool | None = None) -> PullError:
    """The failure an answer other than success carries: its message, once the answer is read whole."""
    try:
        body = _Body(response, f"{what} (HTTP {response.status})", BODY_LIMIT).whole()
    except PullError as broken:
        return broken
    return PullError(_message(body, response.status), permanent)


def _pulled(body: _Body) -> None:
    """A pull's progress stream, read to its end: a JSON object a line, none of them an error (a pull that
    fails midway still answers 200, and says so in the stream), and at least one."""
    messages = 0
    for line in body.lines():
        if line.strip():
            message = _json_object(line, body.what)
            error = message.get("error") or message.get("errorDetail")
            if error:
                detail = error.get("message") if isinstance(error, dict) else None
                raise PullError(str(detail or error))
            messages += 1
    if not messages:
        raise body.broken("ended without a status")


def _json_object(data: bytes, what: str) -> dict[str, object]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        excerpt = data[:80].decode(errors="replace")
        raise PullError(f"the Docker Engine answer to {what} is not JSON: {excerpt}", permanent=False) from None
    if not isinstance(value, dict):
        raise PullError(f"the Docker Engine answer to {what} is JSON but not an object", permanent=False)
    return value


def _message(body: bytes, status: int) -> str:
    try:
        data = json.loads(body)
        return str(data.get("message") or data) if isinstance(data, dict) else f"HTTP {status}"
    except (ValueError, RecursionError):
        return f"HTTP {status}: {body[:200].decode(errors='replace')}"
