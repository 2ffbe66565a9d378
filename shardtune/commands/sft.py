"""``shardtune sft``: supervised fine-tuning. Launches itself through torchrun, or runs in place as a worker.

    shardtune sft --nproc_per_node 4 --dataset samsum_dataset ...       # launches 4 processes
    torchrun --nproc_per_node 4 -m shardtune.sft --dataset ...           # the same, torchrun by hand
"""

from __future__ import annotations

import os
import sys

from shardtune.config.accelerate import expand_accelerate_config
from shardtune.config.flags import parse_args
from shardtune.config.schema import ConfigError
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
from shardtune.runtime.libraries import quiet_libraries
from shardtune.training.checks import prepare
from shardtune.training.worker import run_worker


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_libraries()
    clear_accelerate_loading_variables()
    if "-h" in argv or "--help" in argv:
        print(sft_help_text())
        return 0
    debug = "--debug" in argv
    try:
        file_launch_args, file_train_argv, argv = expand_accelerate_config(argv)
        launch_args, train_argv = split_launcher_args(argv)
        hardware, train_argv = split_hardware_flags(train_argv)
        train_argv = file_train_argv + train_argv  # flags typed on the command line come last and win
        cfg = parse_args(train_argv)
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
            return run_worker(cfg)
        launch_args = {**file_launch_args, **launch_args}
        if cfg.one_gpu:
            launch_args.setdefault("nproc_per_node", "1")
        if cfg.dry_run:
            return dry_run(cfg, dry_run_topology(launch_args, hardware), hardware, train_argv)
        topology = resolve_here(launch_args)
        prepare(cfg, topology.world_size)
    except ConfigError as e:
        fail(str(e), debug)
        return 2
    if runs_in_place(launch_args, topology):
        os.environ.update(in_place_worker_env())
        return run_worker(cfg, prepared=True)
    if local_gpu_count():  # before torchrun's agent starts: it would set TORCH_NCCL_ASYNC_ERROR_HANDLING=1
        os.environ.update(nccl_watchdog_env(cfg.dist_timeout, os.environ))
    # workers receive the resolved model path, so a preset is built once, here
    return launch(topology, "shardtune.sft", [*train_argv, "--model_name", cfg.model_name])
