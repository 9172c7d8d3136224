"""The puller against real daemons: containerd 1.6 (CRI plugin, and `ctr` for pod-network registries),
dockerd 20.10 and the distribution registry (plain HTTP, TLS with the test's own CA, htpasswd), each
started here on loopback. What runs is the container the webhook generates (its args, its pull-secrets
volume, its registry settings), run the way the pod runs it: uid 0, every capability dropped, no new
privileges, the root filesystem read-only."""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from certs.authority import generate_ca, issue_serving
from harness.daemons import (
    TOOLS,
    Containerd,
    Dockerd,
    Registry,
    build_image,
    containerd,
    dockerd,
    hanging_server,
    registry,
    require,
    trickling_registry,
)
from harness.environment import child_env
from webhook.config import build_settings
from webhook.mutation.puller import SECRETS_PATH, puller_container
from webhook.mutation.runtime import Runtime
from webhook.pull.clients import CRIClient

ROOT = Path(__file__).parent.parent
TEAM_REGISTRY = "registry.team.svc.cluster.local"  # a name only the pod's resolver knows


@dataclass
class World:
    containerd: Containerd
    dockerd: Dockerd
    plain: Registry
    private: Registry
    tls: Registry
    app: str  # plain/app:v1
    app2: str  # plain/app:v2
    secret_app: str  # private/app:v1
    tls_app: str  # team/app:v1 on the TLS registry, named by TEAM_REGISTRY
    ca_pem: str
    work: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    require(*TOOLS, "unshare", "setpriv")
    work = tmp_path_factory.mktemp("daemons")
    short = Path(f"/tmp/cwd-{os.getpid()}")  # dockerd's socket paths must stay under 108 bytes
    ca = generate_ca("test registry CA")
    leaf = issue_serving(ca, [TEAM_REGISTRY, "localhost"], ["127.0.0.1"])
    tls_dir = work / "tls"
    tls_dir.mkdir()
    for name, data in (("tls.crt", leaf.cert_pem), ("tls.key", leaf.key_pem), ("ca.crt", ca.cert_pem)):
        (tls_dir / name).write_bytes(data)
    layout = work / "oci"
    build_image(layout, "v1", "one")
    build_image(layout, "v2", "two")
    try:
        with (
            containerd(work / "containerd") as ctd,
            registry(work / "plain") as plain,
            registry(work / "private", user=("alice", "s3cret")) as private,
            registry(
                work / "tls", tls=(tls_dir / "tls.crt", tls_dir / "tls.key", tls_dir / "ca.crt"), name=TEAM_REGISTRY
            ) as tls,
            dockerd(short, mirror=plain.host) as dkr,  # the plain registry serves docker.io's names too
        ):
            ctd.trust(plain.host, plain_http=True)
            ctd.trust(private.host, plain_http=True)
            app, app2 = plain.push(layout, "v1", "plain/app"), plain.push(layout, "v2", "plain/app")
            secret_app = private.push(layout, "v1", "private/app")
            pushed = Registry(f"127.0.0.1:{tls.port}", tls.port, tls.ca).push(layout, "v1", "team/app")
            tls_app = pushed.replace(f"127.0.0.1:{tls.port}", tls.host)
            yield World(ctd, dkr, plain, private, tls, app, app2, secret_app, tls_app, ca.cert_pem.decode(), work)
    finally:
        import shutil

        shutil.rmtree(short, ignore_errors=True)


@dataclass
class Run:
    code: int
    lines: list[str]
    seconds: float

    def result(self, image: str) -> dict[str, str]:
        line = next(ln for ln in self.lines if ln.startswith(f"image={image} "))
        head, _, error = line.partition(" error=")
        fields = dict(part.split("=", 1) for part in head.split())
        if error:
            fields["error"] = error
        return fields


def _container(
    runtime: Runtime, images: list[str], secrets: list[str] | None = None, **settings: Any
) -> dict[str, Any]:
    """The container the webhook generates, for a node whose socket is the test daemon's."""
    return puller_container(runtime, images, build_settings({"imagePuller": settings}).image_puller, secrets=secrets)


def _command(container: dict[str, Any], secrets_dir: Path | None) -> list[str]:
    args = [a.replace(SECRETS_PATH, str(secrets_dir)) if secrets_dir else a for a in container["args"]]
    return [sys.executable, "-m", "webhook.pull", "--backoff=0.05", *args]


