"""TRL's flag names (``trl sft`` / ``trl dpo``: SFTConfig, DPOConfig, ModelConfig, ScriptArguments, transformers'
TrainingArguments) with TRL's meaning, as canonical settings.

Every TRL name is in ``SPELLINGS``: it sets canonical setting(s), or it is refused in one line naming the flag and
what to use instead. Nothing is accepted and ignored. :func:`finish` applies the rules that depend on several TRL
flags at once. The table also feeds ``--help`` and docs/flags.md.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, Callable

from shardtune.config.dialects import (
    Pairs,
    Spelling,
    refused,
    text,
    trl_grpo,
    trl_kto,
    trl_reward,
    trl_rloo,
    trl_trainer,
)
from shardtune.config.dialects.cookbook import STATE as COOKBOOK
from shardtune.config.dialects.cookbook import report_to
from shardtune.config.dialects.trl_model import _attn_implementation, _dtype, _model_init_kwargs, _model_revision
from shardtune.config.dialects.trl_values import _bool
from shardtune.config.fields import flat_fields
from shardtune.config.objectives import OBJECTIVES, registration
from shardtune.config.schema import ConfigError, DpoConfig, TrainConfig, TrlDatasetConfig

STATE = "trl:"


def _number(name: str, value: Any) -> float:
    try:
        return float(text(value)) if isinstance(value, str) or value is None else float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--{name} {value!r} is not a number") from None


def _max_grad_norm(value: Any) -> Pairs:
    norm = _number("max_grad_norm", value)
    if norm < 0:
        raise ConfigError(f"--max_grad_norm {value} must be >= 0 (0: no clipping)")
    return [("optim.max_grad_norm", norm or None)]  # Hugging Face's Trainer: 0 turns clipping off


def _interval(name: str, key: str) -> Callable[[Any], Pairs]:
    """--save_steps / --eval_steps / --logging_steps / --warmup_steps: an integer is steps, a float in (0, 1) a
    fraction of the run's steps (Trainer)."""

    def to(value: Any) -> Pairs:
        steps = _number(name, value)
        if steps < 0 or (steps >= 1 and steps != int(steps)):
            raise ConfigError(f"--{name} {value} is neither a whole number of steps nor a fraction in (0, 1)")
        return [(key, steps)]

    return to


def _warmup_ratio(value: Any) -> Pairs:
    ratio = _number("warmup_ratio", value)
    if not 0 <= ratio < 1:
        raise ConfigError(f"--warmup_ratio {value} must be in [0, 1): a fraction of the run's optimizer steps")
    return [("optim.warmup_steps", ratio)]


def _num_train_epochs(value: Any) -> Pairs:
    epochs = _number("num_train_epochs", value)
    if epochs <= 0:
        raise ConfigError(f"--num_train_epochs {value} must be positive")
    return [("train.num_epochs", epochs)]


def _max_steps(value: Any) -> Pairs:
    steps = _number("max_steps", value)
    if steps == -1:  # TRL's default: unset, the epochs decide
        return [("train.max_steps", 0)]
    if steps < 0 or steps != int(steps):
        raise ConfigError(f"--max_steps {value} must be a whole number of optimizer steps (-1: unset)")
    return [("train.max_steps", int(steps))]


# TRL's scheduler names that are ours too; the others are refused in one line.
TRL_SCHEDULERS = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup")


def _lr_scheduler_type(value: Any) -> Pairs:
    name = text(value)
    if name in TRL_SCHEDULERS or name == "step":
        return [("optim.lr_scheduler", name)]
    raise ConfigError(
        f"--lr_scheduler_type {name} is not built: use one of {', '.join(TRL_SCHEDULERS)} or step "
        "(llama-cookbook's x gamma per epoch)"
    )


