"""Registry credentials from the pod's image pull secrets, matched the way the kubelet's keyring matches
them (pkg/credentialprovider/keyring.go): a key is a registry host, optionally with a port, a path and a
`*` per host label (`*.example.com`), with or without a scheme; an image matches a key when the hosts
match label by label, the ports are equal, and the key's path is a prefix of the repository. Every
matching credential is tried, the most specific key first, as the kubelet does.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import json
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

from webhook.references import DOCKER_HUB, LEGACY_HUB, Reference

SECRET_LIMIT = 1024 * 1024  # the API server's limit on a Secret's data: no pull secret is larger


class Credential(NamedTuple):
    key: str  # the registry key as written in the secret
    username: str
    password: str


def _split(key: str) -> tuple[str, str]:
    parts = urlsplit(key if "://" in key else f"https://{key}")
    host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    if host == LEGACY_HUB:  # the kubelet's defaultRegistryHost: its credentials serve docker.io's images
        host = DOCKER_HUB
    path = parts.path.strip("/")
    if host == DOCKER_HUB and path == "v1":  # https://index.docker.io/v1/ means all of Docker Hub
        path = ""
    return host, path


def _host_matches(pattern: str, host: str) -> bool:
    p_name, _, p_port = pattern.partition(":")
    h_name, _, h_port = host.partition(":")
    p_labels, h_labels = p_name.split("."), h_name.split(".")
    if p_port != h_port or len(p_labels) != len(h_labels):
        return False
    return all(fnmatch.fnmatchcase(h, p) for p, h in zip(p_labels, h_labels, strict=True))


class Keyring:
    def __init__(self, entries: list[Credential]) -> None:
        self.entries = entries

    @classmethod
    def from_directory(cls, directory: str | None) -> tuple[Keyring, list[str]]:
        """Every file of the directory (one per secret) read as a .dockerconfigjson; problems are returned,
        never raised: a broken secret must not stop the images that need none."""
        problems: list[str] = []
        try:
            files = sorted(p for p in Path(directory).iterdir() if p.is_file()) if directory else []
        except OSError as exc:  # the pod runs without CAP_DAC_OVERRIDE: root cannot read what root may not
            return cls([]), [f"pull secrets {directory} ignored: {exc.strerror}"]
        documents: dict[str, bytes] = {}
        for path in files:
            try:
                with path.open("rb") as file:
                    documents[path.name] = file.read(SECRET_LIMIT + 1)
            except OSError as exc:
                problems.append(f"pull secret {path.name} ignored: {exc}")
        keyring, more = cls.from_documents(documents)
        return keyring, problems + more

    @classmethod
    def from_documents(cls, documents: dict[str, bytes]) -> tuple[Keyring, list[str]]:
        """Each document (one per secret, by name) read as a .dockerconfigjson; problems are returned."""
        entries: list[Credential] = []
        problems: list[str] = []
        for name, data in documents.items():
            try:
                found, skipped = _credentials(data)
                entries += found
                problems += [f"pull secret {name}: {problem}" for problem in skipped]
            except ValueError as exc:
                problems.append(f"pull secret {name} ignored: {exc}")
            except RecursionError:  # the API server stores JSON nested deeper than Python's parser recurses
                problems.append(f"pull secret {name} ignored: nested too deeply to read")
        return cls(entries), problems

    def lookup(self, reference: Reference) -> list[Credential]:
        matches: list[tuple[int, int, Credential]] = []
        for order, credential in enumerate(self.entries):
            host, path = _split(credential.key)
            if not _host_matches(host, reference.registry):
                continue
            if path and not (reference.repository == path or reference.repository.startswith(path + "/")):
                continue
            matches.append((-(len(host) + len(path)), order, credential))
        return [credential for *_rank, credential in sorted(matches)]


def _credentials(data: bytes) -> tuple[list[Credential], list[str]]:
    """The document's credentials, and the entries skipped because their registry key is no URL (the
    kubelet skips those alone, and so do we: they would fail every lookup)."""
    if len(data) > SECRET_LIMIT:
        raise ValueError(f"larger than {SECRET_LIMIT} bytes, more than a Secret holds")
    document = json.loads(data)
    auths = document.get("auths", document) if isinstance(document, dict) else None
    if not isinstance(auths, dict):
        raise ValueError("no auths object")
    credentials: list[Credential] = []
    skipped: list[str] = []
    for key, entry in auths.items():
        try:
            _split(str(key))
        except ValueError as exc:
            skipped.append(f"registry {str(key)[:80]!r} ignored: {exc}")
            continue
        credential = _credential(str(key), entry)
        if credential is not None:
            credentials.append(credential)
    return credentials, skipped


def _credential(key: str, entry: object) -> Credential | None:
    if not isinstance(entry, dict):
        return None
    username, password = entry.get("username"), entry.get("password")
    if isinstance(entry.get("auth"), str) and entry["auth"]:
        try:
            decoded = base64.b64decode(entry["auth"], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise ValueError(f"the auth of {key} is not base64 user:password") from None
        username, _, password = decoded.partition(":")
    if not isinstance(username, str) or not isinstance(password, str) or not username:
        return None
    return Credential(key, username, password)
