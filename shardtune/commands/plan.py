"""``shardtune plan``: will this configuration fit, and how fast will it be, before a GPU is rented.

    shardtune plan --model_name llama3-8b --enable_fsdp --gpus_per_node 8 --gpu H100
    shardtune plan --model_name llama3-70b --use_peft --quantization 4bit --enable_fsdp --gpus_per_node 4 --json
    shardtune plan --objective dpo --model_name llama3-8b --enable_deepspeed --deepspeed_config.zero_stage 3

Takes sft's flags (the model is read from its config.json, or a built-in shape; nothing is loaded) plus the
hardware; prints the per-GPU memory of the configuration, the alternatives that fit, the fastest of them as a
command line, and the largest micro-batch and longest sequence that fit. Exit status 1 when nothing fits.
``--objective dpo`` plans a ``shardtune dpo`` run (with dpo's flags): two rows per pair, the logits of every token,
and for full fine-tuning the frozen reference model, sharded like the policy (none with --use_peft or
--precompute_ref_log_probs).
"""

from __future__ import annotations

import json
import sys

from shardtune.config.schema import ConfigError, DpoConfig, TrainConfig
from shardtune.config.flags import parse_args
from shardtune.planner.search import check_split, plan, setup_from_config
from shardtune.planner.render import render, split_named_flags, without_strategy_flags
from shardtune.planner.hardware import DEVICES, resolve_device

PLAN_FLAGS = {"gpu": "H100", "gpu_memory": "", "host_memory": "", "nnodes": "1", "gpus_per_node": "8",
              "objective": "sft"}
OBJECTIVES = ("sft", "dpo")


def split_plan_args(argv: list[str]) -> tuple[dict[str, str], list[str], bool]:
    """sft's topology flags too: --nproc_per_node (--num_processes) N is --gpus_per_node N, --nnodes M as given; the
    rendezvous flags (where the processes meet) do not change a plan."""
    from shardtune.config.trl import take_num_processes
    from shardtune.launch.torchrun import split_launcher_args

    as_json = any(a == "--json" for a in argv)
    launch, argv = split_launcher_args(take_num_processes([a for a in argv if a != "--json"]))
    values, rest = split_named_flags(argv, PLAN_FLAGS)
    topology = {"gpus_per_node": launch.get("nproc_per_node"), "nnodes": launch.get("nnodes")}
    for name, value in topology.items():
        if value is not None and values.setdefault(name, value) != value:
            raise ConfigError(f"--{name} {values[name]} and the launcher's {value} disagree: keep one of them")
    return {**PLAN_FLAGS, **values}, rest, as_json


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip() + "\n\nplan flags: --gpu " + "|".join(DEVICES) + "|cpu, --gpu_memory SIZE, --host_memory SIZE (per node; "
              "default: what a server of that GPU ships with, stated in the output), --nnodes M, "
              "--gpus_per_node G, --objective sft|dpo (default sft; dpo: a shardtune dpo run, with its flags), --json; "
              "every sft flag (shardtune sft --help)")
        return 0
    try:
        values, sft_argv, as_json = split_plan_args(argv)
        cfg = parse_args(sft_argv)
        if cfg.model_revision:
            raise ConfigError(f"--model_revision {cfg.model_revision}: the plan reads the hub id's main config.json; "
                              "drop --model_revision, or download the revision and pass its directory as "
                              "--model_name")
        objective = check_objective(values["objective"], cfg)
        device = resolve_device(values)
        setup = setup_from_config(cfg, values, device, objective)
        if objective == "dpo":
            from shardtune.training.dpo import check_dpo_config

            check_dpo_config(cfg, setup.world_size)
        check_split(cfg, setup)
        result = plan(setup, device, cfg.gradient_accumulation_steps)
        result["command"] = f"shardtune {objective}"
    except ConfigError as e:
        print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(result, default=lambda o: None, indent=1))
    else:
        print(render(result, without_strategy_flags(sft_argv)))
    return 0 if result["recommended"] else 1


def check_objective(objective: str, cfg: TrainConfig) -> str:
    """--objective names what is planned; DPO's flags plan nothing without it (a plan of SFT would ignore them)."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"--objective {objective}: choose one of {', '.join(OBJECTIVES)}")
    if objective == "sft" and cfg.dpo != DpoConfig():
        raise ConfigError("--beta / --loss_type / --label_smoothing / --precompute_ref_log_probs are shardtune dpo's "
                          "flags: add --objective dpo to plan a DPO run, or drop them")
    return objective
