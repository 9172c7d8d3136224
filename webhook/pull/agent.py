"""copilot-webhook-agent: the node agent of the image puller's agent mode.

A DaemonSet pod, the only holder of its node's runtime socket. It learns its node's runtime from the
Node object's containerRuntimeVersion (the kubelet's own report) and finds that runtime's socket under
the host directory it is given. Pods on its node ask it, over HTTPS, to pull the images they name:

    POST /v1/pull   Authorization: Bearer <projected token of the agent's audience>
                    {"images": [...], "pullSecrets": {"<name>": "<.dockerconfigjson>"}, "timeoutSeconds": N}
    200 {"node", "runtime", "results": [{"image", "result", "attempts", "seconds", "error"}]}
    GET  /healthz   200 ok

Who may ask: the token must pass a TokenReview for the agent's audience and be bound to a pod (the
TokenReview's extra pod name and uid); that pod must still exist with that uid, run on this node, under
the token's service account, and name every image asked for. Nothing else is read from the caller: its
pull secrets are its own (its pod's imagePullSecrets, mounted into it), so the agent reads no Secret.

Concurrent requests for one image with the same credentials are one pull. Bounds: connections at once
(more are closed on arrival), a request head and body within HEAD_SECONDS, a body of BODY_LIMIT bytes,
IMAGES_LIMIT images, and every pull within the request's timeout (at most --timeout).

Written on http.server rather than the webhook's server stack: the agent runs in the puller image
(the standard library and grpcio), serves one small request per pod, and needs no more than these bounds.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.server
import json
import logging
import os
import signal
import socket
import socketserver
import ssl
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from types import FrameType
from typing import Any

from webhook.errors import InvalidReference
from webhook.pull import MAX_TIMEOUT, Puller, PullOutcome, add_registry_options, with_pod_network
from webhook.pull.clients import Client, CRIClient, DockerClient
from webhook.pull.keyring import Keyring
from webhook.pull.kubeapi import APIError, KubeAPI
from webhook.references import normalise
from webhook.stamps import file_stamp

log = logging.getLogger("copilot-webhook-agent")

BODY_LIMIT = 4 * 1024 * 1024  # images and pull secrets; a pod's whole spec is smaller
IMAGES_LIMIT = 256
TOKEN_LIMIT = 16 * 1024
PROBLEMS_LOGGED = 5  # of a request's pull secrets
DRAIN_SECONDS = 10.0  # at SIGTERM, for the requests in flight to be answered (the kubelet grants 30)
HEAD_SECONDS = 15.0  # default: the TLS handshake, the head and the body, from the connection's arrival
POD_NAME, POD_UID = "authentication.kubernetes.io/pod-name", "authentication.kubernetes.io/pod-uid"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
# Where each runtime keeps its socket, relative to the host directory given (the host's /run, or the
# socket's own directory): the usual place first.
SOCKETS = {
    "containerd": ("containerd/containerd.sock", "k3s/containerd/containerd.sock", "containerd.sock"),
    "cri-o": ("crio/crio.sock", "crio.sock"),
    "docker": ("docker.sock",),
}


class Refused(Exception):
    """A request the agent will not serve: its HTTP status and why, in words the caller can act on."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


# --- who may ask ------------------------------------------------------------------------------------


def _object(parent: dict[str, Any], key: str) -> dict[str, Any]:
    """The object under the key, or an empty one where there is none (or not an object)."""
    value = parent.get(key)
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Caller:
    namespace: str
    pod: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod}"


def pod_images(pod: dict[str, Any]) -> set[str]:
    """The images a pod's spec names (containers and init containers), normalised."""
    spec = _object(pod, "spec")
    named: set[str] = set()
    for field in ("initContainers", "containers"):
        containers = spec.get(field)
        for container in containers if isinstance(containers, list) else []:
            image = container.get("image") if isinstance(container, dict) else None
            if isinstance(image, str):
                with contextlib.suppress(InvalidReference):
                    named.add(normalise(image))
    return named


def _bound_pod(status: dict[str, Any]) -> tuple[Caller, str, str]:
    """The pod a TokenReview's user is bound to, its uid and the service account; Refused when it is none."""
    user = _object(status, "user")
    username = str(user.get("username", ""))
    extra = _object(user, "extra")
    names, uids = extra.get(POD_NAME) or [], extra.get(POD_UID) or []
    parts = username.removeprefix(SERVICE_ACCOUNT_PREFIX).split(":")
    if not username.startswith(SERVICE_ACCOUNT_PREFIX) or len(parts) != 2 or len(names) != 1 or len(uids) != 1:
        raise Refused(403, "the token is not a service account token bound to a pod")
    namespace, account = parts
    return Caller(namespace, str(names[0])), str(uids[0]), account


