"""A model as a Hugging Face directory (config.json, safetensors, tokenizer), published atomically."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from shardtune.runtime.files import publish_dir, staging_dir


def cast_to_model_dtype(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Save in the dtype the model was loaded in (config.dtype), not silently in the fp32 of master weights."""
    dtype = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        return state_dict
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}


def save_hf_model(model: nn.Module, state_dict: dict[str, torch.Tensor], tokenizer, out_dir: Path) -> list[str]:
    """Rank 0: write a plain Hugging Face directory (config.json, safetensors, tokenizer) into out_dir; returns the
    names of the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out_dir, "model")
    state_dict = cast_to_model_dtype(state_dict, model)
    written = {t.dtype for t in state_dict.values() if t.is_floating_point()}  # save_pretrained empties the dict
    with already_unwrapped():
        model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
    state_config_dtype(staging / "config.json", written)
    tokenizer.save_pretrained(staging)
    return publish_dir(staging, out_dir)


@contextlib.contextmanager
def already_unwrapped() -> Iterator[None]:
    """``save_pretrained`` first unwraps the model through accelerate, which imports DeepSpeed (when it is installed,
    ~0.7 s and a "Setting accelerator to CPU" warning on CPU) only to test the model against DeepSpeed's engine
    class. Our callers hand over the unwrapped model, so for the call transformers' ``unwrap_model`` is the
    identity; a transformers without that name is left as it is."""
    import transformers.modeling_utils as modeling_utils

    original = getattr(modeling_utils, "unwrap_model", None)
    if original is None:
        yield
        return
    modeling_utils.unwrap_model = lambda model, *args, **kwargs: model
    try:
        yield
    finally:
        modeling_utils.unwrap_model = original


def state_config_dtype(config_path: Path, written: set[torch.dtype]) -> None:
    """config.json's ``dtype`` names the dtype of the floating-point weights written, so ``from_pretrained`` loads
    them as they are (transformers writes the dtype of the model object, fp32 master weights, whatever was saved)."""
    import json

    if len(written) != 1:
        return
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["dtype"] = str(next(iter(written))).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
