"""The reward model's scores and its Bradley-Terry loss, as TRL 1.16's RewardTrainer defines them.

A micro-batch is shardtune.data.preference.collate_pairs' layout: ``n`` chosen rows then ``n`` rejected rows,
right-padded; the model is a sequence-classification model with one label, whose forward reads each row's score at
its last non-pad token (the config's pad token: shardtune.model.loading.name_pad_token). A pair's loss is

    -log sigmoid(r_chosen - r_rejected - margin)  +  center_rewards_coefficient x (r_chosen + r_rejected)^2

(``margin``: the data's margin column, 0 without one). TRL takes each term's mean over a micro-batch's pairs; here a
micro-batch gives their SUM, and the engine divides by the step's global pairs, so the step's loss is the mean over
all its pairs on any layout (TRL's number at one micro-batch per step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardtune.model.lean_layer import lean_keywords
from shardtune.model.loss import hf_model, model_inputs

# Sums over a micro-batch's pairs (and its 2n scores), then the extremes of its scores: the loss, the pairs whose
# chosen score is the higher (TRL's accuracy), r_chosen - r_rejected (TRL's margin, without the margin column), the
# scores of all rows (mean_reward), the lowest and the highest score (min_reward, max_reward)
STATS = ("loss_sum", "num_correct", "margin_sum", "reward_sum", "min_reward", "max_reward")
STAT_REDUCTIONS = ("sum", "sum", "sum", "sum", "min", "max")
# TRL's names of the step's metrics: means over its pairs (accuracy, margin) or its scores (mean_reward), extremes
METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")


def num_pairs(batch: dict[str, torch.Tensor]) -> int:
    return batch["input_ids"].shape[0] // 2


def scores(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device, lean: bool = True) -> torch.Tensor:
    """Each row's score (2n,), in fp32 with its graph: the chosen rows' then the rejected rows'. ``lean``: the last
    decoder layer computes only the position each row's score is read at (shardtune.model.lean_layer; the same
    scores up to float rounding), else the model's own forward whole (TRL's computation, op for op)."""
    inputs = model_inputs(batch, device)
    inner = hf_model(model)
    lean_inputs = lean_keywords(inner, inputs, read_positions(inner, inputs["input_ids"])) if lean else {}
    output = model(**inputs, **lean_inputs, use_cache=False)
    return output.logits.squeeze(-1).float()


def read_positions(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Where a sequence-classification model reads each row's score, as indices into the flattened rows x tokens:
    transformers' rule (the last token that is not the config's pad token; the row's last position without one)."""
    rows, width = input_ids.shape
    pad_id = model.config.get_text_config().pad_token_id
    if pad_id is None:
        last = torch.full((rows,), width - 1, device=input_ids.device)
    else:
        last = (torch.arange(width, device=input_ids.device) * (input_ids != pad_id)).argmax(-1)
    return torch.arange(rows, device=input_ids.device) * width + last


def pair_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None, center_coefficient: float
) -> torch.Tensor:
    """Each pair's loss (n,): Bradley-Terry's -log sigmoid of the score difference less the pair's margin, plus the
    centring term (its mean over pairs is TRL's)."""
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin.to(difference.device, difference.dtype)
    losses = -F.logsigmoid(difference)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses


def score_stats(losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """The micro-batch's :data:`STATS` (float64, no graph)."""
    chosen, rejected = chosen.detach().double(), rejected.detach().double()
    both = torch.cat([chosen, rejected])
    return torch.stack(
        [
            losses.detach().double().sum(),
            (chosen > rejected).double().sum(),
            (chosen - rejected).sum(),
            both.sum(),
            both.min(),
            both.max(),
        ]
    )


def micro_batch_loss(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    center_coefficient: float,
    device: torch.device,
    lean: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the SUM of the micro-batch's pair losses, with its graph; its :data:`STATS`), from one forward of its 2n
    rows (``lean``: :func:`scores`')."""
    chosen, rejected = scores(model, batch, device, lean).chunk(2)
    losses = pair_losses(chosen, rejected, batch.get("margin"), center_coefficient)
    return losses.sum(), score_stats(losses, chosen, rejected)


def means(stats: list[float], pairs: float) -> dict[str, float]:
    """The loss and :data:`METRICS` of ``stats`` (:data:`STATS` summed over micro-batches and ranks, the extremes
    taken) over ``pairs`` pairs."""
    n = max(pairs, 1)
    loss_sum, correct, margin_sum, reward_sum, lowest, highest = stats
    return {
        "loss": loss_sum / n,
        "accuracy": correct / n,
        "margin": margin_sum / n,
        "min_reward": lowest,
        "mean_reward": reward_sum / (2 * n),
        "max_reward": highest,
    }
