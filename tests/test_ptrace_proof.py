"""Where SYS_PTRACE must sit for the copilot to see the user process: shown on a real kernel.

A pod with `shareProcessNamespace: true` is one PID namespace whose first process is the pause container;
every container's process enters it from outside, so inside it its parent PID is 0. Flyte <= 1.15's
uploader (flytecopilot/cmd/containerwatcher/spns_watcher.go@v1.15.3) lists /proc the way go-ps does and
waits while a process with parent 0 other than itself and PID 1 runs. This test builds that namespace
with unshare and nsenter (util-linux), starts a "primary" and a "watcher" in it as containers start
(uid and capability bounding set per container, as the runtimes set them), and checks what the watcher
sees: the process list (/proc/<pid>/stat, the start/exit signal) and a ptrace-guarded file
(/proc/<pid>/environ, what reading another container's process needs SYS_PTRACE for).

What it shows: the kernel checks the capability of the process that reads (ptrace_may_access), so the
grant belongs on the watcher (`ptrace.target: sidecar`); Flyte's grant on the primary gives the primary
*more* capabilities than the watcher, which makes the primary's files unreadable to a root watcher. What
it does not show: a container runtime's own /proc masking; the containers here are processes with the
runtime's default capability set, not containers of a runtime.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness.environment import eventually

# containerd's and Docker's default capability set for a container.
RUNTIME_DEFAULT = "chown,dac_override,fsetid,fowner,mknod,net_raw,setgid,setuid,setfcap,setpcap,net_bind_service,sys_chroot,kill,audit_write"  # noqa: E501
WATCHER = """
import json, os
me = os.getpid()
seen = {}
for entry in os.listdir("/proc"):
    if not entry.isdigit():
        continue
    pid = int(entry)
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        continue
    ppid = int(stat.rsplit(")", 1)[1].split()[1])
    if ppid != 0 or pid in (me, 1):  # go-ps's filter in spns_watcher.go: parent 0, not us, not pause
        continue
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read()
        seen[pid] = "readable" if b"TASK_SECRET=42" in environ else "empty"
    except OSError as exc:
        seen[pid] = type(exc).__name__
print(json.dumps(seen))
"""

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "nsenter", "setpriv")),
    reason="needs root and util-linux (unshare, nsenter, setpriv) to build a PID namespace",
)


@pytest.fixture(autouse=True)
def _no_skip_in_ci(request: pytest.FixtureRequest) -> None:
    if os.environ.get("CI") == "true" and (os.geteuid() != 0 or not shutil.which("unshare")):
        pytest.fail("CI must run the kernel proof: it runs as root with util-linux")


@contextmanager
def pod_namespace() -> Iterator[int]:
    """A PID namespace with its own /proc and a pause process as PID 1; yields that process's outside PID."""
    pause = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--", "sleep", "120"])
    children = Path(f"/proc/{pause.pid}/task/{pause.pid}/children")
    assert eventually(lambda: children.exists() and children.read_text().strip() != "", timeout=10)
    inner = int(children.read_text().split()[0])
    try:
        yield inner
    finally:
        pause.kill()
        pause.wait()


def _container(ns: int, uid: int, caps: str, command: list[str], env: dict[str, str]) -> list[str]:
    setpriv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", f"--bounding-set=-all,{caps}"]
    if uid != 0:
        setpriv += [f"--inh-caps=-all,{caps}", f"--ambient-caps=-all,{caps}"]
    environment = ["env", "-i", *(f"{k}={v}" for k, v in env.items())]
    return ["nsenter", f"--target={ns}", "--pid", "--mount", "--", *setpriv, "--", *environment, *command]


def _caps(extra: str) -> str:
    return ",".join(f"+{c}" for c in RUNTIME_DEFAULT.split(",") + ([extra] if extra else []))


def _watch(ns: int, caps: str) -> dict[str, str]:
    command = _container(ns, 0, caps, [sys.executable, "-c", WATCHER], {"PATH": "/usr/bin:/bin"})
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
    seen: dict[str, str] = json.loads(done.stdout)
    return seen


@needs_root
@pytest.mark.parametrize(
    ("name", "primary_uid", "primary_extra", "watcher_extra", "environ"),
    [
        # Flyte <= 1.15 as it ships: SYS_PTRACE on the primary. The watcher sees the process start and
        # exit, but the primary now holds a capability the watcher lacks, so its files are closed to it.
        ("flyte-1.15 (primary)", 0, "sys_ptrace", "", "PermissionError"),
        # ptrace.target sidecar: the capability on the reader; the primary keeps the runtime default.
        ("target sidecar", 0, "", "sys_ptrace", "readable"),
        # A user image running as uid 1000: only a watcher holding SYS_PTRACE reads its files.
        ("non-root primary, no grant", 1000, "", "", "PermissionError"),
        ("non-root primary, target sidecar", 1000, "", "sys_ptrace", "readable"),
        ("non-root primary, grant on primary", 1000, "sys_ptrace", "", "PermissionError"),
        # ptrace.mode drop: same uid, same capabilities: the start/exit signal needs no capability at all.
        ("drop", 0, "", "", "readable"),
    ],
)
def test_the_watcher_sees_the_user_process_when_the_capability_is_on_the_watcher(
    name: str, primary_uid: int, primary_extra: str, watcher_extra: str, environ: str
) -> None:
    with pod_namespace() as ns:
        env = {"TASK_SECRET": "42", "PATH": "/usr/bin:/bin"}
        command = _container(ns, primary_uid, _caps(primary_extra), ["sleep", "60"], env)
        primary = subprocess.Popen(command, start_new_session=True)  # nsenter forks: end the whole group
        try:
            assert eventually(lambda: len(_watch(ns, _caps(watcher_extra))) == 1, timeout=10), name
            (state,) = _watch(ns, _caps(watcher_extra)).values()
            assert state == environ, name
        finally:
            os.killpg(primary.pid, signal.SIGKILL)
            primary.wait()
        started = time.monotonic()
        assert eventually(lambda: _watch(ns, _caps(watcher_extra)) == {}, timeout=10), "the exit is seen"
        assert time.monotonic() - started < 10
