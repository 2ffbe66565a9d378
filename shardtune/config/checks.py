"""Checks of the settings alone (no model, no data, no process group): each a function ``check(cfg, world_size)``
raising one ConfigError line. Choices, ranges and finiteness come from each field's metadata
(shardtune.config.schema); the rest are the combinations. The one list of every pre-launch check, including those
owned by the model, parallel and training floors, is shardtune.training.engine.checks.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tempfile
from pathlib import Path

from shardtune.config.dialects.deepspeed import DEEPSPEED_OWNED_KEYS, deepspeed_file_config
from shardtune.config.fields import flat_fields, get_value, optional
from shardtune.config.flags import spelling_of
from shardtune.config.objectives import registration
from shardtune.config.schema import (
    PREVIOUS_FOLDER,
    PROFILER_SCHEDULE,
    TRACKER_PACKAGES,
    ConfigError,
    TrainConfig,
    effective_batch_size,
)
from shardtune.runtime.elastic import worker_group_attempt
from shardtune.runtime.run_lock import RunLocked, check_not_locked

# what 0 means for a setting, in its help's own words ("...; 0: none", "(0: train.batch_size)")
ZERO_MEANS = re.compile(r"(?:^|[(;] ?)0: ([^);]+)")


def check_fields(cfg: TrainConfig, world_size: int) -> None:
    """Every field against its metadata: finite numbers, choices, ranges, intervals."""
    for key, info in flat_fields().items():
        value, meta = get_value(cfg, key), info.meta
        if value is None:
            continue
        flag = spelling_of(cfg, key)
        if isinstance(value, float) and not math.isfinite(value):  # inf / nan pass every comparison below
            raise ConfigError(f"{flag} {value} is not a finite number: pass a finite value")
        choices = meta.get("choices") or ()
        for one in value if isinstance(value, list) and choices else [value] if choices else []:
            if one not in choices:
                close = difflib.get_close_matches(str(one), [str(c) for c in choices], n=1)
                named = [str(c) for c in choices if c != ""]
                hint = (
                    f"did you mean {close[0]}?"
                    if close
                    else f"choose {', '.join(named[:-1])} or {named[-1]}"
                    if len(named) > 1
                    else f"choose {named[0]}"
                )
                raise ConfigError(f"{flag} {one!r} is not valid: {hint}")
        if meta.get("needs") and value and not get_value(cfg, meta["needs"]):
            needed = spelling_of(cfg, meta["needs"])
            raise ConfigError(f"{flag} needs {needed} on, and it is off: turn it on, or drop {flag}")
        if optional(info.type)[0] not in (int, float) or isinstance(value, bool):
            continue
        if "at_least" in meta and value < meta["at_least"]:
            what = (
                "must be positive: pass a value >= 1" if meta["at_least"] == 1 else f"must be >= {meta['at_least']:g}"
            )
            zero = ZERO_MEANS.search(meta["help"]) if meta["at_least"] == 0 else None
            raise ConfigError(f"{flag} {value:g} {what}" + (f" (0: {zero.group(1)})" if zero else ""))
        if "above" in meta and value <= meta["above"]:
            raise ConfigError(f"{flag} {value:g} must be positive" + (": pass e.g. 1e-4" if key == "optim.lr" else ""))
        if "below" in meta and value >= meta["below"]:
            raise ConfigError(f"{flag} {value:g} must be in [{meta.get('at_least', 0):g}, {meta['below']:g})")
        if "at_most" in meta and value > meta["at_most"]:
            raise ConfigError(f"{flag} {value:g} must be in (0, {meta['at_most']:g}]")
        if meta.get("interval") and (value < 0 or (value >= 1 and value != int(value))):
            raise ConfigError(
                f"{flag} {value:g} is neither a whole number of steps nor a fraction in (0, 1) of the run's steps"
            )


def check_core(cfg: TrainConfig, world_size: int) -> None:
    _check_output_dir(cfg.output.dir)
    check_previous_run(cfg)


# Files whose presence means output_dir already holds a run.
RUN_FILES = ("metrics.jsonl", "config.yaml", "config.json", "adapter_config.json")


def previous_run_files(output_dir: Path) -> list[str]:
    """The files that say ``output_dir`` holds an ended run (finished or failed: config.yaml is a run's first write)."""
    return [name for name in RUN_FILES if (output_dir / name).exists()]


def check_previous_run(cfg: TrainConfig, resuming: bool | None = None) -> None:
    """Never overwrite a previous run's outputs by accident (resuming it, or a torchrun restart, is fine), and never
    share output_dir with a run that is still going (not even with --resume auto, --overwrite_output_dir or
    --output.previous_run move_aside). ``resuming``: whether a checkpoint is resumed (default: any --resume; --resume
    auto that finds no checkpoint is a new run, decided by
    shardtune.training.engine.checkpoint.checkpointer.check_checkpointing). With
    move_aside the worker's rank 0 moves the earlier run into output_dir/previous/
    (shardtune.training.engine.previous_run)."""
    out = Path(cfg.output.dir)
    try:
        check_not_locked(out)
    except RunLocked as e:
        raise ConfigError(str(e)) from None
    restarted = worker_group_attempt() > 0
    if cfg.output.overwrite or (bool(cfg.checkpoint.resume) if resuming is None else resuming) or restarted:
        return
    if cfg.output.previous_run == "move_aside":
        return
    found = previous_run_files(out)
    if found:
        # --resume latest only where there is something to resume (output_dir/checkpoints/step-NNNNNN, the layout of
        # shardtune.training.engine.checkpoint.layout; whether one verifies is that floor's business)
        resumable = any((out / "checkpoints").glob("step-*"))
        continue_it = "--resume latest to continue it, " if resumable else ""
        raise ConfigError(
            f"{spelling_of(cfg, 'output.dir')} {cfg.output.dir} already holds a run ({found[0]}): pass "
            f"another directory, {continue_it}--output.previous_run move_aside to move it into "
            f"{PREVIOUS_FOLDER}/, or --overwrite_output_dir true to replace it"
        )


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
        raise ConfigError(
            f"--output_dir {output_dir} is not writable ({probe_dir}: {e.strerror}): pass a directory you can write to"
        ) from None


def changed_from_default(cfg: TrainConfig, keys: tuple[str, ...]) -> str | None:
    """The first of ``keys`` whose value is not its default."""
    return next((key for key in keys if get_value(cfg, key) != flat_fields()[key].default), None)


# Settings that only mean something under FSDP / DeepSpeed (activation checkpointing applies under every strategy).
FSDP_ONLY_SETTINGS = (
    "parallel.sharding_strategy",
    "parallel.sharding_group_size",
    "parallel.replica_group_size",
    "parallel.cpu_offload",
    "parallel.low_cpu_fsdp",
)
DEEPSPEED_ONLY_SETTINGS = (
    "parallel.zero_stage",
    "parallel.offload_optimizer",
    "parallel.offload_param",
    "parallel.deepspeed_config_file",
)


def check_fsdp(cfg: TrainConfig, world_size: int) -> None:
    p = cfg.parallel
    if cfg.train.precision == "pure_bf16" and p.strategy != "fsdp":
        flag = spelling_of(cfg, "train.precision")
        raise ConfigError(
            f"{flag if flag.endswith('pure_bf16') else flag + ' pure_bf16'} (parameters, gradients and "
            "optimizer state in bf16) needs FSDP: add --enable_fsdp or drop the flag"
        )
    if p.strategy != "fsdp":
        changed = changed_from_default(cfg, FSDP_ONLY_SETTINGS)
        if changed:
            raise ConfigError(
                f"{spelling_of(cfg, changed)} {get_value(cfg, changed)} has no effect without FSDP: add "
                "--enable_fsdp or drop the flag"
            )
        return
    if cfg.model.quantization == "8bit":
        raise ConfigError(
            "--quantization 8bit is not supported with --enable_fsdp (bitsandbytes 8-bit weights "
            "cannot be sharded): use --quantization 4bit, or drop --enable_fsdp"
        )
    hybrid = p.sharding_strategy == "HYBRID_SHARD"
    for key in ("parallel.sharding_group_size", "parallel.replica_group_size"):
        size = get_value(cfg, key)
        if size and not hybrid:
            raise ConfigError(
                f"{spelling_of(cfg, key)} {size} only applies to --fsdp_config.sharding_strategy "
                f"HYBRID_SHARD (not {p.sharding_strategy}): set it, or drop the flag"
            )
        if size and world_size % size:
            raise ConfigError(
                f"{spelling_of(cfg, key)} {size} does not divide the world size {world_size}: pass a "
                f"divisor of {world_size}"
            )
    shard, replicas = p.sharding_group_size, p.replica_group_size
    if shard and replicas and shard * replicas != world_size:
        raise ConfigError(
            f"--fsdp_config.sharding_group_size {shard} x --fsdp_config.replica_group_size {replicas} "
            f"= {shard * replicas}, but the world size is {world_size}: make their product "
            f"{world_size}, or set one of them to 0 (derived)"
        )


def check_deepspeed(cfg: TrainConfig, world_size: int) -> None:
    p = cfg.parallel
    if p.strategy != "deepspeed":
        changed = changed_from_default(cfg, DEEPSPEED_ONLY_SETTINGS)
        if changed:
            raise ConfigError(
                f"{spelling_of(cfg, changed)} {get_value(cfg, changed)} has no effect without "
                "DeepSpeed: add --enable_deepspeed or drop the flag"
            )
        return
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            "--enable_deepspeed needs DeepSpeed, which is not installed: pip install "
            "--no-build-isolation 'shardtune[deepspeed]' (its build needs torch), or drop the flag"
        )
    if p.offload_param and p.zero_stage != 3:
        raise ConfigError(
            f"--deepspeed_config.offload_param needs --deepspeed_config.zero_stage 3 (not "
            f"{p.zero_stage}): set it, or drop --deepspeed_config.offload_param"
        )
    if cfg.model.quantization == "8bit" and p.zero_stage == 3:
        raise ConfigError(
            "--quantization 8bit cannot be partitioned by ZeRO-3: use --quantization 4bit (stored in the "
            "compute dtype, which ZeRO-3 partitions), or --deepspeed_config.zero_stage 2"
        )
    if cfg.train.nan_policy == "skip":
        raise ConfigError(
            "--nan_policy skip is not supported with --enable_deepspeed (its step cannot be skipped "
            "once gradients are accumulated): use --nan_policy stop, or --enable_fsdp"
        )
    if cfg.model.compile:
        raise ConfigError("--compile is not supported with --enable_deepspeed yet: drop one of them")
    ours = {
        "train_micro_batch_size_per_gpu": cfg.train.batch_size,
        "gradient_accumulation_steps": cfg.train.gradient_accumulation_steps,
        "train_batch_size": effective_batch_size(cfg, world_size),
    }
    file_config = deepspeed_file_config(cfg)
    stage = (file_config.get("zero_optimization") or {}).get("stage", "auto")
    path = p.deepspeed_config_file
    if stage not in ("auto", p.zero_stage):
        raise ConfigError(
            f"--deepspeed_config.config_file {path}: zero_optimization.stage is {stage}, but "
            f"--deepspeed_config.zero_stage is {p.zero_stage}: make them agree (or drop the stage "
            "from the file)"
        )
    for key, value in file_config.items():
        if key not in DEEPSPEED_OWNED_KEYS or value == "auto" or ours.get(key) == value:
            continue
        what = (
            f"{value}, but shardtune's is {ours[key]} (from --batch_size_training, the world size and "
            "--gradient_accumulation_steps)"
            if key in ours
            else "set by shardtune"
        )
        raise ConfigError(
            f'--deepspeed_config.config_file {path}: "{key}" is {what}: remove the key or set it to "auto"'
        )


