"""The plan as text: the table of alternatives and the command line that runs the recommended one."""

from __future__ import annotations

from typing import Any

from shardtune.accounting.memory import GIB
from shardtune.config.argv import Arguments, split_argv
from shardtune.config.spellings import resolve
from shardtune.planner.estimate import Setup
from shardtune.planner.shapes import HUB_IDS


def describe_setup(setup: Setup) -> str:
    parts = [setup.strategy]
    if setup.activation_checkpointing:
        parts.append("+AC")
    if setup.cpu_offload:
        parts.append("+offload")
    if setup.sequence_parallel > 1:
        parts.append(f"sp {setup.sequence_parallel}")
    if setup.context_parallel > 1:
        parts.append(f"cp {setup.context_parallel}")
    return " ".join(parts)


def command_flags(setup: Setup) -> list[str]:
    """The sft flags that select this setup's strategy and memory levers."""
    s = setup
    flags: list[str] = []
    if s.strategy.startswith("ZERO"):
        flags += ["--enable_deepspeed", "--deepspeed_config.zero_stage", s.strategy[-1]]
        if s.cpu_offload:
            flags += ["--deepspeed_config.offload_optimizer", "true"]
            if s.strategy == "ZERO3":
                flags += ["--deepspeed_config.offload_param", "true"]
    elif s.strategy != "DDP":
        flags += [
            "--enable_fsdp",
            "--fsdp_config.sharding_strategy",
            s.strategy,  # explicit: a --config may set them
            "--fsdp_config.fsdp_activation_checkpointing",
            str(s.activation_checkpointing).lower(),
            "--fsdp_config.fsdp_cpu_offload",
            str(s.cpu_offload).lower(),
        ]
    if s.sequence_parallel > 1:
        flags += ["--sp_size", str(s.sequence_parallel)]
    if s.context_parallel > 1:
        flags += ["--cp_size", str(s.context_parallel)]
    return flags


def _gib(b: float) -> str:
    return f"{b / GIB:,.1f} GiB"


def render(result: dict, base_argv: list[str]) -> str:
    g = _gib
    lines = [
        f"model: {result['model']} ({result['parameters'] / 1e9:.2f} B parameters, "
        f"{result['trainable_parameters'] / 1e6:,.1f} M trainable); {result['world_size']} GPUs of "
        f"{result['device']}; usable per GPU: {g(result['usable_bytes'])}",
        *([images_line(result["images"])] if result.get("images") else []),
        "",
        f"per GPU, {result['given']['setup']} (as given):",
    ]
    for name, value in result["given"]["breakdown"].items():
        lines.append(f"  {name:<26} {g(value):>12}")
    lines.append(
        f"  {'peak':<26} {g(result['given']['peak_bytes']):>12}  "
        f"{'fits' if result['given']['fits'] else 'DOES NOT FIT'}"
    )
    lines.append(f"  host memory to load the weights: {g(result['given']['host_loading_bytes_per_node'])} per node")
    lines.append(
        f"  host memory per node: {g(result['given']['host_bytes_per_node'])} of "
        f"{g(result['usable_host_bytes'])} usable (--host_memory)"
    )
    lines += [
        "",
        "alternatives (peak per GPU, host memory per node, estimated step time at "
        "40% of the matmul peak, communication overlapped):",
        f"  {'setup':<30} {'peak':>12} {'host/node':>12}  {'fits':<4} {'step':>9} {'tokens/s/GPU':>13}",
    ]
    for r in sorted(result["alternatives"], key=lambda r: (not r["fits"], -r["tokens_per_s_per_gpu"])):
        lines.append(
            f"  {r['setup']:<30} {g(r['peak_bytes']):>12} {g(r['host_bytes_per_node']):>12}  "
            f"{'yes' if r['fits'] else 'no':<4} {r['step_s']:>8.2f}s {r['tokens_per_s_per_gpu']:>13,.0f}"
        )
    best = result["recommended"]
    lines += _recommendation(result, best, base_argv) if best else _nothing_fits(result)
    return "\n".join(lines)


def images_line(images: dict) -> str:
    """The one line saying what the plan counted for a vision-language model's images."""
    trains = (
        "trained"
        if images["tower_trains"]
        else "tower frozen: no activations kept but the projector's input"
        if images["projector_trains"]
        else "frozen: no activations kept"
    )
    return (
        f"images: {images['images_per_example']} per example (--images_per_example) x {images['image_tokens']:,} "
        f"token{'' if images['image_tokens'] == 1 else 's'} of the row ({images['image_tokens_from']}); "
        f"{images['family']} tower + projector "
        f"{images['tower_parameters']:,} parameters ({trains}), {images['tower_positions_per_image']:,} "
        f"positions x {images['tower_layers']} layers per image; image activations "
        f"{_gib(images['activation_bytes'])} per micro-batch (in activations)"
    )


