"""The puller's agent mode: the pod's init container asks its node's agent to pull.

It holds no socket and no privilege: it sends the agent the images, the pod's pull secrets (mounted into
it) and a projected token of the agent's audience, over TLS verified against the CA bundle it is given,
and reads one JSON answer. Reaching the agent is bounded by the connect timeout; the whole by the
deadline. A failure of any kind fails every image, which the failure policy then decides.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from webhook.pull import keyring as keyrings
from webhook.pull.errors import PullError

ANSWER_LIMIT = 4 * 1024 * 1024  # one line per image: a few KB
ERROR_LIMIT = 1000  # characters of an image's error: the agent sends at most ERROR_LIMIT of errors.py
MAX_NUMBER = 86400  # attempts and seconds of one image, at most


class Asker:
    def __init__(
        self, url: str, ca_pem: str, token_file: str, *, connect_timeout: float, secrets_directory: str | None
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "https" or not parts.hostname:
            raise ValueError(f"--agent must be an https:// URL with a host, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 443
        self.ca_pem, self.token_file = ca_pem, token_file
        self.connect_timeout, self.secrets_directory = connect_timeout, secrets_directory
        self.connection: http.client.HTTPSConnection | None = None
        self.stopped = False

    def _secrets(self) -> tuple[dict[str, str], list[str]]:
        """The pull secrets' documents as mounted, by file name; unreadable ones are reported and skipped."""
        documents: dict[str, str] = {}
        problems: list[str] = []
        if not self.secrets_directory:
            return documents, problems
        try:
            files = sorted(p for p in Path(self.secrets_directory).iterdir() if p.is_file())
        except OSError as exc:
            return documents, [f"pull secrets {self.secrets_directory} ignored: {exc.strerror}"]
        for path in files:
            try:
                with path.open("rb") as file:
                    data = file.read(keyrings.SECRET_LIMIT + 1)
                if len(data) > keyrings.SECRET_LIMIT:
                    raise ValueError(f"larger than {keyrings.SECRET_LIMIT} bytes, more than a Secret holds")
                documents[path.name] = data.decode()
            except (OSError, ValueError) as exc:
                problems.append(f"pull secret {path.name} ignored: {exc}")
        return documents, problems

    def ask(self, images: list[str], deadline: float) -> tuple[list[tuple[str, str, int, float, str]], list[str]]:
        """Each image's (image, result, attempts, seconds, error), and lines worth printing; PullError when
        the agent gave no usable answer."""
        secrets, problems = self._secrets()
        token, context = self._credentials()
        remaining = deadline - time.monotonic()
        body = json.dumps({"images": images, "pullSecrets": secrets, "timeoutSeconds": max(remaining - 1, 1)})
        where = f"the node agent at {self.host}:{self.port}"
        connection = http.client.HTTPSConnection(
            self.host, self.port, context=context, timeout=min(self.connect_timeout, max(remaining, 0.001))
        )
        self.connection = connection
        # The deadline holds whatever the agent does: a socket timeout bounds one read, and an answer that
        # comes a byte at a time never lets it expire. At the deadline the connection is shut.
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            self._shut()

        timer = threading.Timer(max(remaining, 0), expire)
        timer.daemon = True
        timer.start()
        try:
            status, raw = self._exchange(connection, body.encode(), token, deadline, expired)
        except ssl.SSLCertVerificationError as exc:
            raise PullError(f"{where} is not trusted: {exc.verify_message}") from None
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, TimeoutError) or expired.is_set() or self.stopped:
                raise PullError(f"{where} did not answer in time") from None
            raise PullError(f"{where} cannot be reached: {exc or type(exc).__name__}") from None
        finally:
            timer.cancel()
            connection.close()
        if expired.is_set() or self.stopped:  # the answer was cut short
            raise PullError(f"{where} did not answer in time")
        return self._results(status, raw, images, where), problems

    def _exchange(
        self,
        connection: http.client.HTTPSConnection,
        body: bytes,
        token: str,
        deadline: float,
        expired: threading.Event,
    ) -> tuple[int, bytes]:
        """One request and its whole answer (status, body read to its end, at most ANSWER_LIMIT + 1 bytes)."""
        connection.connect()
        if self.stopped or expired.is_set():  # cancelled while connecting, before there was a socket
            raise TimeoutError
        assert connection.sock is not None
        connection.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        connection.request("POST", "/v1/pull", body=body, headers=headers)
        response = connection.getresponse()
        raw = response.read(ANSWER_LIMIT + 1)
        if len(raw) <= ANSWER_LIMIT and response.length:  # read() returns what came before an early close
            raise http.client.IncompleteRead(raw, response.length)
        return response.status, raw

    def _credentials(self) -> tuple[str, ssl.SSLContext]:
        """The token to present and the context that verifies the agent; PullError when either is unusable."""
        try:
            token = Path(self.token_file).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise PullError(f"cannot read the token {self.token_file}: {exc}") from None
        try:
            context = ssl.create_default_context(cadata=self.ca_pem)
        except (ssl.SSLError, ValueError) as exc:
            raise PullError(f"the agent's CA bundle does not load: {exc}") from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return token, context

    def _results(
        self, status: int, raw: bytes, images: list[str], where: str
    ) -> list[tuple[str, str, int, float, str]]:
        answer = _answer(status, raw, where)
        results = answer.get("results")
        if not isinstance(results, list) or len(results) != len(images):
            raise PullError(f"{where} answered without one result per image")
        outcomes = []
        for image, result in zip(images, results, strict=True):
            if not isinstance(result, dict) or result.get("result") not in ("present", "pulled", "failed", "cancelled"):
                raise PullError(f"{where} answered a result that is none of present, pulled, failed, cancelled")
            error = " ".join(str(result.get("error") or "").split())[:ERROR_LIMIT]  # one line per image
            attempts, seconds = _number(result.get("attempts")), _number(result.get("seconds"))
            outcomes.append((image, str(result["result"]), int(attempts), seconds, error))
        return outcomes

    def cancel(self) -> None:
        """Abandon the request (SIGTERM): at once if it is under way, else as soon as it connects."""
        self.stopped = True
        self._shut()

    def _shut(self) -> None:
        connection = self.connection
        if connection is not None and connection.sock is not None:
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)


def _number(value: object) -> float:
    """A number the agent sent, when it is one a line can show (from 0 to a day), else 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_NUMBER:
        return 0.0
    return float(value)


def _answer(status: int, raw: bytes, where: str) -> dict[str, Any]:
    """The agent's answer as a JSON object; PullError for one too large, not JSON, or a refusal."""
    if len(raw) > ANSWER_LIMIT:
        raise PullError(f"{where} answered more than {ANSWER_LIMIT} bytes")
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError):
        raise PullError(f"{where} answered HTTP {status} that is not JSON") from None
    if not isinstance(answer, dict):
        answer = {}
    if status != 200:
        raise PullError(f"{where} refused: HTTP {status}: {answer.get('error') or 'no reason given'}")
    return answer


def ca_from_env(variable: str) -> str:
    value = os.environ.get(variable, "")
    if "-----BEGIN CERTIFICATE-----" not in value:
        raise ValueError(f"${variable} holds no PEM certificate (the agent's CA bundle)")
    return value
