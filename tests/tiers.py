"""Test tiers: each test is marked with exactly one of four markers by what it needs to run, so a contributor
can run the in-process tests alone (`make test-fast`: `pytest -m pure`) before the whole suite.

- `pure`: in-process unit, golden and property tests; no subprocess, no listening socket.
- `server`: a process or a listening socket of its own: the webhook's server or uvicorn, the fake API
  server, a command or Go program run as a child (harness/server_process.py, harness/fake_apiserver.py).
- `daemons`: containerd, dockerd, registries (harness/daemons.py, harness/image_builds.py).
- `cluster`: the real control plane or node (harness/controlplane.py, harness/node.py, harness/kube_api.py).

A test is given its tier at collection: the heaviest tier of what its function and the fixtures it uses
reach, read from their code (`REACHES`): a name the code loads or imports counts by where it comes from (a
module, or a function or class of one), a method named like a server's (`listen`, `create_server`) makes it
`server`, and so does a request to the app's `/preview` (a preview is rendered in a worker process). A
function or class of tests/ that it uses is read the same way. A test that reaches none of them is `pure`. A
tier marker written on a test or its module is taken as it is, and a test may carry only one.

A `pure` test is held to it while it runs: starting a process or listening on a socket through Python's
`socket` fails it, naming what it started, so a test that starts something by a way `REACHES` does not
list fails instead of slowing the fast lane or needing what it does not declare. The fix is a `REACHES`
entry, or a marker on the test. What starts listening inside C code (uvloop's servers, grpc's) is seen only
by `REACHES`.
"""

from __future__ import annotations

import dis
import inspect
import multiprocessing.util
import os
import re
import socket
import subprocess
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

TIERS = ("pure", "server", "daemons", "cluster")  # lightest first: a test takes the heaviest it reaches
DESCRIPTIONS = {
    "pure": "in-process unit, golden and property tests: no subprocess, no listening socket (tests/tiers.py)",
    "server": "starts a process or a listening socket: the server, uvicorn, the fake API server, a child command",
    "daemons": "needs containerd, dockerd or a registry (harness/daemons.py)",
    "cluster": "needs the real control plane or node (harness/controlplane.py, harness/node.py)",
}

# Modules (and their submodules) by the tier a test that refers to them needs.
REACHES: dict[str, str] = {
    "harness.controlplane": "cluster",
    "harness.node": "cluster",
    "harness.node_setup": "cluster",
    "harness.kube_api": "cluster",
    "harness.daemons": "daemons",
    "harness.image_builds": "daemons",
    "harness.server_process": "server",
    "harness.fake_apiserver": "server",
    "harness.gotools": "server",  # a Go program run as a child
    "subprocess": "server",
    "multiprocessing": "server",
    "concurrent.futures.process": "server",
    "uvicorn": "server",
    "grpc": "server",
    "socketserver": "server",
    "http.server": "server",
    "webhook.preview.workers": "server",  # the preview's worker processes
    "webhook.web.relay.HumanApi": "server",  # uvicorn on a unix socket
}
# Methods only a server calls, on whatever object.
SERVING_METHODS = frozenset(
    {"listen", "create_server", "create_unix_server", "start_server", "start_unix_server", "serve_forever"}
)
# A request to these paths of the app starts a process (a preview is rendered in a worker process): a string
# naming one, in a test's code or among its parameters, makes it `server`.
SPAWNING_PATHS = re.compile(r"(?:^|\s)/preview\b")
# What those modules hold that starts nothing: builders of the objects the fake API server serves, the check
# that a program is on PATH.
STARTS_NOTHING = frozenset(
    {
        "harness.daemons.require",
        "harness.fake_apiserver.node",
        "harness.fake_apiserver.namespace",
        "harness.fake_apiserver.node_row",
        "harness.fake_apiserver.managed_fields",
    }
)
# Where a test's own helpers live: read like the test itself.
OWN = ("tests.",)


def _heaviest(tiers: Iterable[str]) -> str:
    return max(tiers, key=TIERS.index, default="pure")


def _tier_of(name: str) -> str:
    """The tier of a dotted name: its own entry, or that of the module it is in."""
    if name in STARTS_NOTHING:
        return "pure"
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        tier = REACHES.get(".".join(parts[:end]))
        if tier is not None:
            return tier
    return "pure"


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _functions(obj: Any) -> Iterator[types.FunctionType]:
    """The Python functions behind a test, a fixture, a helper or a class (its methods)."""
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        yield from (f for accessor in (obj.fget, obj.fset, obj.fdel) if accessor for f in _functions(accessor))
        return
    if inspect.ismethod(obj):
        obj = obj.__func__
    inner = getattr(getattr(obj, "hypothesis", None), "inner_test", None)
    if inner is not None:
        yield from _functions(inner)
    if isinstance(obj, types.FunctionType):
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None:
            yield from _functions(wrapped)
        yield obj
    elif inspect.isclass(obj):
        for member in vars(obj).values():
            yield from _functions(member)


