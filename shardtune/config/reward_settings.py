"""Reward modelling's own section of the canonical config (shardtune.config.schema): TRL 1.16's RewardConfig names
(read by shardtune reward; docs/reward.md)."""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.config.setting import setting


@dataclass
class RewardModelConfig:
    """TRL's RewardTrainer settings, under TRL's names (read by shardtune reward)."""

    center_rewards_coefficient: float = setting(
        0.0,
        "adds this coefficient x the mean over the step's pairs of (r_chosen + r_rejected)^2, pulling the rewards "
        "toward mean zero (Eisenstein et al. 2023, eq. 2; TRL recommends 0.01); 0: off (TRL's None)",
        at_least=0,
    )
