"""DPO's preference losses, as TRL 1.16's DPOTrainer computes them per pair, and the checks of their flags.

Each loss is a function of the policy's and the reference's log-probabilities of a pair's chosen and rejected
completions (and, for ipo / sigmoid_norm, the completions' lengths); several are summed with --loss_weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardtune.config.schema import ConfigError, DpoConfig


def loss_types(dpo: DpoConfig) -> list[str]:
    """--loss_type as a list (a single name, as code and older configs write it, is a list of one)."""
    return [dpo.loss_type] if isinstance(dpo.loss_type, str) else list(dpo.loss_type)


def loss_terms(dpo: DpoConfig) -> list[tuple[str, float]]:
    """(loss type, weight) of each --loss_type, weighted by --loss_weights (1 each when not given), as TRL sums them."""
    types = loss_types(dpo)
    return list(zip(types, list(dpo.loss_weights) or [1.0] * len(types)))


def sft_weight(dpo: DpoConfig) -> float:
    """The weight of the ``sft`` term (the NLL of the chosen completions, a mean over their tokens; 0: none)."""
    return sum(weight for loss_type, weight in loss_terms(dpo) if loss_type == "sft")


def divergence_scores(logratios: torch.Tensor, dpo: DpoConfig) -> torch.Tensor:
    """The log-ratios through --f_divergence_type's f'(t), t = pi / pi_ref (f-DPO; reverse_kl: the log-ratios)."""
    kind = dpo.f_divergence_type
    if kind == "forward_kl":  # f'(t) = 1 - 1 / t
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":  # f'(t) = log(2 t / (t + 1))
        return math.log(2) + F.logsigmoid(logratios)
    if kind == "alpha_divergence" and abs(dpo.f_alpha_divergence_coef - 1.0) >= 1e-6:  # (t^(a - 1) - 1) / (a - 1)
        a = dpo.f_alpha_divergence_coef
        return (torch.exp(((a - 1.0) * logratios).clamp(max=80.0)) - 1.0) / (a - 1.0)
    return logratios  # reverse_kl, and alpha_divergence's limit at alpha = 1


# the losses that are functions of the divergence scores' difference (TRL: the others have no f-DPO form)
F_DIVERGENCE_LOSSES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}


def preference_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    lengths: torch.Tensor,
    dpo: DpoConfig,
) -> torch.Tensor:
    """Per-pair losses (n,), as TRL 1.16 computes them: each --loss_type's term times its weight, summed (``sft``,
    a mean over tokens rather than pairs, is added by the caller: :func:`sft_weight`). ``lengths``: the micro-batch's
    completion lengths (2n,) (:func:`completion_lengths`), for ipo's and sigmoid_norm's per-token normalisation."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    chosen_score, rejected_score = divergence_scores(chosen_ratio, dpo), divergence_scores(rejected_ratio, dpo)
    beta, eps = dpo.beta, dpo.label_smoothing
    margin = beta * (chosen_score - rejected_score)
    chosen_len, rejected_len = lengths.to(chosen.device).float().clamp(min=1.0).chunk(2, dim=0)
    per_token = chosen_score / chosen_len - rejected_score / rejected_len
    total = torch.zeros_like(chosen)
    for loss_type, weight in loss_terms(dpo):
        if loss_type == "sigmoid":
            loss = -F.logsigmoid(margin)
        elif loss_type == "hinge":
            loss = torch.relu(1 - margin)
        elif loss_type == "ipo":  # per completion token (TRL, with the IPO authors)
            loss = (per_token - 1 / (2 * beta)) ** 2
        elif loss_type == "sigmoid_norm":
            loss = -F.logsigmoid(beta * per_token)
        elif loss_type == "robust":
            loss = (-(1 - eps) * F.logsigmoid(margin) + eps * F.logsigmoid(-margin)) / (1 - 2 * eps)
        elif loss_type == "exo_pair":  # KL(p_theta || p_target) over {chosen, rejected}, target (1 - eps, eps)
            loss = torch.sigmoid(margin) * (F.logsigmoid(margin) - math.log1p(-eps)) + torch.sigmoid(-margin) * (
                F.logsigmoid(-margin) - math.log(eps)
            )
        elif loss_type == "nca_pair":
            loss = (
                -F.logsigmoid(beta * chosen_ratio)
                - 0.5 * F.logsigmoid(-beta * chosen_ratio)
                - 0.5 * F.logsigmoid(-beta * rejected_ratio)
            )
        elif loss_type == "bco_pair":
            loss = -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
        elif loss_type == "sppo_hard":  # the winner's log-ratio pulled to 1 / (2 beta), the loser's to -1 / (2 beta)
            loss = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
        elif loss_type == "apo_zero":
            loss = (1 - torch.sigmoid(beta * chosen_ratio)) + torch.sigmoid(beta * rejected_ratio)
        elif loss_type == "apo_down":
            loss = torch.sigmoid(beta * chosen_ratio) + (1 - torch.sigmoid(beta * (chosen_ratio - rejected_ratio)))
        elif loss_type == "discopop":  # logistic and exponential losses, mixed by the margin
            mix = torch.sigmoid(margin / dpo.discopop_tau)
            loss = -F.logsigmoid(margin) * (1 - mix) + torch.exp(-margin) * mix
        elif loss_type == "sft":
            continue
        else:
            raise ValueError(f"unknown --loss_type {loss_type}")
        total = total + weight * loss
    return total


