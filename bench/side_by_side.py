"""Shared by the per-objective benches (bench/dpo.py, kto.py, reward.py, rloo.py): one TRL trainer and one
``shardtune`` command on the same data, model and settings, run one after the other ``--repeats`` times (alternating
which goes first, so that both share the machine's load), each step timed the same way on both sides.

A step is the time between consecutive step ends: shardtune's ``step_time_s`` rows (metrics.jsonl), TRL's
``on_step_end`` timestamps from a callback (the first from ``on_train_begin``), so both include loading the step's
batch, (sampling,) the forward, backward, optimizer and logging; TRL's ``on_step_begin`` to ``on_step_end`` is kept
too (``inside_step_s``). The first ``--warmup`` steps of each run are left out; the medians are over all repeats'
remaining steps. The whole process is each command from start to exit, start-up included.

The settings both sides share, and why: fp32 on the CPU (TRL's configs default ``bf16`` on), gradient checkpointing
off (TRL's configs default it on; ``--gradient_checkpointing true`` for both), torch's fused AdamW (TRL's default
optimizer and the fastest on the CPU), ``--threads`` threads per process (0: one per core), no evaluation, no saving.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import RESULTS, machine_info, python, run, run_json, spread, trl_step_times

# TRL's side: PROLOGUE + the objective's body (which builds ``trainer`` from ``job``) + EPILOGUE, one script; its
# one argument is the job as JSON: model, data, config (the TRL config's keyword arguments) and the body's own keys
TRL_PROLOGUE = r"""
import json, sys, time
start = time.perf_counter()
import torch
from transformers import TrainerCallback

job = json.loads(sys.argv[1])
""" + trl_step_times("loss")

TRL_EPILOGUE = r"""
train_start = time.perf_counter()
output = trainer.train()
print(json.dumps({"train_s": time.perf_counter() - train_start, "steps": output.global_step,
                  "step_s": [b - a for a, b in zip(ends, ends[1:])], "inside_step_s": inside, "logs": LOGS,
                  "process_s": time.perf_counter() - start}))
"""


def add_settings(ap: argparse.ArgumentParser, *, batch: int, steps: int = 10, warmup: int = 1) -> None:
    """The flags every per-objective bench takes."""
    ap.add_argument("--model", default="", help="a model directory (default: --preset's, built once)")
    ap.add_argument("--preset", default="demo-32k", help="the preset built when --model is not given (demo, tiny)")
    ap.add_argument("--batch", type=int, default=batch, help="rows (RL: completions) per step")
    ap.add_argument("--steps", type=int, default=steps, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=warmup, help="steps per run left out of the medians")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each tool, alternating which goes first")
    ap.add_argument("--gradient_checkpointing", default="false", choices=("true", "false"), help="both tools")
    ap.add_argument("--optim", default="adamw_torch_fused", choices=("adamw_torch_fused", "adamw_torch"))
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of both tools' processes (0: all cores)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--name", default="", help="bench/results/NAME.json (default: the objective's name)")
    ap.add_argument("--profile", default="false", choices=("true", "false"), help="one more shardtune run, profiled")


def threads(args: argparse.Namespace) -> str:
    return str(args.threads or os.cpu_count() or 1)


def trl_config(args: argparse.Namespace, out: Path, **extra) -> dict:
    """The TRL config's keyword arguments both sides' shared settings make (module docstring)."""
    return {
        "output_dir": str(out),
        "per_device_train_batch_size": args.batch,
        "gradient_accumulation_steps": 1,
        "max_steps": args.warmup + args.steps,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "max_grad_norm": 1.0,
        "seed": 42,
        "use_cpu": args.device == "cpu",
        "bf16": args.device == "cuda",
        "gradient_checkpointing": args.gradient_checkpointing == "true",
        "optim": args.optim,
        "dataloader_num_workers": 0,
        "save_strategy": "no",
        "eval_strategy": "no",
        "logging_steps": 1,
        "report_to": [],
        "disable_tqdm": True,
        **extra,
    }


def shardtune_flags(args: argparse.Namespace, model: str, data: Path, out: Path, steps: int | None = None) -> list:
    """``shardtune OBJECTIVE``'s flags for the shared settings, in TRL's names (``--defaults trl``); ``steps``: other
    than the runs' ``warmup + steps``."""
    return [
        *("--defaults", "trl", "--nproc_per_node", 1, "--model_name_or_path", model, "--dataset_name", data),
        *("--output_dir", out, "--per_device_train_batch_size", args.batch, "--gradient_accumulation_steps", 1),
        *("--max_steps", steps or args.warmup + args.steps, "--lr_scheduler_type", "constant", "--warmup_steps", 0),
        *("--max_grad_norm", 1.0, "--seed", 42, "--gradient_checkpointing", args.gradient_checkpointing),
        *("--optim", args.optim, "--dataloader_num_workers", 0, "--save_strategy", "no", "--eval_strategy", "no"),
        *("--logging_steps", 1, "--report_to", "none", "--save_model", "false", "--save_plots", "false"),
        *(("--bf16", "true") if args.device == "cuda" else ("--train.precision", "fp32")),
    ]