class Gate:
    def __init__(self, api: KubeAPI, audience: str, node: str) -> None:
        self.api, self.audience, self.node = api, audience, node

    def admit(self, token: str, images: list[str]) -> Caller:
        """The pod the token speaks for, once it may ask for these images; Refused otherwise."""
        try:
            status = self.api.review_token(token, self.audience)
        except APIError as exc:
            raise Refused(503, f"cannot check the token now: {exc}") from None
        if status.get("authenticated") is not True:
            raise Refused(401, f"the token is not valid: {status.get('error') or 'not authenticated'}")
        if self.audience not in (status.get("audiences") or []):
            raise Refused(401, f"the token is not for audience {self.audience}")
        caller, uid, account = _bound_pod(status)
        pod = self._pod(caller)
        self._may_ask(caller, pod, uid, account)
        named = pod_images(pod)
        for image in images:
            if normalise(image) not in named:
                raise Refused(403, f"pod {caller} does not name the image {image[:200]}")
        return caller

    def _may_ask(self, caller: Caller, pod: dict[str, Any], uid: str, account: str) -> None:
        meta, spec = _object(pod, "metadata"), _object(pod, "spec")
        if meta.get("uid") != uid:
            raise Refused(403, f"the token's pod {caller} no longer exists (its uid changed)")
        # Its init containers ask before its containers start: a finished pod never asks again, nor one
        # being deleted (its token stays valid until some time after deletion).
        if meta.get("deletionTimestamp"):
            raise Refused(403, f"pod {caller} is being deleted")
        if _object(pod, "status").get("phase") in ("Succeeded", "Failed"):
            raise Refused(403, f"pod {caller} has finished")
        if spec.get("nodeName") != self.node:
            raise Refused(403, f"pod {caller} runs on node {spec.get('nodeName') or '(none)'}, not on {self.node}")
        if (spec.get("serviceAccountName") or "default") != account:
            raise Refused(403, f"pod {caller} does not run as service account {account}")

    def _pod(self, caller: Caller) -> dict[str, Any]:
        try:
            return self.api.pod(caller.namespace, caller.pod)
        except APIError as exc:
            if exc.status == 404:
                raise Refused(403, f"the token's pod {caller} no longer exists") from None
            raise Refused(503, f"cannot read pod {caller} now: {exc}") from None


# --- one pull per image and credentials -------------------------------------------------------------


def _fingerprint(keyring: Keyring) -> str:
    digest = hashlib.sha256()
    for credential in keyring.entries:
        digest.update(json.dumps(list(credential)).encode())
    return digest.hexdigest()


@dataclass
class _Flight:
    deadline: float  # the latest deadline of the requests waiting for it
    done: threading.Event
    outcome: PullOutcome | None = None


