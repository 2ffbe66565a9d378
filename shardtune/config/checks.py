"""Checks of the settings alone (no model, no data, no process group): each a function ``check(cfg, world_size)``
raising one ConfigError line. The one list of every pre-launch check, including those owned by the model,
parallel and training floors, is shardtune.training.checks.
"""

from __future__ import annotations

import difflib
import math
import os
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

from shardtune.config.deepspeed_file import DEEPSPEED_OWNED_KEYS, deepspeed_file_config
from shardtune.config.flags import flat_fields
from shardtune.config.schema import (
    PROFILER_SCHEDULE,
    TRACKER_PACKAGES,
    ConfigError,
    DeepSpeedConfig,
    FsdpConfig,
    TrainConfig,
    effective_batch_size,
    trackers,
)
from shardtune.runtime.elastic import worker_group_attempt
from shardtune.runtime.run_lock import RunLocked, check_not_locked


def _setting(cfg: TrainConfig, key: str) -> Any:
    target: Any = cfg
    for part in key.split("."):
        target = getattr(target, part)
    return target


def check_core(cfg: TrainConfig, world_size: int) -> None:
    for key, (typ, _f) in flat_fields().items():  # inf / nan pass every comparison below as if they were fine
        value = _setting(cfg, key)
        if typ is float and isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{key} {value} is not a finite number: pass a finite value")
    for name in ("batch_size_training", "gradient_accumulation_steps", "num_epochs", "context_length",
                 "val_batch_size", "logging_steps"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name} {getattr(cfg, name)} must be positive: pass a value >= 1")
    for name in ("max_train_step", "max_eval_step", "num_workers_dataloader", "warmup_steps", "eval_steps"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} {getattr(cfg, name)} must be >= 0 (0 means no limit / none)")
    if cfg.fractional_epochs and (cfg.fractional_epochs < 0 or math.ceil(cfg.fractional_epochs) != cfg.num_epochs):
        raise ConfigError(f"--fractional_epochs {cfg.fractional_epochs} needs --num_epochs "
                          f"{max(1, math.ceil(cfg.fractional_epochs))} (the epochs it reaches into), not "
                          f"{cfg.num_epochs}: pass TRL's --num_train_epochs {cfg.fractional_epochs} alone")
    if cfg.lr <= 0:
        raise ConfigError(f"--lr {cfg.lr} must be positive: pass e.g. 1e-4")
    if cfg.weight_decay < 0:
        raise ConfigError(f"--weight_decay {cfg.weight_decay} must be >= 0")
    if not 0 < cfg.gamma <= 1:
        raise ConfigError(f"--gamma {cfg.gamma} must be in (0, 1]: it multiplies the lr once per epoch")
    if cfg.gradient_clipping and cfg.gradient_clipping_threshold <= 0:
        raise ConfigError(f"--gradient_clipping_threshold {cfg.gradient_clipping_threshold} must be positive")
    for key, (typ, f) in flat_fields().items():
        choices = f.metadata.get("choices")
        if choices:
            *owners, name = key.split(".")
            target: Any = cfg
            for o in owners:
                target = getattr(target, o)
            value = getattr(target, name)
            for one in value if isinstance(value, list) else [value]:  # a list setting: each of its values
                if one not in choices:
                    close = difflib.get_close_matches(str(one), choices, n=1)
                    hint = f"did you mean {close[0]}?" if close else "choose one of " + ", ".join(choices)
                    raise ConfigError(f"--{key} {one!r} is not valid: {hint}")
    for frac_key in ("samsum_dataset.validation_fraction", "alpaca_dataset.validation_fraction"):
        owner, name = frac_key.split(".")
        frac = getattr(getattr(cfg, owner), name)
        if not 0 <= frac < 1:
            raise ConfigError(f"--{frac_key} {frac} must be in [0, 1)")
    _check_output_dir(cfg.output_dir)
    check_previous_run(cfg)


# Files whose presence means output_dir already holds a run.
RUN_FILES = ("metrics.jsonl", "config.yaml", "config.json", "adapter_config.json")


def check_previous_run(cfg: TrainConfig, resuming: bool | None = None) -> None:
    """Never overwrite a previous run's outputs by accident (resuming it, or a torchrun restart, is fine), and never
    share output_dir with a run that is still going (not even with --resume auto or --overwrite_output_dir).
    ``resuming``: whether a checkpoint is resumed (default: any --resume; --resume auto that finds no checkpoint is
    a new run, decided by shardtune.training.checkpoint.check_checkpointing)."""
    try:
        check_not_locked(Path(cfg.output_dir))
    except RunLocked as e:
        raise ConfigError(str(e)) from None
    restarted = worker_group_attempt() > 0
    if cfg.overwrite_output_dir or (bool(cfg.resume) if resuming is None else resuming) or restarted:
        return
    found = [name for name in RUN_FILES if (Path(cfg.output_dir) / name).exists()]
    if found:
        # --resume latest only where there is something to resume (output_dir/checkpoints/step-NNNNNN, the layout of
        # shardtune.training.checkpoint_layout; whether one verifies is that floor's business)
        resumable = any((Path(cfg.output_dir) / "checkpoints").glob("step-*"))
        continue_it = "--resume latest to continue it, " if resumable else ""
        raise ConfigError(f"--output_dir {cfg.output_dir} already holds a run ({found[0]}): pass another directory, "
                          f"{continue_it}or --overwrite_output_dir true to replace it")


