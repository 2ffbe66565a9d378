"""llama-cookbook's flags (its train_config and fsdp_config, with the cookbook's meaning) and the flat names shardtune
accepted before its config had groups, as canonical settings.

Most are renames (``--lr`` is optim.lr). A few of the cookbook's knobs are two flags for one setting
(``--gradient_clipping`` and ``--gradient_clipping_threshold`` are optim.max_grad_norm; ``--use_peft`` and
``--peft_method`` are peft.method; ``--enable_fsdp`` / ``--enable_deepspeed`` are parallel.strategy; ``--use_fp16``,
``--mixed_precision`` and ``--fsdp_config.pure_bf16`` are train.precision; ``--freeze_layers`` and
``--num_freeze_layers`` are model.freeze_layers; ``--hsdp`` selects HYBRID_SHARD; ``--use_wandb`` adds wandb to
logging.report_to): their values are kept as given and :func:`finish` settles them once every flag is read, so the
order in which they come does not matter.
"""

from __future__ import annotations

from typing import Any

from shardtune.config.dialects import Pairs, Spelling, text
from shardtune.config.fields import FALSE, TRUE
from shardtune.config.mixture import MIXTURE_KEY, mixture_entries
from shardtune.config.schema import REPORT_TO, ConfigError, TrainConfig

STATE = "cookbook:"


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if text(value).lower() in TRUE:
        return True
    if text(value).lower() in FALSE:
        return False
    raise ConfigError(f"--{name} {value!r} is not a boolean: use true or false")


def _number(name: str, value: Any, kind=float) -> Any:
    try:
        return kind(text(value)) if isinstance(value, str) or value is None else kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--{name} {value!r} is not {'an integer' if kind is int else 'a number'}") from None


def rule(name: str, kind: str = "bool") -> Spelling:
    """A flag that settles a setting together with others (:func:`finish`)."""
    convert = {
        "bool": lambda v: _bool(name, v),
        "int": lambda v: _number(name, v, int),
        "float": lambda v: _number(name, v),
        "str": text,
    }[kind]
    return Spelling(TARGETS.get(name, "-"), to=lambda value: [(STATE + name, convert(value))])


# the canonical setting each rule flag settles (docs/flags.md)
TARGETS = {
    "gradient_clipping": "optim.max_grad_norm",
    "gradient_clipping_threshold": "optim.max_grad_norm",
    "use_peft": "peft.method",
    "peft_method": "peft.method",
    "enable_fsdp": "parallel.strategy",
    "enable_deepspeed": "parallel.strategy",
    "use_fp16": "train.precision",
    "mixed_precision": "train.precision",
    "pure_bf16": "train.precision",
    "freeze_layers": "model.freeze_layers",
    "num_freeze_layers": "model.freeze_layers",
    "hsdp": "parallel.sharding_strategy",
    "use_wandb": "logging.report_to",
    "report_to": "logging.report_to",
}


def _quantization(value: Any) -> Pairs:
    bits = {"int4": "4bit", "int8": "8bit"}.get(text(value), "" if value is None else text(value))
    return [("model.quantization", bits)]


def _fractional_epochs(value: Any) -> Pairs:
    epochs = _number("fractional_epochs", value)
    return [("train.num_epochs", epochs)] if epochs else []


def _fixed(name: str, accepted: Any, why: str) -> Spelling:
    """A flag accepted only with the value that means what shardtune does."""

    def to(value: Any) -> Pairs:
        if text(value) == text(accepted):
            return []
        raise ConfigError(f"--{name} {text(value)}: {why}")

    return Spelling("-", to=to)


def _eval_only(value: Any) -> Pairs:
    only = _bool("eval_only", value)
    return [("eval.only", only)] + ([("eval.enabled", True)] if only else [])


def _no_effect(meaning: str) -> Spelling:
    return Spelling("-", meaning=meaning, to=lambda value: [])


def _renames(prefix: str, target: str, names: dict[str, str] | list[str]) -> dict[str, Spelling]:
    pairs = names.items() if isinstance(names, dict) else ((n, n) for n in names)
    return {f"{prefix}{old}": Spelling(f"{target}{new}") for old, new in pairs}


