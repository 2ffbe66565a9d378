"""KTO's per-row losses, as TRL 1.16's KTOTrainer computes them, and the sums its metrics are made of.

Each row is a completion with a label (desirable or not); its log-ratio is the policy's minus the reference's
log-probability of the completion. ``kto`` (Eq. 7 of the KTO paper) compares it with the reference point ``kl`` (the
step's KL estimate from mismatched completions, clamped at 0): a desirable row's loss is 1 - sigmoid(beta (r - kl)),
an undesirable row's 1 - sigmoid(beta (kl - r)). ``apo_zero_unpaired`` (APO-zero, unpaired) has no reference point:
1 - sigmoid(beta r) and sigmoid(beta r). Desirable losses are weighed by --desirable_weight, undesirable ones by
--undesirable_weight; the step's loss is their mean over the step's rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Sums over a micro-batch's rows, by label: the weighted losses, the rewards (beta x log-ratio), the policy's
# log-probabilities; then over its completion tokens: the entropy of all, the mean logit (over the vocabulary) of the
# desirable and of the undesirable rows' tokens
ROW_STATS = ("loss_sum", "chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps")
TOKEN_STATS = ("entropy_sum", "chosen_logits_sum", "rejected_logits_sum")
STATS = (*ROW_STATS, *TOKEN_STATS)


def kto_losses(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    labels: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float,
    loss_type: str,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """The rows' weighted losses (n,): ``labels`` true for desirable rows; ``kl`` the reference point (kto only)."""
    logratios = logps - ref_logps
    if loss_type == "kto":
        desirable = 1 - F.sigmoid(beta * (logratios - kl))
        undesirable = 1 - F.sigmoid(beta * (kl - logratios))
    elif loss_type == "apo_zero_unpaired":
        desirable = 1 - F.sigmoid(beta * logratios)
        undesirable = F.sigmoid(beta * logratios)
    else:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}")
    return torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)


def row_stats(
    losses: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor, beta: float
) -> torch.Tensor:
    """The sums of ROW_STATS over a micro-batch's rows, on the device (float64, no graph)."""
    logps = logps.detach()
    rewards = beta * (logps - ref_logps)
    chosen, rejected = labels, ~labels
    values = (losses.detach(), rewards[chosen], rewards[rejected], logps[chosen], logps[rejected])
    return torch.stack([v.double().sum() for v in values])


def step_means(
    sums: list[float],
    num_rows: float,
    num_chosen: float,
    num_rejected: float,
    tokens: tuple[float, float, float],
    kl: float,
) -> dict[str, float]:
    """The loss and TRL 1.16's metrics of ``sums`` (STATS summed over the step's micro-batches and ranks) and its
    counts: ``loss`` the mean over the rows; ``kl`` the step's reference point; ``rewards/*``, ``logps/*`` means over
    the desirable (chosen) or undesirable (rejected) rows, left out where there are none (as TRL);
    ``rewards/margins`` their difference; ``entropy``, ``logits/*`` means over the completion tokens of all,
    desirable and undesirable rows (``tokens``: those three counts; 0 where there are none)."""
    loss, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps = sums[: len(ROW_STATS)]
    entropy, chosen_logits, rejected_logits = sums[len(ROW_STATS) :]
    all_tokens, chosen_tokens, rejected_tokens = tokens
    out = {"loss": loss / max(num_rows, 1), "kl": kl, "entropy": entropy / all_tokens if all_tokens else 0.0}
    if chosen_tokens:
        out["logits/chosen"] = chosen_logits / chosen_tokens
    if rejected_tokens:
        out["logits/rejected"] = rejected_logits / rejected_tokens
    if num_chosen:
        out["rewards/chosen"], out["logps/chosen"] = chosen_rewards / num_chosen, chosen_logps / num_chosen
    if num_rejected:
        out["rewards/rejected"], out["logps/rejected"] = rejected_rewards / num_rejected, rejected_logps / num_rejected
    if num_chosen and num_rejected:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
