"""TRL's GRPOConfig names (``trl grpo``), as shardtune grpo's settings (shardtune.config.grpo_settings); the names
GRPO shares with DPO (``beta``; ``loss_type`` is settled in trl.py) set the section of the command's objective."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from shardtune.config.dialects import Pairs, Spelling, refused, text
from shardtune.config.objectives import OBJECTIVES
from shardtune.config.schema import ConfigError, DpoConfig, GrpoConfig, TrainConfig

STATE = "trl:"
SHARED = tuple(
    f.name for f in fields(GrpoConfig) if f.name in {d.name for d in fields(DpoConfig)} and f.name != "loss_type"
)


def _shared(name: str):
    def to(value: Any) -> Pairs:
        return [(STATE + name, value)]

    return to


def _scale_rewards(value: Any) -> Pairs:
    """TRL's scale_rewards: group / batch / none, or a bool (true: group, false: none)."""
    v = text(value).lower()
    return [("grpo.scale_rewards", {"true": "group", "false": "none"}.get(v, v))]


def _optional_zero(key: str):
    """TRL's None (epsilon_high, steps_per_generation, generation_batch_size): shardtune's 0."""

    def to(value: Any) -> Pairs:
        return [(key, 0 if text(value).lower() in ("none", "null", "") else value)]

    return to


def _help(name: str) -> str:
    return GrpoConfig.__dataclass_fields__[name].metadata["help"]


SPELLINGS: dict[str, Spelling] = {
    **{
        f.name: Spelling(f"grpo.{f.name}", f.metadata["help"])
        for f in fields(GrpoConfig)
        if f.name not in SHARED and f.name != "loss_type"
    },
    **{
        name: Spelling(f"grpo.{name}", _help(name), _optional_zero(f"grpo.{name}"))
        for name in ("epsilon_high", "steps_per_generation", "generation_batch_size")
    },
    "scale_rewards": Spelling(
        "grpo.scale_rewards", _help("scale_rewards") + " (true: group, false: none)", _scale_rewards
    ),
    **{
        name: Spelling(
            f"dpo.{name} / grpo.{name}",
            f"shardtune dpo: {DpoConfig.__dataclass_fields__[name].metadata['help']}; shardtune grpo: {_help(name)}",
            _shared(name),
        )
        for name in SHARED
    },
    "use_vllm": refused(
        "generation with vLLM is not built: completions are sampled with the model being trained (docs/grpo.md); "
        "drop the flag",
        False,
    ),
    "vllm_mode": refused("generation with vLLM is not built (docs/grpo.md): drop the flag", "colocate"),
    "num_generations_eval": refused("evaluation is not built for shardtune grpo: drop the flag"),
    "min_p": refused("min-p sampling is not built: use --top_p / --top_k, or drop the flag"),
    "repetition_penalty": refused("a repetition penalty is not built: drop the flag", 1.0, "1.0", "1"),
    "top_entropy_quantile": refused("the high-entropy token mask is not built: drop the flag", 1.0, "1.0", "1"),
    "delta": refused("two-sided clipping (delta) is not built: drop the flag"),
    "entropy_coef": refused("the entropy bonus is not built: drop the flag", 0.0, "0.0", "0"),
    "off_policy_mask_threshold": refused("the off-policy sequence mask is not built: drop the flag"),
    "cast_lm_head_to_fp32": refused(
        "the log-probabilities are computed in fp32 from the hidden states already: drop the flag", False
    ),
}


def settle(cfg: TrainConfig, given: dict[str, Any]) -> None:
    """A shared name (--beta) sets the section of the command's objective; an objective without it refuses."""
    for name in SHARED:
        if name not in given:
            continue
        registration = OBJECTIVES[cfg.objective]
        section = getattr(cfg, registration.settings, None) if registration.settings else None
        if section is None or not hasattr(section, name):
            owners = " / ".join(
                o for o, r in OBJECTIVES.items() if r.settings and hasattr(getattr(cfg, r.settings), name)
            )
            raise ConfigError(f"--{name} is a flag of shardtune {owners}: run one of those, or drop it")
        try:
            setattr(section, name, type(getattr(section, name))(text(given[name])))
        except ValueError:
            raise ConfigError(f"--{name} {given[name]!r} is not a number") from None


def settle_loss_type(section: Any, names: list[str], objective: str) -> bool:
    """--loss_type for a section whose loss_type is one name (GRPO's); False: not such a section."""
    if section is None or not isinstance(getattr(section, "loss_type", None), str):
        return False
    if len(names) != 1:
        raise ConfigError(f"--loss_type {','.join(names)}: shardtune {objective} trains one loss type")
    section.loss_type = names[0]
    return True
