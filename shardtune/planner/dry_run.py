"""``shardtune sft --dry_run``: the run's checks, model, mesh and per-rank shards, without hardware or processes.

Nothing is launched, no weights or data are read, and nothing is written to --output_dir:

- the same checks as a real run before launch (config values, the mesh for the world size, the model's shape
  against FSDP / PEFT / sequence parallel flags), with the same one-line errors;
- the model is built on the meta device (shardtune.model.loading.build_model_on_meta, the low_cpu_fsdp path), with the
  PEFT adapter when asked;
- the mesh is built for the requested world size on torch's fake process group (every collective a no-op, seen
  from rank 0), and FSDP2 shards the meta model with the strategy's own ``shard``, so the per-rank state is read
  from rank 0's local shards by the formula of the start log (shardtune.accounting.memory.local_state_bytes). DDP
  holds the whole model. DeepSpeed ZeRO partitions flat buffers its engine allocates, and bitsandbytes cannot quantise
  on the meta device: for those the per-rank state is computed (shardtune.planner, the same formulas);
- then the plan of shardtune plan for this configuration.

A built-in shape (llama3-8b ...) or preset is written as a config.json into a temporary directory, so every check
reads it like a model directory.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from shardtune.config import defaults
from shardtune.config.schema import TrainConfig
from shardtune.launch.topology import Topology, resolve_topology
from shardtune.runtime.precision import weights_dtype
from shardtune.training.engine.checks import check_before_launch


def dry_run_topology(launch_args: dict[str, str | None], hardware: dict[str, str]) -> Topology:
    """The world the run would have: --gpus_per_node (or --nproc_per_node) processes on each of --nnodes nodes;
    by default one per GPU this machine sees, as sft. GPUs asked for need not be here."""
    from shardtune.runtime.distributed import local_gpu_count

    flags = dict(launch_args)
    if "gpus_per_node" in hardware:
        flags["nproc_per_node"] = hardware["gpus_per_node"]
    return resolve_topology(flags, os.environ, 0 if "nproc_per_node" in flags else local_gpu_count())


def model_directory(model_name: str, into: Path, trust_remote_code: bool = False) -> str:
    """A model directory for ``model_name``: a built-in shape or a preset as a config.json in ``into``; a directory
    or hub id as it is (checked as a real run checks it)."""
    from shardtune.model.loading import PRESET_PREFIX, PRESETS, TOKENIZER_VOCAB_SIZE, check_model_source
    from shardtune.model.vision_presets import VISION_PRESETS
    from shardtune.planner.shapes import BUILTIN_SHAPES
    from shardtune.planner.vision import write_preset_config

    if model_name in BUILTIN_SHAPES:
        config = dict(BUILTIN_SHAPES[model_name], architectures=["LlamaForCausalLM"])
    elif not model_name or model_name.startswith(PRESET_PREFIX):
        check_model_source(model_name)
        name = model_name.removeprefix(PRESET_PREFIX) or "demo"
        if name in VISION_PRESETS:  # its config and processor files (a vision run's checks read them)
            write_preset_config(name, into)
            return str(into)
        # the shared tokenizer's size unless the preset names its own vocabulary (as the built preset does)
        config = {
            "vocab_size": TOKENIZER_VOCAB_SIZE,
            **PRESETS[name],
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }
    else:
        check_model_source(model_name, trust_remote_code=trust_remote_code)
        return model_name
    (into / "config.json").write_text(json.dumps(config, indent=1))
    return str(into)


def fake_world(world_size: int) -> None:
    """A process group of ``world_size`` ranks seen from rank 0, in this process: torch's fake backend."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def shard_lines(cfg: TrainConfig, topology: Topology, arch_name: str, setup) -> list[str]:
    """The model on the meta device, sharded as the run would shard it; the start log's lines about it."""
    import torch.distributed as dist

    from shardtune.accounting.memory import human_bytes, local_state_bytes
    from shardtune.model.freezing import apply_freezing
    from shardtune.model.loading import build_model_on_meta, count_parameters, model_head, training_model_config
    from shardtune.model.peft import apply_peft
    from shardtune.parallel import make_strategy
    from shardtune.parallel.dims import ParallelDims
    from shardtune.runtime.distributed import DistEnv

    dims = ParallelDims.from_config(cfg, topology.world_size, topology.nproc_per_node)
    lines = [f"mesh: {dims.describe()} (world size {topology.world_size}; {dims.dp_size} data-parallel ranks)"]
    if cfg.model.quantization or cfg.parallel.strategy == "deepspeed":  # computed (module docstring)
        from shardtune.planner.estimate import estimate
        from shardtune.planner.render import describe_setup

        state = estimate(setup)
        lines.append(
            f"{describe_setup(setup)}: per-rank training state (computed by shardtune.planner): params "
            f"{human_bytes(state.params)}, grads {human_bytes(state.grads)}, AdamW state "
            + ("and fp32 master weights " if cfg.parallel.strategy == "deepspeed" else "")
            + human_bytes(state.optimizer)
            + (f", offloaded to the host {human_bytes(state.host_state)}" if state.host_state else "")
        )
        return lines
    dtype = weights_dtype(cfg.parallel.strategy, cfg.train.precision)
    model = build_model_on_meta(
        cfg.model.name,
        dtype=dtype,
        config=training_model_config(cfg),
        trust_remote_code=cfg.model.trust_remote_code,
        head=model_head(cfg),
    )
    apply_freezing(model, cfg)
    if bool(cfg.peft.method):
        model = apply_peft(model, cfg)
    num_params, num_trainable = count_parameters(model)
    lines.insert(
        0, f"meta model: {arch_name} ({num_params:,} parameters, {num_trainable:,} trainable), on the meta device"
    )
    if cfg.parallel.strategy != "fsdp":
        state = local_state_bytes(model)
        lines.append(
            f"ddp: per-rank training state (every rank holds the whole model): params "
            f"{human_bytes(state.params)}, grads {human_bytes(state.grads)}, AdamW state "
            f"{human_bytes(state.optimizer)}"
        )
        return lines
    from shardtune.parallel.fsdp import per_rank_state_line

    fake_world(topology.world_size)
    try:
        env = DistEnv(
            rank=0,
            local_rank=0,
            world_size=topology.world_size,
            local_world_size=topology.nproc_per_node,
            device=torch.device("cpu"),
            backend="fake",
        )
        strategy = make_strategy(cfg, env)
        strategy.shard(model)
        lines.append(per_rank_state_line(model))
    finally:
        dist.destroy_process_group()
    return lines


