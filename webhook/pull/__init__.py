"""copilot-webhook-pull: the command the image-puller init container runs.

Pulls every image given through the node's runtime, in parallel, once per reference as the runtimes
normalise it, skipping those the node already has, retrying with exponential back-off only what can
succeed later (a registry down or hanging, not an image that is not there or a credential that is
refused), all within one deadline (at which the calls in flight are cancelled). It prints one line per
image in the order given (the pod's), then a summary. On failure it exits non-zero (`--failure-policy=Fail`) or
says so and exits 0 (`Ignore`), so the kubelet pulls as usual. SIGTERM (it runs as PID 1) stops it at
once: calls in flight are cancelled and child processes killed. Runs in the puller image: the standard
library and grpcio only.

With --agent it holds no socket: it asks the node agent to pull (webhook/pull/ask.py).

Nothing the pod author writes is read as an option: references are parsed first (one starting with `-`
is invalid), travel in API messages, and follow `--` where a command line carries them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from types import FrameType

from webhook.errors import InvalidReference
from webhook.pull.clients import Client, CRIClient, DockerClient
from webhook.pull.errors import Cancelled, PullError
from webhook.pull.keyring import Credential, Keyring
from webhook.pull.native import NativeClient
from webhook.references import parse

RESULTS = ("present", "pulled", "failed", "cancelled")
MAX_TIMEOUT = 86400.0  # a day: the chart allows an hour


@dataclass
class PullOutcome:
    image: str
    result: str  # present, pulled, failed, cancelled
    attempts: int
    seconds: float
    error: str = ""

    def line(self) -> str:
        text = f"image={self.image} result={self.result} attempts={self.attempts} seconds={self.seconds:.1f}"
        return text + (f" error={self.error}" if self.error else "")  # last: the cause needs no quoting


class Puller:
    def __init__(
        self,
        clients: dict[str, Client],
        route: dict[str, str],
        keyring: Keyring,
        *,
        deadline: float,
        retries: int,
        backoff: float,
    ) -> None:
        self.clients, self.route, self.keyring = clients, route, keyring
        self.deadline, self.retries, self.backoff = deadline, retries, backoff
        self.stopping = threading.Event()  # set by SIGTERM or SIGINT

    def _remaining(self) -> float:
        return self.deadline - time.monotonic()

    def one(self, image: str) -> PullOutcome:
        started = time.monotonic()
        attempts = [0]

        def outcome(result: str, error: str = "") -> PullOutcome:
            return PullOutcome(image, result, attempts[0], time.monotonic() - started, error)

        if self.stopping.is_set():
            return outcome("cancelled")
        if self._remaining() <= 0:
            return outcome("failed", "timed out before starting")
        try:
            reference = parse(image)
        except InvalidReference as exc:
            return outcome("failed", str(exc))
        client = self.clients[self.route.get(reference.registry, "default")]
        credentials: list[Credential | None] = [*self.keyring.lookup(reference), None]  # matches, anonymous
        try:
            return outcome(*self._retried(client, str(reference), credentials, attempts=attempts))
        except Cancelled:  # SIGTERM, or the deadline cancelled the calls in flight
            return outcome("cancelled") if self.stopping.is_set() else outcome("failed", "timed out")

    def _retried(
        self, client: Client, text: str, credentials: list[Credential | None], *, attempts: list[int]
    ) -> tuple[str, str]:
        """Ask whether the node has the image and pull it if not, retrying transient failures of either with
        back-off, up to `retries` tries: (result, error); `attempts` counts the pulls tried."""
        tries = 0
        while True:
            tries += 1
            try:
                if client.present(text, max(self._remaining(), 0.001)):
                    return "present", ""
                attempts[0] += 1
                self._pull(client, text, credentials)
                return "pulled", ""
            except PullError as exc:
                if exc.permanent or tries >= self.retries or self._remaining() <= 0:
                    return "failed", exc.message
            pause = min(self.backoff * 2 ** (tries - 1), max(self._remaining(), 0))
            if self.stopping.wait(pause):
                return "cancelled", ""

    def _pull(self, client: Client, reference: str, credentials: list[Credential | None]) -> None:
        error: PullError | None = None
        for credential in credentials:
            try:
                client.pull(reference, credential, max(self._remaining(), 0.001))
                return
            except PullError as exc:
                error = exc
                if not exc.permanent:
                    break  # the registry is unwell: no use trying other credentials now
        assert error is not None
        raise error

    def run(self, images: list[str], parallel: int) -> list[PullOutcome]:
        outcomes: dict[int, PullOutcome] = {}
        cancelled = False
        with ThreadPoolExecutor(max_workers=min(parallel, len(images))) as pool:
            futures: dict[Future[PullOutcome], int] = {
                pool.submit(self.one, image): i for i, image in enumerate(images)
            }
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                for future in done:
                    outcomes[futures[future]] = future.result()
                # The deadline is the run's, whatever a client's own timeouts do: a socket timeout bounds one
                # read, and a runtime that keeps streaming progress never lets it expire.
                if not cancelled and (self.stopping.is_set() or self._remaining() <= 0):
                    cancelled = True
                    for client in self.clients.values():
                        client.cancel()
        return [outcomes[i] for i in range(len(images))]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="copilot-webhook-pull", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--runtime", choices=["cri", "docker"], help="the API the socket serves")
    parser.add_argument("--socket", help="the runtime socket, e.g. /run/containerd/containerd.sock")
    parser.add_argument("--agent", metavar="URL", help="ask the node agent at this https:// URL instead of a socket")
    parser.add_argument("--agent-ca-env", metavar="VAR", help="with --agent: the variable holding its CA bundle")
    parser.add_argument("--token", metavar="FILE", help="with --agent: the projected token to present")
    parser.add_argument(
        "--connect-timeout", type=float, default=10, help="with --agent: seconds to reach it (default 10)"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds for everything (default 300)")
    parser.add_argument("--failure-policy", choices=["Ignore", "Fail"], default="Ignore")
    parser.add_argument("--retries", type=int, default=3, help="attempts per image, transient failures (default 3)")
    parser.add_argument("--parallel", type=int, default=4, help="pulls at once (default 4)")
    parser.add_argument("--backoff", type=float, default=1.0, help="first pause between attempts, doubled each time")
    parser.add_argument("--pull-secrets", help="directory of .dockerconfigjson files (the pod's imagePullSecrets)")
    add_registry_options(
        parser, "pull this registry's images from inside the pod (containerd's native client; cri runtime only)"
    )
    parser.add_argument("images", nargs="*")
    return parser


def add_registry_options(parser: argparse.ArgumentParser, pod_network_help: str) -> None:
    """The options with_pod_network reads: the registries pulled from the pod's own network, and how."""
    parser.add_argument("--pod-network-registry", action="append", default=[], metavar="HOST", help=pod_network_help)
    parser.add_argument("--registry-ca", action="append", default=[], metavar="HOST=ENV", help="CA bundle in $ENV")
    parser.add_argument("--registry-plain-http", action="append", default=[], metavar="HOST")
    parser.add_argument("--registry-skip-verify", action="append", default=[], metavar="HOST")


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, refused with a usage error (exit 2) where a value cannot be used."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.retries < 1 or args.parallel < 1:
        parser.error("--retries and --parallel must be positive")
    # Finite and bounded: NaN compares false to everything, and a socket refuses a timeout past time_t.
    if not 0 < args.timeout <= MAX_TIMEOUT:
        parser.error(f"--timeout must be more than 0 and at most {MAX_TIMEOUT} seconds, not {args.timeout}")
    if not 0 <= args.backoff <= args.timeout:
        parser.error(f"--backoff must be from 0 to --timeout seconds, not {args.backoff}")
    _check_source(parser, args)
    if args.pull_secrets is not None and not os.path.isdir(args.pull_secrets):
        what = "not a directory" if os.path.exists(args.pull_secrets) else "no such directory"
        parser.error(f"--pull-secrets {args.pull_secrets}: {what} (the pod's pull secrets volume)")
    return args


