"""KTO's own section of the canonical config (shardtune.config.schema): the settings of TRL 1.16's KTOConfig that
DPO's do not name. What KTO shares with DPO under the same TRL name and meaning (beta, ref_model,
precompute_ref_log_probs, precompute_ref_batch_size) is DPO's section, read by both (Registration.shares; docs/kto.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.config.setting import setting

# TRL 1.16's KTO losses: kto (the paper's, with the KL reference point), apo_zero_unpaired (APO-zero, unpaired: no KL)
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclass
class KtoConfig:
    """TRL's KTO settings, under TRL's names (read by shardtune kto); see docs/kto.md."""

    loss_type: str = setting(
        "kto",
        "kto (the KTO paper's loss: each completion's reward against the batch's KL estimate from mismatched "
        "completions) or apo_zero_unpaired (APO-zero, unpaired: no KL term)",
        choices=KTO_LOSS_TYPES,
    )
    desirable_weight: float = setting(
        1.0, "the desirable (label true) completions' losses are weighed by this (to balance unequal counts)", above=0
    )
    undesirable_weight: float = setting(
        1.0, "the undesirable (label false) completions' losses are weighed by this", above=0
    )
