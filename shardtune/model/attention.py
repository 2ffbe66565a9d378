"""Padding-free ("varlen") attention for flattened micro-batches.

A flattened micro-batch is one row holding all its examples back to back, with no pad token anywhere: positions
restart at 0 at each example and ``cu_seq_lens`` (cumulative lengths, ``[0, n1, n1 + n2, ...]``) marks where each
starts. Every linear layer then computes on real tokens only, and attention must stay inside each example. That
is what the attention function registered here as ``shardtune_varlen`` does, with the cost of sum(n_i^2)
rather than the (sum n_i)^2 of a block-diagonal mask:

- CUDA, fp16 / bf16: ``torch.nn.attention.varlen.varlen_attn``, the FlashAttention varlen kernel shipped in torch
  (its arguments are built by :func:`flash_varlen_arguments`, which a CPU test feeds to a reference);
- otherwise (CPU, fp32, dropout, soft-capped logits): one causal SDPA call per example, on a view of the row (no
  copy, no mask), or the eager formula where the model soft-caps its attention logits (Gemma 2).

A layer's sliding window (Mistral, Qwen2, Phi-3, the sliding layers of Gemma 2/3) is honoured on each path: a
banded causal mask for an example longer than the window, ``window_size`` on the kernel.

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
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

VARLEN = "shardtune_varlen"
VARLEN_EAGER = (
    "shardtune_varlen_eager"  # the same, each example's attention by the eager formula (--attn_implementation eager)
)
NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3")  # transformers runs these varlen from the same keywords


def varlen_kwargs(batch: dict[str, torch.Tensor]) -> dict:
    """The model keywords of a flattened micro-batch (empty for a padded one)."""
    if "cu_seq_lens" not in batch:
        return {}
    cu, longest = batch["cu_seq_lens"], int(batch["max_length"])
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def attention_implementation(config: PretrainedConfig) -> str:
    """The attention shardtune loads a model with: SDPA, or eager where SDPA cannot compute the model's attention
    (attention-logit soft-capping, as in Gemma 2; a model class without SDPA support)."""
    if soft_caps_logits(config):
        return "eager"
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "eager" if model_class is not None and not model_class._supports_sdpa else "sdpa"


def soft_caps_logits(config: PretrainedConfig) -> bool:
    """Whether the model soft-caps its attention logits (Gemma 2): only the eager formula computes that."""
    return getattr(config.get_text_config(), "attn_logit_softcapping", None) is not None


def use_varlen_attention(model: nn.Module, eager: bool = False) -> str:
    """Make ``model`` (a bare Hugging Face model) attend within examples of a flattened row; returns a note.
    ``eager``: each example's attention by the eager formula (softmax(q k^T) v), as --attn_implementation eager asks."""
    current = model.config._attn_implementation
    if current in NATIVE_VARLEN:
        return f"padding-free batches: attention stays {current} (varlen from cu_seq_lens)"
    register()
    model.set_attn_implementation(VARLEN_EAGER if eager else VARLEN)
    if eager:
        return "padding-free batches: attention within each example, by the eager formula (--attn_implementation eager)"
    return (
        "padding-free batches: attention within each example (FlashAttention varlen on CUDA, SDPA per example "
        "otherwise)"
    )


@functools.cache
def register() -> None:
    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, varlen_mask)
    AttentionInterface.register(VARLEN_EAGER, functools.partial(varlen_attention_forward, eager=True))
    AttentionMaskInterface.register(VARLEN_EAGER, varlen_mask)


def varlen_mask(*args, **kwargs):
    """No mask for an unpadded row (the attention function finds its examples and applies causality and the
    sliding window itself); SDPA's mask otherwise (padding; decoding after a cache, where keys outnumber queries)."""
    if kwargs.get("attention_mask") is None and kwargs.get("q_length") == kwargs.get("kv_length"):
        return None
    return sdpa_mask(*args, **kwargs)


