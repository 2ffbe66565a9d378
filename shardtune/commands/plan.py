"""``shardtune plan``: will this configuration fit, and how fast will it be, before a GPU is rented.

    shardtune plan --model_name llama3-8b --enable_fsdp --gpus_per_node 8 --gpu H100
    shardtune plan --model_name llama3-70b --use_peft --quantization 4bit --enable_fsdp --gpus_per_node 4 --json
    shardtune plan --objective dpo --model_name llama3-8b --enable_deepspeed --deepspeed_config.zero_stage 3

Takes sft's flags (the model is read from its config.json, or a built-in shape; nothing is loaded) plus the
hardware; prints the per-GPU memory of the configuration, the alternatives that fit, the fastest of them as a
command line, and the largest micro-batch and longest sequence that fit. Exit status 1 when nothing fits.
``--objective dpo`` plans a ``shardtune dpo`` run (with dpo's flags): two rows per pair, and for full fine-tuning the
frozen reference model, sharded like the policy (none with --use_peft or --precompute_ref_log_probs). ``--objective
grpo``: also the sampling between steps (the KV cache of a generation's completions, ZeRO-3's whole-model gather).
"""

from __future__ import annotations

import json
import sys

from shardtune.config.argv import split_argv
from shardtune.config.flags import build_config
from shardtune.config.objectives import OBJECTIVES
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.planner.hardware import DEVICES, resolve_device
from shardtune.planner.render import base_command, render
from shardtune.planner.search import check_split, plan, setup_from_config
from shardtune.training.engine.objective import check_objective as check_run_objective
from shardtune.training.engine.objective import foreign_setting, objective_class

HARDWARE_DEFAULTS = {"gpu": "H100", "gpu_memory": "", "host_memory": "", "nnodes": "1", "gpus_per_node": "8"}


def plan_values(hardware: dict[str, str], launcher: dict[str, str | None]) -> dict[str, str]:
    """The plan's hardware, with sft's topology flags too: --nproc_per_node (--num_processes) N is --gpus_per_node
    N, --nnodes M as given; the rendezvous flags (where the processes meet) do not change a plan."""
    values = dict(hardware)
    topology = {"gpus_per_node": launcher.get("nproc_per_node"), "nnodes": launcher.get("nnodes")}
    for name, value in topology.items():
        if value is not None and values.setdefault(name, value) != value:
            raise ConfigError(f"--{name} {values[name]} and the launcher's {value} disagree: keep one of them")
    return {**HARDWARE_DEFAULTS, **values}


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(
            __doc__.strip()
            + "\n\nplan flags: --gpu "
            + "|".join(DEVICES)
            + "|cpu, --gpu_memory SIZE, --host_memory SIZE (per node; "
            "default: what a server of that GPU ships with, stated in the output), --nnodes M, "
            "--gpus_per_node G, --images_per_example N and --image_tokens N (a vision-language model: images per "
            "row, default 1; tokens per image where the resolution sets them, Qwen2-VL), --objective "
            + "|".join(OBJECTIVES)
            + " (default sft; another: such a run, its flags), --json; "
            "every sft flag (shardtune sft --help)"
        )
        return 0
    as_json = "--json" in argv
    try:
        args = split_argv([a for a in argv if a != "--json"])
        values = plan_values(args.hardware, args.launcher)
        cfg = build_config(args.training, args.recipe)
        if cfg.model.revision:
            raise ConfigError(
                f"--model_revision {cfg.model.revision}: the plan reads the hub id's main config.json; "
                "drop --model_revision, or download the revision and pass its directory as "
                "--model_name"
            )
        objective = check_objective(cfg.objective, cfg)
        device = resolve_device(values)
        setup = setup_from_config(cfg, values, device)
        if setup.arch.vision:  # a vision-language model: the objective that trains one checks (or refuses) it
            check_run_objective(cfg, setup.world_size)
        else:
            objective_class(objective).check(cfg, setup.world_size)
        check_split(cfg, setup)
        result = plan(setup, device, cfg.train.gradient_accumulation_steps)
        result["command"] = f"shardtune {objective}"
    except ConfigError as e:
        print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(result, default=lambda o: None, indent=1))
    else:
        print(render(result, base_command([(n, v) for n, v in args.training if n != "objective"])))
    return 0 if result["recommended"] else 1


def check_objective(objective: str, cfg: TrainConfig) -> str:
    """--objective names what is planned; another objective's flags plan nothing without it (they would be
    ignored)."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"--objective {objective}: choose one of {', '.join(OBJECTIVES)}")
    cfg.objective = objective
    foreign = foreign_setting(cfg)
    if foreign:
        raise ConfigError(
            f"--{foreign[1]} is one of shardtune {foreign[0]}'s flags: add --objective {foreign[0]} to "
            f"plan a {foreign[0]} run, or drop it"
        )
    return objective