class Flights:
    """Pulls in progress, each shared by every request for the same image with the same credentials: a
    request that asks with other credentials pulls for itself, so nobody is told an image is theirs on
    the strength of someone else's secret.

    Rules: each request pulls in lanes of its own, at most `workers` at once, so no request waits in a
    queue behind another's pulls (it waits only for a pull of its own image it joined); a flight runs
    until the latest deadline of its requests, so a request that joins later is not answered by an
    earlier one's deadline; at most `lanes` lanes run on the node (the connections at once times
    `workers`)."""

    def __init__(
        self,
        clients: dict[str, Client],
        *,
        workers: int,
        retries: int,
        backoff: float,
        route: dict[str, str] | None = None,
        lanes: int | None = None,
    ) -> None:
        """`route`: registry host -> the client that pulls its images, when not the runtime's ("default")."""
        self.clients, self.route, self.retries, self.backoff = clients, route or {}, retries, backoff
        self.workers = workers
        self.pool = ThreadPoolExecutor(max_workers=lanes or workers, thread_name_prefix="pull")
        self.lock = threading.Lock()
        self.running: dict[tuple[str, str], _Flight] = {}
        self.pullers: set[Puller] = set()
        self.stopping = threading.Event()
        self.pulls = 0  # flights started, for tests and logs

    def pull(self, images: list[str], keyring: Keyring, deadline: float) -> list[PullOutcome]:
        """Each image's outcome, in the order asked, by the deadline: what is not done by then failed."""
        fingerprint = _fingerprint(keyring)
        keys = list(dict.fromkeys(normalise(image) for image in images))  # one image however often asked
        todo = iter(keys)
        outcomes: dict[str, PullOutcome] = {}
        taken = threading.Lock()

        def lane() -> None:
            while not self.stopping.is_set() and time.monotonic() < deadline:
                with taken:
                    key = next(todo, None)
                if key is None:
                    return
                outcomes[key] = self._one(key, fingerprint, keyring, deadline)

        lanes = []
        with contextlib.suppress(RuntimeError):  # the pool is shut: the agent is stopping
            lanes = [self.pool.submit(lane) for _ in range(min(self.workers, len(keys)))]
        wait(lanes, timeout=max(deadline - time.monotonic(), 0))
        answered = []
        for image in images:
            outcome = outcomes.get(normalise(image))
            if outcome is not None:
                answered.append(PullOutcome(image, outcome.result, outcome.attempts, outcome.seconds, outcome.error))
            elif self.stopping.is_set():
                answered.append(PullOutcome(image, "cancelled", 0, 0.0, "the agent is stopping"))
            else:
                answered.append(PullOutcome(image, "failed", 0, 0.0, "timed out waiting for the node's pull"))
        return answered

    def _one(self, key: str, fingerprint: str, keyring: Keyring, deadline: float) -> PullOutcome:
        """The image's outcome: from the flight in progress for it with these credentials, or its own."""
        with self.lock:
            flight = self.running.get((key, fingerprint))
            if flight is None:
                flight = self.running[(key, fingerprint)] = _Flight(deadline, threading.Event())
                self.pulls += 1
                mine = True
            else:
                flight.deadline = max(flight.deadline, deadline)
                mine = False
        if mine:
            return self._fly(key, fingerprint, keyring, flight)
        if flight.done.wait(max(deadline - time.monotonic(), 0)) and flight.outcome is not None:
            return flight.outcome
        return PullOutcome(key, "failed", 0, 0.0, "timed out waiting for the node's pull")

    def _fly(self, key: str, fingerprint: str, keyring: Keyring, flight: _Flight) -> PullOutcome:
        """The pull, again while it ran out of time and a request that joined meanwhile has more. It ends
        under the lock: a request either joined in time to be counted, or starts a flight of its own."""
        outcome = PullOutcome(key, "failed", 0, 0.0, "the agent failed")
        try:
            while True:
                with self.lock:
                    attempt = flight.deadline
                    puller = Puller(
                        self.clients, self.route, keyring, deadline=attempt, retries=self.retries, backoff=self.backoff
                    )
                    self.pullers.add(puller)
                    if self.stopping.is_set():
                        puller.stopping.set()
                try:
                    outcome = puller.one(key)
                finally:
                    with self.lock:
                        self.pullers.discard(puller)
                with self.lock:
                    ran_out = outcome.result == "failed" and time.monotonic() >= attempt
                    if not ran_out or flight.deadline <= attempt or self.stopping.is_set():
                        self._land(key, fingerprint, flight, outcome)
                        return outcome
        except Exception:  # a defect: logged with its stack; the requests waiting are answered all the same
            log.exception("pull of %s", key)
            with self.lock:
                self._land(key, fingerprint, flight, outcome)
            return outcome

    def _land(self, key: str, fingerprint: str, flight: _Flight, outcome: PullOutcome) -> None:
        self.running.pop((key, fingerprint), None)
        flight.outcome = outcome
        flight.done.set()

    def stop(self) -> None:
        self.stopping.set()
        with self.lock:
            for puller in self.pullers:
                puller.stopping.set()
        for client in self.clients.values():
            client.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)


# --- the request ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PullRequest:
    images: list[str]
    secrets: dict[str, bytes]
    timeout: float


