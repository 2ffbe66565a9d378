"""GRPO's group advantages and the reward and completion metrics of a generation (all ranks' completions), as TRL
1.16's GRPOTrainer._generate_and_score_completions computes them (tests/unit/test_grpo_loss.py compares)."""

from __future__ import annotations

import math

import torch

METRICS = ("reward", "reward_std", "frac_reward_zero_std")
COMPLETION_METRICS = (
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's nanstd: the unbiased standard deviation of the non-NaN values."""
    keep = {} if dim is None else {"dim": dim, "keepdim": True}
    mean = torch.nanmean(x, **keep)
    variance = torch.nanmean((x - mean) ** 2, **keep)
    count = (~torch.isnan(x)).sum(**keep)
    out = (variance * count / (count - 1)).sqrt()
    return out.squeeze(dim) if dim is not None else out


def advantages_of(rewards_per_func: torch.Tensor, weights: torch.Tensor, grpo) -> tuple[torch.Tensor, dict]:
    """TRL's advantages of a generation batch (completions in groups of num_generations, in order) and its reward
    metrics: (advantages, {reward, reward_std, frac_reward_zero_std, rewards/<i>/mean|std by index})."""
    g = grpo.num_generations
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if grpo.multi_objective_aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights[None]).nansum(dim=1)
        rewards[unscorable] = math.nan
        grouped_mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
        if grpo.scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards)
        else:
            std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g)
        advantages = rewards - grouped_mean
        if grpo.scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    else:  # normalize_then_sum (GDPO)
        grouped = rewards_per_func.view(-1, g, rewards_per_func.size(1))
        normalised = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (
            nanstd(grouped, dim=1).unsqueeze(1) + 1e-4
        )
        rewards = (normalised.view(-1, rewards_per_func.size(1)) * weights[None]).nansum(dim=1)
        rewards[unscorable] = math.nan
        std = nanstd(rewards).expand_as(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    logged = (rewards_per_func * weights[None]).nansum(dim=1)
    logged[unscorable] = math.nan
    metrics = {
        "reward": torch.nanmean(logged).item(),
        "reward_std": nanstd(logged).item(),
        "frac_reward_zero_std": zero_std.double().mean().item(),
    }
    for i in range(rewards_per_func.size(1)):
        metrics[f"rewards/{i}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        metrics[f"rewards/{i}/std"] = nanstd(rewards_per_func[:, i]).item()
    return torch.nan_to_num(advantages, nan=0.0), metrics


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's completions/* of a generation batch (all ranks)."""
    ended = lengths[~truncated.bool()]
    ended = ended if ended.numel() else torch.zeros(1, dtype=lengths.dtype)
    lengths = lengths.double()
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.double().mean().item(),
        "completions/mean_terminated_length": ended.double().mean().item(),
        "completions/min_terminated_length": ended.double().min().item(),
        "completions/max_terminated_length": ended.double().max().item(),
    }