DATASET_SECTIONS = (
    "synthetic_dialogues",
    "samsum_dataset",
    "alpaca_dataset",
    "custom_dataset",
    "grammar_dataset",
    "trl_dataset",
)
FSDP_NAMES = {
    "sharding_strategy": "parallel.sharding_strategy",
    "sharding_group_size": "parallel.sharding_group_size",
    "replica_group_size": "parallel.replica_group_size",
    "fsdp_cpu_offload": "parallel.cpu_offload",
    "fsdp_activation_checkpointing": "parallel.activation_checkpointing",
    "checkpoint_type": "checkpoint.checkpoint_type",
}


def _section_renames() -> dict[str, Spelling]:
    from shardtune.config.fields import flat_fields

    out: dict[str, Spelling] = {}
    for key in flat_fields():
        group, *rest = key.split(".")
        if group == "data" and rest and rest[0] in DATASET_SECTIONS and len(rest) == 2:
            out[".".join(rest)] = Spelling(key)  # --samsum_dataset.data_path
        if group == "logging" and rest[0] == "wandb" and len(rest) == 2:
            out[f"wandb_config.{rest[1]}"] = Spelling(key)
        if group == "peft" and rest[0] in ("llama_adapter", "prefix") and len(rest) == 2:
            out[f"{rest[0]}_config.{rest[1]}"] = Spelling(key)
    return out


