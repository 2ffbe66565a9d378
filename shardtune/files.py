"""Durable writes: what a power cut may not take back. (Future home: runtime/files.py, with staging_dir,
publish_dir and write_text_atomic.)

A rename is atomic, but only durable once the renamed file's data and the folder's entry are on disk: without an
fsync of the file before the rename and of its folder after it, a power cut can leave the new name pointing at an
empty or truncated file (what ext4 and xfs do with delayed allocation).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """The folder's entries (names created, renamed or removed in it); some file systems refuse it: then the data
    is as durable as they make it."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file and folder below ``root`` (and root itself)."""
    for folder, _dirs, names in os.walk(root):
        for name in names:
            fsync_file(Path(folder) / name)
        fsync_dir(Path(folder))
