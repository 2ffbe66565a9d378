"""The last decoder layer computed only where a loss reads it.

A causal LM's last layer feeds nothing but the output layer, and the losses here read the output layer at a few
positions (SFT's labelled tokens, DPO's, KTO's and GRPO's completion tokens): the other positions of the last layer
are needed only as keys and values of the positions that are read. So the lean path computes, in the last layer,
the keys and values of every position and the query, attention, output projection and MLP of the read positions only
(on bench/'s dialogues ~13% of the tokens: most of the layer's matmuls are skipped). The layer's output holds the
new state at the read positions and the layer's input elsewhere (never read: the output layer takes the read rows
only, shardtune.model.loss.head_computes).

The same numbers up to float rounding (the attention of the read queries runs as masked SDPA instead of the causal
kernel). Taken where the computation is known: Llama's decoder layer (its forward, under FSDP2's subclass too), SDPA
or shardtune's padding-free attention (padded rows, padding-free rows, the shared-prompt layout's 4-D boolean mask),
no dropout while training, no cache, no --compile of the layers, no split rows (sequence / context parallelism); the
whole layer otherwise, as before. The read positions travel as a model keyword (:data:`POSITIONS`) down to the
layer, whose forward is replaced once by a dispatcher that takes the lean path only when the keyword is there: an
activation-checkpointed layer (torch's wrapper, transformers' gradient checkpointing) recomputes in backward with
the same keywords, so its recomputation matches its forward.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv

from shardtune.model.attention import VARLEN
from shardtune.model.lora_dropout import ExampleKeyedDropout

LAYER_CLASSES = ("LlamaDecoderLayer",)
ATTENTION_CLASSES = ("LlamaAttention",)
ATTENTIONS = ("sdpa", VARLEN)
# the model keyword that carries the read positions down to the last layer (transformers passes a model's extra
# keywords to every decoder layer and attention function, which ignore it): a checkpointed layer's recomputation
# in backward gets the same keywords, so it computes the same positions
POSITIONS = "shardtune_lean_positions"


def lean_keywords(inner: nn.Module, inputs: dict, positions: torch.Tensor) -> dict:
    """The model keywords that make the last decoder layer of ``inner`` (the Hugging Face model inside the wrappers:
    shardtune.model.loss.hf_model) compute its output at ``positions`` only (sorted, unique indices into the
    flattened rows x tokens of the model's input), when it computes that exactly with the keywords ``inputs``
    (module doc); {} otherwise, and when no position is read."""
    layer = lean_last_layer(inner, inputs)
    if layer is None or positions.numel() == 0:
        return {}
    if not getattr(layer.forward, "_shardtune_lean", False):
        layer.forward = _dispatcher(layer)
    return {POSITIONS: positions}


def lean_last_layer(inner: nn.Module, inputs: dict) -> nn.Module | None:
    """The last decoder layer of ``inner`` when the lean path computes it exactly with the model keywords
    ``inputs`` (module doc), else None."""
    config = getattr(inner, "config", None)
    layers = getattr(getattr(inner, "model", None), "layers", None)
    if config is None or not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return None
    if config._attn_implementation not in ATTENTIONS or "sequence_layout" in inputs:
        return None
    layer = layers[-1]
    layer = getattr(layer, "_checkpoint_wrapped_module", layer)  # torch's activation-checkpointing wrapper
    base = next((c for c in type(layer).__mro__ if c.__name__ in LAYER_CLASSES), None)  # FSDP2 subclasses it
    if base is None or _code(type(layer).forward) is not _code(base.forward):  # (and copies its forward)
        return None
    if not any(c.__name__ in ATTENTION_CLASSES for c in type(getattr(layer, "self_attn", None)).__mro__):
        return None
    if "forward" in vars(layer) and not getattr(layer.forward, "_shardtune_lean", False):  # --compile's, another's
        return None
    if layer.self_attn.training and getattr(config, "attention_dropout", 0.0):
        return None
    if any(isinstance(m, (nn.Dropout, ExampleKeyedDropout)) and m.p > 0 and m.training for m in layer.modules()):
        return None  # masks drawn per token of the whole row (LoRA's keyed by example): not for a subset of rows
    return layer


def _code(function) -> object:
    """The code of the function inside its decorators' wrappers."""
    return getattr(inspect.unwrap(function), "__code__", None)


def _dispatcher(layer: nn.Module):
    """The layer's forward: its own, or :func:`_forward_at` where the keywords carry read positions."""

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        positions = kwargs.pop(POSITIONS, None)
        if positions is None:
            return type(layer).forward(layer, hidden_states, *args, **kwargs)
        return _forward_at(layer, positions, hidden_states, *args, **kwargs)

    forward._shardtune_lean = True  # type: ignore[attr-defined]
    return forward


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding (transformers' apply_rotary_pos_emb, for one tensor)."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _forward_at(
    layer: nn.Module,
    positions: torch.Tensor,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache=None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    if (
        cache is not None
        or kwargs.get("past_key_values") is not None
        or position_embeddings is None
        or (attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4))
    ):
        return type(layer).forward(
            layer,
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    rows, width, size = hidden_states.shape
    attn = layer.self_attn
    head_dim = attn.head_dim
    x = layer.input_layernorm(hidden_states)
    cos, sin = (t.expand(rows, width, head_dim) for t in position_embeddings)
    key = _rotate(attn.k_proj(x).view(rows, width, -1, head_dim).transpose(1, 2), cos[:, None], sin[:, None])
    value = attn.v_proj(x).view(rows, width, -1, head_dim).transpose(1, 2)
    flat_x = x.reshape(rows * width, size)
    row_of, column_of = positions // width, positions % width
    query = attn.q_proj(flat_x.index_select(0, positions)).view(len(positions), -1, head_dim)
    query = _rotate(query, cos[row_of, column_of][:, None], sin[row_of, column_of][:, None])
    groups = query.shape[1] // key.shape[1]
    outputs = []
    for first, last, row, start, end in _spans(positions, width, kwargs.get("cu_seq_lens_q")):
        q = query[first:last].transpose(0, 1)[None]  # (1, heads, n, head_dim)
        k, v = key[row : row + 1, :, start:end], value[row : row + 1, :, start:end]
        if groups > 1:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        keys = torch.arange(start, end, device=positions.device)
        mask = keys[None, :] <= column_of[first:last, None]  # causal
        if attention_mask is not None:  # padded rows, the shared-prompt layout: the model's 4-D boolean mask
            mask = mask & attention_mask[row, 0][column_of[first:last]][:, start:end]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
        outputs.append(out[0].transpose(0, 1).reshape(last - first, -1))
    attended = attn.o_proj(torch.cat(outputs))
    flat = hidden_states.reshape(rows * width, size)
    read = flat.index_select(0, positions) + attended
    read = read + layer.mlp(layer.post_attention_layernorm(read))
    return flat.index_copy(0, positions, read).view(rows, width, size)


def _spans(positions: torch.Tensor, width: int, cu_seq_lens: torch.Tensor | None) -> list[tuple[int, ...]]:
    """(first, last) of each run of ``positions`` that shares its keys, with the row and the key range [start, end):
    a row of padded rows, an example of a padding-free row (``cu_seq_lens``)."""
    bounds = [0, width] if cu_seq_lens is None else cu_seq_lens.tolist()
    cuts = torch.tensor([r * width + b for r in range(int(positions.max()) // width + 1) for b in bounds[1:]])
    owner = torch.bucketize(positions.cpu(), cuts, right=True).tolist()  # which (row, span) each position is in
    spans, first = [], 0
    for i in range(1, len(owner) + 1):
        if i == len(owner) or owner[i] != owner[first]:
            row, span = divmod(owner[first], len(bounds) - 1)
            spans.append((first, i, row, bounds[span], bounds[span + 1]))
            first = i
    return spans
