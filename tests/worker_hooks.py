"""Preview workers that die at a chosen point, for tests only.

A test puts `hooked(point, folder)` in place of `webhook.preview.workers._serve` (monkeypatch, in the test's own
process): the spawned worker then runs `serve` below, which wraps one step of the real worker and kills its
own process there (SIGKILL, as the kernel's OOM killer does). What it obeys is files in the test's `folder`,
never anything in a request:

- `kill`: a token; the first worker to reach `point` while it exists takes it (one death per token).
- a body holding `DIES` kills its worker at parse, every time; one holding `SLEEPS` makes it sleep
  `sleep` seconds (the file's number) at parse first, then take a `kill` token if there is one.

Each worker writes `started` a line at start: its pid and how many live preview workers the server had then,
itself included, not counting those listed in `others` (the workers of other servers in the same process).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

POINTS = ("parse", "diff", "answered")
DIES = b"x-test-worker-dies"
SLEEPS = b"x-test-worker-sleeps"


def hooked(point: str, folder: Path) -> Callable[[Connection], None]:
    return functools.partial(serve, point, str(folder))


def children(parent: int) -> dict[int, str]:
    """The processes whose parent is `parent`: pid -> state (R, S, Z, ...)."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if int(fields[1]) == parent:
            found[int(entry.name)] = fields[0]
    return found


def workers(parent: int) -> list[int]:
    """The live (not zombie) preview worker processes of `parent`."""
    live = []
    for pid, state in children(parent).items():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if state != "Z" and b"--multiprocessing-fork" in command:  # not the resource tracker
            live.append(pid)
    return live


def others(folder: str) -> set[int]:
    path = Path(folder, "others")
    return {int(pid) for pid in path.read_text().split()} if path.exists() else set()


def _take(folder: str) -> bool:
    try:
        os.unlink(os.path.join(folder, "kill"))
    except FileNotFoundError:
        return False
    return True


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)  # the signal is on its way


def serve(point: str, folder: str, conn: Connection) -> None:
    from webhook.preview import render
    from webhook.preview import workers as real

    with open(os.path.join(folder, "started"), "a") as out:
        out.write(f"{os.getpid()} {len(set(workers(os.getppid())) - others(folder))}\n")
    load, diff = render.load_documents, render._diff

    def loading(body: bytes, content_type: str) -> list[Any]:
        if DIES in body:
            _die()
        if SLEEPS in body:
            time.sleep(float(Path(folder, "sleep").read_text()))
        if point == "parse" and _take(folder):
            _die()
        return load(body, content_type)

    def diffing(entry: Any, resolved: dict[str, str]) -> str:
        if point == "diff" and _take(folder):
            _die()
        return diff(entry, resolved)

    send = conn.send

    def sending(message: Any) -> None:
        send(message)
        if point == "answered" and message[0] == 200 and _take(folder):
            _die()

    render.load_documents, render._diff = loading, diffing
    conn.send = sending  # type: ignore[method-assign,assignment]
    real._serve(conn)
