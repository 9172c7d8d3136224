"""copilot-webhook-pull: the command the image-puller init container runs (spec 1.3).

Pulls every image given through the node's runtime socket, in parallel, skipping those the node
already has, retrying with exponential back-off, all within one deadline, and prints one line per
image. On failure it exits non-zero (`--failure-policy=Fail`) or says so and exits 0 (`Ignore`), so
the kubelet pulls as usual. Standard library only: it runs in the small puller image.

Clients: `docker` (the Docker Engine API on the socket) or `crictl` (any CRI socket: containerd, CRI-O,
cri-dockerd). Image references are passed to the client untouched: digests, registry ports and
missing tags are the client's to resolve, as the kubelet would.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass
class Outcome:
    image: str
    result: str  # present, pulled, failed
    attempts: int
    seconds: float
    error: str = ""

    def line(self) -> str:
        text = f"image={self.image} result={self.result} attempts={self.attempts} seconds={self.seconds:.1f}"
        return text + (f" error={self.error!r}" if self.error else "")


class Puller:
    def __init__(self, client: str, socket: str, deadline: float, retries: int, backoff: float) -> None:
        endpoint = f"unix://{socket}"
        if client == "docker":
            self.base = ["docker", "--host", endpoint]
            self.inspect, self.pull = ["image", "inspect"], ["pull", "--quiet"]
        else:
            self.base = ["crictl", "--runtime-endpoint", endpoint, "--image-endpoint", endpoint]
            self.inspect, self.pull = ["inspecti", "--quiet"], ["pull"]
        self.deadline, self.retries, self.backoff = deadline, retries, backoff
        self.print_lock = threading.Lock()

    def _remaining(self) -> float:
        return self.deadline - time.monotonic()

    def _run(self, args: list[str]) -> tuple[int, str]:
        remaining = self._remaining()
        if remaining <= 0:
            return -1, "timed out"
        try:
            done = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=remaining, check=False)
        except subprocess.TimeoutExpired:
            return -1, "timed out"
        except OSError as exc:
            return -1, f"cannot run {self.base[0]}: {exc.strerror}"
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return done.returncode, last[-1][:300] if last else f"exit code {done.returncode}"

    def one(self, image: str) -> Outcome:
        started = time.monotonic()
        code, _ = self._run([*self.inspect, image])
        if code == 0:
            return self._report(Outcome(image, "present", 0, time.monotonic() - started))
        error = ""
        for attempt in range(1, self.retries + 1):
            code, error = self._run([*self.pull, image])
            if code == 0:
                return self._report(Outcome(image, "pulled", attempt, time.monotonic() - started))
            if error == "timed out" or attempt == self.retries:
                break
            pause = min(self.backoff * 2 ** (attempt - 1), max(self._remaining(), 0))
            time.sleep(pause)
        return self._report(Outcome(image, "failed", attempt, time.monotonic() - started, error))

    def _report(self, outcome: Outcome) -> Outcome:
        with self.print_lock:
            print(outcome.line(), flush=True)
        return outcome


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="copilot-webhook-pull", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--client", choices=["docker", "crictl"], required=True)
    parser.add_argument(
        "--socket", required=True, help="path of the runtime socket, e.g. /run/containerd/containerd.sock"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds for everything (default 300)")
    parser.add_argument("--failure-policy", choices=["Ignore", "Fail"], default="Ignore")
    parser.add_argument("--retries", type=int, default=3, help="pull attempts per image (default 3)")
    parser.add_argument("--parallel", type=int, default=4, help="pulls at once (default 4)")
    parser.add_argument("--backoff", type=float, default=1.0, help="first pause between attempts, doubled each time")
    parser.add_argument("images", nargs="*")
    args = parser.parse_args(argv)
    if args.timeout <= 0 or args.retries < 1 or args.parallel < 1:
        parser.error("--timeout, --retries and --parallel must be positive")
    images = list(dict.fromkeys(args.images))
    if not images:
        print("no images to pull")
        return 0
    puller = Puller(args.client, args.socket, time.monotonic() + args.timeout, args.retries, args.backoff)
    with ThreadPoolExecutor(max_workers=min(args.parallel, len(images))) as pool:
        outcomes = list(pool.map(puller.one, images))
    failed = [o for o in outcomes if o.result == "failed"]
    counts = {r: sum(o.result == r for o in outcomes) for r in ("present", "pulled", "failed")}
    summary = " ".join(f"{k}={v}" for k, v in counts.items())
    if failed and args.failure_policy == "Fail":
        print(f"summary {summary}: failing (failure policy Fail)", flush=True)
        return 1
    suffix = "; the kubelet pulls the rest as usual (failure policy Ignore)" if failed else ""
    print(f"summary {summary}{suffix}", flush=True)
    return 0


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
