"""``shardtune plan``: will this configuration fit, and how fast will it be, before a GPU is rented.

    shardtune plan --model_name llama3-8b --enable_fsdp --gpus_per_node 8 --gpu H100
    shardtune plan --model_name llama3-70b --use_peft --quantization 4bit --enable_fsdp --gpus_per_node 4 --json

Takes sft's flags (the model is read from its config.json, or a built-in shape; nothing is loaded) plus the
hardware; prints the per-GPU memory of the configuration, the alternatives that fit, the fastest of them as a
command line, and the largest micro-batch and longest sequence that fit. Exit status 1 when nothing fits.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from shardtune.config import ConfigError, TrainConfig, parse_args
from shardtune.planner import (
    DEVICES, HUB_IDS, Adapter, Device, Setup, alternatives, command_flags, cpu_device, describe_setup, estimate,
    fits, largest_batch, longest_sequence, read_arch, step_time_s, usable_bytes,
)

PLAN_FLAGS = {"gpu": "H100", "gpu_memory": "", "nnodes": "1", "gpus_per_node": "8"}
GIB = 2**30


def split_plan_args(argv: list[str]) -> tuple[dict[str, str], list[str], bool]:
    values, rest, as_json = dict(PLAN_FLAGS), [], False
    i = 0
    while i < len(argv):
        name, eq, value = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        if name == "json":
            as_json = True
        elif name in PLAN_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"--{name} needs a value")
                i += 1
                value = argv[i]
            values[name] = value
        else:
            rest.append(argv[i])
        i += 1
    return values, rest, as_json


def parse_memory(text: str) -> float:
    units = {"TB": 1e12, "GB": 1e9, "TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "MB": 1e6}
    upper = text.strip().upper()
    for unit, size in units.items():
        if upper.endswith(unit):
            number = upper[:-len(unit)]
            break
    else:
        number, size = upper, 2**30
    try:
        return float(number) * size
    except ValueError:
        raise ConfigError(f"--gpu_memory {text!r} is not a size: pass e.g. 80GB or 141GiB") from None


def resolve_device(values: dict[str, str]) -> Device:
    name = values["gpu"]
    if name.lower() == "cpu":
        memory = parse_memory(values["gpu_memory"] or "24GiB")
        return cpu_device(memory)
    if name not in DEVICES:
        raise ConfigError(f"--gpu {name!r} is unknown: choose one of {', '.join(DEVICES)}, cpu")
    device = DEVICES[name]
    return replace(device, memory_bytes=parse_memory(values["gpu_memory"])) if values["gpu_memory"] else device


def setup_from_config(cfg: TrainConfig, values: dict[str, str], device: Device) -> Setup:
    try:
        nnodes, per_node = int(values["nnodes"]), int(values["gpus_per_node"])
    except ValueError:
        raise ConfigError("--nnodes and --gpus_per_node must be whole numbers") from None
    if nnodes <= 0 or per_node <= 0:
        raise ConfigError("--nnodes and --gpus_per_node must be positive")
    fc, dc = cfg.fsdp_config, cfg.deepspeed_config
    if cfg.enable_fsdp:
        strategy = fc.sharding_strategy
    elif cfg.enable_deepspeed:
        strategy = f"ZERO{dc.zero_stage}"
    else:
        strategy = "DDP"
    adapter = Adapter()
    if cfg.use_peft:
        adapter = Adapter(method=cfg.peft_method, lora_r=cfg.lora_config.r,
                          lora_targets=tuple(cfg.lora_config.target_modules),
                          lora_dropout=cfg.lora_config.lora_dropout,
                          adapter_len=cfg.llama_adapter_config.adapter_len,
                          adapter_layers=cfg.llama_adapter_config.adapter_layers,
                          num_virtual_tokens=cfg.prefix_config.num_virtual_tokens)
    quantization = {"int4": "4bit", "int8": "8bit"}.get(cfg.quantization, cfg.quantization)
    return Setup(arch=read_arch(cfg.model_name or "preset:demo"), strategy=strategy, num_nodes=nnodes,
                 gpus_per_node=per_node, sharding_group_size=fc.sharding_group_size,
                 batch_size=cfg.batch_size_training, seq_len=cfg.context_length,
                 activation_checkpointing=fc.fsdp_activation_checkpointing,
                 cpu_offload=fc.fsdp_cpu_offload or dc.offload_optimizer, pure_bf16=fc.pure_bf16,
                 compute_bytes=device.compute_bytes, adapter=adapter, quantization=quantization,
                 sequence_parallel=cfg.sequence_parallel_size, context_parallel=cfg.context_parallel_size,
                 low_cpu_fsdp=cfg.low_cpu_fsdp)


def check_split(cfg: TrainConfig, setup: Setup) -> None:
    """The sequence / context parallel sizes against the world and the model's heads: sft's own checks and
    messages (shardtune.parallel.dims, shardtune.parallel.sequence)."""
    from types import SimpleNamespace

    from shardtune.parallel.dims import ParallelDims, _check_parallel_dims
    from shardtune.parallel.sequence import check_sequence_split

    _check_parallel_dims(cfg, setup.world_size)
    ParallelDims.from_config(cfg, setup.world_size, setup.gpus_per_node)
    arch = setup.arch
    check_sequence_split(cfg, SimpleNamespace(num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
                                              sliding_window=arch.sliding_window))


def plan(setup: Setup, device: Device, accumulation: int) -> dict:
    """Everything the command prints, as data (``--json``)."""
    rows = []
    for candidate in alternatives(setup):
        b = estimate(candidate)
        seconds, compute_s, comm_s = step_time_s(candidate, device, accumulation)
        tokens = candidate.batch_size * candidate.seq_len * accumulation * candidate.data_parallel
        rows.append({"setup": describe_setup(candidate), "flags": command_flags(candidate),
                     "peak_bytes": b.peak, "fits": b.peak <= usable_bytes(device), "step_s": seconds,
                     "compute_s": compute_s, "communication_s": comm_s, "tokens_per_s_per_gpu":
                     tokens / seconds / candidate.world_size, "host_state_bytes": b.host_state,
                     "_setup": candidate})
    fitting = [r for r in rows if r["fits"]]
    # by tokens/s: a row split over sp x cp ranks trains fewer rows per step, so its step time is not comparable
    best = max(fitting, key=lambda r: r["tokens_per_s_per_gpu"]) if fitting else None
    smallest = min(rows, key=lambda r: r["peak_bytes"])
    given = estimate(setup)
    return {"model": setup.arch.name, "parameters": setup.arch.num_params,
            "trainable_parameters": setup.adapter.trainable_params(setup.arch), "device": device.describe(),
            "usable_bytes": usable_bytes(device), "world_size": setup.world_size,
            "given": {"setup": describe_setup(setup), "breakdown": dict(given.rows()), "peak_bytes": given.peak,
                      "fits": fits(setup, device), "host_loading_bytes_per_node": given.host_loading,
                      "host_state_bytes_per_rank": given.host_state},
            "alternatives": rows, "recommended": best, "smallest": None if best else smallest,
            "would_fit": None if best else would_fit(setup, device),
            "largest_micro_batch": largest_batch(best["_setup"] if best else setup, device),
            "longest_sequence": longest_sequence(best["_setup"] if best else setup, device)}


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


def render(result: dict, base_argv: list[str]) -> str:
    g = lambda b: f"{b / GIB:,.1f} GiB"  # noqa: E731
    lines = [f"model: {result['model']} ({result['parameters'] / 1e9:.2f} B parameters, "
             f"{result['trainable_parameters'] / 1e6:,.1f} M trainable); {result['world_size']} GPUs of "
             f"{result['device']}; usable per GPU: {g(result['usable_bytes'])}", "",
             f"per GPU, {result['given']['setup']} (as given):"]
    for name, value in result["given"]["breakdown"].items():
        lines.append(f"  {name:<26} {g(value):>12}")
    lines.append(f"  {'peak':<26} {g(result['given']['peak_bytes']):>12}  "
                 f"{'fits' if result['given']['fits'] else 'DOES NOT FIT'}")
    lines.append(f"  host memory to load the weights: {g(result['given']['host_loading_bytes_per_node'])} per node")
    lines += ["", "alternatives (peak per GPU, estimated step time at "
              "40% of the matmul peak, communication overlapped):",
              f"  {'setup':<30} {'peak':>12}  {'fits':<4} {'step':>9} {'tokens/s/GPU':>13}"]
    for r in sorted(result["alternatives"], key=lambda r: (not r["fits"], -r["tokens_per_s_per_gpu"])):
        lines.append(f"  {r['setup']:<30} {g(r['peak_bytes']):>12}  {'yes' if r['fits'] else 'no':<4} "
                     f"{r['step_s']:>8.2f}s {r['tokens_per_s_per_gpu']:>13,.0f}")
    best = result["recommended"]
    if best:
        command = " ".join(["shardtune sft", *base_argv, *best["flags"]])
        lines += ["", f"recommended: {best['setup']}", f"  {command}",
                  f"largest micro-batch that fits: {result['largest_micro_batch']}; longest sequence (micro-batch "
                  f"1): {result['longest_sequence']:,} tokens"]
    else:
        s, given, usable = result["smallest"], result["given"], result["usable_bytes"]
        lines += ["", f"nothing fits: {given['setup']} (as given) misses by {g(given['peak_bytes'] - usable)}; the "
                  f"smallest is {s['setup']} at {g(s['peak_bytes'])} per GPU, {g(s['peak_bytes'] - usable)} over "
                  f"what a GPU can use ({g(usable)})"]
        grow, where = result["would_fit"], []
        if grow["gpus"]:
            gpus = grow["gpus"]
            where.append(f"{gpus['setup']} on {gpus['nnodes'] * gpus['gpus_per_node']} GPUs (--nnodes "
                         f"{gpus['nnodes']} --gpus_per_node {gpus['gpus_per_node']})")
        where.append(f"{s['setup']} on GPUs of {grow['gpu_memory_bytes'] / GIB:,.0f} GiB (--gpu_memory)")
        lines.append("  would fit: " + ", or ".join(where) + "; else shorten --context_length, lower "
                     "--batch_size_training, or use --use_peft / --quantization 4bit")
    return "\n".join(lines)


STRATEGY_FLAGS = ("enable_fsdp", "enable_deepspeed", "fsdp_config.sharding_strategy", "fsdp_config.fsdp_cpu_offload",
                  "fsdp_config.fsdp_activation_checkpointing", "deepspeed_config.zero_stage",
                  "deepspeed_config.offload_optimizer", "deepspeed_config.offload_param", "sequence_parallel_size",
                  "context_parallel_size", "sp_size", "cp_size")


def without_strategy_flags(argv: list[str]) -> list[str]:
    """The user's sft flags minus those the recommendation replaces; a built-in shape becomes its hub id."""
    out, i = [], 0
    while i < len(argv):
        name = argv[i][2:].partition("=")[0]
        takes_value = "=" not in argv[i] and i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if name in STRATEGY_FLAGS:
            i += 2 if takes_value else 1
            continue
        out.append(argv[i])
        if name == "model_name" and takes_value:
            out.append(HUB_IDS.get(argv[i + 1], argv[i + 1]))
            i += 1
        i += 1
    return out


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip() + "\n\nplan flags: --gpu " + "|".join(DEVICES) + "|cpu, --gpu_memory SIZE, --nnodes M, "
              "--gpus_per_node G, --json; every sft flag (shardtune sft --help)")
        return 0
    try:
        values, sft_argv, as_json = split_plan_args(argv)
        cfg = parse_args(sft_argv)
        device = resolve_device(values)
        setup = setup_from_config(cfg, values, device)
        check_split(cfg, setup)
        result = plan(setup, device, cfg.gradient_accumulation_steps)
    except ConfigError as e:
        print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(result, default=lambda o: None, indent=1))
    else:
        print(render(result, without_strategy_flags(sft_argv)))
    return 0 if result["recommended"] else 1
