"""Image globs (copilot.imagePatterns, imagePuller.images and exclude): one compiled matcher per pattern
set, kept, since settings change only at a reload."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from functools import lru_cache


def _never(_text: str) -> None:
    return None


@lru_cache(maxsize=64)
def glob_matcher(patterns: tuple[str, ...]) -> Callable[[str], re.Match[str] | None]:
    """A function matching a whole string against any of the globs (`*` spans `/` too); never matches
    without patterns."""
    if not patterns:
        return _never
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match
