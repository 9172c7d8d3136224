"""The configuration model: defaults, then a YAML file, then COPILOT_WEBHOOK_* environment variables.

This is the only module that reads settings from files or the environment. Keys are camelCase and equal
to the Helm values keys. Unknown keys and invalid values are refused with a message that names the key,
the bad value and what is allowed.

The environment is merged by hand rather than through pydantic-settings' env source: that source matches
names case-insensitively against field names, not camelCase aliases, and silently ignores unknown
variables, while we must refuse `COPILOT_WEBHOOK_PTRACE__MOOD` as loudly as `ptrace: {mood: ...}`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Self, TypeAlias, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from webhook import __version__
from webhook.documents import decode_text, load_yaml_documents
from webhook.errors import ConfigError, DocumentError, InvalidReference
from webhook.globs import glob_matcher
from webhook.objects import JSONObject
from webhook.references import parse
from webhook.stamps import MISSING, Stamp, file_stamp

ENV_PREFIX = "COPILOT_WEBHOOK_"
CONFIG_ENV = "COPILOT_WEBHOOK_CONFIG"
_MEMO = "_memo"

T = TypeVar("T")

PtraceMode = Literal["add", "drop", "keep"]
PtraceTarget = Literal["primary", "sidecar", "all"]


class _Section(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        validate_default=True,
        use_attribute_docstrings=True,  # the docstring under a field is its description (docs/configuration.md)
    )

    def __getstate__(self) -> dict[Any, Any]:
        """Pickled (for a preview worker) without the values derived and cached on it: they are rebuilt
        there when read."""
        state = super().__getstate__()
        state["__dict__"] = {k: v for k, v in state["__dict__"].items() if k in type(self).model_fields}
        return state

    def memo(self, derive: Callable[[Self], T]) -> T:
        """`derive(self)`, computed once per section (sections are immutable and replaced whole on reload) for
        the code that owns the derivation, which this module need not know; kept like a cached property,
        so not pickled."""
        memos: dict[Callable[[Self], Any], Any] = self.__dict__.setdefault(_MEMO, {})
        if derive not in memos:
            memos[derive] = derive(self)
        value: T = memos[derive]
        return value


class PtraceSettings(_Section):
    mode: PtraceMode = "add"
    """add (what Flyte <= 1.15 expects), drop (the opt-out for hardened clusters), or keep."""
    target: PtraceTarget = "primary"
    """Which containers of a legacy copilot pod get SYS_PTRACE in add mode; sidecar: the watcher alone."""
    allow_pod_override: bool = False
    """Honour a pod's copilot-webhook.io/ptrace annotation even when it grants more than ptrace.mode."""


class CopilotSettings(_Section):
    @cached_property
    def image_matcher(self) -> Callable[[str], bool]:
        """imagePatterns compiled, once per settings (settings are immutable and replaced whole on reload)."""
        return glob_matcher(self.image_patterns)

    name_prefix: str = Field(default="flyte-copilot-", min_length=1)
    """Name prefix of Flyte's copilot containers."""
    commands: tuple[str, ...] = ("/bin/flyte-copilot",)
    """A copilot container's command[0] is one of these ..."""
    # Flyte 2 ships the copilot in its single-binary image (flytek8s/config/config.go@v2.0.43 L38-44).
    image_patterns: tuple[str, ...] = (
        "*/flyteorg/flytecopilot:*",
        "*/flyteorg/flytecopilot@*",
        "*/flyteorg/flyte-binary-v2:*",
        "*/flyteorg/flyte-binary-v2@*",
    )
    """... or its image matches one of these globs."""


