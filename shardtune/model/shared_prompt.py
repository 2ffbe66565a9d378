"""Completions that share a prompt computed over one copy of it: a micro-batch's rows of one prompt become one row
[prompt | completion 1 | completion 2 | ...] in which each completion attends to the prompt and to itself only, at
the positions it has in its own row.

GRPO's micro-batches hold num_generations completions of each prompt, DPO's the chosen and the rejected completion
of each pair's prompt, and a causal model's prompt positions do not depend on what follows them, so the padded
layout [prompt | completion | pad] computes every prompt once per completion, forward and backward (with gradient
checkpointing, twice forward). Here it is computed once; each token's
log-probability is read from the hidden state that predicts it (a completion's first token from the prompt's last
position, shared), and a completion's last token, which predicts nothing scored, is left out. The same values up
to float rounding: masked keys weigh exactly 0 in the softmax, and the gradient of a shared prompt position is the
sum of what its completions send it.

The layout is built with the batch (shardtune.data.shared_prompt, on the host); the model computes on it
when it can (:func:`shared_inputs`: SDPA or eager attention, which take a 4-D mask as it is, a model type whose
positions are its ``position_ids``, no sliding window that would bite, no dropout, no PEFT prompt learning, which
prepends its own keys); otherwise the padded rows are used, as before.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtune.data.shared_prompt import SHARED_IDS, SHARED_INDEX, SHARED_POSITIONS, SHARED_SEGMENTS
from shardtune.model.lora_dropout import ExampleKeyedDropout
from shardtune.model.loss import LEAN_MODEL_TYPES, hf_model

ATTENTIONS = ("sdpa", "eager")  # transformers passes a 4-D mask to these as it is


def shared_mask(segments: torch.Tensor, eager: bool) -> torch.Tensor:
    """The (groups, 1, width, width) mask: a prompt token sees the prompt before it, a completion token the whole
    prompt and its own completion up to itself; a pad position sees itself only (no empty softmax row, no NaN in
    what backward multiplies by 0). Boolean for SDPA; additive (0 / the lowest float) for the eager formula."""
    order = torch.arange(segments.size(1), device=segments.device)
    query, key = segments[:, :, None], segments[:, None, :]
    allowed = (order[:, None] >= order[None, :]) & (key >= 0) & ((key == 0) | (key == query))
    allowed |= (order[:, None] == order[None, :]) & (query < 0)
    allowed = allowed[:, None]
    if not eager:
        return allowed
    return torch.zeros(allowed.shape, device=segments.device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def can_share(model: nn.Module, width: int) -> bool:
    """Whether ``model`` computes the shared layout exactly as the padded rows of ``width`` tokens (module doc)."""
    inner = hf_model(model)
    config = getattr(inner, "config", None)
    if config is None or config._attn_implementation not in ATTENTIONS:
        return False
    window = getattr(config, "sliding_window", None)
    if config.model_type not in LEAN_MODEL_TYPES or (window is not None and window < width):
        return False
    if any(getattr(c, "is_prompt_learning", False) for c in _peft_configs(model)):
        return False
    return not (model.training and _drops_out(model, config))


def _drops_out(model: nn.Module, config) -> bool:
    """Whether a forward draws dropout masks (a module's, or the config's attention / hidden dropout applied in the
    forward itself): a shared prompt would draw one mask where its padded rows draw one each."""
    rates = [v for k, v in vars(config).items() if "dropout" in k and isinstance(v, float)]
    modules = (m for m in model.modules() if isinstance(m, (nn.Dropout, ExampleKeyedDropout)))
    return any(rate > 0 for rate in rates) or any(m.p > 0 and m.training for m in modules)


def _peft_configs(model: nn.Module) -> list:
    while not hasattr(model, "peft_config") and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    configs = getattr(model, "peft_config", None)
    return list(configs.values()) if isinstance(configs, dict) else []


def shared_inputs(model: nn.Module, batch: dict, device: torch.device) -> tuple[dict, torch.Tensor] | None:
    """(the model's keywords for the shared layout, the index of the scored tokens' predicting states in its
    flattened output), or None where the batch has no shared prompts or the model cannot take the layout."""
    if SHARED_IDS not in batch or not can_share(model, batch["input_ids"].size(1)):
        return None
    segments = batch[SHARED_SEGMENTS].to(device)
    eager = hf_model(model).config._attn_implementation == "eager"
    inputs = {
        "input_ids": batch[SHARED_IDS].to(device),
        "attention_mask": shared_mask(segments, eager),
        "position_ids": batch[SHARED_POSITIONS].to(device),
    }
    return inputs, batch[SHARED_INDEX].to(device)


def computed_rows(model: nn.Module | None, batch: dict) -> dict:
    """The rows ``model`` computes for ``batch`` (its FLOPs as computed): the shared layout's where it is taken."""
    if model is None or SHARED_IDS not in batch or not can_share(model, batch["input_ids"].size(1)):
        return batch
    return {"input_ids": batch[SHARED_IDS], "attention_mask": (batch[SHARED_SEGMENTS] >= 0).long()}
