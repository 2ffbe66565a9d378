"""Whose defaults the settings a user leaves out take: llama-cookbook's (the canonical config's own defaults, what the
lesson's commands have always got) or TRL 1.16's (SFTConfig / DPOConfig / ModelConfig: a TRL command means what it
means in TRL).

The rule, applied once when a command line (and its recipe) is read:

1. ``--defaults trl|cookbook`` decides, when given;
2. else the names used decide: a name only TRL has for a setting the cookbook also names (``--learning_rate``,
   ``--model_name_or_path``, ``--per_device_train_batch_size``, ``--dataset_name`` ...) speaks TRL; the cookbook's
   counterparts (``--lr``, ``--model_name``, ``--batch_size_training`` ...) speak llama-cookbook; both at once is
   refused in one line (which defaults apply would be a guess);
3. else (only names both use, or shardtune's own): the objective's home (its Registration.home): llama-cookbook for
   sft, TRL for dpo and grpo.

Code that builds a config (``config_from``) gets the cookbook's unless it says ``defaults``. The table of TRL's
values is checked against trl's own dataclasses by tests/unit/test_trl_defaults.py.
"""

from __future__ import annotations

from typing import Any, Iterable

from shardtune.config.objectives import OBJECTIVES, registration
from shardtune.config.schema import ConfigError

PROFILES = ("cookbook", "trl")

# TRL 1.16's defaults where they differ from the canonical (the cookbook's), shared by its trainers (SFTConfig's, on
# TrainingArguments): canonical key -> value; an objective's own differences are in its Registration.defaults
TRL_SFT = {
    "optim.lr": 2e-5,
    "optim.lr_scheduler": "linear",
    "optim.max_grad_norm": 1.0,
    "optim.optimizer": "adamw_torch_fused",
    "train.num_epochs": 3.0,
    "train.batch_size": 8,
    "eval.batch_size": 8,
    "eval.enabled": False,  # eval_strategy no
    "data.batching": "padding",  # packing false
    "data.packing_strategy": "bfd",  # what --packing packs with
    "data.num_workers": 0,
    "checkpoint.save_steps": 500.0,  # save_strategy steps, save_steps 500
    "logging.steps": 10.0,
    "parallel.activation_checkpointing": True,  # gradient_checkpointing true
    "peft.lora.r": 16,
    "peft.lora.alpha": 32,
    "peft.lora.dropout": 0.05,
}


def implied(names: Iterable[str]) -> tuple[str, list[str]]:
    """The defaults the names speak for ("" if none) and the names that say so; a mix raises."""
    from shardtune.config.spellings import dialect_of

    said: dict[str, list[str]] = {"trl": [], "cookbook": []}
    for name in names:
        dialect = dialect_of(name)
        if dialect and name not in said[dialect]:
            said[dialect].append(name)
    if said["trl"] and said["cookbook"]:
        raise ConfigError(
            f"--{said['trl'][0]} is TRL's name and --{said['cookbook'][0]} llama-cookbook's: the settings you "
            "leave out would take one tool's defaults or the other's: use one tool's names, or say whose with "
            "--defaults trl (TRL 1.16's SFTConfig) or --defaults cookbook"
        )
    for profile in PROFILES:
        if said[profile]:
            return profile, said[profile]
    return "", []


def profile_defaults(profile: str, objective: str) -> dict[str, Any]:
    """Canonical key -> value of ``profile``'s defaults for ``objective`` where they differ from the canonical: the
    profile's shared ones (TRL's: TRL_SFT; the cookbook's: the canonical defaults themselves), then the objective's own
    (its Registration.defaults)."""
    shared = TRL_SFT if profile == "trl" else {}
    return {**shared, **registration(objective).defaults.get(profile, {})}


def summary(cfg: Any) -> str:
    """The start log's line: whose defaults, and the settings they decide, as the run has them."""
    o, t, c = cfg.optim, cfg.train, cfg.checkpoint
    whose = {"trl": "TRL's", "cookbook": "llama-cookbook's"}[cfg.run.defaults]
    how = cfg.provenance.defaults_reason
    steps = f"{t.max_steps} steps" if t.max_steps else f"{t.num_epochs:g} epoch{'' if t.num_epochs == 1 else 's'}"
    if c.save_steps:
        saves = f"checkpoints every {c.save_steps:g}" + (" of the steps" if c.save_steps < 1 else " steps")
    else:
        saves = "checkpoints at epoch ends" if c.checkpoint_type else "no checkpoints"
    warmup = f"{o.warmup_steps:g}" + (" of the steps" if 0 < o.warmup_steps < 1 else " steps")
    parts = [
        f"lr {o.lr:g}",
        f"{o.lr_scheduler} schedule",
        f"warmup {warmup}",
        f"max_grad_norm {o.max_grad_norm:g}" if o.max_grad_norm else "no clipping",
        steps,
        f"batch {t.batch_size}",
        saves,
        cfg.data.batching,
    ]
    if cfg.peft.method == "lora":
        lora = cfg.peft.lora
        parts.append(f"LoRA r {lora.r} / alpha {lora.alpha} / dropout {lora.dropout:g}")
    return f"defaults: {whose}{f' ({how})' if how else ''}: " + ", ".join(parts)


# the built-in objectives' TRL defaults and homes (--help, docs/flags.md; checked against trl's dataclasses)
TRL_DEFAULTS = {name: profile_defaults("trl", name) for name in OBJECTIVES}
HOME = {name: entry.home for name, entry in OBJECTIVES.items()}