class ServerSettings(_Section):
    host: str = "0.0.0.0"  # noqa: S104 - a webhook in a pod must listen on the pod IP
    """Address to listen on."""
    port: int = Field(default=8443, ge=1, le=65535)
    """HTTPS port."""
    tls_cert: str = "/tls/tls.crt"
    """Serving certificate (PEM), reloaded when the file changes; the default is where the chart mounts it."""
    tls_key: str = "/tls/tls.key"
    """Its private key (PEM)."""
    client_ca: str | None = None
    """Require client certificates signed by this CA (PEM)."""
    tls_min_version: Literal["1.2", "1.3"] = "1.2"
    """Oldest TLS version accepted."""
    # The API server refuses request bodies over 3 MiB after etcd's 1.5 MiB object limit is
    # expanded by JSON encoding; controller-runtime settles on 7 MiB to leave room for both
    # object and oldObject. We follow it.
    max_body_bytes: int = Field(default=7 * 1024 * 1024, ge=1024)
    """Largest admission review body (413 beyond)."""
    deadline_seconds: float = Field(default=2.0, gt=0, le=30)
    """A request body must arrive within this (408); below the webhook's timeoutSeconds."""
    # A connection that sends no request for this long is closed: before its first request as well as
    # between requests. Longer than the API server keeps an idle connection to a webhook (90 s, Go's
    # http.Transport default in client-go), so it is always the API server that closes one: a POST it
    # writes on a connection we are closing fails the call (Go retries no POST), and the pod is admitted
    # unmutated or rejected by the failure policy.
    idle_timeout_seconds: float = Field(default=120.0, gt=0, le=300)
    """Close a connection that sends no request for this long (before its first one too)."""
    # The API servers of a large control plane hold tens of connections each. Every open connection holds
    # memory: docs/performance.md's sizing says how many the chart's memory limit leaves room for.
    max_connections: int = Field(default=1024, ge=1, le=65536)
    """Open connections at most; more are closed on arrival."""
    # After SIGTERM: answer for this long with readyz 503 and `Connection: close`, then stop accepting.
    drain_seconds: float = Field(default=2.0, ge=0, le=60)
    """After SIGTERM: keep answering (readyz 503, Connection: close) this long before refusing connections."""
    # GET /metrics over plain HTTP on a port of its own (0: off), so a Prometheus scrape needs no client TLS;
    # nothing else is served there.
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """GET /metrics over plain HTTP on this port (0: off)."""

    @field_validator("tls_min_version", mode="before")
    @classmethod
    def _version_as_text(cls, value: Any) -> Any:
        # YAML reads 1.2 as a float; the key is a version, not a number.
        return str(value) if isinstance(value, float) else value


class PreviewSettings(_Section):
    enabled: bool = True
    """Serve POST /preview (side-effect free)."""
    # Previews run in worker processes beside admission, one at a time by default; a larger body than
    # this is refused before it is read (a preview's CPU grows with its body, to seconds for the largest),
    # and a preview still running after timeoutSeconds is stopped.
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    """Largest preview body."""
    concurrency: int = Field(default=1, ge=1, le=8)
    """Previews running at once, each in its own worker process; more get 503 with Retry-After."""
    timeout_seconds: float = Field(default=10.0, gt=0, le=120)
    """A preview still running after this long is stopped (503)."""


Flavour = Literal["docker", "containerd", "cri-o"]
FLAVOURS: tuple[Flavour, ...] = ("docker", "containerd", "cri-o")
PULLER_IMAGE = f"ghcr.io/copilot-webhook/image-puller:{__version__}"
# Kubernetes resource quantities, e.g. 10m, 64Mi, 1.5, 1e3 (apimachinery's resource.Quantity).
_QUANTITY = re.compile(r"^[+]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[numkKMGTPE]|[KMGTPE]i)?$")


_FIELD_OF_FLAVOUR = {"docker": "docker", "containerd": "containerd", "cri-o": "cri_o"}


class _PerFlavour(_Section):
    docker: str
    containerd: str
    cri_o: str = Field(alias="cri-o")

    def of(self, flavour: str) -> str:
        return getattr(self, _FIELD_OF_FLAVOUR[flavour])  # type: ignore[no-any-return]


class PullerImages(_PerFlavour):
    """One image carries the docker CLI and crictl; a flavour may name its own."""

    docker: str = Field(default=PULLER_IMAGE, min_length=1)
    """The puller's image on Docker nodes."""
    containerd: str = Field(default=PULLER_IMAGE, min_length=1)
    """The puller's image on containerd nodes."""
    cri_o: str = Field(default=PULLER_IMAGE, alias="cri-o", min_length=1)
    """The puller's image on CRI-O nodes."""


class Sockets(_PerFlavour):
    docker: str = Field(default="/var/run/docker.sock", pattern="^/")
    """The Docker Engine's socket on the node, mounted into the puller."""
    containerd: str = Field(default="/run/containerd/containerd.sock", pattern="^/")
    """containerd's socket on the node, mounted into the puller."""
    cri_o: str = Field(default="/var/run/crio/crio.sock", alias="cri-o", pattern="^/")
    """CRI-O's socket on the node, mounted into the puller."""


class Quantities(_Section):
    cpu: str | None = None
    """The puller container's CPU, a Kubernetes quantity (10m, 0.5); none leaves it unset."""
    memory: str | None = None
    """The puller container's memory, a Kubernetes quantity (32Mi); none leaves it unset."""

    @field_validator("cpu", "memory")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and not _QUANTITY.match(value):
            raise ValueError("expected a Kubernetes quantity such as 10m, 64Mi or 0.5")
        return value

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in (("cpu", self.cpu), ("memory", self.memory)) if v is not None}


