"""GPU benchmark (one H200, at most 9 minutes): tokens/s per GPU, MFU and peak memory of shardtune's real training
step on random-initialised Llama shapes. Launched by bench/gpu.sh under torchrun (one process per GPU).

    full       llama-1b-shape, bf16 compute (fp32 master weights), FSDP2, sequence 2048, full fine-tuning
    lora       llama-8b-shape, bf16 weights, FSDP2, LoRA r=8 on q_proj / v_proj, sequence 2048
    long-128k  llama-8b-shape as lora, ONE sequence of 131,072 tokens, with the long-sequence levers: activation
    long-512k  checkpointing, --tiled_mlp, the lean loss, and --activation_offloading when the checkpointed
    long-1m    layers' inputs would not fit the GPU (issue 10); one step each, no warm-up step

A long row whose offloaded activations would not fit the host's memory, or that would not end in the time left
before ``--deadline_s`` (estimated from the FLOPs of the step at the rate the rows before it reached) is skipped
and reported as such; one that fails (CUDA out of memory, any error) is reported with its error, and the script
goes on.

MFU = model FLOPs as computed (shardtune/accounting/flops.py: output layer on labelled tokens, causal attention) /
the GPU's data-sheet dense bf16 peak (shardtune/accounting/peak_flops.py; a GPU missing from its table: the measured
bf16 matmul peak, labelled so in the row's ``peak_source``), as torchtitan and Megatron-LM report it.
``--cpu-smoke`` runs the same code on tiny shapes, fp32, gloo, two steps each (one for the long rows, of 256 / 512 /
1,024 tokens): what the tests exercise.
On CUDA the figures are appended to bench/results/gpu.md and written to bench/results/gpu-DATE.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
import traceback
from dataclasses import dataclass

import torch

from shardtune.config.flags import config_from

SHAPES = {
    "full": dict(preset="llama-1b-shape", seq_len=2048, batch=8, peft=False),
    "lora": dict(preset="llama-8b-shape", seq_len=2048, batch=4, peft=True),
}
LONG = {"long-128k": 131_072, "long-512k": 524_288, "long-1m": 1_048_576}
SMOKE_LONG = {"long-128k": 256, "long-512k": 512, "long-1m": 1024}  # tokens of the long rows in --cpu-smoke
for _name in LONG:
    SHAPES[_name] = dict(preset="llama-8b-shape", seq_len=LONG[_name], batch=1, peft=True, long=True)
ASSUMED_MFU = 0.3  # to estimate a long row's time before any row has run
SMOKE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=176,
    vocab_size=1000,
    seq_len=64,
    batch=2,
)


def build(name: str, smoke: bool, device: torch.device) -> tuple[torch.nn.Module, int, int]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardtune.model.loading import PRESETS

    spec = SHAPES[name]
    shape = (
        {k: v for k, v in SMOKE.items() if k not in ("seq_len", "batch")} if smoke else dict(PRESETS[spec["preset"]])
    )
    seq_len, batch = (SMOKE["seq_len"], SMOKE["batch"]) if smoke else (spec["seq_len"], spec["batch"])
    if smoke and spec.get("long"):
        seq_len, batch = SMOKE_LONG[name], 1
    config = LlamaConfig(**shape)
    # full fine-tuning keeps fp32 master weights (bf16 compute through FSDP's policy); LoRA's frozen base is bf16
    dtype = torch.bfloat16 if spec["peft"] and device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model, seq_len, batch


def planned_peak_bytes(name: str, config: dict, env, seq_len: int, batch: int, long: bool) -> float | None:
    """``shardtune plan``'s peak for this configuration (shardtune.planner): FSDP FULL_SHARD over the processes,
    bf16 compute with fp32 master weights (full) or bf16 weights (LoRA) on a GPU, fp32 on the CPU. None for the
    long rows: the planner does not model the tiled MLP or activation offloading they run with."""
    from shardtune.planner.estimate import Setup, estimate
    from shardtune.planner.shapes import Adapter, Arch

    if long:
        return None
    gpu = env.device.type == "cuda"
    lora = SHAPES[name]["peft"]
    setup = Setup(
        arch=Arch.from_config(config, name),
        strategy="FULL_SHARD",
        gpus_per_node=env.world_size,
        batch_size=batch,
        seq_len=seq_len,
        compute_bytes=2 if gpu else 4,
        pure_bf16=gpu and lora,
        adapter=Adapter(method="lora", lora_targets=("q_proj", "v_proj")) if lora else Adapter(),
    )
    return estimate(setup).peak


@dataclass(frozen=True)
class LongRowPlan:
    """What a long row needs, estimated before anything is allocated, and whether it runs."""

    run: bool
    offload: bool
    device_gib: float
    host_gib: float
    seconds: float
    reason: str = ""


def plan_long_row(
    config: dict,
    seq_len: int,
    dtype_bytes: int,
    device_gib: float,
    host_gib: float,
    flops_per_s: float,
    seconds_left: float,
) -> LongRowPlan:
    """Memory and time of one LoRA step over one sequence of ``seq_len`` tokens with activation checkpointing,
    tiled MLP and the lean loss (``config``: the model's LlamaConfig keywords).

    Kept between forward and backward: each decoder layer's input (layers x tokens x hidden) -- on the GPU, or in
    host memory with --activation_offloading, taken when the GPU cannot hold it. A row whose offloaded activations
    would not fit the host's available memory is skipped (the kernel's OOM killer would end the whole script); one
    estimated too large for the GPU still runs (CUDA's out-of-memory error is caught and reported). Live at the
    peak, on the GPU: the weights, and about WORKING_ROWS rows of tokens x hidden (one layer's recomputed
    activations and their gradients, q / k / v / attention output, the loss's hidden rows and their gradients; the
    MLP's (tokens x intermediate) activations exist one tile at a time). Time: the step's FLOPs (body matmuls
    forward, input gradients and the checkpointing recompute: 6 per parameter per token; causal attention forward,
    recompute and backward: ~9 x tokens^2 x hidden per layer) at ``flops_per_s``, plus a minute to build the
    model."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    params = layers * (4 * hidden * hidden + 3 * hidden * config["intermediate_size"])
    params += 2 * config["vocab_size"] * hidden
    gib = 2**30
    weights = params * dtype_bytes / gib
    saved = layers * seq_len * hidden * dtype_bytes / gib
    working = WORKING_ROWS * seq_len * hidden * dtype_bytes / gib
    seconds = 60 + (6 * params * seq_len + 9 * seq_len**2 * hidden * layers) / flops_per_s
    offload = weights + saved + working > 0.9 * device_gib
    need_device, need_host = weights + working + (0 if offload else saved), saved if offload else 0.0
    reason = ""  # too much for the GPU is tried all the same: CUDA's out-of-memory error is reported, host OOM kills
    if need_host > 0.8 * host_gib:
        reason = f"needs ~{need_host:,.0f} GiB of host memory for offloaded activations (of {host_gib:,.0f} available)"
    elif seconds > seconds_left:
        reason = f"needs ~{seconds:,.0f} s (estimated), {seconds_left:,.0f} s left before the deadline"
    return LongRowPlan(not reason, offload, need_device, need_host, seconds, reason)


WORKING_ROWS = 32  # see plan_long_row (RMSNorm's fp32 copies count double)


def host_available_gib() -> float:
    with open("/proc/meminfo") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("MemAvailable:")) / 2**20


def run_config(name: str, args, env, plan: LongRowPlan | None = None) -> dict:
    from shardtune.accounting.flops import model_shape
    from shardtune.accounting.peak_flops import device_peak
    from shardtune.model.longseq import apply_memory_levers
    from shardtune.model.speed import apply_speed_features
    from shardtune.parallel import make_strategy
    from shardtune.parallel.optim import build_optimizer
    from shardtune.training.engine.step import train_step
    from shardtune.training.objectives.sft.objective import SFT

    spec = SHAPES[name]
    long = bool(spec.get("long"))
    cfg = config_from(
        enable_fsdp=True,
        use_peft=spec["peft"],
        use_fast_kernels=True,
        compile=args.compile,
        lr=1e-5,
        tiled_mlp=long,
        activation_offloading=long and (plan is None or plan.offload),
    )
    cfg.parallel.activation_checkpointing = long
    model, seq_len, batch = build(name, args.cpu_smoke, env.device)
    planned = planned_peak_bytes(name, model.config.to_dict(), env, seq_len, batch, long)
    if long:
        apply_memory_levers(model, cfg, env.device)  # before PEFT, as shardtune.training.engine.worker does
    apply_speed_features(model, cfg, env.device)
    if spec["peft"]:
        import peft

        from shardtune.model.peft import peft_config

        cfg.peft.lora.target_modules = ["q_proj", "v_proj"]
        model = peft.get_peft_model(model, peft_config(cfg, model.config.num_hidden_layers))
    strategy = make_strategy(cfg, env)
    model = strategy.wrap(model)
    optimizer = build_optimizer(model, cfg)
    shape = model_shape(model)
    vocab = model.config.vocab_size if hasattr(model, "config") else SMOKE["vocab_size"]
    gen = torch.Generator().manual_seed(env.rank)

    def micro_batch() -> dict:
        """`batch` sequences of seq_len tokens as training collates packed blocks: one padding-free row."""
        from shardtune.data.batching import collate_flat

        ids = torch.randint(0, vocab, (batch, seq_len), generator=gen).tolist()
        return collate_flat([{"input_ids": row, "labels": row} for row in ids])

    warmup, steps = (0, 1) if long else (1, 2) if args.cpu_smoke else (args.warmup, args.steps)
    sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    objective = SFT(cfg, env, strategy, None)
    for _ in range(warmup):
        train_step(model, strategy, optimizer, objective, [micro_batch()], shape=shape)
    sync()
    tick = time.perf_counter()
    flops = tokens = 0
    losses = []
    for _ in range(steps):
        stats = train_step(model, strategy, optimizer, objective, [micro_batch()], shape=shape)
        flops += stats.counts["flops"]
        tokens += stats.counts["input_tokens"]
        losses.append(stats.loss)
    sync()
    elapsed = time.perf_counter() - tick
    peak, peak_source = device_peak(env.device, strategy.compute_dtype)
    peak_memory = (
        torch.cuda.max_memory_allocated()
        if env.device.type == "cuda"
        else __import__("shardtune.runtime.distributed", fromlist=["peak_memory_bytes"]).peak_memory_bytes(env.device)
    )
    return {
        "config": name,
        "model": "smoke" if args.cpu_smoke else spec["preset"],
        "seq_len": seq_len,
        "batch_per_gpu": batch,
        "steps": steps,
        "tokens_per_s_per_gpu": tokens / elapsed / env.world_size,
        "mfu": flops / elapsed / (peak * env.world_size),
        "peak_flops_per_s": peak,
        "peak_source": peak_source,
        "peak_memory_gib": peak_memory / 2**30,
        "planned_peak_gib": planned / 2**30 if planned else None,
        # the planner's error against torch.cuda.max_memory_allocated (live tensor bytes); None on the CPU,
        # where peak_memory is the process's resident size, and where the plan does not model a lever
        "plan_error": planned / peak_memory - 1 if planned and env.device.type == "cuda" else None,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "num_matmul_params": shape.num_matmul_params,
        "num_trainable_params": shape.num_trainable_params,
        "levers": (
            "activation checkpointing, tiled MLP, lean loss"
            + (", activation offloading" if cfg.parallel.activation_offloading else "")
        )
        if long
        else "lean loss",
    }


def record(results: list[dict], device_name: str, date: str) -> None:
    """Write what has been measured so far (called after every row, so a later crash loses nothing)."""
    from bench.common import RESULTS, machine_info

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"gpu-{date[:10]}.json").write_text(
        json.dumps({"date": date, "gpu": device_name, "machine": machine_info(), "results": results}, indent=2) + "\n"
    )
    with open(RESULTS / "gpu.md", "a") as fh:
        fh.write(f"| {date} | {device_name} | " + table_cells(results[-1]) + " |\n")