def _lr_scheduler_kwargs(value: Any) -> Pairs:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            raise ConfigError(
                f"--lr_scheduler_kwargs {value!r} is not a JSON object: pass e.g. '{{\"min_lr_rate\": 0.1}}'"
            ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"--lr_scheduler_kwargs {value!r} is not a mapping: pass e.g. '{{\"min_lr_rate\": 0.1}}'")
    pairs: Pairs = []
    for key, v in value.items():
        if key not in ("min_lr_rate", "min_lr"):
            raise ConfigError(
                f"--lr_scheduler_kwargs {key} is not built: shardtune takes min_lr_rate or min_lr "
                "(with --lr_scheduler_type cosine_with_min_lr)"
            )
        pairs.append((f"optim.{key}", _number(f"lr_scheduler_kwargs {key}", v)))
    return pairs


TRL_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit")


def _optim(value: Any) -> Pairs:
    name = text(value)
    if name in TRL_OPTIMS:
        return [("optim.optimizer", name)]
    if name == "adamw_bnb_8bit":  # Trainer's other name of adamw_8bit
        return [("optim.optimizer", "adamw_8bit")]
    raise ConfigError(f"--optim {name} is not built: use {', '.join(TRL_OPTIMS)}")


def _switch(name: str, state: str) -> Callable[[Any], Pairs]:
    """A TRL switch that is one of the cookbook's two-flag knobs (settled by the cookbook dialect's finish)."""
    return lambda value: [(COOKBOOK + state, _bool(name, value))]


def _packing(value: Any) -> Pairs:
    return [("data.batching", "packing" if _bool("packing", value) else "padding")]


def _packing_strategy(value: Any) -> Pairs:
    strategy = text(value)  # checked against data.packing_strategy's choices (bfd, bfd_split, wrapped; greedy: ours)
    return [("data.packing_strategy", "bfd_split" if strategy == "bfd-requeue" else strategy)]  # TRL's old name


def _load_in(bits: str) -> Callable[[Any], Pairs]:
    def to(value: Any) -> Pairs:
        if not _bool(f"load_in_{bits}", value):
            return []
        return [("model.quantization", bits), (STATE + f"load_in_{bits}", True)]

    return to


def _eval_strategy(value: Any) -> Pairs:
    strategy = text(value)
    if strategy not in ("no", "epoch", "steps"):
        raise ConfigError(f"--eval_strategy {strategy} is not valid: choose no, steps or epoch")
    return [
        ("eval.enabled", strategy != "no"),
        ("eval.at_epoch_ends", strategy != "steps"),  # Trainer: steps evaluates on its interval only
        (STATE + "eval_strategy", strategy),
    ]


def _save_strategy(value: Any) -> Pairs:
    strategy = text(value)
    if strategy not in ("no", "epoch", "steps"):
        raise ConfigError(f"--save_strategy {strategy} is not built: use no, steps (with --save_steps N) or epoch")
    return [(STATE + "save_strategy", strategy)]  # settled in finish, whatever the order of --save_steps


def _resume(value: Any) -> Pairs:
    given = text(value)
    if given in ("true", ""):
        return [("checkpoint.resume", "latest")]
    if given == "false":
        return []
    return [("checkpoint.resume", given)]


def _num_processes(value: Any) -> Pairs:
    # the command line's --num_processes is the launcher's (the front door takes it); this is a recipe's key
    raise ConfigError(
        "num_processes is a launcher setting: give --num_processes N on the command line, or "
        "num_processes in the Accelerate file"
    )


def _hub_strategy(value: Any) -> Pairs:
    strategy = text(value)
    if strategy not in ("end", "every_save", "checkpoint", "all_checkpoints"):
        raise ConfigError(f"--hub_strategy {value} is not valid: choose end, every_save, checkpoint or all_checkpoints")
    return [(STATE + "hub_strategy", strategy)]  # settled in finish: it means something only with --push_to_hub


def _shuffle_dataset(value: Any) -> Pairs:
    return [(STATE + "shuffle_dataset", _bool("shuffle_dataset", value))]  # its objective's (trl_grpo.settle)