class Resources(_Section):
    requests: Quantities = Quantities(cpu="10m", memory="32Mi")
    limits: Quantities = Quantities(cpu="500m", memory="128Mi")


class RegistrySettings(_Section):
    """A registry the puller pulls from inside the pod (containerd nodes): one only the pod network
    reaches, such as an in-cluster registry Service."""

    ca: str | None = None
    """PEM CA bundle that signs the registry's certificate."""
    plain_http: bool = False
    """Pull over plain HTTP (an explicit opt-in, with a warning)."""
    skip_verify: bool = False
    """Do not verify the registry's certificate (an explicit opt-in, with a warning)."""

    @field_validator("ca")
    @classmethod
    def _pem(cls, value: str | None) -> str | None:
        if value is not None and "-----BEGIN CERTIFICATE-----" not in value:
            raise ValueError("expected a PEM certificate bundle")
        return value


_HOST_PORT = r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?:[0-9]{1,5}$"


class AgentSettings(_Section):
    """The node agent (mode agent): a DaemonSet holding the runtime socket, asked by a restricted
    client in the pod through a Service with internalTrafficPolicy Local."""

    address: str = Field(default="copilot-webhook-agent.copilot-webhook.svc:443", pattern=_HOST_PORT)
    """host:port of the agent's Service, as its TLS certificate names it."""
    audience: str = Field(default="copilot-webhook-agent", min_length=1, max_length=253)
    """The audience of the client's projected ServiceAccount token, checked by the agent's TokenReview."""
    ca_file: str | None = None
    """PEM bundle that signs the agent's certificate, read by the webhook and given to the client."""
    image: str = Field(default=PULLER_IMAGE, min_length=1)
    """The client's image (the agent's, by the chart)."""
    token_seconds: int = Field(default=600, ge=600, le=86400)
    """Lifetime of the client's token (the API server's minimum is 600)."""
    connect_timeout_seconds: int = Field(default=10, ge=1, le=300)
    """The client gives up reaching the agent after this long, then follows failurePolicy."""
    run_as_user: int = Field(default=65532, ge=1, le=2147483647)
    """The client's non-root user id."""

    def ca(self) -> str | None:
        """The CA bundle as the file holds it now (re-read when it changes: a mounted Secret is rotated),
        or None when there is none or it is not PEM."""
        return _read_pem(self.ca_file) if self.ca_file else None


_PEM_CACHE: dict[str, tuple[Stamp, str | None]] = {}


def _read_pem(path: str) -> str | None:
    (stamp,) = file_stamp(path)
    if stamp == MISSING:
        return None
    cached = _PEM_CACHE.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        with open(path, encoding="ascii") as handle:
            text: str | None = handle.read(1024 * 1024)
    except (OSError, UnicodeDecodeError):
        text = None
    if text is not None and "-----BEGIN CERTIFICATE-----" not in text:
        text = None
    _PEM_CACHE[path] = (stamp, text)
    return text


class ImagePullerSettings(_Section):
    enabled: bool = True
    """Inject the image-puller init container (false: the opt-out)."""
    mode: Literal["socket", "agent"] = "socket"
    """socket: the init container mounts the node's runtime socket (hostPath, root); agent: it asks the node agent."""
    agent: AgentSettings = AgentSettings()
    scope: Literal["copilot", "all"] = "copilot"
    """copilot: copilot pods only; all: every pod the webhook sees."""
    images: tuple[str, ...] = ("*",)
    """Globs of images to pre-pull ..."""
    exclude: tuple[str, ...] = ()
    """... and globs never to pre-pull."""
    puller_images: PullerImages = PullerImages()
    runtime: Literal["auto", "docker", "containerd", "cri-o"] = "auto"
    """auto: from each candidate node's containerRuntimeVersion."""
    default_runtime: Flavour = "containerd"
    """The runtime when nothing is known of the nodes."""
    sockets: Sockets = Sockets()
    heterogeneous: Literal["skip", "pin"] = "skip"
    """When candidate nodes disagree: skip (no puller) or pin (node affinity on runtimeLabel)."""
    runtime_label: str = Field(default="copilot-webhook.io/container-runtime", min_length=1, max_length=316)
    """Node label the labeller keeps and pin mode selects on."""
    labeller: bool = False
    """Keep runtimeLabel true on every node from inside the server (needs patch on nodes)."""
    timeout_seconds: int = Field(default=300, ge=1, le=3600)
    """The puller's own deadline."""
    failure_policy: Literal["Ignore", "Fail"] = "Ignore"
    """The puller's exit on failure: Ignore (the kubelet pulls as usual) or Fail."""
    resources: Resources = Resources()
    # host[:port] -> how the puller reaches it from inside the pod (containerd nodes; docker and CRI-O
    # nodes pull through the runtime, which has no pod-network path).
    registries: dict[str, RegistrySettings] = Field(default_factory=dict)
    """Registries only the pod network reaches: host[:port] -> {ca, plainHttp, skipVerify}."""

    # Values derived from the settings alone, computed once per settings object (a reload makes a new one).
    @cached_property
    def wanted(self) -> Callable[[str], bool]:
        return glob_matcher(self.images)

    @cached_property
    def unwanted(self) -> Callable[[str], bool]:
        return glob_matcher(self.exclude)

    @cached_property
    def own_images(self) -> frozenset[str]:
        """The puller images themselves, normalised: never pre-pulled."""
        own = set()
        for image in [*(self.puller_images.of(flavour) for flavour in FLAVOURS), self.agent.image]:
            try:
                own.add(str(parse(image)))
            except InvalidReference:
                own.add(image)
        return frozenset(own)

    @field_validator("registries")
    @classmethod
    def _hosts(cls, value: dict[str, RegistrySettings]) -> dict[str, RegistrySettings]:
        for host in value:
            if not re.fullmatch(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]{1,5})?", host):
                raise ValueError(f"{host!r} is not a registry host[:port]")
        return value