SPELLINGS: dict[str, Spelling] = {
    # llama-cookbook's train_config
    "model_name": Spelling("model.name"),
    "tokenizer_name": Spelling("model.tokenizer"),
    "enable_fsdp": rule("enable_fsdp"),
    "enable_deepspeed": rule("enable_deepspeed"),
    "low_cpu_fsdp": Spelling("parallel.low_cpu_fsdp"),
    "run_validation": Spelling("eval.enabled"),
    "batch_size_training": Spelling("train.batch_size"),
    "batching_strategy": Spelling("data.batching"),
    "context_length": Spelling("data.context_length"),
    "gradient_clipping": rule("gradient_clipping"),
    "gradient_clipping_threshold": rule("gradient_clipping_threshold", "float"),
    "num_epochs": Spelling("train.num_epochs"),
    "max_train_step": Spelling("train.stop_after_steps"),
    "max_eval_step": Spelling("eval.max_batches"),
    "num_workers_dataloader": Spelling("data.num_workers"),
    "lr": Spelling("optim.lr"),
    "gamma": Spelling("optim.gamma"),
    "use_fp16": rule("use_fp16"),
    "mixed_precision": rule("mixed_precision"),
    "val_batch_size": Spelling("eval.batch_size"),
    "dataset": Spelling("data.dataset"),
    "peft_method": rule("peft_method", "str"),
    "from_peft_checkpoint": Spelling("peft.from_checkpoint"),
    "freeze_layers": rule("freeze_layers"),
    "num_freeze_layers": rule("num_freeze_layers", "int"),
    "freeze_LLM_only": Spelling("model.freeze_llm_only"),
    "quantization": Spelling("model.quantization", meaning="4bit / 8bit (int4 / int8: the same)", to=_quantization),
    "one_gpu": Spelling("parallel.one_gpu"),
    "save_model": Spelling("output.save_model"),
    "dist_checkpoint_root_folder": Spelling("checkpoint.dist_checkpoint_root_folder"),
    "dist_checkpoint_folder": Spelling("checkpoint.dist_checkpoint_folder"),
    "save_optimizer": Spelling("checkpoint.save_optimizer"),
    "use_fast_kernels": Spelling("model.fast_kernels"),
    "use_wandb": rule("use_wandb"),
    "save_metrics": Spelling("logging.save_metrics"),
    "flop_counter": Spelling("logging.flop_counter"),
    "flop_counter_start": Spelling("logging.flop_counter_start"),
    "use_profiler": Spelling("logging.profiler"),
    "profiler_dir": Spelling("logging.profiler_dir"),
    "enable_activation_checkpointing": Spelling("parallel.activation_checkpointing"),
    "activation_checkpointing_use_reentrant": _fixed(
        "activation_checkpointing_use_reentrant",
        False,
        "shardtune recomputes layers non-reentrantly (same result, works with FSDP2): drop the flag",
    ),
    "enable_memory_monitoring": _no_effect("peak memory is in every metrics.jsonl row and the start log, always"),
    "memory_monitoring_interval": _no_effect("memory is logged every step"),
    # llama-cookbook's fsdp_config (also without its prefix, as the cookbook accepts them)
    **{f"fsdp_config.{name}": Spelling(target) for name, target in FSDP_NAMES.items()},
    **{name: Spelling(target) for name, target in FSDP_NAMES.items()},
    "fsdp_config.hsdp": rule("hsdp"),
    "hsdp": rule("hsdp"),
    "fsdp_config.pure_bf16": rule("pure_bf16"),
    "pure_bf16": rule("pure_bf16"),
    "fsdp_config.use_fp16": rule("use_fp16"),
    "fsdp_config.mixed_precision": rule("mixed_precision"),
    "fsdp_config.optimizer": _fixed(
        "fsdp_config.optimizer",
        "AdamW",
        "torchdistx's AnyPrecisionAdamW is not "
        "available: use AdamW (the default), with --fsdp_config.pure_bf16 for bf16 "
        "optimizer state",
    ),
    "optimizer": _fixed(
        "fsdp_config.optimizer",
        "AdamW",
        "torchdistx's AnyPrecisionAdamW is not available: use "
        "AdamW (the default), with --fsdp_config.pure_bf16 for bf16 optimizer state",
    ),
    # peft and quantisation sections, as the cookbook's configs name them
    **_renames(
        "lora_config.",
        "peft.lora.",
        {
            "r": "r",
            "lora_alpha": "alpha",
            "target_modules": "target_modules",
            "lora_dropout": "dropout",
            "bias": "bias",
            "use_dora": "use_dora",
            "use_rslora": "use_rslora",
            "modules_to_save": "modules_to_save",
        },
    ),
    **_renames(
        "quantization_config.",
        "model.",
        {"quant_type": "quant_type", "use_double_quant": "double_quant", "compute_dtype": "quant_compute_dtype"},
    ),
    **_renames(
        "deepspeed_config.",
        "parallel.",
        {
            "zero_stage": "zero_stage",
            "offload_optimizer": "offload_optimizer",
            "offload_param": "offload_param",
            "config_file": "deepspeed_config_file",
        },
    ),
    # shardtune's flat names before its config had groups
    "fractional_epochs": Spelling("train.num_epochs", meaning="a fraction of epochs", to=_fractional_epochs),
    "lr_scheduler": Spelling("optim.lr_scheduler"),
    "min_lr_rate": Spelling("optim.min_lr_rate"),
    "min_lr": Spelling("optim.min_lr"),
    "logging_fraction": Spelling("logging.steps"),
    "eval_fraction": Spelling("eval.steps"),
    "save_fraction": Spelling("checkpoint.save_steps"),
    "strict_data": Spelling("data.strict"),
    "dataset_mixture": Spelling(
        MIXTURE_KEY,
        "several datasets in one run by weight: path[@split][:weight], comma-separated (data/a.jsonl:0.7,"
        "data/b.jsonl:0.3); a recipe may give TRL's datasets: mappings here too (docs/data-formats.md#mixtures)",
        lambda value: [(MIXTURE_KEY, mixture_entries("--dataset_mixture", value))],
    ),
    "save_plots": Spelling("logging.save_plots"),
    "debug": Spelling("run.debug"),
    "defaults": Spelling("run.defaults"),
    "dry_run": Spelling("run.dry_run"),
    "compile": Spelling("model.compile"),
    # LLaMA-Factory's names for a vision-language model's parts (TRL has none)
    "freeze_vision_tower": Spelling("model.freeze_vision_tower"),
    "freeze_multi_modal_projector": Spelling("model.freeze_multi_modal_projector"),
    "freeze_language_model": Spelling("model.freeze_language_model"),
    "resume": Spelling("checkpoint.resume"),
    "nan_policy": Spelling("train.nan_policy"),
    "sequence_parallel_size": Spelling("parallel.sequence_parallel_size"),
    "context_parallel_size": Spelling("parallel.context_parallel_size"),
    "tiled_mlp": Spelling("parallel.tiled_mlp"),
    "rope_scaling": Spelling("model.rope_scaling"),
    "rope_factor": Spelling("model.rope_factor"),
    "log_eval_samples": Spelling("eval.log_samples"),
    "eval_only": Spelling(
        "eval.only / eval.enabled",
        "evaluate the model once on the test split and stop, no training step (trainer.evaluate()'s run)",
        _eval_only,
    ),
    "dist_timeout": Spelling("parallel.dist_timeout"),
    **_section_renames(),
}

