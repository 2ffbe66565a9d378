"""DPO's own section of the canonical config (shardtune.config.schema): its loss, reference and TRL options."""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.config.setting import RUN, setting

# -- DPO -----------------------------------------------------------------------------------------------------------

# TRL 1.16's per-pair losses, and sft (the NLL of the chosen completions, RPO's term; with others: loss_weights)
DPO_LOSS_TYPES = (
    "sigmoid",
    "ipo",
    "hinge",
    "robust",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
    "sft",
)
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@dataclass
class DpoConfig:
    """TRL's DPO settings, under TRL's names (read by shardtune dpo); see docs/dpo.md."""

    beta: float = setting(
        0.1,
        "how far the policy may move from the reference (sigmoid, hinge, robust); ipo: the "
        "regularisation parameter tau",
        above=0,
    )
    loss_type: list[str] = setting(
        ["sigmoid"],
        "the preference loss, or several summed with loss_weights (TRL 1.16's "
        "names: sigmoid (DPO), ipo, hinge, robust, exo_pair, nca_pair, "
        "bco_pair, sppo_hard, apo_zero, apo_down, discopop, sigmoid_norm, sft)",
        choices=DPO_LOSS_TYPES,
    )
    loss_weights: list[float] = setting([], "one weight per loss_type (default: 1 each)")
    label_smoothing: float = setting(
        0.0,
        "robust: the probability that a preference label is flipped, in [0, 0.5); "
        "exo_pair: the epsilon of its target distribution, in (0, 0.5)",
    )
    f_divergence_type: str = setting(
        "reverse_kl",
        "the divergence the log-ratios go through: reverse_kl (DPO), forward_kl, js_divergence, alpha_divergence",
        choices=F_DIVERGENCES,
    )
    f_alpha_divergence_coef: float = setting(0.5, "alpha_divergence: its alpha")
    discopop_tau: float = setting(
        0.05, "discopop: the temperature of its mixing of the logistic and exponential losses"
    )
    ref_model: str = setting(
        "",
        "the reference model: a local directory, hub id or preset:NAME with the policy's tokenizer (TRL's "
        "DPOTrainer(ref_model=...)); empty: the starting weights (with PEFT: the base, adapter off)",
    )
    precompute_ref_log_probs: bool = setting(
        False,
        "one reference pass over the train and test pairs before "
        "training, kept with each pair; the reference model is then freed "
        "(full fine-tuning: no second copy in memory while training)",
        **RUN,
    )
    precompute_ref_batch_size: int = setting(
        0, "pairs per forward of the precompute_ref_log_probs pass, per device (0: train.batch_size)", at_least=0, **RUN
    )