def check_fp16_device(cfg: TrainConfig, world_size: int) -> None:
    from shardtune.runtime.precision import fp16_compute_available

    if cfg.train.precision == "fp16" and not fp16_compute_available():
        raise ConfigError(
            f"{spelling_of(cfg, 'train.precision')} needs CUDA GPUs (fp16 compute with a gradient "
            "scaler, for GPUs without bf16); this machine has none, and on CPU shardtune computes in "
            "fp32: drop it"
        )


def check_long_sequence_levers(cfg: TrainConfig, world_size: int) -> None:
    m = cfg.model
    if m.rope_scaling and m.rope_factor <= 1:
        raise ConfigError(
            f"--rope_factor {m.rope_factor} must be > 1 with --rope_scaling {m.rope_scaling}: pass the "
            "context extension, e.g. --rope_factor 4"
        )
    if not m.rope_scaling and m.rope_factor != 1:
        raise ConfigError(
            f"--rope_factor {m.rope_factor} has no effect without --rope_scaling: add --rope_scaling yarn "
            "or drop the flag"
        )


def check_observability(cfg: TrainConfig, world_size: int) -> None:
    import importlib.util

    lg = cfg.logging
    for name in lg.report_to:
        module, extra = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            flag = (
                "--use_wandb"
                if cfg.provenance.spelled.get("logging.report_to") == "use_wandb"
                else f"--report_to {','.join(lg.report_to)}"
            )
            raise ConfigError(
                f"{flag} needs {module}, which is not installed: pip install 'shardtune[{extra}]', or drop the flag"
            )
    if lg.profiler and lg.flop_counter:
        raise ConfigError(
            "--use_profiler and --flop_counter are both set: the FLOP counter would count the "
            "profiler's steps too; drop one of them"
        )
    key = "train.max_steps" if cfg.train.max_steps else "train.stop_after_steps"
    max_steps, flag = get_value(cfg, key), spelling_of(cfg, key)
    if lg.flop_counter and max_steps and max_steps <= lg.flop_counter_start:
        raise ConfigError(
            f"--flop_counter measures step {lg.flop_counter_start + 1} (after --flop_counter_start "
            f"{lg.flop_counter_start} warm-up steps), but {flag} is {max_steps}: raise "
            f"{flag} or lower --flop_counter_start"
        )
    profiled = sum(PROFILER_SCHEDULE.values())
    if lg.profiler and max_steps and max_steps <= profiled:
        raise ConfigError(
            f"--use_profiler records steps 4-6 after {PROFILER_SCHEDULE['wait']} wait and "
            f"{PROFILER_SCHEDULE['warmup']} warm-up steps, so it needs more than {profiled} steps, but "
            f"{flag} is {max_steps}: raise it to {profiled + 1} or more"
        )


