"""Speed features that keep the numbers: --use_fast_kernels (llama-cookbook's name) and --compile.

Both are applied to the bare Hugging Face model after it is built and before a strategy wraps it, and both
change how a layer computes, never what: tests compare their losses with the default path on CPU. So is the
padding-free attention that packing and --padding_free need (shardtune.model.attention).

- fast kernels: attention through flash-attention 2 when ``flash_attn`` imports and the model is on CUDA, else
  PyTorch SDPA (the default already); on CUDA, liger-kernel's fused RMSNorm / SwiGLU / RoPE when installed
  (``pip install shardtune[fast]``). Its fused linear cross-entropy is not used: the lean loss already avoids
  full logits. On CPU nothing faster than SDPA exists, which is said once.
- compile: ``torch.compile`` of each decoder layer's forward. The layer object and its parameter names stay
  as they are (checkpoints and exports do not change), and wrappers' hooks on the layer (FSDP2, activation
  checkpointing) stay outside the compiled region.
"""

from __future__ import annotations

import importlib.util
import inspect

import torch
from torch import nn

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.batching import flattened
from shardtune.model.attention import avoid_cudnn_attention, soft_caps_logits, use_varlen_attention
from shardtune.model.loss import hf_model
from shardtune.model.structure import layer_list
from shardtune.runtime.distributed import print0


def apply_speed_features(model: nn.Module, cfg: TrainConfig, device: torch.device, say: bool = True) -> list[str]:
    """Apply what the config asks for; returns (and rank 0 prints, with ``say``) one line per feature applied."""
    applied: list[str] = [note] if (note := avoid_cudnn_attention(device)) else []
    if cfg.model.fast_kernels:
        applied += apply_fast_kernels(model, device)
    if cfg.model.attn_implementation:
        applied.append(apply_attention_choice(hf_model(model), cfg.model.attn_implementation))
    if flattened(cfg):
        applied.append(use_varlen_attention(hf_model(model), eager=cfg.model.attn_implementation == "eager"))
    if cfg.model.compile:
        applied.append(compile_decoder_layers(model))
    for line in applied if say else ():
        print0(f"speed: {line}")
    return applied


def apply_attention_choice(model: nn.Module, choice: str) -> str:
    """--attn_implementation (TRL's flag): the model's attention function as asked (check_attn_implementation and
    check_attention_fits refused what cannot run before launch)."""
    model.set_attn_implementation(choice)
    return f"attention: {choice} (--attn_implementation)"


def check_attention_fits(cfg: TrainConfig, config) -> None:
    """Before launch, with the model's config: a kernel that cannot compute the model's attention is one line."""
    if cfg.model.attn_implementation in ("", "eager"):
        return
    if soft_caps_logits(config):
        raise ConfigError(
            f"--attn_implementation {cfg.model.attn_implementation} cannot compute {config.model_type}'s "
            "soft-capped attention logits: pass --attn_implementation eager, or drop the flag"
        )


def check_attn_implementation(cfg: TrainConfig, world_size: int) -> None:
    if cfg.model.attn_implementation != "flash_attention_2":
        return
    if importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            "--attn_implementation flash_attention_2 needs the flash-attn package (pip install "
            "flash-attn, CUDA): install it, or drop the flag (SDPA)"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            "--attn_implementation flash_attention_2 needs CUDA GPUs, and this machine has none: drop the flag (SDPA)"
        )


def apply_fast_kernels(model: nn.Module, device: torch.device) -> list[str]:
    if device.type != "cuda":
        return [
            "fast kernels: on CPU the fastest attention is PyTorch SDPA (already in use); flash-attention and "
            "liger-kernel need CUDA"
        ]
    notes = []
    if importlib.util.find_spec("flash_attn") is not None:
        model.set_attn_implementation("flash_attention_2")
        notes.append("attention: flash-attention 2")
    else:
        notes.append("attention: PyTorch SDPA (flash_attn is not installed)")
    notes.append(apply_liger(model))
    return notes


def apply_liger(model: nn.Module) -> str:
    if importlib.util.find_spec("liger_kernel") is None:
        return "fused kernels: none (liger-kernel is not installed: pip install 'shardtune[fast]')"
    import liger_kernel.transformers as liger

    model_type = model.config.model_type
    patch = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
    if patch is None:
        return f"fused kernels: none (liger-kernel has no kernels for model type {model_type!r})"
    wanted = dict(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model
    )
    accepted = inspect.signature(patch).parameters
    patch(**{k: v for k, v in wanted.items() if k in accepted})
    return "fused kernels: liger-kernel RMSNorm, SwiGLU, RoPE"


def compile_decoder_layers(model: nn.Module) -> str:
    layers = layer_list(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=None)
    return f"torch.compile of each of the {len(layers)} decoder layers"
