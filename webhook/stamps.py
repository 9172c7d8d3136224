"""What tells a file changed on disk, for the files reloaded in place (certificates, the configuration,
the agent's CA bundle). Kubernetes updates a mounted Secret or ConfigMap by swapping a symlink, so a change
shows as a new inode, size or mtime of the file the path resolves to."""

from __future__ import annotations

import os

Stamp = tuple[int, int, int]
MISSING: Stamp = (-1, -1, -1)


def file_stamp(*paths: str | None) -> tuple[Stamp, ...]:
    """Each path's (inode, size, mtime in ns), MISSING where it cannot be read; None paths are left out."""
    stamps = []
    for path in paths:
        if path is None:
            continue
        try:
            st = os.stat(path)
        except OSError:
            stamps.append(MISSING)
        else:
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)