def parse_request(body: bytes, max_timeout: float) -> PullRequest:
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        raise Refused(400, "the body is not JSON") from None
    if not isinstance(document, dict):
        raise Refused(400, "the body must be a JSON object with images, pullSecrets and timeoutSeconds")
    images = _images(document.get("images"))
    secrets = document.get("pullSecrets", {})
    if not isinstance(secrets, dict) or not all(isinstance(v, str) for v in secrets.values()):
        raise Refused(400, "pullSecrets must be an object of secret name to .dockerconfigjson text")
    timeout = document.get("timeoutSeconds", max_timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < float("inf"):
        raise Refused(400, "timeoutSeconds must be a positive number")
    return PullRequest(images, {str(k): v.encode() for k, v in secrets.items()}, min(float(timeout), max_timeout))


def _images(images: object) -> list[str]:
    """The request's images: 1 to IMAGES_LIMIT references that parse."""
    if not isinstance(images, list) or not images or not all(isinstance(i, str) and i for i in images):
        raise Refused(400, "images must be a non-empty array of image references")
    if len(images) > IMAGES_LIMIT:
        raise Refused(400, f"images: at most {IMAGES_LIMIT}, not {len(images)}")
    for image in images:
        try:
            normalise(image)
        except InvalidReference as exc:
            raise Refused(400, f"images: {exc}") from None
    return list(images)


class Handler(http.server.BaseHTTPRequestHandler):
    server: AgentServer
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.1"  # every answer has a status line, even to a head that names none
    server_version = "copilot-webhook-agent"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        self.close_connection = True  # one request per connection: a pod asks once

    def _answer(self, status: int, document: dict[str, Any]) -> None:
        body = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed head, one too long), as JSON like every other answer."""
        with contextlib.suppress(OSError):
            self._answer(code, {"error": message or http.server.BaseHTTPRequestHandler.responses[code][0]})

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.client_address[0], format % args)

    def do_GET(self) -> None:
        self.server.head_done(self.connection)
        if self.path == "/healthz":
            health = {"status": "ok", "node": self.server.node, "runtime": self.server.runtime}
            self._answer(200, health | {"pulls": self.server.flights.pulls})
        else:
            self._answer(404, {"error": f"no such path {self.path[:100]}: POST /v1/pull, GET /healthz"})

    def do_POST(self) -> None:
        started = time.monotonic()
        try:
            caller, outcomes = self._pull()
        except Refused as exc:
            self.server.head_done(self.connection)
            log.info("refused %s: %s", self.client_address[0], exc.message)
            self._answer(exc.status, {"error": exc.message})
            return
        counts = {r: sum(o.result == r for o in outcomes) for r in ("present", "pulled", "failed", "cancelled")}
        log.info(
            "pull %s images=%d %s seconds=%.1f",
            caller,
            len(outcomes),
            " ".join(f"{k}={v}" for k, v in counts.items()),
            time.monotonic() - started,
        )
        results = [o.__dict__ for o in outcomes]
        self._answer(200, {"node": self.server.node, "runtime": self.server.runtime, "results": results})

    def _body(self) -> bytes:
        """The request's JSON body, whole, within BODY_LIMIT."""
        if self.path != "/v1/pull":
            raise Refused(404, f"no such path {self.path[:100]}: POST /v1/pull")
        if self.headers.get_content_type() != "application/json":
            raise Refused(415, "the body must be application/json")
        length = self.headers.get("Content-Length", "")
        # ASCII digits only: str.isdigit() also takes '²', which int() refuses. A body in chunks is not read.
        if not (length.isascii() and length.isdigit()) or "Transfer-Encoding" in self.headers:
            raise Refused(411, "a Content-Length (and no Transfer-Encoding) is required")
        if int(length) > BODY_LIMIT:
            raise Refused(413, f"the body is larger than {BODY_LIMIT} bytes")
        body = self.rfile.read(int(length))
        if len(body) < int(length):
            raise Refused(400, "the body ended before its Content-Length")
        return body

    def _pull(self) -> tuple[Caller, list[PullOutcome]]:
        body = self._body()
        self.server.head_done(self.connection)
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip() or len(token) > TOKEN_LIMIT:
            raise Refused(401, "a bearer token of the agent's audience is required")
        request = parse_request(body, self.server.max_timeout)
        caller = self.server.gate.admit(token.strip(), request.images)
        keyring, problems = Keyring.from_documents(request.secrets)
        for problem in problems[:PROBLEMS_LOGGED]:  # a body holds hundreds of thousands: the log gets a few
            log.info("%s: %s", caller, problem)
        if len(problems) > PROBLEMS_LOGGED:
            log.info("%s: %d more problems with its pull secrets", caller, len(problems) - PROBLEMS_LOGGED)
        deadline = time.monotonic() + request.timeout
        return caller, self.server.flights.pull(request.images, keyring, deadline)


class AgentServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        tls: ReloadingContext,
        gate: Gate,
        flights: Flights,
        *,
        node: str,
        runtime: str,
        max_connections: int,
        max_timeout: float,
        head_seconds: float = HEAD_SECONDS,
    ) -> None:
        self.head_seconds = head_seconds
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, Handler)
        self.tls, self.gate, self.flights = tls, gate, flights
        self.node, self.runtime, self.max_timeout = node, runtime, max_timeout
        self.slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        self.timers: dict[int, _Cut] = {}
        self.timers_lock = threading.Lock()

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            log.warning("refused a connection from %s: %s at once already", client_address[0], "all slots taken")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        cut = _Cut(request, self.head_seconds)
        with self.timers_lock:
            self.timers[id(request)] = cut
        cut.timer.start()
        try:
            request.settimeout(self.head_seconds)
            wrapped = self.tls.context().wrap_socket(request, server_side=True)
            with self.timers_lock:  # wrapping moved the descriptor: cut the wrapped socket from now on
                self.timers[id(wrapped)] = self.timers.pop(id(request))
                cut.sock = wrapped
            self.finish_request(wrapped, client_address)
        except (OSError, ssl.SSLError) as exc:
            log.debug("connection from %s ended: %s", client_address[0], exc)
        except Exception:  # a defect: logged with its stack, the agent keeps serving
            log.exception("connection from %s", client_address[0])
        finally:
            cut.timer.cancel()
            with self.timers_lock:
                self.timers.pop(id(cut.sock), None)
            self.shutdown_request(cut.sock)
            self.slots.release()

    def drain(self, seconds: float) -> None:
        """Stopping: cut the requests still arriving, and give those being answered (their pulls
        cancelled) up to `seconds` to be, as every slot comes back."""
        with self.timers_lock:
            cuts = list(self.timers.values())
        for cut in cuts:
            cut.timer.cancel()
            cut.fire()
        deadline = time.monotonic() + seconds
        for _ in range(self.max_connections):
            if not self.slots.acquire(timeout=max(deadline - time.monotonic(), 0)):
                log.warning("stopped with requests still unanswered after %.0f s", seconds)
                return

    def head_done(self, connection: Any) -> None:
        """The request has arrived whole: its time bound no longer runs (pulls have their own), and the
        answer must be taken within the same bound."""
        with self.timers_lock:
            cut = self.timers.pop(id(connection), None)
        if cut is not None:
            cut.timer.cancel()
        with contextlib.suppress(OSError):
            connection.settimeout(self.head_seconds)


class _Cut:
    """A connection's time bound: so long after its arrival, whatever socket carries it is shut."""

    def __init__(self, sock: Any, seconds: float) -> None:
        self.sock = sock
        self.timer = threading.Timer(seconds, self.fire)
        self.timer.daemon = True

    def fire(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class ReloadingContext:
    """The serving context, rebuilt when the certificate files change (a mounted Secret is rotated); a
    pair that does not load keeps the previous one serving."""

    def __init__(self, cert: str, key: str) -> None:
        self.cert, self.key = cert, key
        self._stamp: tuple[tuple[int, int, int], ...] = ()
        self._context: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self.context()

    def context(self) -> ssl.SSLContext:
        with self._lock:
            stamp = file_stamp(self.cert, self.key)
            if stamp != self._stamp or self._context is None:
                self._stamp = stamp
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                context.set_alpn_protocols(["http/1.1"])
                try:
                    context.load_cert_chain(self.cert, self.key)
                    self._context = context
                    log.info("serving certificate loaded from %s", self.cert)
                except (OSError, ssl.SSLError) as exc:
                    log.error("certificate %s not loaded, the previous one serves: %s", self.cert, exc)
            if self._context is None:
                raise ValueError(f"cannot load the certificate {self.cert} and key {self.key}")
            return self._context


# --- the node's runtime -----------------------------------------------------------------------------


def runtime_of(node: dict[str, Any]) -> str:
    """The flavour of a Node's runtime: containerRuntimeVersion before `://`, as the webhook reads it."""
    version = str(_object(_object(node, "status"), "nodeInfo").get("containerRuntimeVersion", ""))
    return version.partition("://")[0] if "://" in version else ""


def find_socket(flavour: str, directory: str) -> str:
    """The first of the runtime's usual sockets under the directory that is a socket; ValueError else."""
    if flavour not in SOCKETS:
        raise ValueError(f"the node's runtime {flavour or '(none reported)'!r} is none of {', '.join(SOCKETS)}")
    for relative in SOCKETS[flavour]:
        path = os.path.join(directory, relative)
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.stat(path).st_mode):
                return path
    tried = ", ".join(SOCKETS[flavour])
    raise ValueError(f"the node runs {flavour}, and none of {tried} under {directory} is a socket")


