"""The Go programs the tests run (kube-apiserver, etcd, the kubelet, kube-proxy, Flyte's pod generators,
actionlint), built from the small Go modules under tests/ into a cache outside the work tree, keyed by
everything that decides the binary: the module's go.mod, go.sum and Go files, the package, the link flags
and the Go version. A warm run finds the binary and builds nothing; a changed pin builds a new one beside
the old.

    python -m harness.gotools build [NAME ...]   # build (or reuse) and print each binary's path
    python -m harness.gotools path NAME          # print the cached path, exit 1 if it is not built

Tests call `binary(NAME)`: the path, or a pytest skip naming `make go-tools` (a failure under CI=true).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAKE_TARGET = "make go-tools"
KUBERNETES_VERSION = "v1.35.4"


def _kube_ldflags(version: str) -> tuple[str, ...]:
    # Unstamped, the API server reports v0.0.0-master and Helm's kubeVersion checks refuse the chart.
    major, minor = version.lstrip("v").split(".")[:2]
    pkg = "k8s.io/component-base/version"
    return (
        f"-X {pkg}.gitVersion={version}",
        f"-X {pkg}.gitMajor={major}",
        f"-X {pkg}.gitMinor={minor}",
        f"-X {pkg}.gitTreeState=clean",
        f"-X {pkg}.buildDate=1970-01-01T00:00:00Z",
    )


@dataclass(frozen=True)
class Tool:
    name: str
    module: str  # folder of the Go module, relative to the repository root
    package: str  # what `go build` builds, as the module sees it
    ldflags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = (("CGO_ENABLED", "0"),)
    extra: tuple[str, ...] = field(default=())  # files outside the module that the build reads

    @property
    def module_dir(self) -> Path:
        return ROOT / self.module


TOOLS: dict[str, Tool] = {
    tool.name: tool
    for tool in (
        Tool(
            "kube-apiserver",
            "tests/kube/apiserver",
            "k8s.io/kubernetes/cmd/kube-apiserver",
            _kube_ldflags(KUBERNETES_VERSION),
        ),
        Tool(
            "kube-controller-manager",
            "tests/kube/apiserver",
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            _kube_ldflags(KUBERNETES_VERSION),
        ),
        # The node's agent (harness/node.py): v1.35 is the last minor that runs on containerd 1.x.
        Tool("kubelet", "tests/kube/apiserver", "k8s.io/kubernetes/cmd/kubelet", _kube_ldflags(KUBERNETES_VERSION)),
        # The node's Service routing (harness/node.py).
        Tool(
            "kube-proxy", "tests/kube/apiserver", "k8s.io/kubernetes/cmd/kube-proxy", _kube_ldflags(KUBERNETES_VERSION)
        ),
        Tool("etcd", "tests/kube/etcd", "go.etcd.io/etcd/server/v3"),
        # Flyte's pod generators, one module per release line whose Flyte modules resolve (scripts/flyte_source.py).
        Tool("flyte-pods-1.16", "tests/flyte/v1.16", "."),
        # flyteplugins v1.15.3 and v1.14.1 over the nearest served flyteidl, flytestdlib and flytepropeller
        # (v1.16.8).
        Tool("flyte-pods-1.15", "tests/flyte/v1.15", "."),
        Tool("flyte-pods-1.14", "tests/flyte/v1.14", "."),
        # Flyte's own flytecopilot, copied from Flyte's repository (tests/flyte/copilot/README.md), for the
        # node's task pods (tests/test_kube_copilot.py). Its packages sit in subfolders, which the key reads
        # as extra files.
        *(
            Tool(
                f"flytecopilot-{line}",
                f"tests/flyte/copilot/{tag}",
                ".",
                extra=tuple(
                    str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests/flyte/copilot" / tag).glob("*/**/*.go"))
                ),
            )
            for line, tag in (("1.15", "v1.15.3"), ("1.16", "v1.16.8"))
        ),
        # Flyte 1.16.8's flytepropeller with the pod plugin alone, and Flyte's kubectl-flyte that compiles a
        # workflow closure into a FlyteWorkflow, for the workflows of tests/test_kube_propeller.py.
        Tool("flytepropeller-1.16", "tests/flyte/propeller", "."),
        Tool(
            "kubectl-flyte-1.16", "tests/flyte/propeller", "github.com/flyteorg/flyte/flytepropeller/cmd/kubectl-flyte"
        ),
        # The linter of GitHub Actions workflows, for the release workflow (tests/test_release.py).
        Tool("actionlint", "tests/tools/actionlint", "github.com/rhysd/actionlint/cmd/actionlint"),
    )
}


def cache_root() -> Path:
    override = os.environ.get("COPILOT_WEBHOOK_GO_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "copilot-webhook" / "go-tools"


def go_version() -> str | None:
    go = shutil.which("go")
    if go is None:
        return None
    done = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


def key(tool: Tool, version: str) -> str:
    digest = hashlib.sha256()
    for part in (tool.package, *tool.ldflags, *(f"{k}={v}" for k, v in tool.env), version):
        digest.update(part.encode() + b"\0")
    files = sorted(p for p in tool.module_dir.iterdir() if p.is_file() and p.suffix in {".go", ".mod", ".sum"})
    for path in [*files, *(ROOT / e for e in tool.extra)]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cached_path(tool: Tool, version: str) -> Path:
    return cache_root() / f"{tool.name}-{key(tool, version)}" / tool.name


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(tool: Tool) -> Path:
    version = go_version()
    if version is None:
        raise RuntimeError(f"{tool.name}: no Go toolchain on PATH")
    target = cached_path(tool, version)
    with _locked(target.parent.with_suffix(".lock")):
        if target.exists():
            return target
        partial = target.with_name(target.name + ".partial")
        env = {**os.environ, **dict(tool.env), "GOFLAGS": "-mod=readonly"}
        command = ["go", "build", "-trimpath", "-ldflags", " ".join(("-s", "-w", *tool.ldflags))]
        started = time.monotonic()
        subprocess.run([*command, "-o", str(partial), tool.package], cwd=tool.module_dir, env=env, check=True)
        partial.rename(target)
        print(f"built {tool.name} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return target


def binary(name: str) -> Path:
    """The cached binary, or a skip that names the make target (under CI=true, a failure)."""
    from harness.environment import unavailable

    version = go_version()
    if version is not None:
        path = cached_path(TOOLS[name], version)
        if path.exists():
            return path
    unavailable(f"{name} is not built: run `{MAKE_TARGET}` (needs Go and the Go module proxy)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.gotools")
    sub = parser.add_subparsers(dest="command", required=True)
    build_cmd = sub.add_parser("build")
    build_cmd.add_argument("names", nargs="*")
    path_cmd = sub.add_parser("path")
    path_cmd.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "path":
        version = go_version()
        path = cached_path(TOOLS[args.name], version) if version else None
        if path is None or not path.exists():
            return 1
        print(path)
        return 0
    for name in args.names or list(TOOLS):
        print(build(TOOLS[name]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
