"""Writing files and folders without ever leaving them half-written (DESIGN principle 5): a folder is staged
under a temporary name and published by renames, the files that make it loadable last."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Written last when publishing a model directory: without it the directory does not load as a model.
LAST_FILES = ("config.json", "adapter_config.json")


def staging_dir(out_dir: Path, what: str) -> Path:
    path = out_dir / f".staging-{what}-{os.getpid()}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def remove_stale_staging(out_dir: Path) -> None:
    """Drop what an interrupted save left behind: staging folders are never part of a published model."""
    for path in out_dir.glob(".staging-*"):
        shutil.rmtree(path, ignore_errors=True)


def publish_dir(staging: Path, out_dir: Path) -> None:
    """Move every file of ``staging`` into ``out_dir`` by atomic renames, the loadability-defining files last."""
    names = sorted(os.listdir(staging), key=lambda n: (n in LAST_FILES, n))
    for name in names:
        src, dst = staging / name, out_dir / name
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        os.replace(src, dst)
    staging.rmdir()


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
