"""Flyte's task pods for the tests, release line by line.

Generated: for each release in GENERATED, a Go module under tests/flyte/<release>/ builds the pods with
Flyte's own code (1.16: flytepropeller's k8s plugin manager running flyteplugins' pod plugin over Flyte's own
mocks; 1.14 and 1.15: that release's pod plugin called directly, with the plugin manager's object metadata
ported, since the manager the Go module proxy serves does not compile against it) and prints them; `make
flyte-pods` (`python -m scripts.flyte_source`) rewrites the committed copies in
tests/flyte/pods/<release>/<cell>.yaml and the golden contexts that feed them to the webhook, and a test
fails when a committed pod differs from what the generator prints.

Hand-derived: the releases in LINES, whose Flyte modules the Go module proxy does not serve or which do not
build from the modules it serves (docs/testing.md, docs/architecture.md), are a port of the parts of
`flyteplugins/go/tasks/pluginmachinery/flytek8s/copilot.go` (FlyteCoPilotContainer, CopilotCommandArgs,
DownloadCommandArgs, SidecarCommandArgs, AddCoPilotToContainer, AddCoPilotToPod), `pod_helper.go`
(ApplyFlytePodConfiguration, MergeBasePodSpecOntoTemplate), `plugins/k8s/pod/plugin.go` (the
primary_container_name annotation) and flytepropeller's object metadata (labels, owner reference) of the
`flyteorg/flyte` repository, at the tags in LINES. Each case's header says it is hand-derived and names the
tag and lines it follows; a test checks the committed tests/golden/flyte-src-*.yaml equal what this module
builds. 1.14 and 1.15 are both: their derived pods are held to the generated ones' shape, and cover the
cases the generators' matrix does not (templates merged in, Flyte's secrets webhook).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

GOLDEN = Path(__file__).parent.parent / "tests" / "golden"
COPILOT = "flyteplugins/go/tasks/pluginmachinery/flytek8s/copilot.go"
PLUGIN = "flyteplugins/go/tasks/plugins/k8s/pod/plugin.go"
HELPER = "flyteplugins/go/tasks/pluginmachinery/flytek8s/pod_helper.go"


@dataclass(frozen=True)
class Line:
    """What differs between release lines, with the lines of copilot.go and plugin.go it comes from."""

    tag: str
    sidecar_name: str  # flyteSidecarContainerName
    ptrace: bool  # AddCoPilotToContainer adds SYS_PTRACE, AddCoPilotToPod sets shareProcessNamespace
    native_sidecar: bool  # the uploader is an init container with restartPolicy Always, prepended
    logger_level: bool  # CopilotCommandArgs passes --logger.level
    timeout_flag: str  # SidecarCommandArgs: --start-timeout (100 s) or --timeout (1 h)
    grace: int | None  # TerminationGracePeriodSeconds set with the uploader
    annotate_raw_container: bool  # plugin.go sets primary_container_name on single-container raw-container pods
    flyte2: bool = False
    image: str = "cr.flyte.org/flyteorg/flytecopilot:v0.0.15"  # config.go default CoPilot.Image
    cites: str = ""


LINES: dict[str, Line] = {
    "1.10": Line("v1.10.0", "sidecar", True, False, False, "--start-timeout", None, True,
                 cites=f"{COPILOT}@v1.10.0 L23 (sidecar), L175 (SYS_PTRACE), L211 (shareProcessNamespace), "
                       f"L240/L269 (downloader, sidecar); {PLUGIN}@v1.10.0 L125-126"),
    "1.13": Line("v1.13.3", "sidecar", True, False, False, "--start-timeout", None, True,
                 cites=f"{COPILOT}@v1.13.3 L23, L175, L211, L240/L269; {PLUGIN}@v1.13.3 L125-126"),
    "1.14": Line("v1.14.1", "uploader", True, False, False, "--start-timeout", None, True,
                 cites=f"{COPILOT}@v1.14.1 L23 (uploader), L175, L212, L243/L274; {PLUGIN}@v1.14.1 L125-126"),
    "1.15": Line("v1.15.3", "uploader", True, False, False, "--start-timeout", None, True,
                 cites=f"{COPILOT}@v1.15.3 L23, L175, L212, L243/L274; {PLUGIN}@v1.15.3 L125-126"),
    # 1.16.0 sets the grace period from a time.Duration cast to *int64: nanoseconds read as seconds.
    "1.16.0": Line("v1.16.0", "uploader", False, True, True, "--timeout", 3_600_000_000_000, False,
                   cites=f"{COPILOT}@v1.16.0 L25, L62-66 (logger.level), L241, L270 (restartPolicy Always), "
                         f"L275 (prepended), L277 (grace period, nanoseconds); {PLUGIN}@v1.16.0 L125"),
    "2.0": Line("v2.0.43", "uploader", False, True, True, "--timeout", 3600, False, flyte2=True,
                image="cr.flyte.org/flyteorg/flyte-binary-v2:latest",
                cites=f"{COPILOT}@v2.0.43 L25, L83 (storage config), L139 (file-input-layout), L314, L343, "
                      f"L348, L351; {PLUGIN}@v2.0.43 L159; config/config.go@v2.0.43 L38-44 (default image)"),
}  # fmt: skip


@dataclass(frozen=True)
class Task:
    inputs: bool = True
    outputs: bool = True
    extra_container: bool = False  # a ContainerTask whose pod template adds a log forwarder
    default_template: bool = False  # a `default` container template (drop ALL) merged into every container
    primary_init_template: bool = False  # a `primary-init` template merged into the downloader
    image: str | None = None  # the copilot image the deployment configures
    secrets: str = "none"  # Flyte's secrets webhook: none, or "before" ours (its mounts are in every container)
    input_path: str = "/var/flyte/inputs"
    output_path: str = "/var/flyte/outputs"
    notes: tuple[str, ...] = field(default_factory=tuple)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _command(line: Line) -> list[str]:
    """CopilotCommandArgs with an s3 (stow) storage configuration."""
    command = ["/bin/flyte-copilot", "--storage.limits.maxDownloadMBs=0"]
    if line.logger_level:
        command.append("--logger.level=3")
    command += ["--storage.container=my-s3-bucket", "--storage.type=stow"]
    if line.flyte2:
        command += ["--config", "/etc/flyte/copilot/*.yaml"]
        return command
    return [*command, "--storage.stow.config", "region=us-east-2", "--storage.stow.kind=s3"]


def _copilot(line: Line, task: Task, role: str, args: list[str], mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """FlyteCoPilotContainer."""
    return {
        "name": "flyte-copilot-" + role,
        "image": task.image or line.image,
        "command": _command(line),
        "args": args,
        "workingDir": "/",
        "resources": {"limits": {"cpu": "500m", "memory": "128Mi"}, "requests": {"cpu": "500m", "memory": "128Mi"}},
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "imagePullPolicy": "IfNotPresent",
    }


def _merge_template(container: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """mergo.Merge(template, container, WithOverride, WithAppendSlice): the container's values win, slices append."""
    merged = copy.deepcopy(template)
    for key, value in container.items():
        if isinstance(value, list) and isinstance(merged.get(key), list):
            merged[key] = merged[key] + value
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge_template(value, merged[key])
        else:
            merged[key] = value
    return {k: merged[k] for k in sorted(merged, key=lambda k: k != "name")}