def _greater_is_better(value: Any) -> Pairs:
    return [("eval.greater_is_better", None if text(value) in ("auto", "none") else _bool("greater_is_better", value))]


def _disable_dropout(value: Any) -> Pairs:
    return [("peft.lora.dropout", 0.0)] if _bool("disable_dropout", value) else []


def _completion_only_loss(value: Any) -> Pairs:
    given = text(value).lower()
    if given not in ("auto", "none", "true", "false"):
        raise ConfigError(f"--completion_only_loss {value!r} is not valid: true, false or auto (unset)")
    return [("data.trl_dataset.completion_only_loss", "auto" if given == "none" else given)]


def _loss_type(value: Any) -> Pairs:
    """SFTConfig's loss_type (one name: nll, dft) or DPOConfig's (a list): settled in finish by the objective."""
    names = value if isinstance(value, list) else text(value).split(",")
    return [(STATE + "loss_type", [text(n) for n in names if text(n)])]


def _settle_loss_type(cfg: TrainConfig, names: list[str]) -> None:
    """The objective's: its section's loss_type setting (DPO's list), else the losses its registration names."""
    entry = registration(cfg.objective)
    section = getattr(cfg, entry.settings, None) if entry.settings else None
    if trl_grpo.settle_loss_type(section, names, cfg.objective):  # GRPO's: one name
        return
    if section is not None and hasattr(section, "loss_type"):
        section.loss_type = names
        return
    if not entry.loss_types:
        raise ConfigError(
            f"--loss_type: shardtune {cfg.objective} trains one loss (TRL's config for it has no loss_type): drop "
            "the flag"
        )
    not_built = dict(entry.loss_types_not_built)
    if len(names) == 1 and names[0] in not_built:
        raise ConfigError(
            f"--loss_type {names[0]} ({not_built[names[0]]}) is not built in shardtune {cfg.objective}: drop the "
            f"flag to train TRL's default {entry.loss_types[0]} loss"
        )
    if len(names) != 1 or names[0] not in entry.loss_types:
        owners = [name for name in OBJECTIVES if name != cfg.objective and set(names) <= set(loss_types_of(name))]
        trained_by = f" but of shardtune {' / '.join(owners)}: run shardtune {owners[0]} for it, or" if owners else ":"
        raise ConfigError(
            f"--loss_type {','.join(names)} is not a loss of shardtune {cfg.objective} (TRL's loss_type there: "
            f"{', '.join(entry.loss_types)}){trained_by} for {cfg.objective} drop the flag or pass "
            f"{entry.loss_types[0]}"
        )


def loss_types_of(objective: str) -> tuple[str, ...]:
    """The --loss_type names ``objective`` trains: its section's loss_type choices, else its registration's."""
    entry = registration(objective)
    field = flat_fields().get(f"{entry.settings}.loss_type") if entry.settings else None
    return tuple(field.meta["choices"]) if field is not None else entry.loss_types


T = Spelling