def run_trl(args: argparse.Namespace, body: str, job: dict, tmp: Path) -> dict:
    """One TRL run: the script PROLOGUE + body + EPILOGUE with ``job``; its steps and whole process."""
    script = tmp / "trl_job.py"
    script.write_text(TRL_PROLOGUE + body + TRL_EPILOGUE)
    tick = time.perf_counter()
    result = run_json([python(), script, json.dumps(job)], OMP_NUM_THREADS=threads(args))
    result["process_s"] = time.perf_counter() - tick
    return result


def run_shardtune(args: argparse.Namespace, command: str, flags: list, out: Path) -> dict:
    """One ``shardtune COMMAND`` run through the real CLI: its step rows and whole process."""
    tick = time.perf_counter()
    run([python(), "-m", "shardtune", command, *flags], OMP_NUM_THREADS=threads(args))
    process_s = time.perf_counter() - tick
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    return {
        "steps": len(rows),
        "step_s": [r["step_time_s"] for r in rows],
        "loss": [r.get("loss") for r in rows],
        "process_s": process_s,
    }


def alternate(repeats: int, trl: Callable[[int], dict], ours: Callable[[int], dict], label: str) -> tuple:
    """``repeats`` runs of each, TRL first on even repeats, shardtune first on odd ones."""
    trl_runs, ours_runs = [], []
    for repeat in range(repeats):
        order = ("trl", "shardtune") if repeat % 2 == 0 else ("shardtune", "trl")
        for tool in order:
            print(f"{label}: repeat {repeat + 1}/{repeats}: {tool}", file=sys.stderr, flush=True)
            (trl_runs if tool == "trl" else ours_runs).append((trl if tool == "trl" else ours)(repeat))
    return trl_runs, ours_runs


def summary(runs: list[dict], warmup: int, key: str = "step_s") -> dict:
    """The median step over all runs' steps after the warm-up, each run's median, their spread, the median whole
    process."""
    per_run = [statistics.median(r[key][warmup:] or r[key]) for r in runs]
    return {
        "step_s": statistics.median([t for r in runs for t in (r[key][warmup:] or r[key])]),
        "per_repeat_step_s": per_run,
        "spread": spread(per_run),
        "steps": runs[0]["steps"],
        "process_s": statistics.median(r["process_s"] for r in runs),
    }


def compare(args: argparse.Namespace, trl_runs: list[dict], ours_runs: list[dict]) -> dict:
    """The result both tools' runs make: each side's summary (TRL's inside-step median too) and the ratios."""
    theirs = {**summary(trl_runs, args.warmup), "inside_step_s": summary(trl_runs, args.warmup, "inside_step_s")}
    theirs["inside_step_s"] = theirs["inside_step_s"]["step_s"]
    theirs["first_loss"] = next((row["loss"] for row in trl_runs[0]["logs"]), None)
    ours = {**summary(ours_runs, args.warmup), "first_loss": ours_runs[0]["loss"][0]}
    return {
        "trl": {**theirs, "runs": trl_runs},
        "shardtune": {**ours, "runs": ours_runs},
        "step_speedup": theirs["step_s"] / ours["step_s"],
        "process_speedup": theirs["process_s"] / ours["process_s"],
    }