DEFAULT_TEMPLATE = {"securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
PRIMARY_INIT_TEMPLATE = {
    "resources": {"limits": {"ephemeral-storage": "2Gi"}},
    "env": [{"name": "PRIMARY_INIT", "value": "1"}],
}


def flyte_pod(line_name: str, task: Task) -> dict[str, Any]:
    """The pod Flyte's pod plugin writes for a raw-container task, step by step as its Go code does."""
    line = LINES[line_name]
    name = "f7a9c2e4b1-n0-0" if not line.flyte2 else "r4x2k9-a0-0"
    primary = _primary(name, task)
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [primary]}
    if task.extra_container:
        _add_log_forwarder(spec, primary)
    _add_copilot_to_container(line, task, primary)
    _add_copilot_to_pod(line, task, spec)
    _merge_templates(line, task, spec)
    metadata = _metadata(line, name)
    if len(spec["containers"]) == 1 and line.annotate_raw_container:
        metadata["annotations"]["primary_container_name"] = name
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
    if task.secrets == "before":
        _inject_secrets(pod)
    copied: dict[str, Any] = json.loads(json.dumps(pod))  # no shared sub-objects (YAML would write aliases)
    return copied


def _primary(name: str, task: Task) -> dict[str, Any]:
    return {
        "name": name,
        "image": "ghcr.io/flyteorg/rawcontainers-shell:v2",
        "command": ["./calculate-ellipse-area.sh", task.input_path, task.output_path],
        "resources": {"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "1", "memory": "1Gi"}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "env": [{"name": "FLYTE_INTERNAL_EXECUTION_ID", "value": "f7a9c2e4b1"}],
    }


def _add_log_forwarder(spec: dict[str, Any], primary: dict[str, Any]) -> None:
    """A ContainerTask whose pod template adds a second container sharing a log volume."""
    spec["containers"].append(
        {
            "name": "log-forwarder",
            "image": "docker.io/fluent/fluent-bit:3.1",
            "args": ["-i", "tail", "-p", "path=/var/log/task/*.log", "-o", "stdout"],
            "volumeMounts": [{"name": "task-logs", "mountPath": "/var/log/task"}],
        }
    )
    primary.setdefault("volumeMounts", []).append({"name": "task-logs", "mountPath": "/var/log/task"})
    spec["volumes"] = [{"name": "task-logs", "emptyDir": {}}]


def _add_copilot_to_container(line: Line, task: Task, primary: dict[str, Any]) -> None:
    """AddCoPilotToContainer: SYS_PTRACE (<= 1.15; an empty capabilities object from 1.16) and the mounts."""
    primary["securityContext"] = {"capabilities": {"add": ["SYS_PTRACE"]} if line.ptrace else {}}
    if task.inputs:
        primary.setdefault("volumeMounts", []).append({"name": "flyte-inputs", "mountPath": task.input_path})
    if task.outputs:
        primary.setdefault("volumeMounts", []).append({"name": "flyte-outputs", "mountPath": task.output_path})


def _add_copilot_to_pod(line: Line, task: Task, spec: dict[str, Any]) -> None:
    """AddCoPilotToPod: the shared process namespace (<= 1.15), the downloader and the uploader."""
    if line.ptrace:
        spec["shareProcessNamespace"] = True
    init: list[dict[str, Any]] = []
    volumes = spec.setdefault("volumes", [])
    secret_mounts: list[dict[str, Any]] = []
    if line.flyte2 and (task.inputs or task.outputs):
        volumes.append(
            {"name": "flyte-copilot-storage-config",
             "projected": {"sources": [{"secret": {"name": "flyte-copilot-storage"}}], "defaultMode": 0o444}}
        )  # fmt: skip
        secret_mounts = [{"name": "flyte-copilot-storage-config", "mountPath": "/etc/flyte/copilot", "readOnly": True}]
    if task.inputs:
        volumes.append({"name": "flyte-inputs", "emptyDir": {}})
        init.append(_downloader(line, task, secret_mounts))
    if task.outputs:
        volumes.append({"name": "flyte-outputs", "emptyDir": {}})
        _add_uploader(line, task, spec, init, secret_mounts)
    if init:
        spec["initContainers"] = init
    if not volumes:
        del spec["volumes"]


def _downloader(line: Line, task: Task, secret_mounts: list[dict[str, Any]]) -> dict[str, Any]:
    args = ["download", "--from-remote", "s3://my-s3-bucket/metadata/propeller/f7a9c2e4b1/n0/data/inputs.pb",
            "--to-output-prefix", "s3://my-s3-bucket/metadata/propeller/f7a9c2e4b1/n0/data/0",
            "--to-local-dir", task.input_path, "--format", "JSON"]  # fmt: skip
    if line.flyte2:
        args += ["--file-input-layout", "FLAT"]
    args += ["--input-interface", _b64("inputs: a, b (float)")]
    mounts = [{"name": "flyte-inputs", "mountPath": task.input_path}, *secret_mounts]
    return _copilot(line, task, "downloader", args, mounts)


def _add_uploader(
    line: Line, task: Task, spec: dict[str, Any], init: list[dict[str, Any]], secret_mounts: list[dict[str, Any]]
) -> None:
    """The uploader: a regular container (<= 1.15) or a native sidecar, first among the init containers."""
    timeout = "1h0m0s" if line.timeout_flag == "--timeout" else "1m40s"
    args = ["sidecar", line.timeout_flag, timeout,
            "--to-raw-output", "s3://my-s3-bucket/data/raw/f7a9c2e4b1",
            "--to-output-prefix", "s3://my-s3-bucket/metadata/propeller/f7a9c2e4b1/n0/data/0",
            "--from-local-dir", task.output_path, "--interface", _b64("outputs: area (float)")]  # fmt: skip
    mounts = [{"name": "flyte-outputs", "mountPath": task.output_path}, *secret_mounts]
    uploader = _copilot(line, task, line.sidecar_name, args, mounts)
    if line.native_sidecar:
        uploader["restartPolicy"] = "Always"
        init.insert(0, uploader)
        spec["terminationGracePeriodSeconds"] = line.grace
    else:
        spec["containers"].append(uploader)


def _merge_templates(line: Line, task: Task, spec: dict[str, Any]) -> None:
    """MergeWithBasePodTemplate: `default` into every container, `primary-init` into the downloader."""
    init = spec.get("initContainers")
    if task.default_template:
        spec["containers"] = [_merge_template(c, DEFAULT_TEMPLATE) for c in spec["containers"]]
        if init:
            spec["initContainers"] = [_merge_template(c, DEFAULT_TEMPLATE) for c in spec["initContainers"]]
    if task.primary_init_template and task.inputs and not line.native_sidecar:
        spec["initContainers"] = [
            _merge_template(c, PRIMARY_INIT_TEMPLATE) if c["name"] == "flyte-copilot-downloader" else c
            for c in spec["initContainers"]
        ]


def _metadata(line: Line, name: str) -> dict[str, Any]:
    """flytepropeller's addObjectMetadata: labels, DefaultAnnotations, the owner reference (2.0: TaskAction)."""
    if line.flyte2:
        labels = {"run": "r4x2k9", "action": "a0", "attempt": "1", "task-name": "ellipse-area"}
        owner = {"apiVersion": "flyte.org/v1", "kind": "TaskAction", "name": "r4x2k9-a0",
                 "uid": "6f1c1a6e-2b7d-4a51-9c1e-0d5b1a1f2c3d", "controller": True}  # fmt: skip
    else:
        labels = {"domain": "development", "execution-id": "f7a9c2e4b1", "interruptible": "false", "node-id": "n0",
                  "project": "flytesnacks", "shard-key": "21", "task-name": "ellipse-area",
                  "workflow-name": "flytesnacks-workflows-raw-container-wf"}  # fmt: skip
        owner = {"apiVersion": "flyte.lyft.com/v1alpha1", "kind": "flyteworkflow", "name": "f7a9c2e4b1",
                 "uid": "3b0d6c3e-8f2a-4f0e-9a8b-4c7d2e1f0a9b", "controller": True,
                 "blockOwnerDeletion": True}  # fmt: skip
    return {
        "name": name,
        "namespace": "flytesnacks-development",
        "labels": labels,
        "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
        "ownerReferences": [owner],
    }


def _inject_secrets(pod: dict[str, Any]) -> None:
    """flytepropeller/pkg/webhook/k8s_secrets.go@v1.15.3 L40-L59: a volume, mounted with env vars into every
    container and init container."""
    spec = pod["spec"]
    spec.setdefault("volumes", []).append({"name": "m4zg54lqhiqce2lbnvswc", "secret": {"secretName": "api-token"}})
    pod["metadata"]["labels"]["inject-flyte-secrets"] = "true"
    for key in ("initContainers", "containers"):
        for container in spec.get(key, []):
            container.setdefault("volumeMounts", []).append(
                {"name": "m4zg54lqhiqce2lbnvswc", "mountPath": "/etc/flyte/secrets/api-token", "readOnly": True}
            )
            container.setdefault("env", []).append({"name": "FLYTE_SECRETS_DEFAULT_DIR", "value": "/etc/flyte/secrets"})


IO = {"io": Task(), "in": Task(outputs=False), "out": Task(inputs=False), "none": Task(inputs=False, outputs=False)}
FORWARDER = "a ContainerTask whose pod template adds a log forwarder"
SECRETS = "Flyte's secrets webhook ran before ours (flytepropeller/pkg/webhook/k8s_secrets.go@v1.15.3 L40-L59)"
EXTRA: dict[str, tuple[str, Task, str]] = {
    "1.15-extra-container": ("1.15", Task(extra_container=True), FORWARDER),
    "1.15-default-template": (
        "1.15",
        Task(default_template=True),
        f"a `default` pod template container merged in ({HELPER}@v1.15.3 L695-L781)",
    ),
    "1.13-primary-init-template": (
        "1.13",
        Task(primary_init_template=True),
        f"a `primary-init` template merged into the downloader ({HELPER}@v1.15.3 L783-L833)",
    ),
    "1.15-private-registry": (
        "1.15",
        Task(image="registry.corp.example:5000/flyteorg/flytecopilot:v1.15.3"),
        "the copilot image from a private registry with a port",
    ),
    "1.14-digest": (
        "1.14",
        Task(image="cr.flyte.org/flyteorg/flytecopilot@sha256:" + "ab" * 32),
        "the copilot image pinned by digest",
    ),
    "1.15-secrets-before": ("1.15", Task(secrets="before"), SECRETS),
    "1.15-custom-paths": (
        "1.15",
        Task(input_path="/var/inputs", output_path="/var/outputs"),
        "the task sets its own input and output paths",
    ),
}


def derived() -> dict[str, tuple[dict[str, Any], str]]:
    """The hand-derived cases: case name -> (pod, header comment)."""
    out: dict[str, tuple[dict[str, Any], str]] = {}
    for line_name, line in LINES.items():
        for variant, task in IO.items():
            what = {"io": "inputs and outputs", "in": "inputs only", "out": "outputs only", "none": "neither"}[variant]
            header = f"Flyte {line_name}, task with {what}. {line.cites}"
            out[f"flyte-src-{line_name}-{variant}"] = (flyte_pod(line_name, task), header)
    for case, (line_name, task, what) in EXTRA.items():
        out[f"flyte-src-{case}"] = (flyte_pod(line_name, task), f"Flyte {line_name}: {what}. {LINES[line_name].cites}")
    return out


def render(pod: dict[str, Any], header: str) -> str:
    words, lines, current = header.split(), [], "#"
    for word in words:
        if len(current) + len(word) + 1 > 110:
            lines.append(current)
            current = "#"
        current += " " + word
    lines.append(current)
    lines.append("# Hand-derived by scripts/flyte_source.py from the Go code cited; do not edit by hand.")
    lines.append("# Which releases' pods Flyte's own code prints as well, and why not the others: docs/testing.md.")
    return "\n".join(lines) + "\n" + yaml.safe_dump(pod, sort_keys=False, width=200)


# Generated pods ---------------------------------------------------------------------------------------

FLYTE = Path(__file__).parent.parent / "tests" / "flyte"
PODS = FLYTE / "pods"
# release line -> the harness/gotools.py tool that prints its pods (built from tests/flyte/v<release>/).
GENERATED = {"1.14": "flyte-pods-1.14", "1.15": "flyte-pods-1.15", "1.16": "flyte-pods-1.16"}
# How the deployment configures the webhook for a cell whose Flyte configuration is not the default.
CELL_SETTINGS: dict[str, dict[str, Any]] = {"mirror": {"copilot": {"namePrefix": "copilot-"}}}
_CELL = re.compile(r"^# cell ([a-z0-9-]+): ", re.MULTILINE)


def parse(printed: str) -> dict[str, str]:
    """The generator's YAML stream -> cell name -> that pod's document, header included."""
    pods: dict[str, str] = {}
    for document in re.split(r"^---\n", printed, flags=re.MULTILINE):
        if not document.strip():
            continue
        found = _CELL.search(document)
        if found is None:
            raise ValueError(f"a document without a `# cell NAME:` header: {document[:200]!r}")
        pods[found.group(1)] = document
    return pods


def printed(binary: Path) -> dict[str, str]:
    """Run a generator: cell name -> the pod document Flyte's code printed."""
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{binary.name} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return parse(done.stdout)


def pod_path(release: str, cell: str) -> Path:
    return PODS / f"v{release}" / f"{cell}.yaml"


def committed(release: str) -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted((PODS / f"v{release}").glob("*.yaml"))}