def clients_for(flavour: str, path: str, args: argparse.Namespace) -> tuple[dict[str, Client], dict[str, str]]:
    """The runtime's client, and containerd's own for the registries only the pod network reaches (pulled
    from inside the agent's pod, into the runtime's store); ValueError when the node cannot do that."""
    if args.pod_network_registry and flavour != "containerd":
        raise ValueError(f"--pod-network-registry needs a containerd node; this node runs {flavour}")
    if flavour == "docker":
        return {"default": DockerClient(path)}, {}
    return with_pod_network(path, CRIClient(path), args)


# --- the command ------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="copilot-webhook-agent", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--port", type=int, default=8444, help="the HTTPS port (default 8444)")
    parser.add_argument("--host", default="::", help="the address to listen on (default: every address)")
    parser.add_argument("--tls-cert", required=True)
    parser.add_argument("--tls-key", required=True)
    parser.add_argument("--audience", required=True, help="the audience callers' tokens must be for")
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME"), help="this node (default: $NODE_NAME)")
    parser.add_argument("--socket-directory", default="/host/run", help="the host directory of the runtime sockets")
    parser.add_argument("--max-connections", type=int, default=64, help="connections at once (default 64)")
    parser.add_argument(
        "--workers",
        type=int,
        default=4,
        help="pulls at once for one request, as the socket mode's --parallel (default 4)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds a request may take at most (default 300)")
    parser.add_argument(
        "--request-timeout", type=float, default=HEAD_SECONDS, help="seconds for a request to arrive whole (default 15)"
    )
    parser.add_argument("--api-server", help="HOST:PORT of the API server (default: the pod's service account)")
    parser.add_argument("--api-ca-file", help="with --api-server: its CA")
    parser.add_argument("--api-token-file", help="with --api-server: a token to call it with")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_registry_options(
        parser, "pull this registry's images from inside the agent's pod (containerd's own client; containerd nodes)"
    )
    return parser


def _api(args: argparse.Namespace) -> KubeAPI:
    if args.api_server is None:
        return KubeAPI.in_cluster()
    host, _, port = args.api_server.rpartition(":")
    if not host or not port.isdigit() or not args.api_ca_file or not args.api_token_file:
        raise APIError("--api-server must be HOST:PORT, with --api-ca-file and --api-token-file")
    return KubeAPI(host.strip("[]"), int(port), args.api_ca_file, args.api_token_file)


def build(args: argparse.Namespace) -> AgentServer:
    """The server, its node's runtime found; ValueError or APIError naming what is missing."""
    if not args.node_name:
        raise ValueError("--node-name (or $NODE_NAME, from spec.nodeName) is required")
    if not 0 < args.timeout <= MAX_TIMEOUT or not 0 < args.request_timeout <= 300:
        raise ValueError("--timeout must be positive and at most a day, --request-timeout at most 300 s")
    if args.max_connections < 1 or args.workers < 1:
        raise ValueError("--max-connections and --workers must be positive")
    api = _api(args)
    flavour = runtime_of(api.node(args.node_name))
    path = find_socket(flavour, args.socket_directory)
    if args.host == "::" and not socket.has_ipv6:  # every address, where the kernel has no IPv6
        args.host = "0.0.0.0"  # noqa: S104 (the agent serves its node's pods on the pod network)
    clients, route = clients_for(flavour, path, args)
    lanes = args.max_connections * args.workers
    flights = Flights(clients, workers=args.workers, retries=3, backoff=1.0, route=route, lanes=lanes)
    return AgentServer(
        (args.host, args.port),
        ReloadingContext(args.tls_cert, args.tls_key),
        Gate(api, args.audience, args.node_name),
        flights,
        node=args.node_name,
        runtime=f"{flavour}:{path}",
        max_connections=args.max_connections,
        max_timeout=args.timeout,
        head_seconds=args.request_timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        server = build(args)
    except (ValueError, APIError, OSError) as exc:
        print(f"copilot-webhook-agent: {exc}", file=sys.stderr, flush=True)
        return 1
    stop = _stopper(server)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("serving on port %d for node %s, runtime %s", args.port, server.node, server.runtime)
    server.serve_forever(poll_interval=0.5)
    server.drain(DRAIN_SECONDS)
    server.server_close()
    return 0


def _stopper(server: AgentServer) -> Callable[[int, FrameType | None], None]:
    def stop(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: stopping; pulls in flight are cancelled", signal.Signals(signum).name)
        server.flights.stop()
        threading.Thread(target=server.shutdown, daemon=True).start()

    return stop


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
