"""TRL's flag names (``trl sft``: SFTConfig, ModelConfig, ScriptArguments, transformers' TrainingArguments) with
TRL's meaning, as shardtune settings.

    translate(name, value) -> [(our_key, value), ...]   # one flag as given -> the shardtune settings it sets
    finish(cfg, given)                                   # the rules that depend on several TRL flags at once

Every TRL name is in ``TRL_FLAGS``: it maps onto our setting(s), or it is refused in one line naming the flag and
what to use instead. Nothing is accepted and ignored. The table also feeds ``--help`` and docs/flags.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any, Callable

from shardtune.config.schema import ConfigError, TrlDatasetConfig

Pairs = list[tuple[str, Any]]


class TrlFlagError(ValueError):
    """Raised by a translation; the parser re-raises it as a ConfigError (one line)."""


@dataclass(frozen=True)
class TrlFlag:
    ours: str                                   # our setting(s), as the docs show them
    meaning: str                                # what it does here
    to: Callable[[Any], Pairs] | None = None    # value -> our settings; None: a plain rename to ``ours``
    refuse: str = ""                            # non-empty: refused, with this fix


def _text(value: Any) -> str:
    return "true" if value is None else str(value).lower() if isinstance(value, bool) else str(value).strip()


def _bool(name: str, value: Any) -> bool:
    text = _text(value).lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise TrlFlagError(f"--{name} {value!r} is not a boolean: use true or false")


def _number(name: str, value: Any) -> float:
    try:
        return float(_text(value))
    except ValueError:
        raise TrlFlagError(f"--{name} {value!r} is not a number") from None


def _max_grad_norm(value: Any) -> Pairs:
    norm = _number("max_grad_norm", value)
    if norm < 0:
        raise TrlFlagError(f"--max_grad_norm {value} must be >= 0 (0: no clipping)")
    if norm == 0:  # Hugging Face's Trainer: 0 turns clipping off
        return [("gradient_clipping", "false")]
    return [("gradient_clipping", "true"), ("gradient_clipping_threshold", str(norm))]


def _warmup_steps(value: Any) -> Pairs:
    """transformers 5: an integer is steps, a float in (0, 1) a fraction of the run's steps."""
    steps = _number("warmup_steps", value)
    if 0 < steps < 1:
        return [("warmup_ratio", str(steps))]
    if steps != int(steps):
        raise TrlFlagError(f"--warmup_steps {value} is neither a whole number of steps nor a fraction in (0, 1)")
    return [("warmup_steps", str(int(steps)))]


def _num_train_epochs(value: Any) -> Pairs:
    epochs = _number("num_train_epochs", value)
    if epochs <= 0:
        raise TrlFlagError(f"--num_train_epochs {value} must be positive")
    if epochs != int(epochs):  # Trainer: max_steps = ceil(epochs x steps per epoch), over ceil(epochs) epochs
        return [("num_epochs", str(math.ceil(epochs))), ("fractional_epochs", repr(epochs))]
    return [("num_epochs", str(int(epochs)))]


def _max_steps(value: Any) -> Pairs:
    steps = _number("max_steps", value)
    if steps == -1:  # TRL's default: unset, the epochs decide
        return [("max_train_step", "0")]
    return [("max_train_step", _text(value))]


# TRL's scheduler names that are ours too; the others are refused in one line.
TRL_SCHEDULERS = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup")


def _lr_scheduler_type(value: Any) -> Pairs:
    name = _text(value)
    if name in TRL_SCHEDULERS or name == "step":
        return [("lr_scheduler", name)]
    raise TrlFlagError(f"--lr_scheduler_type {name} is not built: use one of {', '.join(TRL_SCHEDULERS)} or step "
                       "(llama-cookbook's x gamma per epoch)")