# Our settings named by llama-cookbook's train_config (the docs' cookbook column).
COOKBOOK_NAMES = frozenset(
    {
        "model_name",
        "batch_size_training",
        "val_batch_size",
        "lr",
        "num_epochs",
        "max_train_step",
        "gradient_clipping_threshold",
        "gradient_clipping",
        "mixed_precision",
        "use_fp16",
        "batching_strategy",
        "num_workers_dataloader",
        "use_peft",
        "quantization",
        "run_validation",
        "output_dir",
        "weight_decay",
        "seed",
        "gradient_accumulation_steps",
        "fsdp_config.fsdp_activation_checkpointing",
        "lora_config.r",
        "lora_config.lora_alpha",
        "lora_config.lora_dropout",
        "lora_config.target_modules",
        "context_length",
    }
)


def finish(cfg: TrainConfig, state: dict[str, Any], spelled: dict[str, str]) -> None:
    """Settle the flags that mean something together (``state``: their values as given, by name)."""
    given = {key.removeprefix(STATE): value for key, value in state.items() if key.startswith(STATE)}
    strategy(cfg, given)
    precision(cfg, given)
    if "gradient_clipping" in given:
        cfg.optim.max_grad_norm = given.get("gradient_clipping_threshold", 1.0) if given["gradient_clipping"] else None
    elif "gradient_clipping_threshold" in given and cfg.optim.max_grad_norm is not None:
        cfg.optim.max_grad_norm = given["gradient_clipping_threshold"]
    if "freeze_layers" in given:
        number = given.get("num_freeze_layers", 1)
        if given["freeze_layers"] and number <= 0:
            raise ConfigError(
                f"--num_freeze_layers {number} must be positive: pass the number of decoder layers to "
                "freeze, counted from the embeddings"
            )
        cfg.model.freeze_layers = number if given["freeze_layers"] else 0
    if "use_peft" in given or "peft_method" in given:
        method = given.get("peft_method") or cfg.peft.method or "lora"
        cfg.peft.method = method if given.get("use_peft", bool(cfg.peft.method)) else ""
    if given.get("hsdp"):
        if cfg.parallel.sharding_strategy == "FULL_SHARD":
            cfg.parallel.sharding_strategy = "HYBRID_SHARD"
        elif cfg.parallel.sharding_strategy != "HYBRID_SHARD":
            raise ConfigError(
                f"--fsdp_config.hsdp true needs --fsdp_config.sharding_strategy HYBRID_SHARD, not "
                f"{cfg.parallel.sharding_strategy}: set it, or drop --fsdp_config.hsdp"
            )
    if given.get("use_wandb") and "wandb" not in cfg.logging.report_to:
        cfg.logging.report_to = [*cfg.logging.report_to, "wandb"]


def strategy(cfg: TrainConfig, given: dict[str, Any]) -> None:
    if "enable_fsdp" not in given and "enable_deepspeed" not in given:
        return
    fsdp = given.get("enable_fsdp", cfg.parallel.strategy == "fsdp")
    deepspeed = given.get("enable_deepspeed", cfg.parallel.strategy == "deepspeed")
    if fsdp and deepspeed:
        raise ConfigError(
            "--enable_fsdp and --enable_deepspeed are both set: they are two sharding strategies; drop one of them"
        )
    cfg.parallel.strategy = "fsdp" if fsdp else "deepspeed" if deepspeed else "ddp"


def precision(cfg: TrainConfig, given: dict[str, Any]) -> None:
    if not {"use_fp16", "mixed_precision", "pure_bf16"} & set(given):
        return
    now = cfg.train.precision
    fp16 = given.get("use_fp16", now == "fp16")
    pure = given.get("pure_bf16", now == "pure_bf16")
    if fp16 and pure:
        raise ConfigError(
            "--use_fp16 and --fsdp_config.pure_bf16 are both set: fp16 and bf16 exclude each other; drop one of them"
        )
    mixed = given.get("mixed_precision", now != "fp32")
    cfg.train.precision = "fp16" if fp16 else "pure_bf16" if pure else "auto" if mixed else "fp32"


def report_to(names: Any) -> list[str]:
    """The trackers of a --report_to value (TRL's: a list, comma-separated; none; all)."""
    given = names if isinstance(names, list) else text(names).split(",")
    given = [str(n).strip() for n in given if str(n).strip()]
    if len(given) > 1 and "none" in given:
        raise ConfigError(f"--report_to {','.join(given)}: none excludes the others: drop it or them")
    if "all" in given:
        return list(REPORT_TO)
    return [n for n in given if n != "none"]