def _check_output_dir(output_dir: str) -> None:
    """Probe with a real file write (os.access says yes to root even on a read-only filesystem)."""
    if not output_dir:
        raise ConfigError("--output_dir is empty: pass a directory to write the model and metrics to")
    p = Path(output_dir).resolve()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--output_dir {output_dir} is a file: pass a directory path")
    probe_dir = p
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir}: {probe_dir} is a file, not a directory: pass another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".shardtune-write-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--output_dir {output_dir} is not writable ({probe_dir}: {e.strerror}): "
                          "pass a directory you can write to") from None




# FSDP settings that only mean something with --enable_fsdp (checkpoint_type belongs to checkpointing; activation
# checkpointing applies under every strategy).
FSDP_ONLY_SETTINGS = ("hsdp", "sharding_strategy", "sharding_group_size", "replica_group_size", "pure_bf16",
                      "fsdp_cpu_offload")


def check_fsdp(cfg: TrainConfig, world_size: int) -> None:
    fc, defaults = cfg.fsdp_config, FsdpConfig()
    if cfg.use_fp16 and fc.pure_bf16:
        raise ConfigError("--use_fp16 and --fsdp_config.pure_bf16 are both set: fp16 and bf16 exclude each other; "
                          "drop one of them")
    if not cfg.enable_fsdp:
        changed = [n for n in FSDP_ONLY_SETTINGS if getattr(fc, n) != getattr(defaults, n)]
        if changed:
            raise ConfigError(f"--fsdp_config.{changed[0]} {getattr(fc, changed[0])} has no effect without FSDP: "
                              "add --enable_fsdp or drop the flag")
        if cfg.low_cpu_fsdp:
            raise ConfigError("--low_cpu_fsdp needs --enable_fsdp (rank-0-only loading shards the model): "
                              "add --enable_fsdp or drop the flag")
        return
    if cfg.quantization == "8bit":
        raise ConfigError("--quantization 8bit is not supported with --enable_fsdp (bitsandbytes 8-bit weights "
                          "cannot be sharded): use --quantization 4bit, or drop --enable_fsdp")
    hybrid = fc.sharding_strategy == "HYBRID_SHARD"
    if fc.hsdp and not hybrid:
        raise ConfigError(f"--fsdp_config.hsdp true needs --fsdp_config.sharding_strategy HYBRID_SHARD, not "
                          f"{fc.sharding_strategy}: set it, or drop --fsdp_config.hsdp")
    sizes = {"sharding_group_size": fc.sharding_group_size, "replica_group_size": fc.replica_group_size}
    for name, size in sizes.items():
        if size < 0:
            raise ConfigError(f"--fsdp_config.{name} {size} must be >= 0 (0: derived)")
        if size and not hybrid:
            raise ConfigError(f"--fsdp_config.{name} {size} only applies to --fsdp_config.sharding_strategy "
                              f"HYBRID_SHARD (not {fc.sharding_strategy}): set it, or drop the flag")
        if size and world_size % size:
            raise ConfigError(f"--fsdp_config.{name} {size} does not divide the world size {world_size}: pass a "
                              f"divisor of {world_size}")
    shard, replicas = fc.sharding_group_size, fc.replica_group_size
    if shard and replicas and shard * replicas != world_size:
        raise ConfigError(f"--fsdp_config.sharding_group_size {shard} x --fsdp_config.replica_group_size {replicas} "
                          f"= {shard * replicas}, but the world size is {world_size}: make their product "
                          f"{world_size}, or set one of them to 0 (derived)")


