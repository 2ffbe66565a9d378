"""RLOO (TRL 1.16's RLOOTrainer) on the one engine: GRPO's keyed sampling, reward functions, rounds, tools and resume
(shardtune.training.objectives.grpo.objective), with RLOO's advantages and loss. It lives in GRPO's package because
it is GRPO's sampling with another objective on top (objectives never import each other; docs/rloo.md).

Per generation (all processes' completions, G per prompt):

- reward r = the weighted sum of the reward functions (NaN when none scores it), clamped to reward_clip_range, minus
  beta x KL, KL the completion's summed first-order log-ratio to the reference, sum(log pi_old - log pi_ref) over its
  scored tokens (Ahmadian et al. 2024; TRL's choice, unlike GRPO's per-token k3 in the loss);
- advantage A = r - mean of the other scorable completions of the same prompt (the leave-one-out baseline); with
  normalize_advantages, (A - mean) / (std + 1e-4) over the generation; an unscorable completion's A is 0.

The loss is sequence level: ratio = exp(sum log pi - sum log pi_old) over the completion's scored tokens, and
-min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) averaged over the step's completions (every process's, every
micro-batch's: N = the step's completions, so any layout gives the same loss). TRL's metric keys: reward, reward_std,
frac_reward_zero_std (groups whose penalised rewards do not vary), rewards/<f>/mean|std, kl (the generation's mean
per-token log-ratio), entropy, clip_ratio/* over sequences, completions/*, tools/*.
"""

from __future__ import annotations

import math

import torch

from shardtune.config.grpo_settings import GrpoConfig
from shardtune.config.schema import ConfigError
from shardtune.model.loss import IGNORE_INDEX
from shardtune.training.objectives.grpo.advantages import nanstd
from shardtune.training.objectives.grpo.loss import completion_targets, token_logps
from shardtune.training.objectives.grpo.objective import GRPO, TAIL

# GRPO's settings TRL's RLOOConfig does not have (RLOO's loss and advantages have none of these knobs)
GRPO_ONLY = ("loss_type", "scale_rewards", "multi_objective_aggregation", "delta", "importance_sampling_level")
GRPO_ONLY += ("use_bias_correction_kl",)


