"""Training FLOPs per token and the peak the hardware reaches: the one place MFU is computed from.

MFU = achieved model FLOP/s / peak FLOP/s, where the peak is *measured* on this machine (a large matmul in the
compute dtype: fp32 on CPU, bf16 on GPU) rather than read from a data sheet, so that CPU and GPU figures mean
the same thing: the fraction of the matmul rate this device actually sustains that training turns into model
FLOPs.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.loss import SEQUENCE_LAYOUT


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_matmul_params: int     # every parameter a token is multiplied by: all but the input embedding table
    num_trainable_params: int  # the trainable ones among those (all of them in full fine-tuning)


def model_shape(model: nn.Module) -> ModelShape:
    """Read the shape from the Hugging Face model inside any DDP / FSDP2 / PEFT wrapping."""
    from shardtune.loss import hf_model

    inner = hf_model(model)
    config = inner.config
    embedding = inner.get_input_embeddings().weight
    head = inner.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    matmul = [p for p in model.parameters() if tied or p is not embedding]
    def numel(p: torch.Tensor) -> int:  # DeepSpeed ZeRO-3 partitions a parameter in place; ds_numel is its size
        return getattr(p, "ds_numel", None) or p.numel()

    return ModelShape(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                      num_matmul_params=sum(numel(p) for p in matmul),
                      num_trainable_params=sum(numel(p) for p in matmul if p.requires_grad))


def training_flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """Model FLOPs of one training token (forward + backward) at sequence length ``seq_len``.

    flops = 6 N + 12 L d T   (all parameters trainable)
          = 4 N + 2 N_trainable + 12 L d T   (in general)

    N: parameters a token is multiplied by (the input embedding is a lookup, not a matmul; a tied head counts),
    L: layers, d: hidden size, T: sequence length. Each matmul parameter costs 2 FLOPs forward, 2 backward for
    the activation gradient, and 2 more for its own gradient when it is trained. Attention scores and their
    weighted sum cost 4 L d T forward and twice that backward. This is the formula of PaLM (Chowdhery et al.
    2022, appendix B: 6N + 12 L H Q T with H Q = d), which counts the full T x T attention even under a causal
    mask, as do the usual MFU reports; frozen weights (PEFT) skip their weight-gradient 2 N.
    """
    attention = 12 * shape.num_layers * shape.hidden_size * seq_len
    return 4 * shape.num_matmul_params + 2 * shape.num_trainable_params + attention


def num_input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens the model computes on: every token of a padding-free row, the non-pad tokens of a padded batch."""
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return int(mask.sum())
    return int(batch["input_ids"].numel())


def micro_batch_flops(shape: ModelShape, batch: dict[str, torch.Tensor]) -> int:
    """Model FLOPs of training on one micro-batch: per token of each sequence the model attends over.

    A padding-free row counts each example at its own length (its attention never spans the row); a padded
    batch counts its non-pad tokens at the padded length, as the kernels compute it.
    """
    if "cu_seq_lens" in batch:
        lengths = batch["cu_seq_lens"].diff().tolist()
        return sum(training_flops_per_token(shape, n) * n for n in lengths)
    if SEQUENCE_LAYOUT in batch:  # a slice of a row split over ranks: its share of the whole row's FLOPs
        boundaries = batch[SEQUENCE_LAYOUT].cu_seq_lens
        whole = sum(training_flops_per_token(shape, n) * n for n in boundaries.diff().tolist())
        return whole * batch["input_ids"].size(1) // int(boundaries[-1])
    return training_flops_per_token(shape, batch["input_ids"].size(1)) * num_input_tokens(batch)


PEAK_DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}


@functools.cache
def measured_peak_flops(device_str: str, size: int | None = None, seconds: float = 0.15) -> float:
    """The matmul FLOP/s this process reaches on ``device`` in its compute dtype: best of short timed bursts.

    Measured once per process (cached), in well under a second. CPU: fp32 1024 x 1024 with the threads this
    process has (the same rate as 2048 x 2048 on the 2-core test machine, 4x sooner); GPU: bf16 8192 x 8192. The
    best burst is taken, so that a neighbour's load lowers the estimate as little as possible.
    """
    device = torch.device(device_str)
    size = size or (8192 if device.type == "cuda" else 1024)
    dtype = PEAK_DTYPES.get(device.type, torch.float32)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        start = time.perf_counter()
        for _ in range(2):
            a @ b
        sync()
        best = max(best, 2 * 2 * size ** 3 / (time.perf_counter() - start))
    return best
