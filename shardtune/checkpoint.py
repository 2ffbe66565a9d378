"""Writing outputs without ever leaving them half-written (DESIGN principle 5)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

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


def cast_to_model_dtype(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Save in the dtype the model was loaded in (config.dtype), not silently in the fp32 of master weights."""
    dtype = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        return state_dict
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}


def save_hf_model(model: nn.Module, state_dict: dict[str, torch.Tensor], tokenizer, out_dir: Path) -> None:
    """Rank 0: write a plain Hugging Face directory (config.json, safetensors, tokenizer) into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out_dir, "model")
    model.save_pretrained(staging, state_dict=cast_to_model_dtype(state_dict, model), safe_serialization=True)
    tokenizer.save_pretrained(staging)
    publish_dir(staging, out_dir)
