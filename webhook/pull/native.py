"""The `native` client: containerd's own client `ctr -n k8s.io images pull` (Debian's), which fetches from
inside the pod, so registries only the pod network reaches (an in-cluster Service) work; the image lands
in the `k8s.io` namespace, where the kubelet's CRI finds it. The reference follows `--`.

No credential is ever on its command line or in its environment: every user of a node reads every
process's arguments (/proc/<pid>/cmdline). ctr is given the user name alone and asks for the password on
its terminal, which here is a pseudo-terminal of the puller's own on ctr's standard error (ctr's
`passwordPrompt` reads the first of stderr, stdout and stdin that is a terminal): the password is typed
into it and nothing else holds it. The CA goes on standard input; nothing is written to a file.
"""

from __future__ import annotations

import os
import subprocess
import threading
import tty
from types import TracebackType

from webhook.pull.clients import BODY_LIMIT, CRIClient
from webhook.pull.errors import Cancelled, PullError
from webhook.pull.keyring import Credential
from webhook.references import parse

# ctr reads the password with one bufio.Reader.ReadLine (a 4,096-byte buffer, the line's end included) and
# ignores the rest of a longer line.
PASSWORD_LIMIT = 4095


class NativeClient:
    """`ctr` for registries the pod network reaches; presence is asked of the CRI on the same socket."""

    def __init__(self, socket_path: str, cri: CRIClient, options: dict[str, list[str]], *, cas: dict[str, str]) -> None:
        self._socket = socket_path
        self._cri = cri
        self._options = options  # registry -> extra ctr flags (--plain-http, --skip-verify)
        self._cas = cas  # registry -> CA bundle (PEM), handed to ctr on its standard input
        self._running: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self._cancelled = False

    def present(self, reference: str, timeout: float) -> bool:
        return self._cri.present(reference, timeout)

    def pull(self, reference: str, credential: Credential | None, timeout: float) -> None:
        registry = parse(reference).registry
        command = ["ctr", "--address", self._socket, "--namespace", "k8s.io", "images", "pull"]
        command += self._options.get(registry, [])
        ca = self._cas.get(registry)
        if ca is not None:
            command += ["--tlscacert", "/dev/stdin"]
        typed = b""
        if credential is not None:
            command += ["--user", credential.username]
            typed = _typed(credential)
        command += ["--", reference]
        code, output = self._run(command, (ca or "").encode(), typed, timeout=timeout)
        if self._cancelled:
            raise Cancelled
        if code != 0:
            lines = [line for line in output.splitlines() if line.startswith("ctr: ")]
            raise PullError(lines[-1][5:] if lines else f"ctr exited {code}")

    def _run(self, command: list[str], feed: bytes, typed: bytes, *, timeout: float) -> tuple[int, str]:
        """ctr's exit code and what it wrote on its standard error."""
        try:
            stderr = _Stderr(terminal=bool(typed))
        except OSError as exc:  # no /dev/pts in the container: the password has no way to ctr
            raise PullError(f"cannot open a terminal for ctr: {exc.strerror}", permanent=True) from None
        with stderr:
            with self._lock:
                if self._cancelled:
                    raise Cancelled
                try:
                    process = subprocess.Popen(
                        command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr.child
                    )
                except OSError as exc:
                    raise PullError(f"cannot run ctr: {exc.strerror}", permanent=True) from None
                self._running.add(process)
            stderr.attach(typed)
            try:
                process.communicate(feed, timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise PullError("timed out", permanent=True) from None
            finally:
                with self._lock:
                    self._running.discard(process)
            return process.returncode, stderr.output()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            for process in self._running:
                process.kill()


def _typed(credential: Credential) -> bytes:
    """The password as typed at ctr's prompt: one line. What one line cannot carry is refused, naming the
    key (the user name is split at its first `:` by ctr, an empty password is asked for again)."""
    password = credential.password.encode()
    if ":" in credential.username:
        raise PullError(f"the user name for {credential.key} holds ':', which ctr cannot take", permanent=True)
    if not password or b"\n" in password or b"\r" in password or len(password) > PASSWORD_LIMIT:
        raise PullError(
            f"the password for {credential.key} cannot be typed at ctr's prompt"
            f" (empty, a line break, or over {PASSWORD_LIMIT} bytes)",
            permanent=True,
        )
    return password + b"\n"


class _Stderr:
    """ctr's standard error, read to say what failed: a pseudo-terminal when a password is to be typed
    (where ctr asks for it), a pipe otherwise."""

    def __init__(self, terminal: bool) -> None:
        if terminal:
            self.master, self.child = os.openpty()
            # Raw: no echo, no line editing and no signal characters, so the password reaches ctr byte for
            # byte and is never written back; ctr turns echo off itself too, and restores this state after.
            tty.setraw(self.child)
        else:
            self.master, self.child = os.pipe()
        self._output = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> _Stderr:
        return self

    def attach(self, typed: bytes) -> None:
        """ctr holds the child's end now: close ours (so reading ends when ctr exits), type the password
        ahead (it waits in the terminal until ctr asks; unread if the registry never asks), read."""
        os.close(self.child)
        self.child = -1
        view = memoryview(typed)
        while view:
            view = view[os.write(self.master, view) :]
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, BODY_LIMIT)
            except OSError:  # a terminal's EIO: every copy of the child's end is closed, ctr has exited
                return
            if not chunk:
                return
            self._output += chunk
            del self._output[:-BODY_LIMIT]  # the last lines say why it failed

    def output(self) -> str:
        self._reader.join(timeout=5)
        return self._output.decode(errors="replace")

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self.child != -1:
            os.close(self.child)
        if self._reader.ident is not None:
            self._reader.join(timeout=1)  # ctr was killed (deadline): its end closes at once
        if not self._reader.is_alive():  # never closed under a reader: the number could be reused meanwhile
            os.close(self.master)
