"""Image references as the runtimes read them (distribution/reference's ParseNormalizedNamed).

`busybox`, `library/busybox` and `docker.io/library/busybox:latest` are one image: a first path part that
has no `.` or `:` and is not `localhost` is a Docker Hub path; Hub images without a namespace live under
`library/`; a reference without tag or digest means `:latest`. Of Docker Hub's other names only
`index.docker.io`, spelled exactly so, becomes `docker.io` (the library's legacyDefaultDomain):
`registry-1.docker.io/x` is another name to containerd's CRI and to dockerd (an image tagged under it is
not found as `docker.io/x`, nor the other way round), so it is kept as written.

Written here rather than imported: the webhook uses it to de-duplicate, the puller image (standard library
and grpcio only) to de-duplicate, route and match credentials, and the rules fit in this module.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from webhook.errors import InvalidReference

DOCKER_HUB = "docker.io"
LEGACY_HUB = "index.docker.io"  # distribution/reference's legacyDefaultDomain: the only alias it maps
# distribution/reference's grammar, reduced to what decides validity: lowercase path components,
# an optional :tag, an optional @algorithm:hex digest.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
_PATH = re.compile(_COMPONENT)
_REFERENCE = re.compile(
    rf"^(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[0-9a-fA-F]{32,}))?$"
)


class Reference(NamedTuple):
    registry: str  # docker.io, registry.example.com:5000, localhost:5000
    repository: str  # library/busybox, team/app
    tag: str | None
    digest: str | None

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    def __str__(self) -> str:
        text = self.name
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text


@functools.lru_cache(maxsize=4096)  # the same images come back with every pod of a task
def _repository(domain: str | None, path: str, text: str) -> tuple[str, str]:
    """The registry and the path in it: a first component without `.`, `:` or being localhost is a path
    component on Docker Hub, whose official images are under library/."""
    if domain is None or ("." not in domain and ":" not in domain and domain != "localhost"):
        if domain is not None and not _PATH.fullmatch(domain):  # a path component: lowercase only
            raise InvalidReference(f"invalid image reference {text[:80]!r}: repository name must be lowercase")
        path = f"{domain}/{path}" if domain else path
        domain = DOCKER_HUB
    elif domain == LEGACY_HUB:
        domain = DOCKER_HUB
    if domain == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    return domain, path


MAX_LENGTH = 512  # longer references never parse


def parse(text: str) -> Reference:
    """The normalised reference, or InvalidReference naming what is wrong. A leading `-` never parses, so a
    reference can never be taken for a client's option."""
    if len(text) > MAX_LENGTH:
        raise InvalidReference(f"invalid image reference {text[:80]!r}")
    return _parse(text)


@functools.lru_cache(maxsize=4096)  # every pod of a task names the same images; at most 2 MB of keys
def _parse(text: str) -> Reference:
    match = _REFERENCE.fullmatch(text)
    if match is None:
        raise InvalidReference(f"invalid image reference {text[:80]!r}")
    domain, path = _repository(match["domain"], match["path"], text)
    tag = match["tag"]
    if tag is None and match["digest"] is None:
        tag = "latest"
    return Reference(domain, path, tag, match["digest"])


def normalise(text: str) -> str:
    if len(text) > MAX_LENGTH:
        raise InvalidReference(f"invalid image reference {text[:80]!r}")
    return _normalise(text)


@functools.lru_cache(maxsize=4096)
def _normalise(text: str) -> str:
    return str(_parse(text))