def _as_pod(command: list[str], hosts: Path | None = None) -> list[str]:
    """uid 0 with every capability dropped and no new privileges, in a mount namespace whose root is
    read-only (so a successful run wrote nothing), with the pod's /etc/hosts where given."""
    script = ["mount --make-rprivate /", "mount -o remount,bind,ro /"]
    data = os.environ.get("COVERAGE_FILE")
    if data and "COVERAGE_PROCESS_CONFIG" in os.environ:  # under coverage: its data directory alone stays writable
        folder = os.path.dirname(data)
        script.insert(1, f"mount --bind {folder} {folder}")
    if hosts is not None:
        script.insert(1, f"mount --bind {hosts} /etc/hosts")
    jail = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--"]
    return ["unshare", "--mount", "--", "sh", "-c", " && ".join(script) + ' && exec "$@"', "sh", *jail, *command]


def _run(
    container: dict[str, Any],
    secrets_dir: Path | None = None,
    hosts: Path | None = None,
    timeout: float = 120,
) -> Run:
    env = child_env(PATH=os.environ["PATH"], PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    started = time.monotonic()
    done = subprocess.run(
        _as_pod(_command(container, secrets_dir), hosts), capture_output=True, text=True, env=env, timeout=timeout
    )
    assert "Traceback" not in done.stderr, done.stderr
    return Run(done.returncode, done.stdout.splitlines(), time.monotonic() - started)


def _cri(world: World) -> Runtime:
    return Runtime("containerd", world.containerd.socket, "cri", "test")


def _docker(world: World) -> Runtime:
    return Runtime("docker", world.dockerd.socket, "docker", "test")


def _secrets(tmp_path: Path, host: str, user: str, password: str) -> Path:
    directory = tmp_path / "pull-secrets"
    directory.mkdir(exist_ok=True)
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    (directory / "team.json").write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return directory


# --- containerd, through the CRI -------------------------------------------------------------------------


def test_cri_fresh_pull_then_present_and_visible_to_the_kubelet(world: World) -> None:
    world.containerd.remove(world.app)
    first = _run(_container(_cri(world), [world.app]))
    assert first.code == 0, first.lines
    assert first.result(world.app)["result"] == "pulled"
    assert world.app in world.containerd.images(), "in the k8s.io namespace, where the kubelet's CRI looks"
    again = _run(_container(_cri(world), [world.app]))
    assert again.result(world.app) | {"seconds": ""} == {
        "image": world.app,
        "result": "present",
        "attempts": "0",
        "seconds": "",
    }


def test_cri_permanent_failures_are_not_retried(world: World) -> None:
    missing = f"{world.plain.host}/plain/nothere:v1"
    wrong_digest = f"{world.plain.host}/plain/app@sha256:{'ab' * 32}"
    run = _run(_container(_cri(world), [missing, wrong_digest, "--help", world.app]))
    assert [ln.split()[0] for ln in run.lines[:4]] == [
        f"image={i}" for i in (missing, wrong_digest, "--help", world.app)
    ]
    for image in (missing, wrong_digest):
        assert run.result(image)["result"] == "failed"
        assert run.result(image)["attempts"] == "1", "not found is permanent"
        assert "not found" in run.result(image)["error"]
    assert run.result("--help") == {
        "image": "--help",
        "result": "failed",
        "attempts": "0",
        "seconds": run.result("--help")["seconds"],
        "error": "invalid image reference '--help'",
    }
    assert run.lines[-1].startswith("summary present=1 pulled=0 failed=3 cancelled=0")
    assert run.code == 0, "failure policy Ignore: the kubelet pulls as usual"


@contextmanager
def _down_port() -> Iterator[int]:
    """A port held bound but not listening: connections to it are refused for as long as we hold it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def test_cri_registry_down_is_retried_with_back_off(world: World) -> None:
    with _down_port() as port:
        world.containerd.trust(f"127.0.0.1:{port}", plain_http=True)
        image = f"127.0.0.1:{port}/down/app:v1"
        run = _run(_container(_cri(world), [image], failurePolicy="Fail"))
    assert run.result(image)["attempts"] == "3", run.lines
    assert "connection refused" in run.result(image)["error"]
    assert run.code == 1, "failure policy Fail"


def test_cri_registry_hanging_hits_the_deadline(world: World) -> None:
    with hanging_server() as port:
        world.containerd.trust(f"127.0.0.1:{port}", plain_http=True)
        image = f"127.0.0.1:{port}/hangs/app:v1"
        run = _run(_container(_cri(world), [image, world.app], timeoutSeconds=3))
    assert run.result(image)["result"] == "failed"
    assert run.result(image)["error"] == "timed out"
    assert run.result(world.app)["result"] in ("present", "pulled"), "the other pulls go on in parallel"
    assert run.seconds < 12


def test_cri_private_registry_with_and_without_the_pull_secret(world: World, tmp_path: Path) -> None:
    image = world.secret_app
    world.containerd.remove(image)
    refused = _run(_container(_cri(world), [image]))
    assert refused.result(image)["attempts"] == "1", "unauthorized is permanent"
    assert "401" in refused.result(image)["error"] or "unauthorized" in refused.result(image)["error"].lower()
    secrets = _secrets(tmp_path, world.private.host, "alice", "s3cret")
    pulled = _run(_container(_cri(world), [image], ["team"]), secrets)
    assert pulled.result(image)["result"] == "pulled", pulled.lines
    assert image in world.containerd.images()


# --- the pod network: containerd's own client from inside the pod ------------------------------------


def _hosts(tmp_path: Path) -> Path:
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost {TEAM_REGISTRY}\n")
    return hosts


def test_pod_network_registry_by_a_name_only_the_pod_resolves_with_its_ca(world: World, tmp_path: Path) -> None:
    image = world.tls_app
    world.containerd.remove(image)
    registries = {world.tls.host: {"ca": world.ca_pem}}
    container = _container(_cri(world), [image], registries=registries)
    assert container["env"][0]["value"] == world.ca_pem
    run = _run(container, hosts=_hosts(tmp_path))
    assert run.result(image)["result"] == "pulled", run.lines
    assert image in world.containerd.images(), "pulled from inside the pod into k8s.io"


def test_pod_network_registry_without_its_ca_is_refused_once(world: World, tmp_path: Path) -> None:
    image = world.tls_app
    world.containerd.remove(image)
    run = _run(_container(_cri(world), [image], registries={world.tls.host: {}}), hosts=_hosts(tmp_path))
    assert run.result(image)["result"] == "failed"
    assert "x509" in run.result(image)["error"] or "certificate" in run.result(image)["error"]
    assert run.result(image)["attempts"] == "1", "an untrusted certificate is permanent"


def test_sigterm_mid_pull_stops_at_once_and_kills_the_client(world: World, tmp_path: Path) -> None:
    with hanging_server() as port:
        host = f"127.0.0.1:{port}"
        image = f"{host}/hangs/app:v1"
        container = _container(_cri(world), [image], registries={host: {"plainHttp": True}}, failurePolicy="Fail")
        env = child_env(PATH=os.environ["PATH"], PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
        process = subprocess.Popen(
            _as_pod(_command(container, None)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        time.sleep(1.5)
        assert any("hangs/app:v1" in _cmdline(pid) for pid in _pids()), "ctr is pulling"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=10)
        stopped = time.monotonic() - started
    assert stopped < 3, f"stopped after {stopped:.1f} s"
    assert "Traceback" not in err
    assert "SIGTERM: stopping" in out
    assert f"image={image} result=cancelled" in out
    assert process.returncode == 1, "failure policy Fail: a cancelled pull is not a success"
    assert not any("ctr" in _cmdline(pid) and "hangs/app" in _cmdline(pid) for pid in _pids()), "no child left"


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> str:
    return _proc(pid, "cmdline")


def _proc(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _eventually(find: Callable[[], int | None], timeout: float = 15) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = find()
        if found is not None:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not found within {timeout} s")


def _ctr_pulling(fragment: str) -> int | None:
    return next((pid for pid in _pids() if _cmdline(pid).startswith("ctr ") and fragment in _cmdline(pid)), None)


def test_no_process_shows_the_password_while_ctr_pulls_with_it(world: World, tmp_path: Path) -> None:
    password = "s3cret-" + secrets.token_hex(8)
    with hanging_server() as port:
        host = f"127.0.0.1:{port}"
        image = f"{host}/hangs/app:v1"
        container = _container(_cri(world), [image], ["team"], registries={host: {"plainHttp": True}}, timeoutSeconds=5)
        env = child_env(PATH=os.environ["PATH"], PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
        process = subprocess.Popen(
            _as_pod(_command(container, _secrets(tmp_path, host, "alice", password))),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        ctr = _eventually(lambda: _ctr_pulling("hangs/app"))
        # Every process of the machine, while ctr holds the credential: its arguments, its environment.
        seen = {pid: (_proc(pid, "cmdline"), _proc(pid, "environ")) for pid in _pids()}
        out, err = process.communicate(timeout=30)
    assert "Traceback" not in err
    assert f"image={image} result=failed" in out
    assert " --user alice -- " in seen[ctr][0], "the credential is in use: ctr has the user name"
    assert seen[process.pid][0], "the puller was running"
    leaks = [pid for pid, (cmdline, environ) in seen.items() if password in cmdline or password in environ]
    assert leaks == [], [seen[pid][0] for pid in leaks]


def test_ctr_is_given_the_password_on_its_terminal(world: World, tmp_path: Path) -> None:
    image = world.secret_app
    registries = {world.private.host: {"plainHttp": True}}
    (tmp_path / "wrong").mkdir()
    (tmp_path / "right").mkdir()
    world.containerd.remove(image)
    wrong = _run(
        _container(_cri(world), [image], ["team"], registries=registries),
        _secrets(tmp_path / "wrong", world.private.host, "alice", "not-it"),
    )
    assert wrong.result(image)["result"] == "failed", wrong.lines
    assert "401" in wrong.result(image)["error"] or "unauthorized" in wrong.result(image)["error"].lower()
    right = _run(
        _container(_cri(world), [image], ["team"], registries=registries),
        _secrets(tmp_path / "right", world.private.host, "alice", "s3cret"),
    )
    assert right.result(image)["result"] == "pulled", right.lines
    assert image in world.containerd.images()


# --- dockerd, through the Docker Engine API -------------------------------------------------------------


def test_docker_fresh_present_missing_and_private(world: World, tmp_path: Path) -> None:
    missing = f"{world.plain.host}/plain/nothere:v1"
    run = _run(_container(_docker(world), [world.app2, missing, world.secret_app]))
    assert run.result(world.app2)["result"] == "pulled"
    assert run.result(missing)["attempts"] == "1"
    assert "not found" in run.result(missing)["error"]
    assert run.result(world.secret_app)["result"] == "failed"
    assert run.result(world.secret_app)["attempts"] == "1"
    again = _run(
        _container(_docker(world), [world.app2, world.secret_app], ["team"]),
        _secrets(tmp_path, world.private.host, "alice", "s3cret"),
    )
    assert again.result(world.app2)["result"] == "present"
    assert again.result(world.secret_app)["result"] == "pulled", again.lines


def test_docker_registry_down_is_retried(world: World) -> None:
    with _down_port() as port:
        image = f"127.0.0.1:{port}/down/app:v1"
        run = _run(_container(_docker(world), [image]))
    assert run.result(image)["attempts"] == "3", run.lines
    assert "connection refused" in run.result(image)["error"]


# --- what a node and a Secret can throw at the puller ----------------------------------------------------


def test_a_secret_nested_too_deeply_is_named_and_the_rest_still_pull(world: World, tmp_path: Path) -> None:
    image = world.secret_app
    world.containerd.remove(image)
    directory = _secrets(tmp_path, world.private.host, "alice", "s3cret")
    (directory / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    run = _run(_container(_cri(world), [world.app, image], ["deep", "team"]), directory)
    assert run.code == 0
    assert run.lines[0] == "pull secret deep.json ignored: nested too deeply to read"
    assert run.result(world.app)["result"] in ("present", "pulled"), "an image that needs no credential"
    assert run.result(image)["result"] == "pulled", "with the other secret"


def test_an_unreadable_secrets_directory_is_reported_and_the_rest_still_pull(world: World, tmp_path: Path) -> None:
    directory = _secrets(tmp_path, world.private.host, "alice", "s3cret")
    directory.chmod(0)  # root without CAP_DAC_OVERRIDE, as in the pod, may not list it
    try:
        run = _run(_container(_cri(world), [world.app], ["team"]), directory)
    finally:
        directory.chmod(0o755)
    assert run.code == 0
    assert run.lines[0] == f"pull secrets {directory} ignored: Permission denied"
    assert run.result(world.app)["result"] in ("present", "pulled")


def _runtime(world: World, flavour: str) -> Runtime:
    return _cri(world) if flavour == "cri" else _docker(world)


@pytest.mark.parametrize("flavour", ["cri", "docker"])
def test_timeout_is_a_deadline_while_the_runtime_streams_progress(world: World, flavour: str, tmp_path: Path) -> None:
    layout = tmp_path / "oci"
    build_image(layout, "big", secrets.token_hex(96 * 1024))  # ~100 KB compressed: 25 s at 4 KB/s
    pushed = world.plain.push(layout, "big", f"plain/big-{flavour}")
    with trickling_registry(world.plain.port) as port:
        host = f"127.0.0.1:{port}"
        world.containerd.trust(host, plain_http=True)
        image = pushed.replace(world.plain.host, host)
        run = _run(_container(_runtime(world, flavour), [image], timeoutSeconds=3))
    assert run.result(image)["result"] == "failed", run.lines
    assert run.result(image)["error"] == "timed out"
    assert run.seconds < 8, f"a 3 s deadline took {run.seconds:.1f} s"


# --- Docker Hub's names, as each runtime has them -----------------------------------------------------


def _in_runtime(world: World, flavour: str, reference: str) -> bool:
    if flavour == "docker":
        return world.dockerd.has(reference)
    return CRIClient(world.containerd.socket).present(reference, 10)


@pytest.mark.parametrize("flavour", ["cri", "docker"])
def test_hub_names_are_found_as_the_runtime_names_them(world: World, flavour: str) -> None:
    runtime = _runtime(world, flavour)
    assert _run(_container(runtime, [world.app])).result(world.app)["result"] in ("present", "pulled")
    tag = world.containerd.tag if flavour == "cri" else world.dockerd.tag
    tag(world.app, f"registry-1.docker.io/library/r1-{flavour}:1.0")
    tag(world.app, f"docker.io/library/hub-{flavour}:1.0")
    # The runtime's own view: registry-1.docker.io is a name of its own, index.docker.io is docker.io.
    assert _in_runtime(world, flavour, f"registry-1.docker.io/library/r1-{flavour}:1.0")
    assert not _in_runtime(world, flavour, f"docker.io/library/r1-{flavour}:1.0")
    assert _in_runtime(world, flavour, f"index.docker.io/library/hub-{flavour}:1.0")
    images = [f"registry-1.docker.io/library/r1-{flavour}:1.0", f"index.docker.io/library/hub-{flavour}:1.0"]
    images += [f"hub-{flavour}:1.0", f"library/hub-{flavour}:1.0", f"docker.io/hub-{flavour}:1.0"]
    run = _run(_container(runtime, images, timeoutSeconds=20))
    assert [ln.split()[:2] for ln in run.lines if ln.startswith("image=")] == [
        [f"image={images[0]}", "result=present"],
        [f"image={images[1]}", "result=present"],
    ], run.lines


@pytest.mark.parametrize("flavour", ["cri", "docker"])
def test_aliases_of_one_image_are_one_pull(world: World, flavour: str) -> None:
    name = f"alias-{flavour}"
    world.plain.push(world.work / "oci", "v1", f"library/{name}")
    world.containerd.trust("docker.io", plain_http=True, upstream=world.plain.host)  # dockerd: --registry-mirror
    aliases = [f"{name}:v1", f"library/{name}:v1", f"docker.io/library/{name}:v1", f"index.docker.io/{name}:v1"]
    run = _run(_container(_runtime(world, flavour), [*aliases, f"docker.io/{name}:v1"]))
    assert [ln.split()[:3] for ln in run.lines if ln.startswith("image=")] == [
        [f"image={name}:v1", "result=pulled", "attempts=1"]
    ], run.lines
    assert _in_runtime(world, flavour, f"docker.io/library/{name}:v1")


def test_registry_1_docker_io_is_pulled_under_that_name(world: World) -> None:
    """containerd's CRI stores a pull under the name asked: the kubelet asks for the pod's."""
    world.containerd.trust("docker.io", plain_http=True, upstream=world.plain.host)
    world.containerd.trust("registry-1.docker.io", plain_http=True, upstream=world.plain.host)
    image = "registry-1.docker.io/plain/app:v1"
    for stale in (image, "docker.io/plain/app:v1"):
        world.containerd.remove(stale)
    run = _run(_container(_cri(world), [image]))
    assert run.result(image)["result"] == "pulled", run.lines
    assert image in world.containerd.images()
    assert "docker.io/plain/app:v1" not in world.containerd.images()
