"""What the mutation core raises: a pod it cannot read (answered 400 by /preview, per failurePolicy at
admission), and a well-formed pod for which no safe decision exists (per failurePolicy)."""

from __future__ import annotations


class PodShapeError(ValueError):
    """The object is not a Pod we can read; the message names the field and what was expected."""


class Undecidable(Exception):
    """A well-formed pod for which no safe decision exists; handled per failurePolicy."""