def _lr_scheduler_kwargs(value: Any) -> Pairs:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            raise TrlFlagError(f"--lr_scheduler_kwargs {value!r} is not a JSON object: pass e.g. "
                               "'{\"min_lr_rate\": 0.1}'") from None
    if not isinstance(value, dict):
        raise TrlFlagError(f"--lr_scheduler_kwargs {value!r} is not a mapping: pass e.g. '{{\"min_lr_rate\": 0.1}}'")
    pairs: Pairs = []
    for key, v in value.items():
        if key not in ("min_lr_rate", "min_lr"):
            raise TrlFlagError(f"--lr_scheduler_kwargs {key} is not built: shardtune takes min_lr_rate or min_lr "
                               "(with --lr_scheduler_type cosine_with_min_lr)")
        pairs.append((key, str(v)))
    return pairs


TRL_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit")


def _optim(value: Any) -> Pairs:
    name = _text(value)
    if name in TRL_OPTIMS:
        return [("optim", name)]
    if name == "adamw_bnb_8bit":  # Trainer's other name of adamw_8bit
        return [("optim", "adamw_8bit")]
    raise TrlFlagError(f"--optim {name} is not built: use {', '.join(TRL_OPTIMS)}")


def _dtype(name: str) -> Callable[[Any], Pairs]:
    def to(value: Any) -> Pairs:
        dtype = _text(value)
        if dtype in ("auto", "float32", "fp32"):
            return []  # master weights are fp32 always; the compute dtype is --bf16 / --fp16
        if dtype in ("bfloat16", "bf16"):
            return [("mixed_precision", "true")]
        if dtype in ("float16", "fp16"):
            return [("use_fp16", "true")]
        raise TrlFlagError(f"--{name} {dtype} is not valid: choose auto, bfloat16, float16 or float32")
    return to


def _packing(value: Any) -> Pairs:
    return [("batching_strategy", "packing" if _bool("packing", value) else "padding")]


def _packing_strategy(value: Any) -> Pairs:
    if _text(value) == "bfd":
        return []  # best-fit decreasing: shardtune's packing (blocks of whole examples, no cross-attention)
    raise TrlFlagError(f"--packing_strategy {value} is not built: use bfd (whole examples in blocks, without "
                       "attention across them: shardtune's packing)")


def _load_in(bits: str) -> Callable[[Any], Pairs]:
    return lambda value: [("quantization", bits)] if _bool(f"load_in_{bits}", value) else []


def _eval_strategy(value: Any) -> Pairs:
    strategy = _text(value)
    if strategy == "no":
        return [("run_validation", "false")]
    if strategy in ("epoch", "steps"):
        return [("run_validation", "true")]
    raise TrlFlagError(f"--eval_strategy {strategy} is not valid: choose no, steps or epoch")


def _save_strategy(value: Any) -> Pairs:
    strategy = _text(value)
    if strategy == "no":
        return [("save_steps", "0")]
    if strategy == "epoch":
        return [("fsdp_config.checkpoint_type", "SHARDED_STATE_DICT")]
    if strategy == "steps":
        return []  # with --save_steps N (checked in finish)
    raise TrlFlagError(f"--save_strategy {strategy} is not built: use no, steps (with --save_steps N) or epoch")


def _interval(name: str) -> Callable[[Any], Pairs]:
    """--save_steps / --eval_steps: an integer is steps, a float in (0, 1) a fraction of the run's steps (Trainer)."""
    def to(value: Any) -> Pairs:
        steps = _number(f"{name}_steps", value)
        if 0 < steps < 1:
            return [(f"{name}_fraction", repr(steps))]
        if steps != int(steps) or steps < 0:
            raise TrlFlagError(f"--{name}_steps {value} is neither a whole number of steps nor a fraction in (0, 1)")
        return [(f"{name}_steps", str(int(steps)))]
    return to


def _resume(value: Any) -> Pairs:
    text = _text(value)
    if text in ("true", ""):
        return [("resume", "latest")]
    if text == "false":
        return []
    return [("resume", text)]


