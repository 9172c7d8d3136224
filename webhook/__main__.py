"""Composition root: `python -m webhook` and the `copilot-webhook` console script."""

from __future__ import annotations

import sys

from webhook.cli import main as _main


def main() -> None:
    sys.exit(_main())


if __name__ == "__main__":
    main()
