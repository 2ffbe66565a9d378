"""``shardtune sft``: supervised fine-tuning. Launches itself through torchrun, or runs in place as a worker.
Every training verb is this command with its objective (``shardtune dpo``: ``main(argv, objective="dpo")``; the
workers run ``-m shardtune.sft --objective dpo``): the same launcher, topology, flags and recipe files.

    shardtune sft --nproc_per_node 4 --dataset samsum_dataset ...       # launches 4 processes
    torchrun --nproc_per_node 4 -m shardtune.sft --dataset ...           # the same, torchrun by hand
"""

from __future__ import annotations

import os
import sys

from shardtune.config import defaults
from shardtune.config.argv import Arguments, as_flags, split_argv
from shardtune.config.dialects.accelerate import clear_accelerate_loading_variables, read_accelerate
from shardtune.config.flags import build_config, recipe_launch_settings
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.launch.torchrun import in_place_worker_env, launch, resolve_here, runs_in_place, sft_help_text
from shardtune.planner.dry_run import dry_run, dry_run_topology
from shardtune.runtime import startup
from shardtune.runtime.distributed import (
    is_torchrun_worker,
    local_gpu_count,
    nccl_watchdog_env,
)
from shardtune.runtime.errors import fail
from shardtune.runtime.libraries import quiet_libraries
from shardtune.training.engine.checks import prepare
from shardtune.training.engine.worker import run_worker


def main(argv: list[str] | None = None, objective: str | None = None) -> int:
    """``objective``: the verb's (None: --objective as given, sft by default)."""
    argv = sys.argv[1:] if argv is None else argv
    startup.command_start()  # launched workers inherit it
    startup.mark("python and imports")
    quiet_libraries()
    clear_accelerate_loading_variables()
    if "-h" in argv or "--help" in argv:
        print(sft_help_text(objective or "sft"))
        return 0
    debug = "--debug" in argv
    try:
        args = split_argv(argv)  # the front door: launcher, hardware, Accelerate file, recipe, training flags
        recipe_env, recipe_accelerate, recipe_launch = recipe_launch_settings(args.recipe)
        os.environ.update(recipe_env)  # the recipe's env: before anything reads the environment
        accelerate_path = args.accelerate or recipe_accelerate
        file_launch_args, file_settings = read_accelerate(accelerate_path)
        notes: list[str] = []  # command line > recipe > Accelerate file; a disagreement of the last two is said
        cfg = build_config(args.training, args.recipe, file_settings, notes, objective)  # another objective: refused
        if not is_torchrun_worker():
            say_sources(args, accelerate_path, notes)
        check_placement(cfg, args)
        if is_torchrun_worker():
            return run_worker(cfg)
        launch_args = {**file_launch_args, **recipe_launch, **args.launcher}  # command line > recipe > file
        if cfg.parallel.one_gpu:
            launch_args.setdefault("nproc_per_node", "1")
        if cfg.run.dry_run and cfg.model.revision:
            raise ConfigError(
                f"--model_revision {cfg.model.revision} with --dry_run: the plan reads the hub id's "
                "main config.json; drop --model_revision, or download the revision and pass its "
                "directory as --model_name"
            )
        if cfg.run.dry_run:
            return dry_run(
                cfg,
                dry_run_topology(launch_args, args.hardware),
                args.hardware,
                [*as_flags(file_settings), *args.training],
            )
        topology = resolve_here(launch_args)
        prepare(cfg, topology.world_size)
        print(f"shardtune: {defaults.summary(cfg)}", file=sys.stderr, flush=True)  # checked: whose defaults, and what
        startup.mark("checks, model source, data cache")
    except ConfigError as e:
        fail(str(e), debug)
        return 2
    if runs_in_place(launch_args, topology):
        print(topology.describe(), flush=True)  # the start log's first line, as when torchrun launches
        os.environ.update(in_place_worker_env())
        return run_worker(cfg, prepared=True)
    if local_gpu_count():  # before torchrun's agent starts: it would set TORCH_NCCL_ASYNC_ERROR_HANDLING=1
        os.environ.update(nccl_watchdog_env(cfg.parallel.dist_timeout, os.environ))
    return launch(topology, "shardtune.sft", worker_argv(cfg, args, accelerate_path))


def worker_argv(cfg: TrainConfig, args: Arguments, accelerate_path: str | None) -> list[str]:
    """What every worker parses: the same files and flags, and what the launcher resolved -- the model path (a
    preset is built once, here), the revision resolved into it (emptied), the run's directory, the objective,
    --padding_free's value when it was not given (the objective's choice)."""
    files = (["--accelerate_config", accelerate_path] if accelerate_path else []) + (
        ["--config", args.recipe] if args.recipe else []
    )
    resolved = ["--objective", cfg.objective, "--model.name", cfg.model.name, "--model.revision", cfg.model.revision]
    resolved += ["--data.padding_free", str(cfg.data.padding_free).lower()]  # None: resolved in prepare()
    return [*files, *args.training_argv(), *resolved, "--output.dir", cfg.output.dir]


def say_sources(args: Arguments, accelerate_path: str | None, notes: list[str]) -> None:
    """The start log's precedence of the files that gave settings, and their disagreements."""
    sources = [f"recipe {args.recipe}"] if args.recipe else []
    sources += [f"Accelerate file {accelerate_path}"] if accelerate_path else []
    if sources:
        print(f"shardtune: settings from the command line > {' > '.join(sources)}", file=sys.stderr)
    for note in notes:
        print(f"shardtune: {note}", file=sys.stderr, flush=True)


def check_placement(cfg: TrainConfig, args: Arguments) -> None:
    """Flags that belong to another place: hardware to a plan, launcher flags and --dry_run outside torchrun."""
    if args.hardware and not cfg.run.dry_run:
        raise ConfigError(
            f"--{next(iter(args.hardware))} describes a plan's hardware or images: add --dry_run (or use "
            "shardtune plan), or drop the flag"
        )
    if not is_torchrun_worker():
        return
    if cfg.run.dry_run:
        raise ConfigError(
            "--dry_run starts no processes, but this one runs under torchrun: run shardtune "
            "sft --dry_run (with --nproc_per_node / --nnodes) without torchrun"
        )
    if args.launcher:
        raise ConfigError(
            f"--{next(iter(args.launcher))} is a torchrun flag, but this process already runs "
            "under torchrun: give it to torchrun, before -m shardtune.sft"
        )