def dry_run(cfg: TrainConfig, topology: Topology, hardware: dict[str, str], flags: list[tuple[str, Any]]) -> int:
    """Check, shard on the meta device, print the shards and the plan; 0 when the plan finds a configuration that
    fits, 1 when nothing does (as shardtune plan). The objective's rows and reference are planned with it
    (``shardtune dpo --dry_run``: pairs and the reference model's memory). ``flags``: the run's settings as (flag,
    value), which the recommended command repeats."""
    from shardtune.planner.hardware import resolve_device
    from shardtune.planner.render import base_command, render
    from shardtune.planner.search import check_split, plan, setup_from_config

    given_name = cfg.model.name
    with tempfile.TemporaryDirectory(prefix="shardtune-dry-run-") as tmp:
        cfg.model.name = model_directory(given_name, Path(tmp), cfg.model.trust_remote_code)
        check_before_launch(cfg, topology.world_size)
        values = {
            "gpu": hardware.get("gpu", "H100"),
            "gpu_memory": hardware.get("gpu_memory", ""),
            "nnodes": str(topology.num_nodes),
            "gpus_per_node": str(topology.nproc_per_node),
            **{k: hardware[k] for k in ("images_per_example", "image_tokens") if k in hardware},
        }
        device = resolve_device(values)
        setup = setup_from_config(cfg, values, device)
        check_split(cfg, setup)
        lines = [
            "dry run: no process started, no weights or data read, nothing written",
            topology.describe(),
            defaults.summary(cfg),
            *shard_lines(cfg, topology, given_name or "preset:demo", setup),
        ]
        result = plan(setup, device, cfg.train.gradient_accumulation_steps)
    result["model"] = given_name or "preset:demo"
    result["command"] = f"shardtune {cfg.objective}"
    print("\n".join(lines) + "\n\n" + render(result, base_command(flags)), flush=True)
    return 0 if result["recommended"] else 1