def contexts(release: str, cell: str) -> dict[str, dict[str, Any]]:
    """The golden cases that feed a generated pod to the webhook: default settings and every kind of
    mutation, and ptrace.mode drop alone."""
    source = {"input": os.path.relpath(pod_path(release, cell), GOLDEN)}
    settings = CELL_SETTINGS.get(cell, {})
    base = {**source, "settings": settings} if settings else source
    drop = {**source, "settings": {**settings, "ptrace": {"mode": "drop"}}, "kinds": ["ptrace"]}
    name = f"flyte-gen-{release}-{cell}"
    return {name: base, f"{name}-drop": drop}


def write_generated(release: str, pods: dict[str, str]) -> None:
    folder = PODS / f"v{release}"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("*.yaml"), *GOLDEN.glob(f"flyte-gen-{release}-*.context.yaml")]:
        stale.unlink()
    for cell, text in pods.items():
        pod_path(release, cell).write_text(text)
        for name, context in contexts(release, cell).items():
            (GOLDEN / f"{name}.context.yaml").write_text(yaml.safe_dump(context, sort_keys=False))


def generated() -> dict[str, tuple[dict[str, Any], str]]:
    """The committed generated pods: case name -> (pod, header comment)."""
    out: dict[str, tuple[dict[str, Any], str]] = {}
    for release in GENERATED:
        for cell, text in committed(release).items():
            header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
            out[f"flyte-gen-{release}-{cell}"] = (yaml.safe_load(text), header)
    return out


def cases() -> dict[str, tuple[dict[str, Any], str]]:
    """Every Flyte pod the tests use: case name -> (pod, header comment)."""
    return {**derived(), **generated()}


def main() -> None:
    """`make flyte-pods`: build (or reuse) the generators, rewrite their pods and the hand-derived cases."""
    from harness import gotools

    for release, tool in GENERATED.items():
        write_generated(release, printed(gotools.build(gotools.TOOLS[tool])))
    for case, (pod, header) in derived().items():
        (GOLDEN / f"{case}.yaml").write_text(render(pod, header))


if __name__ == "__main__":
    main()