def _report_to(value: Any) -> Pairs:
    names = [n.strip() for n in (value if isinstance(value, list) else _text(value).split(",")) if n.strip()]
    if len(names) > 1:
        if "none" in names:
            raise TrlFlagError(f"--report_to {','.join(names)}: none excludes the others: drop it or them")
        return [("report_to", "all" if set(names) >= {"tensorboard", "wandb", "trackio"} else ",".join(names))]
    return [("report_to", names[0] if names else "none")]


def _num_processes(value: Any) -> Pairs:
    # the command line's --num_processes is the launcher's (take_num_processes); this is a recipe's key
    raise TrlFlagError("num_processes is a launcher setting: give --num_processes N on the command line, or "
                       "num_processes in the Accelerate file")


def _model_revision(value: Any) -> Pairs:
    return [] if _text(value) == "main" else [("model_revision", _text(value))]  # main: the hub id as it is


def _attn_implementation(value: Any) -> Pairs:
    if _text(value) in ("sdpa", "eager", "flash_attention_2"):
        return [("attn_implementation", _text(value))]
    raise TrlFlagError(f"--attn_implementation {value} is not built: use sdpa, eager or flash_attention_2 (CUDA, "
                       "flash-attn installed), or drop the flag (shardtune's choice: SDPA, varlen for packed rows)")


def _gradient_checkpointing_kwargs(value: Any) -> Pairs:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict) or set(value) - {"use_reentrant"}:
        raise TrlFlagError(f"--gradient_checkpointing_kwargs {value!r}: shardtune takes only "
                           "'{\"use_reentrant\": false}' (it recomputes non-reentrantly)")
    return [("activation_checkpointing_use_reentrant", _text(value.get("use_reentrant", False)))]


def _hub_strategy(value: Any) -> Pairs:
    if _text(value) == "end":
        return []  # the one upload, after the final model is published
    raise TrlFlagError(f"--hub_strategy {value} is not built: use end (one upload of the final model after the run; "
                       "checkpoints are not pushed)")


def _shuffle_dataset(value: Any) -> Pairs:
    if _bool("shuffle_dataset", value):
        raise TrlFlagError("--shuffle_dataset true is not built: the seeded sampler shuffles the rows every epoch "
                           "(--seed); drop the flag")
    return []


T = TrlFlag


def refused(why: str) -> TrlFlag:
    """A TRL name refused in one line: ``--name: why`` (``why`` ends with the fix)."""
    return TrlFlag("-", "-", refuse=why)