SPELLINGS: dict[str, Spelling] = {
    # model (ModelConfig, ScriptArguments)
    "model_name_or_path": T("model.name", "model directory, hub id or preset:NAME"),
    "model_revision": T(
        "model.revision", "a revision of the hub id --model_name, fetched before launch", _model_revision
    ),
    "dtype": T(
        "train.precision",
        "bfloat16: bf16 compute (fp32 master weights); float16: fp16 with a scaler; auto / float32: fp32",
        _dtype("dtype"),
    ),
    "torch_dtype": T("train.precision", "as --dtype (its older name)", _dtype("torch_dtype")),
    "trust_remote_code": T(
        "model.trust_remote_code", "run the model's own Python code (its auto_map); off by default (docs/security.md)"
    ),
    "attn_implementation": T(
        "model.attn_implementation",
        "sdpa, eager or flash_attention_2 (CUDA); packed rows attend within each example with it",
        _attn_implementation,
    ),
    # PEFT (ModelConfig)
    "use_peft": T("peft.method", "train a LoRA adapter", _switch("use_peft", "use_peft")),
    "lora_r": T("peft.lora.r", "LoRA rank"),
    "lora_alpha": T("peft.lora.alpha", "LoRA scaling numerator"),
    "lora_dropout": T("peft.lora.dropout", "dropout on the LoRA input"),
    "lora_target_modules": T(
        "peft.lora.target_modules", "modules to adapt; all-linear: every linear layer but the output head"
    ),
    "lora_modules_to_save": T("peft.lora.modules_to_save", "modules trained in full and saved with the adapter"),
    "use_rslora": T("peft.lora.use_rslora", "rank-stabilised LoRA: scale lora_alpha / sqrt(r)"),
    "use_dora": T("peft.lora.use_dora", "weight-decomposed LoRA"),
    "load_in_4bit": T("model.quantization", "QLoRA: 4-bit base weights (bitsandbytes)", _load_in("4bit")),
    "load_in_8bit": T("model.quantization", "8-bit base weights (bitsandbytes)", _load_in("8bit")),
    "bnb_4bit_quant_type": T("model.quant_type", "nf4 or fp4"),
    "use_bnb_nested_quant": T(
        "model.double_quant", "quantise the quantisation constants (TRL's default false when --load_in_4bit is given)"
    ),
    # training (SFTConfig, TrainingArguments)
    "per_device_train_batch_size": T("train.batch_size", "micro-batch size per device"),
    "per_device_eval_batch_size": T("eval.batch_size", "eval micro-batch size per device"),
    "learning_rate": T("optim.lr", "peak learning rate"),
    "num_train_epochs": T(
        "train.num_epochs",
        "passes over the data; a fraction (2.5) stops at ceil(2.5 x steps per epoch), the schedule ending there",
        _num_train_epochs,
    ),
    "max_steps": T("train.max_steps", "stop after N optimizer steps; -1: unset", _max_steps),
    "max_grad_norm": T("optim.max_grad_norm", "clip the global gradient norm at it (0: no clipping)", _max_grad_norm),
    "warmup_steps": T(
        "optim.warmup_steps",
        "linear warm-up steps; a float in (0, 1): a fraction of the run",
        _interval("warmup_steps", "optim.warmup_steps"),
    ),
    "warmup_ratio": T("optim.warmup_steps", "warm-up as a fraction of the run's optimizer steps", _warmup_ratio),
    "lr_scheduler_type": T(
        "optim.lr_scheduler",
        "linear, cosine, cosine_with_min_lr, constant, constant_with_warmup (or step)",
        _lr_scheduler_type,
    ),
    "lr_scheduler_kwargs": T("optim.min_lr_rate / optim.min_lr", "cosine_with_min_lr's floor", _lr_scheduler_kwargs),
    "optim": T(
        "optim.optimizer",
        "adamw_torch, adamw_torch_fused, adamw_8bit (adamw_bnb_8bit) or paged_adamw_8bit (bitsandbytes; DDP)",
        _optim,
    ),
    "bf16": T(
        "train.precision",
        "bf16 compute where the device has it (CUDA); fp32 master weights",
        _switch("bf16", "mixed_precision"),
    ),
    "fp16": T("train.precision", "fp16 compute with a gradient scaler (CUDA)", _switch("fp16", "use_fp16")),
    "gradient_checkpointing": T(
        "parallel.activation_checkpointing", "recompute each decoder layer in backward (DDP, FSDP and DeepSpeed)"
    ),
    "gradient_checkpointing_kwargs": trl_trainer.checkpointing_kwargs("gradient_checkpointing_kwargs"),
    "activation_offloading": T("parallel.activation_offloading", "saved activations in CPU memory until backward"),
    "use_liger_kernel": T(
        "model.fast_kernels",
        "liger-kernel's fused RMSNorm / SwiGLU / RoPE on CUDA (and flash-attention 2 where installed)",
    ),
    "save_only_model": T(
        "checkpoint.save_optimizer",
        "true: checkpoints without optimizer state (they do not resume)",
        lambda value: [("checkpoint.save_optimizer", not _bool("save_only_model", value))],
    ),
    "packing": T("data.batching", "true: packing; false: padding", _packing),
    "packing_strategy": T(
        "data.packing_strategy",
        "bfd (best-fit decreasing, rows cut), bfd_split (long rows split), wrapped (concatenated, cut every "
        "max_length tokens, attention across examples), as TRL's, the same blocks; bfd-requeue: bfd_split; greedy: "
        "llama-cookbook's",
        _packing_strategy,
    ),
    "padding_free": T(
        "data.padding_free", "padded batches computed as one row without pad tokens (not given: SFT does so on CPU)"
    ),
    "max_length": T("data.context_length", "tokens per packed block / longest row"),
    "max_seq_length": T("data.context_length", "as --max_length (its older name)"),
    "dataloader_num_workers": T("data.num_workers", "data loader processes per rank"),
    "torch_compile": T("model.compile", "torch.compile each decoder layer"),
    "seed": T("train.seed", "seed of init, data order and dropout"),
    "gradient_accumulation_steps": T("train.gradient_accumulation_steps", "micro-batches per optimizer step"),
    "weight_decay": T("optim.weight_decay", "AdamW weight decay, not on biases and norm weights"),
    "adam_beta1": T("optim.adam_beta1", "AdamW beta1"),
    "adam_beta2": T("optim.adam_beta2", "AdamW beta2"),
    "adam_epsilon": T("optim.adam_epsilon", "AdamW epsilon"),
    # logging, evaluation, saving
    "eval_strategy": T(
        "eval.enabled / eval.steps / eval.at_epoch_ends",
        "no, epoch, or steps (with --eval_steps N; only on that interval, as Trainer)",
        _eval_strategy,
    ),
    "eval_steps": T(
        "eval.steps",
        "evaluate every N optimizer steps (with --eval_strategy steps); a float in (0, 1): "
        "every ceil(F x the run's steps)",
        _interval("eval_steps", "eval.steps"),
    ),
    "eval_on_start": T("eval.on_start", "evaluate the model before the first step (step 0)"),
    "save_strategy": T(
        "checkpoint.save_steps / checkpoint.checkpoint_type",
        "no, epoch, or steps (with --save_steps N)",
        _save_strategy,
    ),
    "save_steps": T(
        "checkpoint.save_steps",
        "checkpoint every N optimizer steps; a float in (0, 1): every ceil(F x the run's steps)",
        _interval("save_steps", "checkpoint.save_steps"),
    ),
    "save_total_limit": T("checkpoint.save_total_limit", "keep the last K checkpoints"),
    "logging_steps": T(
        "logging.steps",
        "trackers receive every Nth step row (a float in (0, 1): every ceil(F x the "
        "run's steps)th); metrics.jsonl keeps every step",
        _interval("logging_steps", "logging.steps"),
    ),
    "output_dir": T("output.dir", "where the model, config.yaml and metrics.jsonl go"),
    "overwrite_output_dir": T("output.overwrite", "replace a previous run's outputs"),
    "resume_from_checkpoint": T(
        "checkpoint.resume", "bare: the newest checkpoint of output_dir; a path: that checkpoint", _resume
    ),
    "report_to": T(
        "logging.report_to",
        "trackers: tensorboard, wandb, trackio (several, or all; none)",
        lambda value: [("logging.report_to", report_to(value))],
    ),
    "load_best_model_at_end": T(
        "eval.load_best_model_at_end",
        "publish the best checkpoint's model (evaluated at its "
        "step) instead of the last; the best is never rotated "
        "out",
    ),
    "metric_for_best_model": T(
        "eval.metric_for_best_model",
        "eval_loss (default), eval_ppl, eval_rouge1, ...: what --load_best_model_at_end compares",
    ),
    "greater_is_better": T(
        "eval.greater_is_better",
        "whether a higher metric is better; unset: not for names ending in loss (Trainer's rule)",
        _greater_is_better,
    ),
    "push_to_hub": T(
        "output.push_to_hub",
        "after the run, upload the published model folder to the hub (refused "
        "before launch when offline or without a token)",
    ),
    "hub_model_id": T("output.hub_model_id", "the --push_to_hub repo; empty: output_dir's folder name"),
    "hub_private_repo": T("output.hub_private_repo", "create the --push_to_hub repo private"),
    "hub_token": T(
        "output.hub_token", "the --push_to_hub token (not written to config.yaml); empty: huggingface_hub's"
    ),
    "hub_strategy": T("-", "end only: one upload after the run", _hub_strategy),
    "shuffle_dataset": T(
        "-",
        "false: no shuffle before tokenising (TRL's default); the seeded sampler still "
        "shuffles every epoch, as Trainer's does",
        _shuffle_dataset,
    ),
    # TRL's data settings (SFTConfig, ScriptArguments): the same names (the mixture is TRL's datasets:, trl_trainer.py)
    **{
        f.name: T(f"data.trl_dataset.{f.name}", f.metadata["help"])
        for f in fields(TrlDatasetConfig)
        if f.name != "dataset_mixture"
    },
    "completion_only_loss": T(
        "data.trl_dataset.completion_only_loss",
        "loss on the completion only; unset: true for prompt-completion data",
        _completion_only_loss,
    ),
    # DPO (DPOConfig): its loss and reference settings, the same names
    **{f.name: T(f"dpo.{f.name}", f.metadata["help"]) for f in fields(DpoConfig) if f.name not in trl_grpo.SHARED},
    **trl_grpo.SPELLINGS,  # GRPO (GRPOConfig); --beta sets the objective's
    **trl_rloo.SPELLINGS,  # RLOO's own (RLOOConfig's names GRPOConfig lacks)
    **trl_reward.SPELLINGS,  # reward models (RewardConfig)
    **trl_kto.SPELLINGS,  # KTO's own (KTOConfig's names DPOConfig lacks)
    "loss_type": T(
        "dpo.loss_type",
        "shardtune dpo: " + DpoConfig.__dataclass_fields__["loss_type"].metadata["help"] + "; shardtune sft: nll "
        "only (TRL's SFT default; dft is not built); shardtune kto: kto or apo_zero_unpaired",
        _loss_type,
    ),
    "disable_dropout": T(
        "peft.lora.dropout",
        "true: no dropout (the LoRA dropout, the one dropout a Llama trains "
        "with, set to 0; TRL's DPO default); false: kept",
        _disable_dropout,
    ),
    "eval_packing": refused(
        "evaluation batches are built as training batches are (--batching_strategy): drop the flag"
    ),
    "dataset_kwargs": refused(
        "the dataset is prepared by shardtune's data flags (docs/data-formats.md): drop the mapping"
    ),
    "pad_token": refused(
        "the tokenizer's pad token is used (its eos when it has none): drop the flag, or give the "
        "model a tokenizer with that pad token"
    ),
    "ld_alpha": refused("LD-DPO's length-desensitised log-probabilities are not built: drop the flag"),
    "use_weighting": refused("WPO's weighting is not built: drop the flag", False),
    **{
        name: refused("the reference stays the starting weights (TR-DPO's syncing is not built): drop the flag", off)
        for name, off in (("sync_ref_model", False), ("ref_model_mixup_alpha", 0.6), ("ref_model_sync_steps", 512))
    },
    "router_aux_loss_coef": refused(
        "a mixture-of-experts router loss: shardtune trains dense Llama-family models; drop the flag"
    ),
    "dataset_num_proc": T("data.num_proc", "processes that tokenise the data before launch; unset: one per CPU"),
    "pad_to_multiple_of": refused(
        "padded micro-batches are padded to their longest row (--padding_free: no pad token at all): drop the flag",
        "auto",
    ),
    "model_init_kwargs": T(
        "train.precision / model.attn_implementation / model.trust_remote_code",
        "a mapping: dtype (or torch_dtype), attn_implementation, trust_remote_code, revision (None: the default), "
        "device_map and use_cache (no effect: placement is the strategy's, training reads no KV cache); other keys "
        "refused",
        _model_init_kwargs,
    ),
    # Accelerate's, on the command line (launcher flags) or in a recipe
    "num_processes": T(
        "nproc_per_node",
        "processes on this machine (Accelerate's name; a launcher flag: the command "
        "line or the Accelerate file, not a recipe)",
        _num_processes,
    ),
    "sp_size": T("parallel.sequence_parallel_size", "Ulysses sequence parallelism (Accelerate's ParallelismConfig)"),
    "cp_size": T("parallel.context_parallel_size", "ring attention (Accelerate's ParallelismConfig)"),
    # the rest of TrainingArguments / ModelConfig / ScriptArguments
    **trl_trainer.SPELLINGS,
}
del T