def table_cells(r: dict) -> str:
    """model config | seq | batch/GPU | tokens/s/GPU | MFU | peak memory (or what happened instead)."""
    head = f"{r['model']} {r['config']} | {r['seq_len']} | {r['batch_per_gpu']}"
    if "skipped" in r:
        return f"{head} | skipped: {r['skipped']} | | "
    if "error" in r:
        return f"{head} | failed: {r['error']} | | "
    return f"{head} | {r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | {r['peak_memory_gib']:.1f} GiB" + (
        f" ({r['levers']})" if r.get("levers", "lean loss") != "lean loss" else ""
    )


def long_row_plan(name: str, args, env, started: float, results: list[dict]) -> LongRowPlan | None:
    """The plan of a long row on CUDA (None in --cpu-smoke: tiny rows always run, with every lever)."""
    if args.cpu_smoke:
        return None
    from shardtune.accounting.peak_flops import device_peak
    from shardtune.model.loading import PRESETS

    rates = [r["mfu"] * r["peak_flops_per_s"] for r in results if SHAPES[r["config"]].get("long") and "mfu" in r]
    rate = rates[-1] if rates else ASSUMED_MFU * device_peak(env.device, torch.bfloat16)[0]
    device_gib = torch.cuda.get_device_properties(env.device).total_memory / 2**30
    return plan_long_row(
        dict(PRESETS[SHAPES[name]["preset"]]),
        SHAPES[name]["seq_len"],
        2,
        device_gib,
        host_available_gib(),
        rate,
        args.deadline_s - (time.monotonic() - started),
    )