TRL_FLAGS: dict[str, TrlFlag] = {
    # model (ModelConfig, ScriptArguments)
    "model_name_or_path": T("model_name", "model directory, hub id or preset:NAME"),
    "model_revision": T("model_revision", "a revision of the hub id --model_name, fetched before launch",
                        _model_revision),
    "dtype": T("mixed_precision / use_fp16", "bfloat16: bf16 compute (fp32 master weights); float16: fp16 with a "
                                             "scaler; auto / float32: fp32", _dtype("dtype")),
    "torch_dtype": T("mixed_precision / use_fp16", "as --dtype (its older name)", _dtype("torch_dtype")),
    "trust_remote_code": T("trust_remote_code", "run the model's own Python code (its auto_map); off by default "
                                                "(docs/security.md)"),
    "attn_implementation": T("attn_implementation", "sdpa, eager or flash_attention_2 (CUDA); packed rows attend "
                                                    "within each example with it", _attn_implementation),
    # PEFT (ModelConfig)
    "lora_r": T("lora_config.r", "LoRA rank"),
    "lora_alpha": T("lora_config.lora_alpha", "LoRA scaling numerator"),
    "lora_dropout": T("lora_config.lora_dropout", "dropout on the LoRA input"),
    "lora_target_modules": T("lora_config.target_modules", "modules to adapt; all-linear: every linear layer but "
                                                           "the output head"),
    "lora_modules_to_save": T("lora_config.modules_to_save", "modules trained in full and saved with the adapter"),
    "use_rslora": T("lora_config.use_rslora", "rank-stabilised LoRA: scale lora_alpha / sqrt(r)"),
    "use_dora": T("lora_config.use_dora", "weight-decomposed LoRA"),
    "load_in_4bit": T("quantization 4bit", "QLoRA: 4-bit base weights (bitsandbytes)", _load_in("4bit")),
    "load_in_8bit": T("quantization 8bit", "8-bit base weights (bitsandbytes)", _load_in("8bit")),
    "bnb_4bit_quant_type": T("quantization_config.quant_type", "nf4 or fp4"),
    "use_bnb_nested_quant": T("quantization_config.use_double_quant", "quantise the quantisation constants (TRL's "
                                                                      "default false when --load_in_4bit is given)"),
    # training (SFTConfig, TrainingArguments)
    "per_device_train_batch_size": T("batch_size_training", "micro-batch size per device"),
    "per_device_eval_batch_size": T("val_batch_size", "eval micro-batch size per device"),
    "learning_rate": T("lr", "peak learning rate"),
    "num_train_epochs": T("num_epochs", "passes over the data; a fraction (2.5) stops at ceil(2.5 x steps per "
                                          "epoch), the schedule ending there", _num_train_epochs),
    "max_steps": T("max_train_step", "stop after N optimizer steps; -1: unset", _max_steps),
    "max_grad_norm": T("gradient_clipping + gradient_clipping_threshold", "given: clip the global gradient norm at "
                                                                          "it (0: no clipping)", _max_grad_norm),
    "warmup_steps": T("warmup_steps / warmup_ratio", "linear warm-up steps; a float in (0, 1): a fraction of the "
                                                     "run", _warmup_steps),
    "lr_scheduler_type": T("lr_scheduler", "linear, cosine, cosine_with_min_lr, constant, constant_with_warmup (or "
                                           "step)", _lr_scheduler_type),
    "lr_scheduler_kwargs": T("min_lr_rate / min_lr", "cosine_with_min_lr's floor", _lr_scheduler_kwargs),
    "optim": T("optim", "adamw_torch, adamw_torch_fused, adamw_8bit (adamw_bnb_8bit) or paged_adamw_8bit "
                        "(bitsandbytes; DDP)", _optim),
    "bf16": T("mixed_precision", "bf16 compute where the device has it (CUDA); fp32 master weights"),
    "fp16": T("use_fp16", "fp16 compute with a gradient scaler (CUDA)"),
    "gradient_checkpointing": T("fsdp_config.fsdp_activation_checkpointing", "recompute each decoder layer in "
                                                                             "backward (DDP, FSDP and DeepSpeed)"),
    "gradient_checkpointing_kwargs": T("activation_checkpointing_use_reentrant", "use_reentrant false only",
                                       _gradient_checkpointing_kwargs),
    "gradient_checkpointing_kwargs.use_reentrant": T("activation_checkpointing_use_reentrant", "false only (a YAML "
                                                                                              "mapping's key)"),
    "use_liger_kernel": T("use_fast_kernels", "liger-kernel's fused RMSNorm / SwiGLU / RoPE on CUDA (and "
                                              "flash-attention 2 where installed)"),
    "save_only_model": T("save_optimizer", "true: checkpoints without optimizer state (they do not resume)",
                         lambda value: [("save_optimizer", "false" if _bool("save_only_model", value) else "true")]),
    "packing": T("batching_strategy", "true: packing; false: padding", _packing),
    "packing_strategy": T("batching_strategy packing", "bfd only (shardtune's packing)", _packing_strategy),
    "dataloader_num_workers": T("num_workers_dataloader", "data loader processes per rank"),
    "torch_compile": T("compile", "torch.compile each decoder layer"),
    # logging, evaluation, saving
    "eval_strategy": T("run_validation / eval_steps", "no, epoch, or steps (with --eval_steps N)", _eval_strategy),
    "save_strategy": T("save_steps / fsdp_config.checkpoint_type", "no, epoch, or steps (with --save_steps N)",
                       _save_strategy),
    "logging_steps": T("logging_steps / logging_fraction", "trackers receive every Nth step row (a float in (0, 1): "
                                                           "every ceil(F x the run's steps)th); metrics.jsonl keeps "
                                                           "every step", _interval("logging")),
    "eval_steps": T("eval_steps / eval_fraction", "evaluate every N optimizer steps (with --eval_strategy steps); a "
                                                  "float in (0, 1): every ceil(F x the run's steps)",
                    _interval("eval")),
    "save_total_limit": T("save_total_limit", "keep the last K checkpoints"),
    "adam_beta1": T("adam_beta1", "AdamW beta1"),
    "adam_beta2": T("adam_beta2", "AdamW beta2"),
    "adam_epsilon": T("adam_epsilon", "AdamW epsilon"),
    "weight_decay": T("weight_decay", "AdamW weight decay, not on biases and norm weights"),
    "use_peft": T("use_peft", "train a LoRA adapter"),
    "gradient_accumulation_steps": T("gradient_accumulation_steps", "micro-batches per optimizer step"),
    "seed": T("seed", "seed of init, data order and dropout"),
    "output_dir": T("output_dir", "where the model, config.yaml and metrics.jsonl go"),
    "overwrite_output_dir": T("overwrite_output_dir", "replace a previous run's outputs"),
    "save_steps": T("save_steps / save_fraction", "checkpoint every N optimizer steps; a float in (0, 1): every "
                                                  "ceil(F x the run's steps)", _interval("save")),
    "resume_from_checkpoint": T("resume", "bare: the newest checkpoint of output_dir; a path: that checkpoint",
                                _resume),
    "report_to": T("report_to", "trackers, comma-separated", _report_to),
    "load_best_model_at_end": T("load_best_model_at_end", "publish the best checkpoint's model (evaluated at its "
                                                          "step) instead of the last; the best is never rotated out"),
    "metric_for_best_model": T("metric_for_best_model", "eval_loss (default), eval_ppl, eval_rouge1, ...: what "
                                                        "--load_best_model_at_end compares"),
    "greater_is_better": T("greater_is_better", "whether a higher metric is better; unset: not for names ending in "
                                                "loss (Trainer's rule)",
                           lambda value: [("greater_is_better", "true" if _bool("greater_is_better", value)
                                               else "false")]),
    "push_to_hub": T("push_to_hub", "after the run, upload the published model folder to the hub (refused before "
                                    "launch when offline or without a token)"),
    "hub_model_id": T("hub_model_id", "the --push_to_hub repo; empty: output_dir's folder name"),
    "hub_private_repo": T("hub_private_repo", "create the --push_to_hub repo private"),
    "hub_token": T("hub_token", "the --push_to_hub token (not written to config.yaml); empty: huggingface_hub's"),
    "hub_strategy": T("-", "end only: one upload after the run", _hub_strategy),
    "shuffle_dataset": T("-", "false: no shuffle before tokenising (TRL's default); the seeded sampler still "
                              "shuffles every epoch, as Trainer's does", _shuffle_dataset),
    "eval_packing": refused("evaluation batches are built as training batches are (--batching_strategy): "
                            "drop the flag"),
    "dataset_kwargs": refused("the dataset is prepared by shardtune's data flags (docs/data-formats.md): "
                              "drop the mapping"),
    "pad_token": refused("the tokenizer's pad token is used (its eos when it has none): drop the flag, "
                         "or give the model a tokenizer with that pad token"),
    # DPO (DPOConfig): its loss flags and precompute_ref_log_probs / precompute_ref_batch_size are shardtune dpo's
    # settings under TRL's names (docs/dpo.md); these are the others
    "disable_dropout": T("lora_config.lora_dropout", "true: no dropout (the LoRA dropout, the one dropout a Llama "
                                                     "trains with, set to 0; TRL's DPO default); false: kept",
                         lambda value: [("lora_config.lora_dropout", "0")] if _bool("disable_dropout", value) else []),
    "ld_alpha": refused("LD-DPO's length-desensitised log-probabilities are not built: drop the flag"),
    "use_weighting": refused("WPO's weighting is not built: drop the flag"),
    **dict.fromkeys(("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"),
                    refused("the reference stays the starting weights (TR-DPO's syncing is not built): drop the "
                            "flag")),
    "router_aux_loss_coef": refused("a mixture-of-experts router loss: shardtune trains dense "
                                    "Llama-family models; drop the flag"),
    "dataset_num_proc": refused("the data is tokenised once before launch and kept in the tokenised-data "
                                "cache (docs/data.md): drop the flag"),
    "pad_to_multiple_of": refused("padded micro-batches are padded to their longest row (--padding_free: "
                                  "no pad token at all): drop the flag"),
    "model_init_kwargs": refused("the model is loaded by shardtune's flags (--model_name, "
                                 "--quantization, --attn_implementation, ...): drop the mapping"),
    # launcher (Accelerate)
    "num_processes": T("nproc_per_node", "processes on this machine (Accelerate's name; a launcher flag: the command "
                                         "line or the Accelerate file, not a recipe)", _num_processes),
}
del T

