"""The alternatives to a configuration, the largest batch and longest row that fit, and the plan of one
configuration: what `shardtune plan` and `shardtune sft --dry_run` print.
"""

from __future__ import annotations

from dataclasses import replace

from shardtune.accounting.memory import GIB
from shardtune.config.objectives import registration
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.planner.estimate import (
    FSDP_STRATEGIES,
    STRATEGIES,
    Setup,
    estimate,
    host_bytes_per_node,
    image_activation_bytes,
    projector_trains,
    tower_trains,
    usable_bytes,
    usable_host_bytes,
)
from shardtune.planner.hardware import Device
from shardtune.planner.render import command_flags, describe_setup
from shardtune.planner.shapes import Adapter, Arch, read_arch
from shardtune.planner.speed import step_time_s

# -- alternatives, limits and the recommendation ---------------------------------------------------------------------


def fits(setup: Setup, device: Device) -> bool:
    """The peak fits a GPU and the node's processes fit its host memory (offloaded state, loading the weights)."""
    return estimate(setup).peak <= usable_bytes(device) and host_bytes_per_node(setup) <= usable_host_bytes(device)


# from this many tokens per micro-batch on, the alternatives include rows split over sequence / context parallel ranks
LONG_CONTEXT_TOKENS = 32768


def sequence_splits(arch: Arch, world_size: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """(sp, cp) pairs worth comparing for a split row: for each product P > 1 that divides the world, the most
    Ulysses ranks that divide the query heads and stay in a node, the ring for the rest; and the pure ring."""
    pairs: list[tuple[int, int]] = []
    for product in range(2, world_size + 1):
        if world_size % product:
            continue
        sp = max(
            d for d in range(1, product + 1) if product % d == 0 and arch.num_heads % d == 0 and d <= gpus_per_node
        )
        for pair in ((sp, product // sp), (1, product)):
            if pair not in pairs and (pair[1] == 1 or arch.sliding_window is None):
                pairs.append(pair)
    return pairs


def alternatives(setup: Setup) -> list[Setup]:
    """The given setup and the others worth comparing: each strategy, with activation checkpointing and offload;
    for long rows, FSDP with each sequence / context parallel split (FSDP shards over the split ranks too)."""
    out = [setup]
    split = setup.sequence_parallel * setup.context_parallel > 1
    for strategy in STRATEGIES:
        if strategy == "HYBRID_SHARD" and setup.num_nodes == 1:
            continue
        if setup.quantization == "8bit" and strategy not in ("DDP", "ZERO1", "ZERO2"):
            continue
        if split and strategy.startswith("ZERO"):  # DeepSpeed counts every rank as data parallel (config.py)
            continue
        for ac in (False, True) if strategy in FSDP_STRATEGIES else (False,):
            offloads = (False, True) if strategy in ("FULL_SHARD", "ZERO2", "ZERO3") else (False,)
            for offload in offloads:
                candidate = replace(setup, strategy=strategy, activation_checkpointing=ac, cpu_offload=offload)
                if candidate not in out:
                    out.append(candidate)
    if (
        setup.batch_size * setup.seq_len >= LONG_CONTEXT_TOKENS
        and setup.quantization != "8bit"
        and setup.adapter.method in ("", "lora")
    ):
        for sp, cp in sequence_splits(setup.arch, setup.world_size, setup.gpus_per_node):
            for ac in (False, True):
                candidate = replace(
                    setup,
                    strategy="FULL_SHARD",
                    activation_checkpointing=ac,
                    cpu_offload=False,
                    sequence_parallel=sp,
                    context_parallel=cp,
                )
                if candidate not in out:
                    out.append(candidate)
    return out


def largest_batch(setup: Setup, device: Device, limit: int = 1024) -> int:
    """The largest micro-batch (units of seq_len tokens) that fits, 0 if none."""
    best, lo, hi = 0, 1, limit
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(replace(setup, batch_size=mid), device):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def longest_sequence(setup: Setup, device: Device, limit: int = 1 << 24) -> int:
    """The longest sequence (tokens, multiple of 256) that fits with the setup's micro-batch of 1, 0 if none."""
    best, lo, hi = 0, 1, limit // 256
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(replace(setup, batch_size=1, seq_len=mid * 256), device):
            best, lo = mid * 256, mid + 1
        else:
            hi = mid - 1
    return best


def setup_from_config(cfg: TrainConfig, values: dict[str, str], device: Device) -> Setup:
    """The planner's configuration of a run of ``cfg`` (its objective's rows and reference too) on ``values``'
    hardware."""
    try:
        nnodes, per_node = int(values["nnodes"]), int(values["gpus_per_node"])
    except ValueError:
        raise ConfigError("--nnodes and --gpus_per_node must be whole numbers") from None
    if nnodes <= 0 or per_node <= 0:
        raise ConfigError("--nnodes and --gpus_per_node must be positive")
    fc = dc = cfg.parallel
    if cfg.parallel.strategy == "fsdp":
        strategy = fc.sharding_strategy
    elif cfg.parallel.strategy == "deepspeed":
        strategy = f"ZERO{dc.zero_stage}"
    else:
        strategy = "DDP"
    adapter = Adapter()
    if bool(cfg.peft.method):
        adapter = Adapter(
            method=cfg.peft.method,
            lora_r=cfg.peft.lora.r,
            lora_targets=tuple(cfg.peft.lora.target_modules),
            lora_dropout=cfg.peft.lora.dropout,
            adapter_len=cfg.peft.llama_adapter.adapter_len,
            adapter_layers=cfg.peft.llama_adapter.adapter_layers,
            num_virtual_tokens=cfg.peft.prefix.num_virtual_tokens,
        )
    quantization = cfg.model.quantization
    from shardtune.model.loading import MODEL_HEADS

    objective = registration(cfg.objective)
    head = MODEL_HEADS[objective.model_head].config.get("num_labels", 0)  # a score head's outputs (0: the LM head)
    arch = replace(read_arch(cfg.model.name or "preset:demo"), score_outputs=head)
    arch, images_per_example = image_settings(arch, values, cfg.data.context_length)
    return Setup(
        arch=arch,
        images_per_example=images_per_example,
        strategy=strategy,
        num_nodes=nnodes,
        gpus_per_node=per_node,
        sharding_group_size=fc.sharding_group_size,
        batch_size=cfg.train.batch_size,
        seq_len=cfg.data.context_length,
        activation_checkpointing=fc.activation_checkpointing,
        cpu_offload=fc.cpu_offload or dc.offload_optimizer,
        pure_bf16=cfg.train.precision == "pure_bf16",
        compute_bytes=device.compute_bytes,
        adapter=adapter,
        quantization=quantization,
        sequence_parallel=cfg.parallel.sequence_parallel_size,
        context_parallel=cfg.parallel.context_parallel_size,
        low_cpu_fsdp=cfg.parallel.low_cpu_fsdp,
        rows_per_unit=objective.rows_per_unit,
        reference_model=objective.frozen_reference(cfg),
        sampling_rows=objective.sampling_rows(cfg, nnodes * per_node),
        sampling_gathers_whole=objective.sampling_gathers_whole(cfg),
        scored_rows_per_unit=objective.scored_rows_per_unit(cfg),
        frozen_parts=frozen_parts(cfg),
    )


def frozen_parts(cfg: TrainConfig) -> frozenset[str]:
    """The vision-language parts the run's freezing flags keep (shardtune.model.freezing.VISION_FREEZING)."""
    from shardtune.model.freezing import VISION_FREEZING

    keys = (key.split(".", 1)[1] for key in VISION_FREEZING)
    return frozenset(key.removeprefix("freeze_") for key in keys if getattr(cfg.model, key))


def _whole_number(values: dict[str, str], name: str) -> int | None:
    if values.get(name) in (None, ""):
        return None
    try:
        number = int(values[name])
    except ValueError:
        number = 0
    if number <= 0:
        raise ConfigError(f"--{name} {values[name]!r}: give a positive whole number")
    return number


def image_settings(arch: Arch, values: dict[str, str], context_length: int) -> tuple[Arch, int]:
    """The model with --image_tokens applied, and --images_per_example (default 1), checked: a text model takes
    neither; the images' tokens must fit the row (the processor counts them within --context_length, and a row cut
    inside an image fails in the model)."""
    per_example, tokens = _whole_number(values, "images_per_example"), _whole_number(values, "image_tokens")
    v = arch.vision
    if v is None:
        if per_example or tokens:
            flag = "images_per_example" if per_example else "image_tokens"
            raise ConfigError(f"--{flag}: {arch.name} is a text model (no vision_config): drop it")
        return arch, 1
    if tokens:
        if not v.dynamic:
            raise ConfigError(
                f"--image_tokens {tokens}: a {v.family} image is always {v.image_tokens} tokens ({v.source}): drop it"
            )
        v = v.with_image_tokens(tokens)
    per_example = per_example or 1
    if per_example * v.image_tokens > context_length:
        hint = ", or --image_tokens N (your images' tokens: smaller images)" if v.dynamic else ""
        raise ConfigError(
            f"--context_length {context_length} is shorter than {per_example} image(s) of {v.image_tokens:,} tokens "
            f"each ({v.family}: {v.source}): raise --context_length, lower --images_per_example{hint}"
        )
    return replace(arch, vision=v), per_example


def check_split(cfg: TrainConfig, setup: Setup) -> None:
    """The sequence / context parallel sizes against the world and the model's heads: sft's own checks and
    messages (shardtune.parallel.dims, shardtune.parallel.sequence)."""
    from types import SimpleNamespace

    from shardtune.parallel.dims import ParallelDims, check_parallel_dims
    from shardtune.parallel.sequence import check_sequence_split

    check_parallel_dims(cfg, setup.world_size)
    ParallelDims.from_config(cfg, setup.world_size, setup.gpus_per_node)
    arch = setup.arch
    check_sequence_split(
        cfg,
        SimpleNamespace(
            num_attention_heads=arch.num_heads,
            num_key_value_heads=arch.num_kv_heads,
            sliding_window=arch.sliding_window,
        ),
    )


def plan(setup: Setup, device: Device, accumulation: int) -> dict:
    """Everything the command prints, as data (``--json``)."""
    rows = []
    for candidate in alternatives(setup):
        b = estimate(candidate)
        seconds, compute_s, comm_s = step_time_s(candidate, device, accumulation)
        tokens = candidate.batch_size * candidate.seq_len * accumulation * candidate.data_parallel
        rows.append(
            {
                "setup": describe_setup(candidate),
                "flags": command_flags(candidate),
                "peak_bytes": b.peak,
                "fits": fits(candidate, device),
                "step_s": seconds,
                "compute_s": compute_s,
                "communication_s": comm_s,
                "tokens_per_s_per_gpu": tokens / seconds / candidate.world_size,
                "host_state_bytes": b.host_state,
                "host_bytes_per_node": host_bytes_per_node(candidate),
                "_setup": candidate,
            }
        )
    fitting = [r for r in rows if r["fits"]]
    # by tokens/s: a row split over sp x cp ranks trains fewer rows per step, so its step time is not comparable
    best = max(fitting, key=lambda r: r["tokens_per_s_per_gpu"]) if fitting else None
    smallest = min(rows, key=lambda r: r["peak_bytes"])
    given = estimate(setup)
    return {
        "images": images_summary(setup),
        "model": setup.arch.name,
        "parameters": setup.arch.num_params,
        "trainable_parameters": setup.trainable_params,
        "device": device.describe(),
        "usable_bytes": usable_bytes(device),
        "usable_host_bytes": usable_host_bytes(device),
        "world_size": setup.world_size,
        "nnodes": setup.num_nodes,
        "gpus_per_node": setup.gpus_per_node,
        "given": {
            "setup": describe_setup(setup),
            "breakdown": dict(given.rows()),
            "peak_bytes": given.peak,
            "fits": fits(setup, device),
            "host_loading_bytes_per_node": given.host_loading,
            "host_state_bytes_per_rank": given.host_state,
            "host_bytes_per_node": host_bytes_per_node(setup),
        },
        "alternatives": rows,
        "recommended": best,
        "smallest": None if best else smallest,
        "would_fit": None if best else would_fit(setup, device),
        "largest_micro_batch": largest_batch(best["_setup"] if best else setup, device),
        "longest_sequence": longest_sequence(best["_setup"] if best else setup, device),
    }


def images_summary(setup: Setup) -> dict | None:
    """What the plan counted for a vision-language model's images (None for a text model)."""
    v = setup.arch.vision
    if v is None:
        return None
    images, _ = image_activation_bytes(setup)
    return {
        "family": v.family,
        "images_per_example": setup.images_per_example,
        "image_tokens": v.image_tokens,
        "image_tokens_from": v.source,
        "tower_positions_per_image": v.positions_per_image,
        "tower_layers": v.num_layers,
        "tower_parameters": v.num_params,
        "activation_bytes": images,
        "tower_trains": tower_trains(setup),
        "projector_trains": projector_trains(setup),
    }


def would_fit(setup: Setup, device: Device, max_nodes: int = 128) -> dict:
    """When nothing fits: the fewest GPUs (this many per node, up to 8, then more nodes) on which an alternative
    fits, and the GPU memory on which the smallest alternative of this world size would fit."""
    smallest = min((estimate(c).peak for c in alternatives(setup)))
    memory = 1.0
    while not smallest <= usable_bytes(replace(device, memory_bytes=memory * GIB)):  # the inverse of usable_bytes
        memory += 1.0
    result = {"gpu_memory_bytes": memory * GIB, "gpus": None}
    per_node = [(1, g) for g in range(setup.gpus_per_node + 1, 9)] if setup.num_nodes == 1 else []
    per_node += [(n, max(setup.gpus_per_node, 8)) for n in range(setup.num_nodes + 1, max_nodes + 1)]
    for nodes, gpus in per_node:
        grown = replace(setup, num_nodes=nodes, gpus_per_node=gpus)
        if grown.world_size % (grown.sequence_parallel * grown.context_parallel):
            continue
        fitting = [c for c in alternatives(grown) if fits(c, device)]
        if fitting:  # the fastest of them, by tokens per second
            fastest = min(fitting, key=lambda c: step_time_s(c, device)[0] / (c.batch_size * c.data_parallel))
            result["gpus"] = {"nnodes": nodes, "gpus_per_node": gpus, "setup": describe_setup(fastest)}
            break
    return result