# TRL's packaged Accelerate profiles (`trl sft --accelerate_config zero2`); shardtune ships files of these names
# (shardtune/config/dialects/accelerate_profiles/).
PROFILES = ("multi_gpu", "single_gpu", "zero1", "zero2", "zero3", "fsdp1", "fsdp2")


def finish(cfg: TrainConfig, state: dict[str, Any], spelled: dict[str, str]) -> None:
    """Rules over several TRL flags: what one means depends on another one given (or not)."""
    given = {key.removeprefix(STATE): value for key, value in state.items() if key.startswith(STATE)}
    if "loss_type" in given:
        _settle_loss_type(cfg, given["loss_type"])
    trl_grpo.settle(cfg, given)
    trl_reward.settle(cfg, given)
    if given.get("hub_strategy", "end") != "end" and cfg.output.push_to_hub:
        raise ConfigError(
            f"--hub_strategy {given['hub_strategy']} is not built: use end (one upload of the final model after the "
            "run; checkpoints are not pushed)"
        )
    if "load_in_4bit" in given and "model.double_quant" not in spelled:
        cfg.model.double_quant = False  # TRL's default for --use_bnb_nested_quant
    eval_strategy = given.get("eval_strategy", "")
    if eval_strategy == "steps" and not cfg.eval.steps:
        cfg.eval.steps = cfg.logging.steps  # Trainer: eval_steps defaults to logging_steps
    if eval_strategy in ("epoch", "no") and cfg.eval.steps:
        raise ConfigError(
            f"--eval_steps {cfg.eval.steps:g} has no effect with --eval_strategy {eval_strategy}: pass "
            "--eval_strategy steps, or drop --eval_steps"
        )
    save_strategy = given.get("save_strategy")
    if save_strategy == "steps" and not cfg.checkpoint.save_steps:
        raise ConfigError("--save_strategy steps needs --save_steps N: say every how many optimizer steps to save")
    if save_strategy in ("no", "epoch"):  # the strategy decides, as in TRL: --save_steps counts only with steps
        cfg.checkpoint.save_steps = 0.0
    if save_strategy == "no":
        if "checkpoint.checkpoint_type" in spelled and cfg.checkpoint.checkpoint_type:
            flag = spelled["checkpoint.checkpoint_type"]
            raise ConfigError(
                f"--save_strategy no writes no checkpoints, but --{flag} {cfg.checkpoint.checkpoint_type} asks for "
                "them: drop one of the two"
            )
        cfg.checkpoint.checkpoint_type = ""
    if save_strategy == "epoch" and not cfg.checkpoint.checkpoint_type:
        cfg.checkpoint.checkpoint_type = "SHARDED_STATE_DICT"