class ClusterSettings(_Section):
    enabled: Literal["auto", "true", "false"] = "auto"
    """auto: the service account or a kubeconfig when present; true: required; false: never."""
    kubeconfig: str | None = None
    """A kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)."""
    context: str | None = None
    """The kubeconfig's context to use (default: its current-context)."""

    @field_validator("enabled", mode="before")
    @classmethod
    def _bool_as_text(cls, value: Any) -> Any:
        return str(value).lower() if isinstance(value, bool) else value


PodSecurityLevel = Literal["privileged", "baseline", "restricted"]
LEVELS: tuple[str, ...] = get_args(PodSecurityLevel)


class PodSecurityDefaults(_Section):
    enforce: PodSecurityLevel = "privileged"
    """Level on namespaces without a pod-security.kubernetes.io/enforce label: the API server's defaults.enforce."""


class PodSecurityExemptions(_Section):
    namespaces: tuple[str, ...] = ()
    """The AdmissionConfiguration's exemptions.namespaces: no level is enforced there, labelled or not."""
    runtime_classes: tuple[str, ...] = ()
    """Its exemptions.runtimeClasses: no level is enforced on a pod with one of these runtimeClassName."""


class PodSecuritySettings(_Section):
    """The cluster's PodSecurity admission configuration, as the API server is given it."""

    defaults: PodSecurityDefaults = PodSecurityDefaults()
    exemptions: PodSecurityExemptions = PodSecurityExemptions()


class Settings(_Section):
    mode: Literal["enforce", "shadow"] = "enforce"
    """enforce, or shadow: compute and report everything, patch nothing."""
    inject: Literal["opt-out", "opt-in"] = "opt-out"
    """opt-out: all namespaces but those labelled copilot-webhook.io/inject=disabled; opt-in: only =enabled ones."""
    failure_policy: Literal["Ignore", "Fail"] = "Ignore"
    """When a review cannot be decided: Ignore (admit, warn) or Fail (deny, naming the cause)."""
    ptrace: PtraceSettings = PtraceSettings()
    copilot: CopilotSettings = CopilotSettings()
    server: ServerSettings = ServerSettings()
    preview: PreviewSettings = PreviewSettings()
    cluster: ClusterSettings = ClusterSettings()
    image_puller: ImagePullerSettings = ImagePullerSettings()
    pod_security: PodSecuritySettings = PodSecuritySettings()


ConfigDocument: TypeAlias = JSONObject
"""Settings as their YAML or JSON text holds them (camelCase keys), whole or in part: a configuration file,
the overrides from the environment or the command line, the effective settings printed."""

_DEFAULTS: ConfigDocument = Settings().model_dump(by_alias=True)


def _describe(error: Mapping[str, Any]) -> str:
    key = ".".join(str(part) for part in error["loc"]) or "(top level)"
    kind = error["type"]
    value = error.get("input")
    if kind == "extra_forbidden":
        return f"{key}: unknown key"
    if kind == "literal_error":
        allowed = error.get("ctx", {}).get("expected", "")
        return f"{key}: {value!r} is not allowed; expected {allowed}"
    return f"{key}: {value!r} is invalid: {error['msg']}"


