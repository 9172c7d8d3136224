"""Image globs (copilot.imagePatterns, imagePuller.images and exclude): one compiled matcher per pattern
set, kept, since settings change only at a reload."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from functools import lru_cache

CACHED_LENGTH = 512  # longer texts are matched each time: a cache of them could hold megabytes


def _never(_text: str) -> bool:
    return False


@lru_cache(maxsize=64)
def glob_matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """A function telling whether a whole string matches any of the globs (`*` spans `/` too); never
    matches without patterns. Answers are kept per matcher: the same images come with every pod."""
    if not patterns:
        return _never
    match = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match

    @lru_cache(maxsize=4096)
    def cached(text: str) -> bool:
        return match(text) is not None

    def matches(text: str) -> bool:
        return cached(text) if len(text) <= CACHED_LENGTH else match(text) is not None

    return matches