def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    eager: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function contract: q (B, H, T, D), k / v (B, H_kv, S, D) -> (B, T, H, D).

    The layer's ``sliding_window`` (Mistral, Qwen2, Gemma 2/3 sliding layers: a query sees itself and the
    ``sliding_window - 1`` keys before it) and attention-logit ``softcap`` (Gemma 2) keywords are honoured on
    every path.
    """
    cu = kwargs.get("cu_seq_lens_q")
    position_ids = kwargs.get("position_ids")
    if attention_mask is None and cu is None and query.shape[2] == key.shape[2] > 1 and position_ids is not None:
        positions = position_ids.expand(query.shape[0], -1)
        if query.shape[0] > 1 and bool((positions[:, 1:] == 0).any()):  # several packed rows: one at a time
            return _each_row(module, query, key, value, dropout, scaling, is_causal, eager, positions, kwargs), None
        cu = _boundaries_from_positions(positions)
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    dropout = dropout if module.training else 0.0
    num_prefix = key.shape[2] - query.shape[2]
    # prefix tuning on a flattened row: the mask transformers builds for keys outnumbering queries is one causal mask
    # over the whole row, which would let examples see each other; the row's boundaries decide instead
    if kwargs.get("cu_seq_lens_q") is not None and num_prefix > 0 and query.shape[0] == 1:
        return _per_example_after_prefix(query, key, value, cu, num_prefix, dropout, scaling, eager), None
    if attention_mask is not None or query.shape[2] != key.shape[2]:  # padded batches: the mask holds the window
        if softcap is None and not eager:
            return sdpa_attention_forward(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                is_causal=is_causal,
                **kwargs,
            )
        return _attend(query, key, value, attention_mask, dropout, scaling, window, softcap, eager).transpose(
            1, 2
        ), None
    if cu is None:  # plain sequences (one per row): each row is one example
        cu = torch.tensor([0, query.shape[2]], dtype=torch.int32)
    elif query.shape[0] != 1:  # cu_seq_lens index one row: batches of several rows are flattened first
        raise ValueError(
            f"cu_seq_lens describe one flattened row, but the batch has {query.shape[0]} rows: put the "
            "examples in one row (shardtune.data.batching.collate_flat)"
        )
    max_length = kwargs.get("max_length_q")
    if max_length is None:
        max_length = int(cu.diff().max())
    dtype = _compute_dtype(query)
    if query.shape[0] == 1 and softcap is None and not eager and _kernel_applies(query.device, dtype, dropout):
        cast = [t.to(dtype) for t in (query, key, value)]  # what SDPA's autocast would do
        arguments = flash_varlen_arguments(*cast, cu, int(max_length), scaling, window)
        if arguments is not None:  # else this torch's kernel cannot express the window: per example below
            args, options = arguments
            return _torch_varlen()(*args, **options).unsqueeze(0), None  # (1, T, H, D)
    return _per_example(query, key, value, cu, dropout, scaling, window, softcap, eager), None


def _each_row(module, query, key, value, dropout, scaling, is_causal, eager, positions, kwargs) -> torch.Tensor:
    """varlen_attention_forward of packed rows, one row at a time (each row's examples from its positions)."""
    others = {k: v for k, v in kwargs.items() if k != "position_ids"}
    rows = [
        varlen_attention_forward(
            module,
            query[b : b + 1],
            key[b : b + 1],
            value[b : b + 1],
            None,
            dropout,
            scaling,
            is_causal,
            eager,
            position_ids=positions[b : b + 1],
            **others,
        )[0]
        for b in range(query.shape[0])
    ]
    return torch.cat(rows)


def avoid_cudnn_attention(device: torch.device) -> str | None:
    """On CUDA, turn off PyTorch SDPA's cuDNN backend for this process (SDPA then picks FlashAttention or the
    memory-efficient kernel, as it did before cuDNN's was added). cuDNN attention builds an execution plan for each
    new (batch, length) shape, and padded batches have a new shape almost every step. Measured on an H200 (torch
    2.11, cu130, the demo model, batches of 8 padded dialogues): 2.3-4.1 s for a step with a new shape and
    ~250 ms for the others, against 45-65 ms with the backend off. Returns the start log's line, None off CUDA."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return None
    torch.backends.cuda.enable_cudnn_sdp(False)
    return (
        "attention: PyTorch SDPA without its cuDNN backend (it builds a plan per new batch shape; "
        "flash / memory-efficient kernels instead)"
    )


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
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and dropout == 0.0
        and _torch_varlen() is not None
    )


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


def flash_varlen_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    max_length: int,
    scaling: float | None,
    sliding_window: int | None,
    accepted: frozenset[str] | None = None,
) -> tuple[tuple, dict] | None:
    """The arguments of torch's FlashAttention ``varlen_attn`` for one flattened row (q (1, H, T, D), k / v
    (1, H_kv, T, D)): ``(args, keywords)``, or None when a kernel taking only ``accepted`` keywords (the installed
    one's by default) cannot express the window. Built apart from the call so that a CPU test can feed them to a
    reference with the same semantics.

    Flash's ``window_size=(left, right)`` lets query i see keys i - left .. i + right of its own sequence (-1:
    unbounded), so causal is (-1, 0) and transformers' sliding window (key j seen when i - j < sliding_window)
    is (sliding_window - 1, 0).
    """
    accepted = _torch_varlen_parameters() if accepted is None else accepted
    cu = cu.to(device=query.device, dtype=torch.int32)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    options: dict = {"scale": scaling}
    if _window_bites(sliding_window, max_length):
        if "window_size" not in accepted:
            return None
        options["window_size"] = (sliding_window - 1, 0)
    elif "is_causal" in accepted:  # older torch
        options["is_causal"] = True
    else:
        options["window_size"] = (-1, 0)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in accepted:
            options["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return (q, k, v, cu, cu, max_length, max_length), options


def _window_bites(sliding_window: int | None, length: int) -> bool:
    """Whether a sliding window hides some earlier key from some query of a sequence of ``length`` tokens."""
    return sliding_window is not None and sliding_window < length


@torch.compiler.disable  # a loop over data-dependent boundaries: run eagerly inside a compiled layer
def _per_example(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    eager: bool = False,
) -> torch.Tensor:
    """Causal attention within each example of the rows (boundaries ``cu``), on views: (B, T, H, D). The views come
    from one split per tensor, whose backward concatenates the examples' gradients once (a slice's backward would
    write each into a zero tensor of the whole row's size, and the row's gradient would add them up)."""
    bounds = cu.tolist()
    edges = [0, *bounds, query.shape[2]]  # the row's positions outside [cu[0], cu[-1]) (none in shardtune's rows)
    sizes = [e - s for s, e in zip(edges[:-1], edges[1:])]
    pieces = [t.split(sizes, dim=2)[1:-1] for t in (query, key, value)]  # the examples' views
    outputs = [_attend(q, k, v, None, dropout, scaling, sliding_window, softcap, eager) for q, k, v in zip(*pieces)]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    eager: bool = False,
) -> torch.Tensor:
    """Attention of one sequence (or rows of one length): (B, H, T, D) -> (B, H, T, D). Without ``mask``, causal
    within ``sliding_window``; a boolean mask is True where a query sees a key, a float one is added."""
    if softcap is not None or eager:
        if mask is None:
            mask = causal_window_mask(query.shape[2], key.shape[2], sliding_window, query.device)
        return _eager_attention(query, key, value, mask, dropout, scaling, softcap)
    # SDPA's is_causal aligns the first query with the first key: only right when queries and keys are one sequence
    causal = mask is None and query.shape[2] == key.shape[2] and not _window_bites(sliding_window, key.shape[2])
    if mask is None and not causal:
        mask = causal_window_mask(query.shape[2], key.shape[2], sliding_window, query.device)
    groups = query.shape[1] // key.shape[1]
    gqa = {}
    if groups > 1 and use_gqa_in_sdpa(mask, key, value):
        gqa = {"enable_gqa": True}
    elif groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scaling, **gqa
    )


def _eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    dropout: float,
    scaling: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The eager formula, softmax(q k^T * scaling + mask) v with the softmax in fp32, as transformers' eager
    attention computes it; with ``softcap`` (Gemma 2, which SDPA cannot compute) the logits are soft-capped first:
    softcap * tanh(q k^T * scaling / softcap)."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = query @ key.transpose(2, 3) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    weights = F.dropout(scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype), p=dropout)
    return weights @ value


def causal_window_mask(
    num_queries: int, num_keys: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """(num_queries, num_keys) booleans, True where a query (the last ``num_queries`` positions) sees a key:
    earlier or itself, and, with a window, fewer than ``sliding_window`` positions back."""
    query_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    key_pos = torch.arange(num_keys, device=device)[None, :]
    seen = key_pos <= query_pos
    if sliding_window is not None:
        seen &= key_pos > query_pos - sliding_window
    return seen


@torch.compiler.disable
def _per_example_after_prefix(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    num_prefix: int,
    dropout: float,
    scaling: float | None,
    eager: bool = False,
) -> torch.Tensor:
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
        keys, values = (
            torch.cat([prefix_key, key[:, :, own]], dim=2),
            torch.cat([prefix_value, value[:, :, own]], dim=2),
        )
        outputs.append(
            _eager_attention(query[:, :, start:end], keys, values, allowed, dropout, scaling)
            if eager
            else F.scaled_dot_product_attention(
                query[:, :, start:end], keys, values, attn_mask=allowed, dropout_p=dropout, scale=scaling
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()
