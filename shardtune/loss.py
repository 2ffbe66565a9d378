"""Token-level loss: a SUM over labelled tokens, so the caller can normalise by the global token count."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def num_label_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss: labels are aligned with input_ids, so position 0 never predicts anything."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    keys = ("input_ids", "attention_mask", "position_ids")
    return {k: batch[k].to(device, non_blocking=True) for k in keys if k in batch}


def token_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of next-token cross-entropy over labelled tokens of one micro-batch, computed in fp32."""
    out = model(**model_inputs(batch, device), use_cache=False)
    logits = out.logits[:, :-1, :]
    targets = batch["labels"][:, 1:].to(device, non_blocking=True)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