def check_combinations(cfg: TrainConfig, world_size: int) -> None:
    """Settings that cannot go together, or with this launch."""
    if cfg.model.freeze_layers and cfg.peft.method:
        raise ConfigError(
            "--freeze_layers applies to full fine-tuning; with --use_peft the base model is frozen "
            "already: drop one of them"
        )
    if cfg.parallel.one_gpu and world_size > 1:
        raise ConfigError(
            f"--one_gpu trains in one process, but this launch has {world_size}: drop --one_gpu, or "
            "launch one process (--nproc_per_node 1)"
        )
    if not cfg.checkpoint.save_optimizer and cfg.parallel.strategy == "deepspeed":
        raise ConfigError(
            "--save_optimizer false is not supported with --enable_deepspeed (DeepSpeed writes its "
            "partitions with the optimizer state): drop the flag"
        )
    if cfg.data.sampling == "sequential" and registration(cfg.objective).sampling_rows(cfg, world_size):
        raise ConfigError(
            f"--train_sampling_strategy sequential: shardtune {cfg.objective} orders its prompts by its own seeded "
            "sampler (the same on every layout): drop the flag"
        )
    if cfg.checkpoint.dist_checkpoint_root_folder and not cfg.checkpoint.dist_checkpoint_folder:
        raise ConfigError(
            "--dist_checkpoint_folder is empty: name the checkpoint folder (llama-cookbook writes "
            "<dist_checkpoint_root_folder>/<dist_checkpoint_folder>-<model_name>)"
        )


# The checks of this floor, in the order they run (shardtune.training.engine.checks runs them first).
CONFIG_CHECKS = (
    check_fields,
    check_core,
    check_combinations,
    check_fsdp,
    check_deepspeed,
    check_fp16_device,
    check_long_sequence_levers,
    check_observability,
)
