"""Both images of the Dockerfile, built by a real dockerd and started: the webhook serves as uid 65532 on a
read-only root filesystem, `certs ensure` runs against an API server, the puller pulls through a real
containerd. Public base images cannot be pulled here, so the base is a stand-in built from Debian's
packages (mmdebstrap of bookworm with python3, `docker import`), and the dependencies are wheels built
beforehand on the host (the Dockerfile's PIP_INSTALL_OPTIONS). The images are built once per test session
(harness/image_builds.py), and tests/test_kube_kubelet_pods.py imports the same ones into its node. The image sizes
are printed."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from certs.authority import generate_files
from harness.daemons import Containerd, Dockerd, build_image, containerd, registry, require
from harness.environment import eventually
from harness.fake_apiserver import FakeAPIServer
from harness.image_builds import ImageBuilder
from harness.server_process import client_context, free_port
from tests.helpers import apply, decoded_patch, pod, review

ROOT = Path(__file__).parent.parent
LOCK = ROOT / "requirements" / "images.lock"


@dataclass
class Images:
    docker: Dockerd
    env: dict[str, str]
    webhook: str
    puller: str
    sizes: dict[str, int]

    def run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["docker", *args], capture_output=True, text=True, env=self.env, timeout=timeout)
        assert not check or done.returncode == 0, f"docker {args[0]}: exit {done.returncode}\n{done.stderr}"
        return done


@pytest.fixture(scope="module")
def images(image_builder: ImageBuilder, dockerfile_images: dict[str, str]) -> Images:
    """The Dockerfile's images, built once for the session (harness/image_builds.py), in the session's dockerd."""
    require("dockerd", "docker", "mmdebstrap", "containerd", "ctr", "docker-registry", "skopeo", "umoci", "htpasswd")
    sizes = {}
    for name, tag in (*dockerfile_images.items(), ("base", image_builder.base)):
        inspect = subprocess.run(
            ["docker", "image", "inspect", "--format", "{{.Size}}", tag],
            check=True,
            capture_output=True,
            text=True,
            env=image_builder.env,
        )
        sizes[name] = int(inspect.stdout)
    print(f"image sizes (MB): { {k: round(v / 1e6) for k, v in sizes.items()} }")
    return Images(
        image_builder.docker, image_builder.env, dockerfile_images["webhook"], dockerfile_images["puller"], sizes
    )


def test_the_webhook_image_serves_as_a_non_root_user_on_a_read_only_root(images: Images, tmp_path: Path) -> None:
    tls = tmp_path / "tls"
    generate_files(tls, "copilot-webhook", "flyte", dns=["localhost"], ips=["127.0.0.1"])
    for path in tls.iterdir():
        path.chmod(0o644)  # the Secret volume's files are readable by the pod's user
    port = free_port()
    name = f"cw-webhook-{port}"
    images.run(
        "run", "--detach", "--name", name, "--network", "host", "--read-only", "--cap-drop", "ALL",
        # /tmp as the chart mounts it (an emptyDir): the human API's private socket
        "--security-opt", "no-new-privileges", "--tmpfs", "/tmp:size=1m", "--volume", f"{tls}:/tls:ro", images.webhook,
        "serve", "--tls-cert", "/tls/tls.crt", "--tls-key", "/tls/tls.key", "--host", "127.0.0.1", "--port", str(port),
    )  # fmt: skip
    try:
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=client_context(tls / "ca.crt")) as client:

            def healthy() -> bool:
                try:
                    return client.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    return False

            assert eventually(healthy, timeout=30), images.run("logs", name, check=False).stderr
            obj = pod("flyte-1.15-bare.yaml")
            res = client.post(
                "/mutate", content=orjson.dumps(review(obj)), headers={"content-type": "application/json"}
            )
            assert res.status_code == 200
            mutated = apply(obj, decoded_patch(res.json()["response"]))
            assert mutated["spec"]["shareProcessNamespace"] is True
            assert client.get("/openapi.json").json()["paths"]["/preview"], "the human API answers through the port"
        assert images.run("exec", name, "id", "-u").stdout.strip() == "65532"
        assert images.run("exec", name, "touch", "/opt/x", check=False).returncode != 0, "the root is read-only"
        started = time.monotonic()
        images.run("stop", "--time", "20", name)
        assert time.monotonic() - started < 15, "SIGTERM: a drain, then a clean stop"
        logs = images.run("logs", name).stderr
        assert "Traceback" not in logs
        assert "draining" in logs
    finally:
        images.run("rm", "--force", name, check=False)


def test_certs_ensure_runs_from_the_webhook_image(images: Images, api: FakeAPIServer, tmp_path: Path) -> None:
    mwc = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/cw"
    api.store[mwc] = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "cw", "resourceVersion": "1"},
        "webhooks": [{"name": "ptrace.copilot-webhook.io", "clientConfig": {"service": {"name": "cw"}}}],
    }
    tmp_path.chmod(0o755)  # mounted as /cfg for uid 65532
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    kubeconfig.chmod(0o644)
    (tmp_path / "config.yaml").write_text("cluster:\n  enabled: true\n  kubeconfig: /cfg/kubeconfig\n")
    (tmp_path / "config.yaml").chmod(0o644)
    done = images.run(
        "run", "--rm", "--network", "host", "--read-only", "--volume", f"{tmp_path}:/cfg:ro", images.webhook,
        "certs", "ensure", "--secret", "cw-tls", "--webhook-config", "cw", "--namespace", "flyte",
        "--config", "/cfg/config.yaml",
    )  # fmt: skip
    assert "cw-tls:" in done.stdout
    secret = api.store["/api/v1/namespaces/flyte/secrets/cw-tls"]
    bundle = base64.b64decode(api.store[mwc]["webhooks"][0]["clientConfig"]["caBundle"])
    assert base64.b64decode(secret["data"]["ca.crt"]) in bundle


def test_the_puller_image_pulls_through_a_real_containerd(images: Images, tmp_path: Path) -> None:
    layout = tmp_path / "oci"
    build_image(layout, "v1", "from the puller image")
    with containerd(tmp_path / "ctd") as ctd, registry(tmp_path / "reg") as reg:
        ctd.trust(reg.host, plain_http=True)
        image = reg.push(layout, "v1", "team/app")
        done = _pull_in_image(images, ctd, image)
    assert f"image={image} result=pulled attempts=1" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0


def _pull_in_image(images: Images, ctd: Containerd, image: str) -> subprocess.CompletedProcess[str]:
    """As the pod runs it: uid 0, no capabilities, no new privileges, read-only root, the socket mounted."""
    return images.run(
        "run", "--rm", "--network", "host", "--read-only", "--user", "0", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--volume", f"{ctd.socket}:{ctd.socket}", images.puller,
        "--runtime=cri", f"--socket={ctd.socket}", "--", image,
    )  # fmt: skip


def test_the_puller_image_carries_only_what_it_runs(images: Images) -> None:
    """The puller's environment: the package without the server's dependencies, grpcio (and typing_extensions, its
    own dependency) and ctr."""
    mb = {name: size / 1e6 for name, size in images.sizes.items()}
    assert mb["puller"] - mb["base"] < 100, mb
    assert mb["puller"] < mb["webhook"], mb
    listed = images.run("run", "--rm", "--entrypoint", "/opt/puller/bin/pip", images.puller, "list", "--format=json")
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert installed <= {"copilot-webhook", "grpcio", "typing_extensions", "pip", "setuptools"}, installed


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_images_hold_the_locked_versions(images: Images) -> None:
    locked = {_norm(n): v for n, v in (line.split("==") for line in LOCK.read_text().split() if "==" in line)}
    for image, pip in ((images.webhook, "/opt/venv/bin/pip"), (images.puller, "/opt/puller/bin/pip")):
        listed = images.run("run", "--rm", "--entrypoint", pip, image, "list", "--format=json")
        installed = {_norm(p["name"]): p["version"] for p in json.loads(listed.stdout)}
        pinned = {name: version for name, version in installed.items() if name in locked}
        assert pinned == {name: locked[name] for name in pinned}, image
        unlisted = set(installed) - set(locked) - {"copilot-webhook", "pip", "setuptools"}
        assert not unlisted, f"{image} installs packages the lock does not pin: {unlisted}"


def test_make_images_tags_what_the_chart_runs_by_default(images: Images) -> None:
    """`make images` (which built these) names its images as the chart's defaults do, under any registry: a
    user who pushes them needs to change only the registry in `helm install`."""
    dry_run = subprocess.run(
        ["make", "--no-print-directory", "-n", "-C", str(ROOT), "images"], capture_output=True, text=True, check=True
    )
    defaults = sorted(re.findall(r"--tag (\S+)", dry_run.stdout))
    chart = ROOT / "deploy" / "helm" / "copilot-webhook"
    version = re.search(r'^appVersion: "?([^"\n]+)"?$', (chart / "Chart.yaml").read_text(), re.MULTILINE)
    assert version is not None
    repository = re.search(r"^  repository: (\S+)$", (chart / "values.yaml").read_text(), re.MULTILINE)
    assert repository is not None
    assert defaults == [
        f"{repository[1]}:{version[1]}",
        f"ghcr.io/copilot-webhook/image-puller:{version[1]}",
    ]
    built = sorted((images.webhook, images.puller))
    assert [tag.split("/", 1)[1] for tag in built] == [tag.rsplit("/", 1)[1] for tag in defaults]
    assert images.run("image", "inspect", *built).returncode == 0
