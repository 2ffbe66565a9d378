"""``shardtune sft``: supervised fine-tuning. Launches itself through torchrun, or runs in place as a worker.
``shardtune dpo`` is this command with the DPO objective (``main(argv, objective="dpo")``; torchrun runs
``-m shardtune.dpo``): the same launcher, topology, flags and recipe files.

    shardtune sft --nproc_per_node 4 --dataset samsum_dataset ...       # launches 4 processes
    torchrun --nproc_per_node 4 -m shardtune.sft --dataset ...           # the same, torchrun by hand
"""

from __future__ import annotations

import os
import sys

from shardtune.config.accelerate import accelerate_config_path, expand_accelerate_config
from shardtune.config.flags import parse_args, recipe_launch_settings, recipe_path
from shardtune.config.schema import ConfigError
from shardtune.config.trl import take_num_processes
from shardtune.launch.torchrun import (
    in_place_worker_env,
    launch,
    resolve_here,
    runs_in_place,
    sft_help_text,
    split_launcher_args,
)
from shardtune.model.cookbook import clear_accelerate_loading_variables
from shardtune.planner.dry_run import dry_run, dry_run_topology, split_hardware_flags
from shardtune.runtime.distributed import (
    is_torchrun_worker,
    local_gpu_count,
    nccl_watchdog_env,
)
from shardtune.runtime.errors import fail
from shardtune.runtime import startup
from shardtune.runtime.libraries import quiet_libraries
from shardtune.training.checks import prepare
from shardtune.training.worker import run_worker


def main(argv: list[str] | None = None, objective: str = "sft") -> int:
    argv = sys.argv[1:] if argv is None else argv
    startup.command_start()  # launched workers inherit it
    startup.mark("python and imports")
    quiet_libraries()
    clear_accelerate_loading_variables()
    if "-h" in argv or "--help" in argv:
        print(sft_help_text(objective))
        return 0
    debug = "--debug" in argv
    try:
        recipe_env, recipe_accelerate = recipe_launch_settings(argv)
        os.environ.update(recipe_env)  # the recipe's env: before anything reads the environment
        accelerate_path, _ = accelerate_config_path(argv)
        accelerate_path = accelerate_path or recipe_accelerate
        file_launch_args, file_train_argv, argv = expand_accelerate_config(argv, recipe_accelerate)
        launch_args, train_argv = split_launcher_args(take_num_processes(argv))
        hardware, train_argv = split_hardware_flags(train_argv)
        notes: list[str] = []  # command line > recipe > Accelerate file; a disagreement of the last two is said
        cfg = parse_args(train_argv, file_train_argv, notes)
        if not is_torchrun_worker():
            sources = [f"recipe {recipe_path(train_argv)}"] if recipe_path(train_argv) else []
            sources += [f"Accelerate file {accelerate_path}"] if accelerate_path else []
            if sources:  # the start log states the precedence
                print(f"shardtune: settings from the command line > {' > '.join(sources)}", file=sys.stderr)
            for note in notes:
                print(f"shardtune: {note}", file=sys.stderr, flush=True)
        if hardware and not cfg.dry_run:
            raise ConfigError(f"--{next(iter(hardware))} describes the hardware of a plan: add --dry_run (or use "
                              "shardtune plan), or drop the flag")
        if is_torchrun_worker():
            if cfg.dry_run:
                raise ConfigError("--dry_run starts no processes, but this one runs under torchrun: run shardtune "
                                  "sft --dry_run (with --nproc_per_node / --nnodes) without torchrun")
            if launch_args:
                raise ConfigError(f"--{next(iter(launch_args))} is a torchrun flag, but this process already runs "
                                  "under torchrun: give it to torchrun, before -m shardtune.sft")
            return run_worker(cfg, objective=objective)
        launch_args = {**file_launch_args, **launch_args}
        if cfg.one_gpu:
            launch_args.setdefault("nproc_per_node", "1")
        if cfg.dry_run and cfg.model_revision:
            raise ConfigError(f"--model_revision {cfg.model_revision} with --dry_run: the plan reads the hub id's "
                              "main config.json; drop --model_revision, or download the revision and pass its "
                              "directory as --model_name")
        if cfg.dry_run:
            return dry_run(cfg, dry_run_topology(launch_args, hardware), hardware, file_train_argv + train_argv,
                           objective)
        topology = resolve_here(launch_args)
        prepare(cfg, topology.world_size, objective)
        startup.mark("checks, model source, data cache")
    except ConfigError as e:
        fail(str(e), debug)
        return 2
    if runs_in_place(launch_args, topology):
        print(topology.describe(), flush=True)  # the start log's first line, as when torchrun launches
        os.environ.update(in_place_worker_env())
        return run_worker(cfg, prepared=True, objective=objective)
    if local_gpu_count():  # before torchrun's agent starts: it would set TORCH_NCCL_ASYNC_ERROR_HANDLING=1
        os.environ.update(nccl_watchdog_env(cfg.dist_timeout, os.environ))
    accelerate = ["--accelerate_config", accelerate_path] if accelerate_path else []  # the workers read it alike
    # the workers read the resolved model path (a preset is built once, here) and the run's directory as resolved
    # (and --model_revision resolved into that path: emptied)
    return launch(topology, f"shardtune.{objective}", [*accelerate, *train_argv, "--model_name", cfg.model_name,
                                                       "--model_revision", cfg.model_revision,
                                                       "--output_dir", cfg.output_dir])