# Our settings named by llama-cookbook's train_config (the docs' cookbook column).
COOKBOOK_NAMES = frozenset({
    "model_name", "batch_size_training", "val_batch_size", "lr", "num_epochs", "max_train_step",
    "gradient_clipping_threshold", "gradient_clipping", "mixed_precision", "use_fp16", "batching_strategy",
    "num_workers_dataloader", "use_peft", "quantization", "run_validation", "output_dir", "weight_decay", "seed",
    "gradient_accumulation_steps", "fsdp_config.fsdp_activation_checkpointing", "lora_config.r",
    "lora_config.lora_alpha", "lora_config.lora_dropout", "lora_config.target_modules", "context_length",
})

# TRL's packaged Accelerate profiles (`trl sft --accelerate_config zero2`); shardtune ships files of these names
# (shardtune/config/accelerate_profiles/).
PROFILES = ("multi_gpu", "single_gpu", "zero1", "zero2", "zero3", "fsdp1", "fsdp2")


def translate(name: str, value: Any) -> Pairs:
    """The shardtune settings one flag sets: [(name, value)] unless ``name`` is a TRL name."""
    key = name.replace("-", "_")
    flag = TRL_FLAGS.get(key)
    if flag is None:
        return [(name, value)]
    if flag.refuse:
        raise ConfigError(f"--{key}: {flag.refuse}")
    if flag.to is None:
        return [(flag.ours, value)]
    try:
        return flag.to(value)
    except TrlFlagError as e:
        raise ConfigError(str(e)) from None


