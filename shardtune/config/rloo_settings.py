"""RLOO's own section of the canonical config (shardtune.config.schema): the settings of TRL 1.16's RLOOConfig that
GRPO does not have. Everything RLOO shares with GRPO under the same TRL name and meaning (the sampling, the reward
functions, beta, epsilon, num_iterations ...) is GRPO's section, read by both (Registration.shares; docs/rloo.md)."""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.config.setting import setting


@dataclass
class RlooConfig:
    """TRL's RLOO-only settings, under TRL's names (read by shardtune rloo); see docs/rloo.md."""

    normalize_advantages: bool = setting(
        False,
        "the leave-one-out advantages of a generation (all processes' completions) shifted to mean 0 and divided "
        "by their standard deviation (+ 1e-4)",
    )
    reward_clip_range: list[float] = setting(
        [],
        "(min, max): each completion's weighted reward clamped to it before the KL penalty and the baseline "
        "([]: no clipping, TRL's None)",
    )