def print_plan_check(results: list[dict]) -> None:
    """shardtune plan's predicted peak device memory against torch.cuda.max_memory_allocated, per row."""
    print("| config | predicted peak (shardtune plan) | measured peak (max_memory_allocated) | error |")
    print("|---|---|---|---|")
    for r in results:
        if r.get("planned_peak_gib") is None:
            continue  # skipped or failed, or a long row (levers the plan does not model)
        error = f"{r['plan_error']:+.1%}" if r["plan_error"] is not None else "n/a (CPU: resident size)"
        print(
            f"| {r['model']} {r['config']} | {r['planned_peak_gib']:.2f} GiB | {r['peak_memory_gib']:.2f} GiB | "
            f"{error} |"
        )


def main() -> None:
    started = time.monotonic()
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (fp32, gloo): a functional check")
    ap.add_argument("--configs", default="full,lora," + ",".join(LONG))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also torch.compile each decoder layer")
    ap.add_argument(
        "--deadline_s",
        type=float,
        default=540,
        help="a long row that would end later (estimated, from the start) is skipped",
    )
    args = ap.parse_args()

    from shardtune.runtime.distributed import init_distributed, print0, shutdown

    env = init_distributed()
    device_name = torch.cuda.get_device_name(0) if env.device.type == "cuda" else "cpu"
    date = datetime.datetime.now().isoformat(timespec="seconds")
    results = []
    try:
        for name in args.configs.split(","):
            spec = SHAPES[name]
            plan = long_row_plan(name, args, env, started, results) if spec.get("long") else None
            base = {
                "config": name,
                "model": "smoke" if args.cpu_smoke else spec["preset"],
                "seq_len": SMOKE_LONG[name] if args.cpu_smoke and spec.get("long") else spec["seq_len"],
                "batch_per_gpu": 1 if spec.get("long") else spec["batch"],
            }
            if plan is not None:
                base["plan"] = plan.__dict__
            if plan is not None and not plan.run:
                results.append({**base, "skipped": plan.reason})
            else:
                try:
                    results.append({**base, **run_config(name, args, env, plan)})
                except Exception as e:  # CUDA out of memory or anything else: this row says so, the next runs
                    if args.cpu_smoke:
                        raise
                    traceback.print_exc()
                    results.append({**base, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"})
            print0(json.dumps(results[-1]))
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
                if env.is_main and not args.cpu_smoke:
                    record(results, device_name, date)
    finally:
        shutdown()
    if env.is_main:
        print("| config | seq | batch/GPU | tokens/s/GPU | MFU | peak memory |")
        print("|---|---|---|---|---|---|")
        for r in results:
            print(f"| {table_cells(r)} |")
        print_plan_check(results)


if __name__ == "__main__":
    main()
