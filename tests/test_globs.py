"""The one glob matcher behind copilot.imagePatterns and imagePuller.images/exclude."""

from __future__ import annotations

import pytest

from webhook.globs import glob_matcher


@pytest.mark.parametrize(
    ("patterns", "image", "matches"),
    [
        (("*/flyteorg/flytecopilot:*",), "cr.flyte.org/flyteorg/flytecopilot:v1.15.3", True),
        (("*/flyteorg/flytecopilot:*",), "cr.flyte.org/flyteorg/flytecopilot@sha256:ab", False),
        (("*",), "registry:5000/a/b/c:1", True),  # * spans path separators
        (("docker.io/library/python:3.1?",), "docker.io/library/python:3.11", True),
        (("docker.io/library/python:3.1?",), "docker.io/library/python:3.111", False),  # the whole string
        (("a:*", "b:*"), "b:1", True),
        ((), "anything", False),  # no patterns match nothing
    ],
)
def test_globs_match_whole_references(patterns: tuple[str, ...], image: str, matches: bool) -> None:
    assert bool(glob_matcher(patterns)(image)) is matches


def test_one_compiled_matcher_per_pattern_set() -> None:
    assert glob_matcher(("x:*",)) is glob_matcher(("x:*",))


def test_answers_are_kept_for_image_sized_strings_only() -> None:
    """Pod authors choose the strings: a megabyte image name, matched, must not stay in memory."""
    import gc
    import tracemalloc

    matcher = glob_matcher(("huge:*",))
    assert matcher("huge:1") is True
    assert matcher("huge:" + "a" * 600) is True
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(50):
            assert matcher(f"huge:{i}" + "a" * 1_000_000) is True
            assert matcher(f"other:{i}" + "a" * 1_000_000) is False
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 1_000_000, f"{kept} bytes kept after matching 100 MB of names"