def measure(args: argparse.Namespace, label: str, trl: Callable[[int], dict], ours: Callable, tmp: Path) -> dict:
    """TRL's and shardtune's runs alternating, compared; with ``--profile true`` one more shardtune run under the
    profiler. ``ours(out, steps=None, extra=())`` runs shardtune into ``out`` (``steps``: other than the runs',
    ``extra``: more flags)."""
    result = compare(args, *alternate(args.repeats, trl, lambda repeat: ours(tmp / f"shardtune-{repeat}"), label))
    if args.profile == "true":
        print(f"{label}: shardtune under --use_profiler", file=sys.stderr, flush=True)
        trace = tmp / "profile-trace"
        ours(tmp / "profile", PROFILE_STEPS, ("--use_profiler", "true", "--profiler_dir", trace))
        result["profile"] = profile_summary(trace)
    return result


PROFILE_STEPS = 8  # the profiler's schedule (PROFILER_SCHEDULE: wait 1, warm-up 2, active 3) ends at step 6


def profile_summary(trace: Path) -> dict:
    """Milliseconds per step from rank 0's trace of the profiler's active steps: the whole step, GRPO's marks where
    the objective samples (bench/grpo.py's PROFILE_MARKS), and the rest split by its outermost events into the
    policy's forward (its wrapper's), backward, optimizer step (bench/grpo.py's part_of), ops (operators outside
    those: mostly the frozen reference's forward, which has no wrapper, and the loss) and other (the time no event
    covers: Python, the data loader, logging)."""
    from bench.grpo import PROFILE_MARKS, TRAINING_PARTS, outermost, part_of

    events = json.loads(next(trace.glob("rank0*.json")).read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    marks = [e for e in spans if e.get("cat") == "user_annotation"]
    steps = [e for e in marks if e["name"].startswith("ProfilerStep#")]
    ms = {name: sum(e["dur"] for e in marks if e["name"] == name) / len(steps) / 1e3 for name in PROFILE_MARKS}
    ms = {name: value for name, value in ms.items() if value}
    ms["step"] = sum(e["dur"] for e in steps) / len(steps) / 1e3
    rest = ms["step"] - sum(ms.get(m, 0.0) for m in ("grpo.sample", "grpo.score", "grpo.policy_logps"))
    parts = dict.fromkeys((*TRAINING_PARTS, "ops"), 0.0)
    for step in steps:
        for e in outermost(spans, step):
            if not e["name"].startswith("grpo."):
                part = part_of(e["name"])
                parts[part if part in parts else "ops"] += e["dur"] / len(steps) / 1e3
    return {"steps": len(steps), "ms_per_step": {**ms, **parts, "other": rest - sum(parts.values())}}


def model_dir(args: argparse.Namespace, tmp: Path) -> str:
    if args.model:
        return args.model
    from shardtune.model.loading import init_model

    return str(init_model(args.preset, tmp / args.preset, seed=0))


def start() -> tuple[float, dict]:
    """The clock and the machine (its load average) at the bench's start."""
    return time.perf_counter(), machine_info()


def write(args: argparse.Namespace, objective: str, result: dict, started: float, machine: dict) -> dict:
    """bench/results/NAME.json with the machine (``machine_info()`` taken at the start: its load then), the
    settings, the load at the end and the time taken."""
    import trl

    result = {
        "machine": machine,
        "date": time.strftime("%Y-%m-%d"),
        "trl_version": trl.__version__,
        "settings": {**vars(args), "threads": int(threads(args))},
        **result,
        "load_average_at_end": list(os.getloadavg()),
        "took_s": time.perf_counter() - started,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name or objective}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def brief(result: dict) -> str:
    """One line: both medians, the ratios, the whole processes."""
    t, o = result["trl"], result["shardtune"]
    return (
        f"TRL {t['step_s']:.3f} s/step (process {t['process_s']:.1f} s), shardtune {o['step_s']:.3f} s/step "
        f"(process {o['process_s']:.1f} s): {result['step_speedup']:.2f}x per step, "
        f"{result['process_speedup']:.2f}x whole process"
    )
