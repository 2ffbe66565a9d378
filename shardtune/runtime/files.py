"""Writing files and folders without ever leaving them half-written (docs/architecture.md, principle 5): a folder is
staged under a temporary name and published by renames, the files that make it loadable last."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

# Written last when publishing a model directory: without it the directory does not load as a model.
LAST_FILES = ("config.json", "adapter_config.json")
# What a loader reads as the model in a published directory (a full model or a PEFT adapter): when a new model is
# published, those of an earlier one that the new one does not replace are removed (a full fine-tune over a LoRA
# run's directory must not leave adapter_config.json behind, which from_pretrained would apply to the new weights).
MODEL_FILE_PATTERNS = (
    "config.json",
    "adapter_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "adapter_model.bin",
    "*.bin.index.json",
    "generation_config.json",
)


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


def publish_dir(staging: Path, out_dir: Path) -> list[str]:
    """Move every file of ``staging`` into ``out_dir`` by atomic renames, durably, the loadability-defining files
    last. An earlier model's loader-visible files that the new one does not replace go first (its config.json /
    adapter_config.json before its weights), so at no moment does the directory load as a mix of the two. Returns the
    names published (what a loader of the directory reads, what --push_to_hub uploads)."""
    fsync_tree(staging)
    names = sorted(os.listdir(staging), key=lambda n: (n in LAST_FILES, n))
    stale = {p.name for pattern in MODEL_FILE_PATTERNS for p in out_dir.glob(pattern) if p.is_file()} - set(names)
    for name in sorted(stale, key=lambda n: (n not in LAST_FILES, n)):
        (out_dir / name).unlink()
    if stale:
        fsync_dir(out_dir)
    for name in names:
        src, dst = staging / name, out_dir / name
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        os.replace(src, dst)
    staging.rmdir()
    fsync_dir(out_dir)
    return names


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Written to a temporary name, fsynced and renamed: readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


# A rename is atomic, but only durable once the renamed file's data and the folder's entry are on disk: without an
# fsync of the file before the rename and of its folder after it, a power cut can leave the new name pointing at an
# empty or truncated file (what ext4 and xfs do with delayed allocation).
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