def check_loss_options(dpo: DpoConfig) -> None:
    """The loss flags as TRL 1.16 takes them, and nothing accepted and ignored: --label_smoothing only where a loss
    reads it (robust, exo_pair), --discopop_tau with discopop, --f_alpha_divergence_coef with alpha_divergence."""
    types = loss_types(dpo)
    eps = dpo.label_smoothing
    if dpo.beta <= 0 or not math.isfinite(dpo.beta):
        raise ConfigError(f"--beta {dpo.beta}: must be a positive number (TRL's default: 0.1)")
    if not types:
        raise ConfigError("--loss_type is empty: name at least one loss (TRL's default: sigmoid)")
    for loss_type in {"aot", "aot_unpaired"} & set(types):
        raise ConfigError(
            f"--loss_type {loss_type} sorts the log-ratios within a device's batch, so its loss would "
            "change with the number of processes (the guarantee of docs/dpo.md): not built; use "
            "sigmoid, or another of TRL's per-pair losses"
        )
    if dpo.loss_weights and len(dpo.loss_weights) != len(types):
        raise ConfigError(
            f"--loss_weights has {len(dpo.loss_weights)} weights for {len(types)} loss types "
            f"({', '.join(types)}): give one weight per --loss_type"
        )
    if not all(math.isfinite(w) for w in dpo.loss_weights):
        raise ConfigError(f"--loss_weights {dpo.loss_weights}: every weight must be a finite number")
    if "robust" in types and not 0 <= eps < 0.5:
        raise ConfigError(f"--label_smoothing {eps}: robust needs it in [0, 0.5)")
    if "exo_pair" in types and not 0 < eps < 1:
        raise ConfigError(f"--label_smoothing {eps}: exo_pair needs it above 0 (the EXO paper recommends 1e-3)")
    if eps and not {"robust", "exo_pair"} & set(types):
        raise ConfigError(
            f"--label_smoothing {eps} has no effect with --loss_type {','.join(types)} (TRL 1.16 "
            "smooths labels in robust and exo_pair only): pass one of them, or drop the flag"
        )
    if dpo.f_divergence_type != "reverse_kl" and not set(types) <= F_DIVERGENCE_LOSSES:
        raise ConfigError(
            f"--f_divergence_type {dpo.f_divergence_type} applies to "
            f"{', '.join(sorted(F_DIVERGENCE_LOSSES))} only (the others have no f-DPO form), not to "
            f"{', '.join(sorted(set(types) - F_DIVERGENCE_LOSSES))}: use reverse_kl with them"
        )
    if dpo.f_alpha_divergence_coef != 0.5 and dpo.f_divergence_type != "alpha_divergence":
        raise ConfigError(
            f"--f_alpha_divergence_coef {dpo.f_alpha_divergence_coef} has no effect with "
            f"--f_divergence_type {dpo.f_divergence_type}: pass alpha_divergence, or drop the flag"
        )
    if "discopop" in types and not dpo.discopop_tau > 0:
        raise ConfigError(f"--discopop_tau {dpo.discopop_tau}: must be positive (TRL's default: 0.05)")
    if dpo.discopop_tau != 0.05 and "discopop" not in types:
        raise ConfigError(f"--discopop_tau {dpo.discopop_tau} has no effect without --loss_type discopop: drop it")
