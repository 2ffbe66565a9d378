"""TRL's GRPOConfig names (``trl grpo``), as shardtune grpo's settings (shardtune.config.grpo_settings); the names
GRPO shares with DPO (``beta``; ``loss_type`` is settled in trl.py) set the section of the command's objective."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from shardtune.config.dialects import Pairs, Spelling, refused, text
from shardtune.config.grpo_settings import GRPO_LOSS_TYPES, GRPO_LOSS_TYPES_NOT_BUILT
from shardtune.config.objectives import OBJECTIVES, registration
from shardtune.config.schema import ConfigError, DpoConfig, GrpoConfig, TrainConfig

STATE = "trl:"
SHARED = tuple(
    f.name for f in fields(GrpoConfig) if f.name in {d.name for d in fields(DpoConfig)} and f.name != "loss_type"
)


VLLM_DEFAULTS = {
    "vllm_mode": "colocate",
    "vllm_model_impl": "vllm",
    "vllm_enable_sleep_mode": False,
    "vllm_structured_outputs_regex": None,
    "vllm_server_base_url": None,
    "vllm_server_host": "0.0.0.0",
    "vllm_server_port": 8000,
    "vllm_server_timeout": 240.0,
    "vllm_group_port": 51216,
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_max_model_length": None,
    "vllm_tensor_parallel_size": 1,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_cap": None,
}
OTHER_LOSSES = {  # loss_type sapo / vespo's own settings: name -> (loss, TRL's default)
    "sapo_temperature_neg": ("sapo", 1.05),
    "sapo_temperature_pos": ("sapo", 1.0),
    "vespo_k_pos": ("vespo", 2.0),
    "vespo_lambda_pos": ("vespo", 3.0),
    "vespo_k_neg": ("vespo", 3.0),
    "vespo_lambda_neg": ("vespo", 2.0),
}
ENTROPY_DEFAULTS = {
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "entropy_coef_min": 0.0,
    "entropy_coef_max": 1.0,
    "entropy_coef_delta": 0.005,
    "entropy_target": 0.2,
}


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
        for name in (
            "epsilon_high",
            "steps_per_generation",
            "generation_batch_size",
            "num_generations_eval",
            "min_p",
            "delta",
            "max_tool_calling_iterations",
        )
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
    "reward_model_name_or_path": Spelling(
        "grpo.reward_funcs",
        "a sequence-classification reward model, first among the reward functions (TRL's script argument)",
        _shared("reward_model_name_or_path"),
    ),
    "use_vllm": refused(
        "generation with vLLM is not built: completions are sampled with the model being trained (docs/grpo.md); "
        "drop the flag",
        False,
    ),
    **{
        name: refused("generation with vLLM is not built (docs/grpo.md): drop the flag", default)
        for name, default in VLLM_DEFAULTS.items()
    },
    **{
        name: refused(f"the {loss} loss is not built (docs/grpo.md): drop the flag", default)
        for name, (loss, default) in OTHER_LOSSES.items()
    },
    **{
        name: refused("the entropy bonus is not built: drop the flag", default)
        for name, default in ENTROPY_DEFAULTS.items()
    },
    "top_entropy_quantile": refused("the high-entropy token mask is not built: drop the flag", 1.0, "1.0", "1"),
    "off_policy_mask_threshold": refused("the off-policy sequence mask is not built: drop the flag", None),
    "cast_lm_head_to_fp32": refused(
        "the log-probabilities are computed in fp32 from the hidden states already: drop the flag", False
    ),
    "generation_kwargs": refused(
        "sampling takes --temperature, --top_p, --top_k and --max_completion_length: drop the mapping", None
    ),
    "chat_template_kwargs": refused("the chat template is applied without extra arguments: drop the mapping", None),
    "cache_implementation": refused("the decode loop keeps transformers' dynamic KV cache: drop the flag", None),
    "log_multimodal": refused("images are not built: drop the flag", True),
    "log_unique_prompts": refused("--log_completions logs every completion with its prompt: drop the flag", False),
    "log_completions_hub_repo": refused(
        "completions go to completions.jsonl and the trackers (--log_completions): drop the flag", None
    ),
    **{
        name: refused("transformers' continuous batching is not built: drop the flag", default)
        for name, default in (
            ("use_transformers_continuous_batching", False),
            ("transformers_continuous_batching_config", None),
            ("use_transformers_paged", False),
        )
    },
}


def settle(cfg: TrainConfig, given: dict[str, Any]) -> None:
    """A shared name (--beta) sets the section of the command's objective; an objective without it refuses.
    --shuffle_dataset: the value the objective honours (Registration.trl_shuffle_dataset) or refused."""
    if given.get("reward_model_name_or_path"):
        cfg.grpo.reward_funcs = [text(given["reward_model_name_or_path"]), *cfg.grpo.reward_funcs]
    if "shuffle_dataset" in given and given["shuffle_dataset"] != registration(cfg.objective).trl_shuffle_dataset:
        raise ConfigError(
            f"--shuffle_dataset {str(given['shuffle_dataset']).lower()} is not built: the seeded sampler shuffles the "
            "rows every epoch (--seed); drop the flag"
        )
    for name in SHARED:
        if name not in given:
            continue
        entry = registration(cfg.objective)
        read = [getattr(cfg, s) for s in (entry.settings, *entry.shares) if s and hasattr(getattr(cfg, s, None), name)]
        section = read[0] if read else None
        if section is None:
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
    if names[0] in GRPO_LOSS_TYPES_NOT_BUILT:
        raise ConfigError(
            f"--loss_type {names[0]} ({GRPO_LOSS_TYPES_NOT_BUILT[names[0]]}) is not built in shardtune {objective}: "
            f"choose one of {', '.join(GRPO_LOSS_TYPES)}, or drop the flag (TRL's default: {GRPO_LOSS_TYPES[0]})"
        )
    section.loss_type = names[0]
    return True
