"""GRPO's sampling alone: one ``sample`` call (shardtune.training.objectives.grpo.generate) timed in process, without
a launch, on a preset built in memory: the decode loop's cost without the rest of a step (bench/grpo.py times whole
steps against TRL).

    python -m bench.grpo_decode [--preset demo] [--prompts 2] [--num_generations 4] [--max_new_tokens 16]
                                [--threads 1] [--repeats 15] [--profile] [--compile]
    python -m bench.grpo_decode --head [--threads 1]

Rows are ``prompts`` x ``num_generations`` (GRPO's grouping: a prompt's generations share its prefill), temperature 1,
no eos reached in practice (the preset is untrained), so every call decodes ``max_new_tokens`` tokens. Reported: the
median and the minimum over ``repeats`` calls of the wall time and of the process's CPU time (the CPU time is the
steadier figure on a shared machine with one thread), and the load average. ``--profile``: torch.profiler's top ops
over three calls. ``--compile``: the same calls with the model's forward under torch.compile (dynamic shapes), its
first call (the compilation) timed apart: whether compiling pays within a short run's sampling.

``--head``: the output head's two layouts alone, F.linear(h, W) against (W @ h.T).T, fp32 and bf16, over vocabularies
of 2k to 128k and 2 to 32 rows (hidden 256, the demo's): the ratio of their best CPU times, > 1 where W @ h.T is
faster (what TRANSPOSED_HEAD_MIN_VOCAB and TRANSPOSED_HEAD_ROWS in generate.py encode).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from shardtune.model.loading import PRESETS
from shardtune.training.objectives.grpo.generate import sample


class _Whole:
    """The placement of a model held whole on one device (DDP's, around generation)."""

    def unwrap(self, model):
        return model

    def generating(self, model, whole=False):
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()


def build(preset: str) -> torch.nn.Module:
    settings = dict(PRESETS[preset])
    settings.setdefault("vocab_size", 1024)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**settings, attn_implementation="sdpa")).eval()


def timed(call, repeats: int) -> dict:
    """Median and minimum wall and CPU milliseconds of ``repeats`` calls."""
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        call()
        wall.append((time.perf_counter() - w) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    return {
        "wall_median_ms": statistics.median(wall),
        "wall_min_ms": min(wall),
        "cpu_median_ms": statistics.median(cpu),
        "cpu_min_ms": min(cpu),
    }


def best_cpu_ms(call, repeats: int = 7, calls: int = 20) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            call()
        best = min(best, (time.process_time() - start) / calls)
    return best * 1e3


def head_layouts() -> None:
    """F.linear's time over (W @ h.T).T's per dtype, vocabulary and row count."""
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in (2048, 4096, 8192, 16384, 32000, 128256):
            weight = torch.randn(vocab, 256, dtype=dtype)
            ratios = []
            for rows in (2, 4, 8, 12, 16, 32):
                hidden = torch.randn(rows, 256, dtype=dtype)
                linear = best_cpu_ms(lambda h=hidden, w=weight: F.linear(h, w))
                transposed = best_cpu_ms(lambda h=hidden, w=weight: (w @ h.T).T)
                ratios.append(f"{rows} rows {linear / transposed:4.2f}")
            print(f"{dtype} vocab {vocab}: " + ", ".join(ratios))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--num_generations", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--head", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.head:
        print(f"{args.threads} thread(s); load average {os.getloadavg()[0]:.1f}")
        return head_layouts()
    model = build(args.preset)
    prompts = [[1] + list(range(5 + 25 * i, 25 + 23 * i)) for i in range(args.prompts)]
    rows = [p for p in prompts for _ in range(args.num_generations)]
    options = dict(max_new_tokens=args.max_new_tokens, eos_ids={2}, pad_id=0, temperature=1.0, top_k=0, top_p=1.0)

    def call():
        return sample(model, _Whole(), rows, list(range(len(rows))), device=torch.device("cpu"), **options)

    head = f"{args.preset}, {len(rows)} rows, {args.max_new_tokens} tokens, {args.threads} thread(s)"
    print(f"{head}; load average {os.getloadavg()[0]:.1f}")
    if args.compile:
        model.forward = torch.compile(model.forward, dynamic=True)
        start = time.perf_counter()
        call()
        print(f"compiled: first call (compilation) {time.perf_counter() - start:.1f} s")
    call()  # warm-up
    print({k: round(v, 1) for k, v in timed(call, args.repeats).items()})
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(3):
                call()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
