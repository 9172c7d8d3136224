"""The version a release tag names, checked against every place the version is written: a tag `v<version>`
is a release only when pyproject.toml's version (the package's `__version__`), the chart's `version` and
its `appVersion` are all `<version>`. The release workflow (.github/workflows/release.yml) runs it before
it builds anything, and tests/test_release.py runs the same check on the tree, so a release cannot be cut
with the three apart.

    python3 -m scripts.release_version --tag v0.1.0 --owner Copilot-Webhook
    version=0.1.0
    owner=copilot-webhook

The lines printed are the workflow's step outputs: the version, and the owner lowercased as image and chart
references need it. Standard library only: the workflow runs it before anything is installed.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART_YAML = Path("deploy") / "helm" / "copilot-webhook" / "Chart.yaml"
# A top-level scalar of Chart.yaml: `key: 0.1.0`, `key: "0.1.0"` or `key: '0.1.0'`, an optional comment after.
_CHART_KEY = re.compile(r"""^(?P<key>version|appVersion):[ \t]*(?P<q>["']?)(?P<value>[^"'\s#]+)(?P=q)[ \t]*(#.*)?$""")


class ReleaseVersionError(ValueError):
    """The tag and the versions written in the tree disagree, or a version cannot be read."""


def pyproject_version(root: Path = ROOT) -> str:
    """project.version, or the module attribute setuptools reads it from when it is dynamic."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    static = project["project"].get("version")
    if static is not None:
        return str(static)
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module, _, name = attr.rpartition(".")
    path = root.joinpath(*module.split("."))
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(source.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(target, ast.Name) and target.id == name for target in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise ReleaseVersionError(f'{source.relative_to(root)}: no `{name} = "..."` to read the version from')


def chart_versions(root: Path = ROOT) -> dict[str, str]:
    """The chart's `version` and `appVersion`, each written once at the top level of Chart.yaml."""
    found: dict[str, list[str]] = {"version": [], "appVersion": []}
    for line in (root / CHART_YAML).read_text().splitlines():
        match = _CHART_KEY.match(line)
        if match:
            found[match["key"]].append(match["value"])
    for key, values in found.items():
        if len(values) != 1:
            raise ReleaseVersionError(f"{CHART_YAML}: {key} is written {len(values)} times as a plain top-level value")
    return {key: values[0] for key, values in found.items()}


def versions(root: Path = ROOT) -> dict[str, str]:
    """Each place the release version is written, by name."""
    chart = chart_versions(root)
    return {
        "pyproject.toml version": pyproject_version(root),
        "Chart.yaml version": chart["version"],
        "Chart.yaml appVersion": chart["appVersion"],
    }


def check(tag: str, root: Path = ROOT) -> str:
    """The version the tag names, if every place agrees with it; otherwise the error lists each disagreement."""
    if not tag.startswith("v"):
        raise ReleaseVersionError(f"tag {tag!r}: a release tag is v<version>")
    version = tag.removeprefix("v")
    apart = [f"{where} is {found!r}" for where, found in versions(root).items() if found != version]
    if apart:
        raise ReleaseVersionError(f"tag {tag!r} names version {version!r}, but " + "; ".join(apart))
    return version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m scripts.release_version", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", required=True, help="the release tag, v<version>")
    parser.add_argument("--owner", required=True, help="the repository's owner, as GitHub spells it")
    args = parser.parse_args(argv)
    try:
        version = check(args.tag)
    except ReleaseVersionError as error:
        print(f"release refused: {error}", file=sys.stderr)
        return 1
    print(f"version={version}")
    print(f"owner={args.owner.lower()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