def _recommendation(result: dict, best: dict, base_argv: list[str]) -> list[str]:
    """The fastest setup that fits as a command line, and the limits of the micro-batch and sequence."""
    lines: list[str] = []
    processes = ["--nproc_per_node", str(result["gpus_per_node"])]
    if result["nnodes"] > 1:
        processes = ["--nnodes", str(result["nnodes"]), *processes]
    verb = result.get("command", "shardtune sft")
    command = " ".join([verb, *processes, *base_argv, *best["flags"]])
    lines += ["", f"recommended: {best['setup']}", f"  {command}"]
    shape = builtin_shape_named(base_argv)
    if shape:
        lines.append(
            f"  ({shape} is a shape the planner knows, not weights: give {verb.split()[-1]} a model "
            f"directory or a hub id, e.g. --model_name {HUB_IDS[shape]})"
        )
    lines.append(
        f"largest micro-batch that fits: {result['largest_micro_batch']}; longest sequence (micro-batch "
        f"1): {result['longest_sequence']:,} tokens"
    )
    return lines


def _nothing_fits(result: dict) -> list[str]:
    """By how much the given setup and the smallest one miss, and what would make it fit."""
    g = _gib
    lines: list[str] = []
    s, given, usable = result["smallest"], result["given"], result["usable_bytes"]
    if s["peak_bytes"] > usable:
        lines += [
            "",
            f"nothing fits: {given['setup']} (as given) misses by {g(given['peak_bytes'] - usable)}; "
            f"the smallest is {s['setup']} at {g(s['peak_bytes'])} per GPU, {g(s['peak_bytes'] - usable)} "
            f"over what a GPU can use ({g(usable)})",
        ]
    else:
        host = min(
            (r for r in result["alternatives"] if r["peak_bytes"] <= usable), key=lambda r: r["host_bytes_per_node"]
        )
        lines += [
            "",
            f"nothing fits the host memory: what fits a GPU needs at least {g(host['host_bytes_per_node'])}"
            f" per node ({host['setup']}), over the {g(result['usable_host_bytes'])} a node can use "
            "(--host_memory sets a node's memory; --low_cpu_fsdp loads the weights on rank 0 alone)",
        ]
    grow, where = result["would_fit"], []
    if grow["gpus"]:
        gpus = grow["gpus"]
        where.append(
            f"{gpus['setup']} on {gpus['nnodes'] * gpus['gpus_per_node']} GPUs (--nnodes "
            f"{gpus['nnodes']} --gpus_per_node {gpus['gpus_per_node']})"
        )
    if s["peak_bytes"] > usable:
        where.append(f"{s['setup']} on GPUs of {grow['gpu_memory_bytes'] / GIB:,.0f} GiB (--gpu_memory)")
    if where:
        lines.append(
            "  would fit: " + ", or ".join(where) + "; else shorten --context_length, lower "
            "--batch_size_training, or use --use_peft / --quantization 4bit"
        )
    else:
        lines.append(
            "  more GPUs of this kind do not make it fit: use --low_cpu_fsdp true, --use_peft or "
            "--quantization 4bit, or give nodes with more host memory (--host_memory)"
        )
    return lines


# the settings a recommendation replaces (and the dry run's own switch)
STRATEGY_SETTINGS = frozenset(
    {
        "parallel.strategy",
        "parallel.sharding_strategy",
        "parallel.cpu_offload",
        "parallel.activation_checkpointing",
        "parallel.zero_stage",
        "parallel.offload_optimizer",
        "parallel.offload_param",
        "parallel.sequence_parallel_size",
        "parallel.context_parallel_size",
        "run.dry_run",
    }
)


def base_command(training: list[tuple[str, Any]]) -> list[str]:
    """The user's flags (the model as the user named it) minus those the recommendation replaces, as a command
    line."""
    kept = [
        (name, value)
        for name, value in training
        if not set(resolve(name).target.replace("/", " ").split()) & STRATEGY_SETTINGS
    ]
    return Arguments(training=kept).training_argv()


def builtin_shape_named(argv: list[str]) -> str:
    """The built-in shape the command line names as its model (``--model_name llama3-8b``), or ""."""
    for name, value in split_argv(argv).training:
        if resolve(name).target == "model.name" and value in HUB_IDS:
            return value
    return ""