def check_deepspeed(cfg: TrainConfig, world_size: int) -> None:
    dc, defaults = cfg.deepspeed_config, DeepSpeedConfig()
    if not cfg.enable_deepspeed:
        changed = [f.name for f in fields(DeepSpeedConfig) if getattr(dc, f.name) != getattr(defaults, f.name)]
        if changed:
            raise ConfigError(f"--deepspeed_config.{changed[0]} {getattr(dc, changed[0])} has no effect without "
                              "DeepSpeed: add --enable_deepspeed or drop the flag")
        return
    import importlib.util

    if cfg.enable_fsdp:
        raise ConfigError("--enable_fsdp and --enable_deepspeed are both set: they are two sharding strategies; "
                          "drop one of them")
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("--enable_deepspeed needs DeepSpeed, which is not installed: pip install "
                          "--no-build-isolation 'shardtune[deepspeed]' (its build needs torch), or drop the flag")
    if dc.zero_stage not in (1, 2, 3):
        raise ConfigError(f"--deepspeed_config.zero_stage {dc.zero_stage} is not valid: choose 1, 2 or 3")
    if dc.offload_param and dc.zero_stage != 3:
        raise ConfigError(f"--deepspeed_config.offload_param needs --deepspeed_config.zero_stage 3 (not "
                          f"{dc.zero_stage}): set it, or drop --deepspeed_config.offload_param")
    if cfg.quantization == "8bit" and dc.zero_stage == 3:
        raise ConfigError("--quantization 8bit cannot be partitioned by ZeRO-3: use --quantization 4bit (stored in the "
                          "compute dtype, which ZeRO-3 partitions), or --deepspeed_config.zero_stage 2")
    if cfg.nan_policy == "skip":
        raise ConfigError("--nan_policy skip is not supported with --enable_deepspeed (its step cannot be skipped "
                          "once gradients are accumulated): use --nan_policy stop, or --enable_fsdp")
    if cfg.compile:
        raise ConfigError("--compile is not supported with --enable_deepspeed yet: drop one of them")
    ours = {"train_micro_batch_size_per_gpu": cfg.batch_size_training,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "train_batch_size": effective_batch_size(cfg, world_size)}
    file_config = deepspeed_file_config(cfg)
    stage = (file_config.get("zero_optimization") or {}).get("stage", "auto")
    if stage not in ("auto", dc.zero_stage):
        raise ConfigError(f"--deepspeed_config.config_file {dc.config_file}: zero_optimization.stage is {stage}, but "
                          f"--deepspeed_config.zero_stage is {dc.zero_stage}: make them agree (or drop the stage "
                          "from the file)")
    for key, value in file_config.items():
        if key not in DEEPSPEED_OWNED_KEYS or value == "auto" or ours.get(key) == value:
            continue
        what = (f"{value}, but shardtune's is {ours[key]} (from --batch_size_training, the world size and "
                "--gradient_accumulation_steps)" if key in ours else "set by shardtune")
        raise ConfigError(f"--deepspeed_config.config_file {dc.config_file}: \"{key}\" is {what}: remove the key "
                          "or set it to \"auto\"")


def check_fp16_device(cfg: TrainConfig, world_size: int) -> None:
    from shardtune.runtime.precision import fp16_compute_available

    if cfg.use_fp16 and not fp16_compute_available():
        raise ConfigError("--use_fp16 needs CUDA GPUs (fp16 compute with a gradient scaler, for GPUs without bf16); "
                          "this machine has none, and on CPU shardtune computes in fp32: drop --use_fp16")


def check_long_sequence_levers(cfg: TrainConfig, world_size: int) -> None:
    if cfg.rope_scaling and cfg.rope_factor <= 1:
        raise ConfigError(f"--rope_factor {cfg.rope_factor} must be > 1 with --rope_scaling {cfg.rope_scaling}: pass "
                          "the context extension, e.g. --rope_factor 4")
    if not cfg.rope_scaling and cfg.rope_factor != 1:
        raise ConfigError(f"--rope_factor {cfg.rope_factor} has no effect without --rope_scaling: add "
                          "--rope_scaling yarn or drop the flag")


def check_observability(cfg: TrainConfig, world_size: int) -> None:
    import importlib.util

    for name in trackers(cfg):
        module, extra = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            flag = "--use_wandb" if name == "wandb" and cfg.report_to not in ("wandb", "all") else \
                f"--report_to {cfg.report_to}"
            raise ConfigError(f"{flag} needs {module}, which is not installed: pip install 'shardtune[{extra}]', "
                              "or drop the flag")
    if cfg.use_profiler and cfg.flop_counter:
        raise ConfigError("--use_profiler and --flop_counter are both set: the FLOP counter would count the "
                          "profiler's steps too; drop one of them")
    if cfg.flop_counter_start < 0 or cfg.log_eval_samples < 0:
        bad = "flop_counter_start" if cfg.flop_counter_start < 0 else "log_eval_samples"
        raise ConfigError(f"--{bad} {getattr(cfg, bad)} must be >= 0")
    if cfg.flop_counter and cfg.max_train_step and cfg.max_train_step <= cfg.flop_counter_start:
        raise ConfigError(f"--flop_counter measures step {cfg.flop_counter_start + 1} (after --flop_counter_start "
                          f"{cfg.flop_counter_start} warm-up steps), but --max_train_step is {cfg.max_train_step}: "
                          "raise --max_train_step or lower --flop_counter_start")
    profiled = sum(PROFILER_SCHEDULE.values())
    if cfg.use_profiler and cfg.max_train_step and cfg.max_train_step <= profiled:
        raise ConfigError(f"--use_profiler records steps 4-6 after {PROFILER_SCHEDULE['wait']} wait and "
                          f"{PROFILER_SCHEDULE['warmup']} warm-up steps, so it needs more than {profiled} steps, but "
                          f"--max_train_step is {cfg.max_train_step}: raise it to {profiled + 1} or more")


def check_dist_timeout(cfg: TrainConfig, world_size: int) -> None:
    if cfg.dist_timeout <= 0:
        raise ConfigError(f"--dist_timeout {cfg.dist_timeout} must be a positive number of seconds (default 1800)")


# The checks of this floor, in the order they run (shardtune.training.checks runs them first).
CONFIG_CHECKS = (check_core, check_fsdp, check_deepspeed, check_fp16_device, check_long_sequence_levers,
                 check_observability, check_dist_timeout)