def rloo_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    kl: torch.Tensor | None,
    generations: int,
    beta: float,
    normalize: bool,
    clip_range: list[float],
) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's RLOO advantages of a generation (completions in groups of ``generations``, in order) and its reward
    metrics (rewards/<i>/mean|std by index); ``kl``: each completion's summed log-ratio to the reference (beta > 0)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    logged = (rewards_per_func * weights[None]).nansum(dim=1)
    logged[unscorable] = math.nan
    rewards = logged.clone()
    if clip_range:
        rewards = rewards.clamp(min=clip_range[0], max=clip_range[1])
    if beta != 0.0 and kl is not None:
        rewards = rewards - beta * kl
    grouped = rewards.view(-1, generations)
    if generations > 1:
        std = nanstd(grouped, dim=1)
        scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
        advantages = rewards - baselines.view(-1)
    else:  # an evaluation with num_generations_eval 1: no baseline, no signal
        std = torch.zeros(grouped.size(0), dtype=rewards.dtype)
        advantages = torch.zeros_like(rewards)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    metrics = {
        "reward": torch.nanmean(logged).item(),
        "reward_std": nanstd(logged).item(),
        "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).double().mean().item(),
    }
    for i in range(rewards_per_func.size(1)):
        metrics[f"rewards/{i}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        metrics[f"rewards/{i}/std"] = nanstd(rewards_per_func[:, i]).item()
    return torch.nan_to_num(advantages, nan=0.0), metrics


def rloo_terms(
    logps: torch.Tensor, entropies: torch.Tensor, batch: dict, grpo: GrpoConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the micro-batch's loss sum with its graph, GRPO's STATS layout: loss, kl 0 (RLOO's is in the reward),
    entropy, low / high / region clipped sequences, the lowest low-clip and highest high-clip indicator)."""
    mask = completion_targets(batch).to(device).ne(IGNORE_INDEX).float()
    sequence = (logps * mask).sum(-1)
    old = batch.get("old_logps")
    old_sequence = sequence.detach() if old is None else (old.to(device) * mask).sum(-1)
    ratio = torch.exp(sequence - old_sequence)
    eps_low, eps_high = grpo.epsilon, grpo.epsilon_high or grpo.epsilon
    advantages = batch["advantages"].to(device).float()
    per_sequence = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages)
    total = per_sequence.sum()
    low = ((ratio < 1 - eps_low) & (advantages < 0)).detach().float()
    high = ((ratio > 1 + eps_high) & (advantages > 0)).detach().float()
    region = torch.maximum(low, high)
    values = (total.detach(), torch.zeros((), device=device), (entropies * mask).sum(), low.sum(), high.sum())
    values += (region.sum(), low.min(), high.max())  # a micro-batch has rows: its extremes are 0 or 1
    return total, torch.stack([v.double() for v in values])


class RLOO(GRPO):
    name = "rloo"

    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        """GRPO's checks; GRPO's settings RLOO has not (loss_type, scale_rewards ...) refused; the clip range."""
        super().check(cfg, world_size)
        default = GrpoConfig()
        for name in GRPO_ONLY:
            if getattr(cfg.grpo, name) != getattr(default, name):
                raise ConfigError(
                    f"--{name} is a flag of shardtune grpo (TRL's RLOOConfig has no {name}): drop it, or run "
                    "shardtune grpo"
                )
        bounds = cfg.rloo.reward_clip_range
        if bounds and (len(bounds) != 2 or bounds[0] > bounds[1]):
            raise ConfigError(f"--reward_clip_range {bounds}: give two numbers, min then max, or drop the flag")

    def normaliser(self, batch: dict, round_tokens: int = 0) -> float:
        """RLOO's N: the step's completions (TRL: the mean over the batch's sequences)."""
        return float(batch["input_ids"].size(0))

    def spread_normalisers(self, everything: list[dict]) -> None:
        """Completions are their own N: nothing to spread."""

    @torch.no_grad()
    def round_columns(self, slices: list[list[dict]]) -> torch.Tensor:
        """With beta > 0, per completion: its summed log-ratio of the sampling policy to the reference over its scored
        tokens, and those tokens (the reward's KL penalty and the kl metric); else nothing."""
        everything = [b for micro in slices for b in micro]
        if self.cfg.grpo.beta == 0.0:
            return torch.zeros(sum(b["input_ids"].size(0) for b in everything), 0, dtype=torch.float64)
        return torch.cat([self.kl_columns(b) for b in everything])

    def kl_columns(self, batch: dict) -> torch.Tensor:
        device, g = self.env.device, self.cfg.grpo
        policy = batch.get("old_logps")
        if policy is None:  # the round trains one step: the policy that sampled is the model as it is
            with self.strategy.autocast():
                policy = token_logps(self.model, batch, device, g.temperature, False)[0]
        mask = completion_targets(batch).ne(IGNORE_INDEX).double()
        log_ratio = (policy.double().cpu() - batch["ref_logps"].double()) * mask
        return torch.stack([log_ratio.sum(-1), mask.sum(-1)], dim=1)

    def generation_metrics(self, shared: torch.Tensor, g) -> tuple[torch.Tensor, dict[str, float]]:
        """RLOO's advantages and TRL's metrics of a generation's table (rewards | TAIL | kl, kl tokens)."""
        n = len(self.rewards)
        extra = shared[:, n + TAIL :]
        kl = extra[:, 0] if extra.size(1) else None
        r = self.cfg.rloo
        advantages, metrics = rloo_advantages(
            shared[:, :n], self.weights, kl, g.num_generations, g.beta, r.normalize_advantages, r.reward_clip_range
        )
        self.name_rewards(metrics)
        metrics.update(self.tail_metrics(shared[:, n : n + TAIL]))
        if kl is not None:
            metrics["kl"] = extra[:, 0].sum().item() / max(extra[:, 1].sum().item(), 1.0)
        return advantages, metrics

    def terms(self, logps: torch.Tensor, entropies: torch.Tensor, batch: dict, g) -> tuple[torch.Tensor, torch.Tensor]:
        return rloo_terms(logps, entropies, batch, g, self.env.device)

    def step_metrics(self, totals: dict[str, float], stats: list[float]) -> dict[str, float]:
        tokens, rows = max(totals["label_tokens"], 1.0), max(totals["completions"], 1.0)
        low, high = stats[6], stats[7]
        return {
            "loss": stats[0] / max(totals["normaliser"], 1e-12),
            **self.pending,  # the generation's rewards, kl, completions/*, tools/*
            "entropy": stats[2] / tokens,
            "clip_ratio/low_mean": stats[3] / rows,
            "clip_ratio/low_min": low if math.isfinite(low) else math.nan,
            "clip_ratio/high_mean": stats[4] / rows,
            "clip_ratio/high_max": high if math.isfinite(high) else math.nan,
            "clip_ratio/region_mean": stats[5] / rows,
        }