def _known_keys(model: type[BaseModel]) -> dict[str, str]:
    """Lower-cased spellings (camelCase and snake_case) of a model's keys, mapped to the camelCase key."""
    keys: dict[str, str] = {}
    for name, field in model.model_fields.items():
        alias = field.alias or name
        keys[alias.lower()] = alias
        keys[name.lower()] = alias
    return keys


def _env_key(var: str, part: str, model: type[BaseModel] | None, *, path: list[str]) -> str:
    """The camelCase key a part of a variable's name stands for under `path`; ConfigError when none."""
    known = _known_keys(model) if model is not None else {}
    key = known.get(part.lower()) or known.get(part.lower().replace("_", ""))
    if key is None:
        where = ".".join(path) or "the top level"
        raise ConfigError(f"{var}: unknown key {part!r} under {where}; known: {', '.join(sorted(set(known.values())))}")
    return key


def _section_model(model: type[BaseModel] | None, key: str) -> type[BaseModel] | None:
    """The model of the section under `key`, None when the key holds a value (or a mapping of them)."""
    field = model.model_fields[_snake(model, key)] if model else None
    annotation = field.annotation if field else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _env_overrides(environ: Mapping[str, str]) -> ConfigDocument:
    """COPILOT_WEBHOOK_PTRACE__MODE=drop -> {"ptrace": {"mode": "drop"}}; values are parsed as YAML scalars."""
    overrides: ConfigDocument = {}
    for var, raw in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX) or var == CONFIG_ENV:
            continue
        parts = var[len(ENV_PREFIX) :].split("__")
        model: type[BaseModel] | None = Settings
        node = overrides
        path: list[str] = []
        for i, part in enumerate(parts):
            key = _env_key(var, part, model, path=path)
            path.append(key)
            if i == len(parts) - 1:
                node[key] = _scalar(raw)
            else:
                node = node.setdefault(key, {})
                model = _section_model(model, key)
    return overrides


def _scalar(raw: str) -> Any:
    """An environment value read as YAML (`true`, `3`, `[a, b]`), or as the plain string when it is not YAML."""
    if raw == "":
        return ""
    try:
        docs = load_yaml_documents(raw)
    except DocumentError:
        return raw
    return docs[0] if len(docs) == 1 else (None if not docs else raw)


def _snake(model: type[BaseModel], alias: str) -> str:
    for name, field in model.model_fields.items():
        if (field.alias or name) == alias:
            return name
    raise KeyError(alias)


def _merge(base: ConfigDocument, extra: Mapping[str, Any]) -> ConfigDocument:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def read_config_file(path: str | Path) -> ConfigDocument:
    """The file's one YAML document, read as JSON values only and to a bounded depth (documents.py): whatever
    its bytes, the answer is a mapping or a ConfigError, so a bad file can never take a running server down."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror}") from None
    return parse_config(raw, f"config file {str(path)!r}")


def parse_config(raw: bytes, where: str) -> ConfigDocument:
    """A configuration document's bytes as a mapping, or a ConfigError naming `where`."""
    try:
        docs = load_yaml_documents(decode_text(raw))
    except DocumentError as exc:
        problem = exc if str(exc).startswith("not ") else f"refused: {exc}"
        raise ConfigError(f"{where} is {problem}") from None
    if len(docs) > 1:
        raise ConfigError(f"{where} holds {len(docs)} YAML documents; expected one mapping")
    data = docs[0] if docs else None
    if data is None:
        return {}
    if not isinstance(data, dict):
        shape = "list" if isinstance(data, list) else "single value"
        raise ConfigError(f"{where} must hold a mapping of keys, not a {shape}")
    return data


def build_settings(data: Mapping[str, Any]) -> Settings:
    """Validate a plain mapping (file contents, test input) into Settings, or raise ConfigError. It is
    layered over the defaults, so a partial nested value (`limits: {memory: 1Gi}`) keeps its siblings."""
    try:
        return Settings.model_validate(_merge(_DEFAULTS, data))
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(e) for e in exc.errors())) from None


def load_settings(
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Defaults, then the YAML file (argument, else $COPILOT_WEBHOOK_CONFIG), then the environment, then
    `overrides` (command-line flags)."""
    env = os.environ if environ is None else environ
    path = config_file or env.get(CONFIG_ENV)
    data = read_config_file(path) if path else {}
    return build_settings(_merge(_merge(data, _env_overrides(env)), overrides or {}))


def dump_settings(settings: Settings) -> ConfigDocument:
    return settings.model_dump(mode="json", by_alias=True)
