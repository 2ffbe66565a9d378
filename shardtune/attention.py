"""Padding-free ("varlen") attention for flattened micro-batches.

A flattened micro-batch is one row holding all its examples back to back, with no pad token anywhere: positions
restart at 0 at each example and ``cu_seq_lens`` (cumulative lengths, ``[0, n1, n1 + n2, ...]``) marks where each
starts. Every linear layer then computes on real tokens only, and attention must stay inside each example. That
is what the attention function registered here as ``shardtune_varlen`` does, with the cost of sum(n_i^2)
rather than the (sum n_i)^2 of a block-diagonal mask:

- CUDA, fp16 / bf16: ``torch.nn.attention.varlen.varlen_attn``, the FlashAttention varlen kernel shipped in torch;
- otherwise (CPU, fp32, dropout): one causal SDPA call per example, on a view of the row (no copy, no mask).

Models whose attention is flash-attention 2/3 (``--use_fast_kernels`` with flash_attn installed) keep it:
transformers passes the same ``cu_seq_lens_*`` / ``max_length_*`` keywords to flash_attn_varlen_func itself.

Batches with a 2-D padding mask (evaluation, generation) go through plain SDPA as before, and an unpadded row
whose positions restart without ``cu_seq_lens`` (someone else's packed input) gets its boundaries from
``position_ids``, so the registered function is correct for every input, not only for shardtune's batches.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

VARLEN = "shardtune_varlen"
NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3")  # transformers runs these varlen from the same keywords


def varlen_kwargs(batch: dict[str, torch.Tensor]) -> dict:
    """The model keywords of a flattened micro-batch (empty for a padded one)."""
    if "cu_seq_lens" not in batch:
        return {}
    cu, longest = batch["cu_seq_lens"], int(batch["max_length"])
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def use_varlen_attention(model: nn.Module) -> str:
    """Make ``model`` (a bare Hugging Face model) attend within examples of a flattened row; returns a note."""
    current = model.config._attn_implementation
    if current in NATIVE_VARLEN:
        return f"padding-free batches: attention stays {current} (varlen from cu_seq_lens)"
    register()
    model.set_attn_implementation(VARLEN)
    return "padding-free batches: attention within each example (FlashAttention varlen on CUDA, SDPA per example " \
           "otherwise)"


@functools.cache
def register() -> None:
    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, varlen_mask)


def varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask for an unpadded row (the attention function finds the examples itself); SDPA's mask otherwise."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def varlen_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function contract: q (B, H, T, D), k / v (B, H_kv, S, D) -> (B, T, H, D)."""
    cu = kwargs.get("cu_seq_lens_q")
    position_ids = kwargs.get("position_ids")
    if attention_mask is None and cu is None and query.shape[2] == key.shape[2] > 1 and position_ids is not None:
        positions = position_ids.expand(query.shape[0], -1)
        if query.shape[0] > 1 and bool((positions[:, 1:] == 0).any()):  # several packed rows: one at a time
            rows = [varlen_attention_forward(module, query[b:b + 1], key[b:b + 1], value[b:b + 1], None, dropout,
                                             scaling, is_causal, position_ids=positions[b:b + 1])[0]
                    for b in range(query.shape[0])]
            return torch.cat(rows), None
        cu = _boundaries_from_positions(positions)
    num_prefix = key.shape[2] - query.shape[2]
    if attention_mask is None and cu is not None and num_prefix > 0 and query.shape[0] == 1:
        return _per_example_after_prefix(query, key, value, cu, num_prefix, dropout if module.training else 0.0,
                                         scaling), None
    if attention_mask is not None or cu is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if query.shape[0] != 1:  # cu_seq_lens index one row: batches of several rows are flattened first
        raise ValueError(f"cu_seq_lens describe one flattened row, but the batch has {query.shape[0]} rows: put the "
                         "examples in one row (shardtune.data.batching.collate_flat)")
    max_length = kwargs.get("max_length_q")
    if max_length is None:
        max_length = int(cu.diff().max())
    dtype = _compute_dtype(query)
    if _kernel_applies(query.device, dtype, dropout if module.training else 0.0):
        query, key, value = (t.to(dtype) for t in (query, key, value))  # what SDPA's autocast would do
        return _flash_varlen(query, key, value, cu, int(max_length), scaling), None
    return _per_example(module, query, key, value, cu, dropout if module.training else 0.0, scaling), None


def _boundaries_from_positions(positions: torch.Tensor) -> torch.Tensor | None:
    """cu_seq_lens of one row whose positions restart at each example, or None when it is a single sequence."""
    if positions.shape[0] != 1:
        return None
    starts = torch.nonzero(positions[0] == 0).flatten()
    if starts.numel() <= 1 or int(starts[0]) != 0:
        return None
    end = torch.tensor([positions.shape[1]], device=positions.device)
    return torch.cat([starts, end]).to(torch.int32)


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's (DDP mixed precision: rotary leaves q, k in fp32), else q's."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def _kernel_applies(device: torch.device, dtype: torch.dtype, dropout: float) -> bool:
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and dropout == 0.0
            and _torch_varlen() is not None)


@functools.cache
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _torch_varlen_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(_torch_varlen()).parameters)


def _flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, max_length: int,
                  scaling: float | None) -> torch.Tensor:
    varlen_attn, accepted = _torch_varlen(), _torch_varlen_parameters()
    cu = cu.to(device=query.device, dtype=torch.int32)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    causal = {"is_causal": True} if "is_causal" in accepted else {"window_size": (-1, 0)}  # older torch: is_causal
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in accepted:
            causal["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q, k, v, cu, cu, max_length, max_length, scale=scaling, **causal)
    return out.unsqueeze(0)  # (1, T, H, D)


@torch.compiler.disable  # a loop over data-dependent boundaries: run eagerly inside a compiled layer
def _per_example(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor,
                 dropout: float, scaling: float | None) -> torch.Tensor:
    gqa = {}
    if key.shape[1] != query.shape[1]:
        if use_gqa_in_sdpa(None, key, value):
            gqa = {"enable_gqa": True}
        else:
            groups = query.shape[1] // key.shape[1]
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    bounds = cu.tolist()
    outputs = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout,
                                              is_causal=True, scale=scaling, **gqa)
               for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


@torch.compiler.disable
def _per_example_after_prefix(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor,
                              num_prefix: int, dropout: float, scaling: float | None) -> torch.Tensor:
    """Prefix tuning on a flattened row: peft puts the learned prefix in the cache, so the first ``num_prefix``
    keys / values are the prefix and the rest is the row. Each example's queries attend to the whole prefix and
    causally to their own example (keys: num_prefix + n), as that example alone with its prefix does."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    prefix_key, prefix_value = key[:, :, :num_prefix], value[:, :, :num_prefix]
    bounds = cu.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        own = slice(num_prefix + start, num_prefix + end)
        allowed = torch.ones(end - start, num_prefix + end - start, dtype=torch.bool, device=query.device)
        allowed[:, num_prefix:].tril_()
        outputs.append(F.scaled_dot_product_attention(
            query[:, :, start:end], torch.cat([prefix_key, key[:, :, own]], dim=2),
            torch.cat([prefix_value, value[:, :, own]], dim=2), attn_mask=allowed, dropout_p=dropout, scale=scaling))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()
