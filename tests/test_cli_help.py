"""The command line's own words: --version, each command's help (a default for every option that takes a
value, examples that parse), and errors in plain words, without internal references or class names."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.environment import child_env
from webhook import __version__
from webhook.cli import _parser
from webhook.cluster.errors import plainly

ENV = child_env()


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "webhook", *args],
        capture_output=True,
        text=True,
        env={**ENV, **(env or {})},
        timeout=60,
        check=False,
    )


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command's words, `certs ensure` included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                words = (*path, name)
                if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield words
                yield from _commands(sub, words)


def _sub(words: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = _parser()
    for word in words:
        (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = action.choices[word]
    return parser


COMMANDS = list(_commands(_parser()))


def test_every_command_is_listed() -> None:
    assert {" ".join(c) for c in COMMANDS} == {
        "serve",
        "certs generate",
        "certs ensure",
        "preview",
        "label-nodes",
        "audit",
        "verify",
        "unregister",
        "config show",
    }


def test_version() -> None:
    result = _run("--version")
    assert result.returncode == 0
    assert result.stdout == f"copilot-webhook {__version__}\n"


@pytest.mark.parametrize("words", COMMANDS, ids=" ".join)
def test_every_option_that_takes_a_value_says_its_default(words: tuple[str, ...]) -> None:
    parser = _sub(words)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.required or action.nargs == 0:
            continue
        text = formatter._expand_help(action) if action.help else ""
        assert "default" in text, f"{' '.join(words)} {action.option_strings[0]}: {text!r}"


def _examples(words: tuple[str, ...]) -> list[list[str]]:
    epilog = _sub(words).epilog or ""
    assert epilog.startswith("examples:\n"), f"{' '.join(words)} has no examples"
    lines = epilog.replace("\\\n", " ").splitlines()[1:]
    found = []
    for line in lines:
        command = line.split("copilot-webhook ", 1)[1].split("#", 1)[0]
        found.append(shlex.split(command))
    return found


@pytest.mark.parametrize("words", COMMANDS, ids=" ".join)
def test_every_command_has_examples_that_parse(words: tuple[str, ...]) -> None:
    examples = _examples(words)
    assert examples
    for args in examples:
        assert tuple(args[: len(words)]) == words
        _parser().parse_args(args)  # exits 2 on an example that is not valid


@pytest.mark.parametrize("words", [(), *COMMANDS], ids=lambda w: " ".join(w) or "top")
def test_help_names_no_internal_section(words: tuple[str, ...]) -> None:
    result = _run(*words, "--help")
    assert result.returncode == 0
    assert "spec " not in result.stdout.lower()
    assert "(default: None)" not in result.stdout


def test_the_top_level_help_points_to_each_commands_help() -> None:
    assert "Run 'copilot-webhook COMMAND --help'" in _run("--help").stdout


def _unreachable(tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    config: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    "args",
    [
        ("audit",),
        ("label-nodes", "--dry-run"),
        ("verify", "--webhook-config", "x"),
        ("unregister", "--webhook-config", "x"),
        ("certs", "ensure", "--secret", "s", "--webhook-config", "x", "--namespace", "n"),
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_an_unreachable_api_server_is_said_in_plain_words(tmp_path: Path, args: tuple[str, ...]) -> None:
    result = _run(*args, "--kubeconfig", str(_unreachable(tmp_path)))
    assert result.returncode == 1
    assert result.stderr.endswith(": cannot reach 127.0.0.1:1: connection refused\n"), result.stderr
    assert "Error" not in result.stderr
    assert "Exception" not in result.stderr


def test_a_kubeconfig_that_is_not_there_is_named(tmp_path: Path) -> None:
    result = _run("audit", "--kubeconfig", str(tmp_path / "nope"))
    assert result.returncode == 1
    assert result.stderr == f"copilot-webhook: audit: the kubeconfig {tmp_path / 'nope'} does not exist\n"


def test_preview_takes_a_cluster_only_with_from_cluster(tmp_path: Path) -> None:
    result = _run("preview", "-f", "examples/flyte-1.15-pod.yaml", "--context", "prod")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "--kubeconfig and --context choose the cluster of --from-cluster" in result.stderr


def test_an_api_servers_refusal_is_said_with_its_code_and_message() -> None:
    from kubernetes.client.exceptions import ApiException

    refused = ApiException(status=403, reason="Forbidden")
    refused.body = '{"kind":"Status","message":"nodes is forbidden: User \\"x\\" cannot list resource \\"nodes\\""}'
    assert plainly(refused) == 'the API server answered 403: nodes is forbidden: User "x" cannot list resource "nodes"'
    assert plainly(ApiException(status=500, reason="Internal Server Error")) == (
        "the API server answered 500: Internal Server Error"
    )
