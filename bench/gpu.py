"""GPU benchmark (one H200, at most 8 minutes): tokens/s per GPU, MFU and peak memory of shardtune's real training
step on random-initialised Llama shapes. Launched by bench/gpu.sh under torchrun (one process per GPU).

    full  llama-1b-shape, bf16 compute (fp32 master weights), FSDP2, sequence 2048, full fine-tuning
    lora  llama-8b-shape, bf16 weights, FSDP2, LoRA r=8 on q_proj / v_proj, sequence 2048

MFU = model FLOPs as computed (shardtune/flops.py: output layer on labelled tokens, causal attention) / the measured
bf16 matmul peak.
``--cpu-smoke`` runs the same code on tiny shapes, fp32, gloo, two steps each: what the tests exercise.
On CUDA the figures are appended to bench/results/gpu.md and written to bench/results/gpu-DATE.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch

from shardtune.config import TrainConfig

SHAPES = {
    "full": dict(preset="llama-1b-shape", seq_len=2048, batch=8, peft=False),
    "lora": dict(preset="llama-8b-shape", seq_len=2048, batch=4, peft=True),
}
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=176, vocab_size=1000, seq_len=64, batch=2)


def build(name: str, smoke: bool, device: torch.device) -> tuple[torch.nn.Module, int, int]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardtune.models import PRESETS

    spec = SHAPES[name]
    shape = ({k: v for k, v in SMOKE.items() if k not in ("seq_len", "batch")} if smoke
             else dict(PRESETS[spec["preset"]]))
    seq_len, batch = (SMOKE["seq_len"], SMOKE["batch"]) if smoke else (spec["seq_len"], spec["batch"])
    config = LlamaConfig(**shape)
    # full fine-tuning keeps fp32 master weights (bf16 compute through FSDP's policy); LoRA's frozen base is bf16
    dtype = torch.bfloat16 if spec["peft"] and device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model, seq_len, batch


def planned_peak_bytes(name: str, config: dict, env, seq_len: int, batch: int) -> float:
    """``shardtune plan``'s peak for this configuration (shardtune.planner): FSDP FULL_SHARD over the processes,
    bf16 compute with fp32 master weights (full) or bf16 weights (LoRA) on a GPU, fp32 on the CPU."""
    from shardtune.planner import Adapter, Arch, Setup, estimate

    gpu = env.device.type == "cuda"
    lora = SHAPES[name]["peft"]
    setup = Setup(arch=Arch.from_config(config, name), strategy="FULL_SHARD", gpus_per_node=env.world_size,
                  batch_size=batch, seq_len=seq_len, compute_bytes=2 if gpu else 4, pure_bf16=gpu and lora,
                  adapter=Adapter(method="lora", lora_targets=("q_proj", "v_proj")) if lora else Adapter())
    return estimate(setup).peak


def run_config(name: str, args, env) -> dict:
    from shardtune.flops import measured_peak_flops, model_shape
    from shardtune.parallel import make_strategy
    from shardtune.speed import apply_speed_features
    from shardtune.train import build_optimizer, train_step

    spec = SHAPES[name]
    cfg = TrainConfig(enable_fsdp=True, use_peft=spec["peft"], use_fast_kernels=True, compile=args.compile, lr=1e-5)
    model, seq_len, batch = build(name, args.cpu_smoke, env.device)
    planned = planned_peak_bytes(name, model.config.to_dict(), env, seq_len, batch)
    apply_speed_features(model, cfg, env.device)
    if spec["peft"]:
        import peft

        from shardtune.peft import peft_config

        cfg.lora_config.target_modules = ["q_proj", "v_proj"]
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

    warmup, steps = (1, 2) if args.cpu_smoke else (args.warmup, args.steps)
    sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        train_step(model, strategy, optimizer, [micro_batch()], cfg, env, shape)
    sync()
    tick = time.perf_counter()
    flops = tokens = 0
    losses = []
    for _ in range(steps):
        stats = train_step(model, strategy, optimizer, [micro_batch()], cfg, env, shape)
        flops += stats["flops"]
        tokens += stats["input_tokens"]
        losses.append(stats["loss"])
    sync()
    elapsed = time.perf_counter() - tick
    peak = measured_peak_flops(str(env.device))
    peak_memory = (torch.cuda.max_memory_allocated() if env.device.type == "cuda"
                   else __import__("shardtune.metrics", fromlist=["peak_memory_bytes"]).peak_memory_bytes(env.device))
    return {"config": name, "model": "smoke" if args.cpu_smoke else spec["preset"], "seq_len": seq_len,
            "batch_per_gpu": batch, "steps": steps, "tokens_per_s_per_gpu": tokens / elapsed / env.world_size,
            "mfu": flops / elapsed / (peak * env.world_size), "peak_flops_per_s": peak,
            "peak_memory_gib": peak_memory / 2**30, "planned_peak_gib": planned / 2**30,
            # the planner's error against torch.cuda.max_memory_allocated (live tensor bytes); None on the CPU,
            # where peak_memory is the process's resident size
            "plan_error": planned / peak_memory - 1 if env.device.type == "cuda" else None,
            "loss_first": losses[0], "loss_last": losses[-1],
            "num_matmul_params": shape.num_matmul_params, "num_trainable_params": shape.num_trainable_params}


def record(results: list[dict], device_name: str) -> None:
    from bench.common import RESULTS, machine_info

    date = datetime.datetime.now().isoformat(timespec="seconds")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"gpu-{date[:10]}.json").write_text(json.dumps({"date": date, "gpu": device_name,
                                                               "machine": machine_info(), "results": results},
                                                              indent=2) + "\n")
    with open(RESULTS / "gpu.md", "a") as fh:
        for r in results:
            fh.write(f"| {date} | {device_name} | {r['model']} {r['config']} | {r['seq_len']} | {r['batch_per_gpu']} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | {r['peak_memory_gib']:.1f} GiB |\n")


def print_plan_check(results: list[dict]) -> None:
    """shardtune plan's predicted peak device memory against torch.cuda.max_memory_allocated, per row."""
    print("| config | predicted peak (shardtune plan) | measured peak (max_memory_allocated) | error |")
    print("|---|---|---|---|")
    for r in results:
        error = f"{r['plan_error']:+.1%}" if r["plan_error"] is not None else "n/a (CPU: resident size)"
        print(f"| {r['model']} {r['config']} | {r['planned_peak_gib']:.2f} GiB | {r['peak_memory_gib']:.2f} GiB | "
              f"{error} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (fp32, gloo): a functional check")
    ap.add_argument("--configs", default="full,lora")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also torch.compile each decoder layer")
    args = ap.parse_args()

    from shardtune.distributed import init_distributed, print0, shutdown

    env = init_distributed()
    results = []
    try:
        for name in args.configs.split(","):
            results.append(run_config(name, args, env))
            print0(json.dumps(results[-1]))
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutdown()
    if env.is_main:
        device_name = torch.cuda.get_device_name(0) if env.device.type == "cuda" else "cpu"
        print("| config | seq | batch/GPU | tokens/s/GPU | MFU | peak memory |")
        print("|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['model']} {r['config']} | {r['seq_len']} | {r['batch_per_gpu']} | "
                  f"{r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | {r['peak_memory_gib']:.1f} GiB |")
        print_plan_check(results)
        if env.device.type == "cuda" and not args.cpu_smoke:
            record(results, device_name)


if __name__ == "__main__":
    main()