class Reach:
    """The heaviest tier that code reaches, remembered per function (helpers are shared by many tests)."""

    def __init__(self) -> None:
        self._seen: dict[types.FunctionType, str] = {}

    def of(self, obj: Any) -> str:
        return _heaviest(self._function(f) for f in _functions(obj))

    def _function(self, function: types.FunctionType) -> str:
        if function not in self._seen:
            self._seen[function] = "pure"  # a cycle of helpers adds nothing
            self._seen[function] = _heaviest(
                self._instructions(code, function.__globals__, function.__doc__) for code in _codes(function.__code__)
            )
        return self._seen[function]

    def _instructions(self, code: types.CodeType, namespace: dict[str, Any], doc: str | None) -> str:
        strings = (const for const in code.co_consts if isinstance(const, str) and const != doc)
        tiers = ["server" for const in strings if SPAWNING_PATHS.search(const)]
        imported, whole = "", -1  # the module of the last import; where its tier is, until a name from it
        loaded = None  # the global loaded just before
        for instruction in dis.get_instructions(code):
            name = instruction.argval
            if instruction.opname == "IMPORT_NAME":
                imported, whole = name, len(tiers)
                tiers.append(_tier_of(name))
            elif instruction.opname == "IMPORT_FROM":
                tier = _tier_of(f"{imported}.{name}")  # `from m import x`: what x is, not all of m
                if whole >= 0:
                    tiers[whole], whole = tier, -1
                else:
                    tiers.append(tier)
            elif instruction.opname in {"LOAD_GLOBAL", "LOAD_NAME"}:
                loaded = namespace.get(name)
                tiers.append(self._global(loaded, name))
                continue
            elif instruction.opname in {"LOAD_ATTR", "LOAD_METHOD"}:
                if name in SERVING_METHODS:
                    tiers.append("server")
                elif inspect.ismodule(loaded):  # `module.attribute`: what the attribute is
                    tiers[-1] = _tier_of(f"{loaded.__name__}.{name}")
            loaded = None
        return _heaviest(tiers)

    def _global(self, obj: Any, name: str) -> str:
        if inspect.ismodule(obj):
            return _tier_of(obj.__name__)
        if not (inspect.isclass(obj) or isinstance(obj, types.FunctionType)):
            return "pure"
        module = getattr(obj, "__module__", None) or ""
        tier = _tier_of(f"{module}.{getattr(obj, '__name__', name)}")
        if tier == "pure" and module.startswith(OWN):
            return self.of(obj)
        return tier


def _fixture_functions(item: pytest.Item) -> Iterator[Callable[..., Any]]:
    info = getattr(item, "_fixtureinfo", None)
    for definitions in getattr(info, "name2fixturedefs", {}).values():
        for definition in definitions:
            if getattr(definition.func, "__module__", "").startswith(OWN):
                yield definition.func


def _parameters(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    values = list(getattr(callspec, "params", {}).values())
    while values:
        value = values.pop()
        if isinstance(value, str) and SPAWNING_PATHS.search(value):
            return "server"
        if isinstance(value, (tuple, list)):
            values.extend(value)
    return "pure"


def assign(items: list[pytest.Item]) -> None:
    """Mark every test with its tier (tests/conftest.py calls this at collection)."""
    reach = Reach()
    for item in items:
        written = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        if len(written) > 1:
            raise pytest.UsageError(f"{item.nodeid}: more than one tier marker ({', '.join(sorted(written))})")
        if written:
            continue
        function = getattr(item, "obj", None)
        tiers = [reach.of(function), *(reach.of(f) for f in _fixture_functions(item)), _parameters(item)]
        item.add_marker(_heaviest(tiers))


class Started(Exception):
    """A `pure` test started a process or listened on a socket."""


@contextmanager
def held_pure(nodeid: str) -> Iterator[list[str]]:
    """While a `pure` test runs, starting a process or listening on a socket raises `Started` (and is
    recorded, for what a background thread starts)."""
    started: list[str] = []

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            started.append(what)
            raise Started(f"{nodeid} is marked pure but {what}: give it its tier (tests/tiers.py)")

        return refused

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refuse("started a subprocess"))
        patch.setattr(os, "fork", refuse("forked"))
        patch.setattr(os, "posix_spawn", refuse("spawned a process"))
        patch.setattr(os, "posix_spawnp", refuse("spawned a process"))
        patch.setattr(multiprocessing.util, "spawnv_passfds", refuse("spawned a process"))
        patch.setattr(socket.socket, "listen", refuse("listened on a socket"))
        yield started


class TierGuard:
    """A pytest plugin (registered by tests/conftest.py): holds each `pure` test to its tier while its
    fixtures are set up and while it runs."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        return (yield from self._held(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        return (yield from self._held(item))

    def _held(self, item: pytest.Item) -> Iterator[None]:
        if item.get_closest_marker("pure") is None:
            return (yield)
        with held_pure(item.nodeid) as started:
            result = yield
        if started:
            pytest.fail(f"{item.nodeid} is marked pure but {started[0]}: give it its tier (tests/tiers.py)")
        return result