def finish(cfg, given: dict[str, Any]) -> None:
    """Rules over several TRL flags: what one means depends on another one given (or not). ``given``: the TRL
    names given, with their values."""
    if "load_in_4bit" in given and "use_bnb_nested_quant" not in given:
        cfg.quantization_config.use_double_quant = False  # TRL's default
    eval_strategy = _text(given["eval_strategy"]) if "eval_strategy" in given else ""
    if eval_strategy == "steps" and not (cfg.eval_steps or cfg.eval_fraction):
        raise ConfigError("--eval_strategy steps needs --eval_steps N: say every how many optimizer steps to evaluate")
    if eval_strategy in ("epoch", "no") and (cfg.eval_steps or cfg.eval_fraction):
        raise ConfigError(f"--eval_steps {cfg.eval_steps or cfg.eval_fraction} has no effect with --eval_strategy {eval_strategy}: pass "
                          "--eval_strategy steps, or drop --eval_steps")
    if "save_strategy" in given and _text(given["save_strategy"]) == "steps" and not (cfg.save_steps or
                                                                                      cfg.save_fraction):
        raise ConfigError("--save_strategy steps needs --save_steps N: say every how many optimizer steps to save")


def take_num_processes(argv: list[str]) -> list[str]:
    """Accelerate's --num_processes N, spelt as torchrun's --nproc_per_node N (processes on this machine)."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if name in ("--num_processes", "--num-processes"):
            out += ["--nproc_per_node", value] if eq else ["--nproc_per_node"]
        else:
            out.append(arg)
    return out


def trl_names_of(ours: str) -> list[str]:
    """The TRL names that set our setting ``ours`` (for --help)."""
    return [trl for trl, flag in TRL_FLAGS.items() if not flag.refuse and ours in flag.ours.replace("/", " ").split()]


def flag_table() -> str:
    """docs/flags.md: TRL name, cookbook name, ours, meaning; generated from TRL_FLAGS."""
    lines = ["# Flags: TRL's names, llama-cookbook's, shardtune's", "",
             "Generated from `shardtune/config/trl.py` (`python -m shardtune.config.trl > docs/flags.md`); a test "
             "checks it is current.", "",
             "Precedence: command line > recipe (`--config`) > Accelerate file (`--accelerate_config`). Where the "
             "recipe and the Accelerate file set the same setting to different values, one line names both and the "
             "recipe's value is used. Every flag given is honoured or refused before launch in one line.", "",
             "Weight decay is not applied to biases and norm weights (as Hugging Face's Trainer does). The "
             "warm-up ramps the lr as (step + 1) / (warmup + 1) of the peak, so no step trains at lr 0 (Hugging "
             "Face's first step does).", "",
             "## Files", "",
             "- `shardtune sft --config FILE` reads a `trl sft --config` YAML: TRL's flat keys (the table below), "
             "shardtune's own names (nested sections too), `env:` (exported before launch) and `accelerate_config:` "
             "(a file or a profile name). All unknown keys are named at once, in one line.",
             "- `--accelerate_config` takes a file or a packaged profile: " + ", ".join(f"`{p}`" for p in PROFILES)
             + " (no process count: one per visible GPU, or `--num_processes N`). `distributed_type: NO` starts one "
             "process whatever `num_processes` says, as Accelerate does.",
             "- `parallelism_config`: `cp_size` (torch backend) is ring attention (`--cp_size`); `sp_size`, and "
             "`cp_size` with `cp_backend: deepspeed` (ALST), are Ulysses (`--sp_size`); `dp_replicate_size` > 1 under "
             "FSDP is HYBRID_SHARD with that many replicas; `dp_shard_size` is the rest of the world; the product must "
             "equal `num_processes`; `tp_size` > 1 is refused.", "",
             "## TRL's names", "",
             "| TRL | llama-cookbook | shardtune | meaning |", "|---|---|---|---|"]
    for trl, flag in TRL_FLAGS.items():
        cookbook = ", ".join(f"`{n}`" for n in flag.ours.replace("/", " ").replace("+", " ").split()
                             if n in COOKBOOK_NAMES) or "-"
        ours = "refused" if flag.refuse else f"`{flag.ours}`"
        meaning = flag.refuse if flag.refuse else flag.meaning
        lines.append(f"| `--{trl}` | {cookbook} | {ours} | {meaning} |")
    for f in fields(TrlDatasetConfig):  # TRL's data flags: the same names, nested under trl_dataset
        lines.append(f"| `--{f.name}` | - | `trl_dataset.{f.name}` | {f.metadata['help']} |")
    lines.append("| `--max_length` | `context_length` | `context_length` | tokens per packed block / longest row |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(flag_table(), end="")