def _check_source(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Where the pulls go: a runtime socket, or the node agent; each with only its own options."""
    if args.agent is None:
        if not args.runtime or not args.socket:
            parser.error("either --runtime and --socket, or --agent, is required")
        if args.pod_network_registry and args.runtime != "cri":
            parser.error("--pod-network-registry needs --runtime=cri (containerd)")
        return
    if args.runtime or args.socket or args.pod_network_registry:
        parser.error("--agent asks the node agent: it takes no --runtime, --socket or --pod-network-registry")
    if not args.agent_ca_env or not args.token:
        parser.error("--agent needs --agent-ca-env and --token")
    # More than --timeout is no error (the settings allow it): the whole is bounded by --timeout.
    if not 0 < args.connect_timeout <= MAX_TIMEOUT:
        parser.error(f"--connect-timeout must be more than 0 and at most {MAX_TIMEOUT}, not {args.connect_timeout}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _arguments(argv)
    images = distinct(args.images)
    if not images:
        print("summary present=0 pulled=0 failed=0 cancelled=0: no images to pull", flush=True)
        return 0
    if args.agent is not None:
        return _ask_agent(args, images)
    keyring, problems = Keyring.from_directory(args.pull_secrets)
    for problem in problems:
        print(problem, flush=True)
    clients, route = _clients(args)
    puller = Puller(
        clients,
        route,
        keyring,
        deadline=time.monotonic() + args.timeout,
        retries=args.retries,
        backoff=args.backoff,
    )

    def stop(signum: int, _frame: FrameType | None) -> None:
        if not puller.stopping.is_set():
            print(f"{signal.Signals(signum).name}: stopping, cancelling the pulls in flight", flush=True)
        puller.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    outcomes = puller.run(images, args.parallel)
    for outcome in outcomes:
        print(outcome.line(), flush=True)
    return _summary(outcomes, args.failure_policy)


def _ask_agent(args: argparse.Namespace, images: list[str]) -> int:
    """Agent mode: one request to the node's agent, its answer printed as the socket mode prints its own."""
    from webhook.pull.ask import Asker, ca_from_env

    started = time.monotonic()
    try:
        asker = Asker(
            args.agent,
            ca_from_env(args.agent_ca_env),
            args.token,
            connect_timeout=args.connect_timeout,
            secrets_directory=args.pull_secrets,
        )
    except ValueError as exc:
        print(f"node agent: {exc}", flush=True)
        failed = [PullOutcome(i, "failed", 0, 0.0, "the node agent did not pull it") for i in images]
        for outcome in failed:
            print(outcome.line(), flush=True)
        return _summary(failed, args.failure_policy)
    stopping = threading.Event()

    def stop(signum: int, _frame: FrameType | None) -> None:
        print(f"{signal.Signals(signum).name}: stopping, abandoning the request to the node agent", flush=True)
        stopping.set()
        asker.cancel()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        answers, problems = asker.ask(images, started + args.timeout)
        outcomes = [PullOutcome(*answer) for answer in answers]
    except PullError as exc:
        problems = [] if stopping.is_set() else [f"node agent: {exc.message}"]
        result = "cancelled" if stopping.is_set() else "failed"
        error = "" if stopping.is_set() else "the node agent did not pull it"
        outcomes = [PullOutcome(i, result, 0, time.monotonic() - started, error) for i in images]
    for line in problems:
        print(line, flush=True)
    for outcome in outcomes:
        print(outcome.line(), flush=True)
    return _summary(outcomes, args.failure_policy)


def distinct(images: list[str]) -> list[str]:
    """The images in order, each once however it is spelled (`busybox` and `docker.io/library/busybox:latest`
    are one pull), as first written; an invalid reference stays, to be reported."""
    seen: dict[str, str] = {}
    for image in images:
        try:
            key = str(parse(image))
        except InvalidReference:
            key = image
        seen.setdefault(key, image)
    return list(seen.values())


def _clients(args: argparse.Namespace) -> tuple[dict[str, Client], dict[str, str]]:
    """The runtime's client, and the pod-network one for the registries routed to it."""
    if args.runtime == "docker":
        return {"default": DockerClient(args.socket)}, {}
    return with_pod_network(args.socket, CRIClient(args.socket), args)


def with_pod_network(socket: str, cri: CRIClient, args: argparse.Namespace) -> tuple[dict[str, Client], dict[str, str]]:
    """The CRI client, and containerd's own for the registries `--pod-network-registry` names (pulled from
    inside this pod's network, into the runtime's store), routed by registry host."""
    if not args.pod_network_registry:
        return {"default": cri}, {}
    cas = {}
    for item in args.registry_ca:
        host, _, variable = item.partition("=")
        cas[host] = os.environ.get(variable, "")
    options: dict[str, list[str]] = {host: [] for host in args.pod_network_registry}
    for flag, hosts in (("--plain-http", args.registry_plain_http), ("--skip-verify", args.registry_skip_verify)):
        for host in hosts:
            options.setdefault(host, []).append(flag)
    native = NativeClient(socket, cri, options, cas=cas)
    return {"default": cri, "native": native}, dict.fromkeys(args.pod_network_registry, "native")


def _summary(outcomes: list[PullOutcome], failure_policy: str) -> int:
    counts = {r: sum(o.result == r for o in outcomes) for r in RESULTS}
    summary = "summary " + " ".join(f"{k}={v}" for k, v in counts.items())
    unfinished = counts["failed"] + counts["cancelled"]
    if unfinished and failure_policy == "Fail":
        print(f"{summary}: failing (failure policy Fail)", flush=True)
        return 1
    suffix = "; the kubelet pulls the rest as usual (failure policy Ignore)" if unfinished else ""
    print(summary + suffix, flush=True)
    return 0


def entrypoint() -> None:
    sys.exit(main())
