"""GRPO: TRL's GRPOTrainer and ``shardtune grpo`` on the same prompts, model, reward function and batch, one process,
in one run; and the demo's reward curve.

    python -m bench.grpo [--part all|speed|profile|speed,profile|learn] [--model DIR | --preset demo] [--prompts 64]
                         [--batch 8] [--num_generations 4] [--max_completion_length 16] [--steps 10] [--warmup 2]
                         [--repeats 4] [--gradient_checkpointing true] [--learn_steps 40] [--learn_lr 3e-3]
                         [--threads 1]
    python -m bench.grpo --write_prompts examples/data/grpo_prompts.jsonl   # the demo's prompts (these 64 rows)

speed: both tools train ``warmup + steps`` steps of ``batch`` completions (``num_generations`` per prompt, at most
``max_completion_length`` new tokens, temperature 1) on ``--preset`` (built once; demo-32k: the demo with a 32k
vocabulary, where the output layer weighs), fp32 on the CPU, beta 0 (no
reference), TRL's dapo loss, lr 1e-3 linear, gradient checkpointing as ``--gradient_checkpointing`` says (on: TRL's
default and ``--defaults trl``'s; both sample without it), reward ``examples/grpo_rewards.py:single_characters``
(the same file: TRL imports the function, shardtune takes it by path). The two run one after the other
``repeats`` times, alternating which goes first, so that both share the machine's load; each process has
``--threads`` threads. A step's time is the time between consecutive step ends on both sides (shardtune's
``step_time_s``; TRL: a callback's ``on_step_end`` timestamps), so it includes sampling the step's completions
(TRL samples inside ``training_step``, shardtune when the loop asks for the step's batches), scoring them, the
training step and logging; TRL's ``on_step_begin`` to ``on_step_end`` is reported too. The first ``warmup`` steps
of each run are left out; the medians are over all repeats' remaining steps.

profile: one ``shardtune grpo`` run of the speed part's settings under ``--use_profiler`` (torch.profiler, steps 4-6):
where a step's time goes, from the trace's marks: sampling (the shared prefill, the decode loop), scoring, the
policy's log-probabilities, and the rest, split by the trace's outermost events into the training forward, its
backward (with checkpointing's recomputation), the optimizer step (with the gradient norm) and what is left (metrics,
all-reduces, logging, checkpoint checks). The profiler's own cost inflates every part somewhat (most where the ops
are many and small: the decode loop); the shares are what it is for.

learn: ``shardtune grpo`` for ``learn_steps`` steps at ``learn_lr`` on the same prompts and reward (what
recipes/grpo-demo.yaml runs), then TRL's GRPOTrainer on the same (``--learn_trl false``: not): the mean reward per
step, the first five steps' mean against the last five's.

Writes bench/results/NAME.json and NAME.md (``--name``, default grpo). Needs trl (the dev extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, RESULTS, machine_info, python, run, run_json, spread, trl_step_times

REWARD_FILE = REPO / "examples" / "grpo_rewards.py"
REWARD = "single_characters"

SUBJECTS = (
    "the river at dawn",
    "a lighthouse keeper",
    "the old library",
    "a small garden",
    "the night train",
    "a mountain path",
    "the harbour market",
    "a winter morning",
)
ASKS = (
    "Describe {} in one line.",
    "Write a short note about {}.",
    "What would you remember of {}?",
    "Tell a story that starts with {}.",
    "List three things found near {}.",
    "Give {} a name and say why.",
    "Explain how to get to {}.",
    "Write a riddle about {}.",
)


def prompt_rows(num: int) -> list[dict]:
    """``num`` standard (text) prompts, the same on every call: the asks in turn, each with every subject (64
    different rows; more repeat them), each ask's subjects starting one further along."""
    rows = []
    for i in range(num):
        ask, subject = ASKS[(i // len(SUBJECTS)) % len(ASKS)], SUBJECTS[(i + i // len(SUBJECTS)) % len(SUBJECTS)]
        rows.append({"prompt": ask.format(subject)})
    return rows


def write_prompts(path: Path, num: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in prompt_rows(num)))
    return path


TRL_SCRIPT = (
    r"""
import importlib.util, json, sys, time
start = time.perf_counter()
import torch
from datasets import load_dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

(model_dir, prompts, out, reward_file, reward, batch, generations, length, steps, lr, checkpointing,
 device) = sys.argv[1:13]
spec = importlib.util.spec_from_file_location("grpo_rewards", reward_file)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
"""
    + trl_step_times("reward")
    + r"""
config = GRPOConfig(output_dir=out, per_device_train_batch_size=int(batch), gradient_accumulation_steps=1,
                    num_generations=int(generations), max_completion_length=int(length), max_steps=int(steps),
                    learning_rate=float(lr), logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[],
                    disable_tqdm=True, seed=42, use_cpu=device == "cpu", bf16=device == "cuda",
                    gradient_checkpointing=checkpointing == "true", dataloader_num_workers=0,
                    model_init_kwargs={"dtype": torch.float32})
trainer = GRPOTrainer(model=model_dir, reward_funcs=getattr(module, reward), args=config,
                      train_dataset=load_dataset("json", data_files=prompts, split="train"), callbacks=[StepTimes()])
train_start = time.perf_counter()
output = trainer.train()
print(json.dumps({"train_s": time.perf_counter() - train_start, "steps": output.global_step,
                  "step_s": [b - a for a, b in zip(ends, ends[1:])], "inside_step_s": inside, "logs": LOGS,
                  "process_s": time.perf_counter() - start}))
"""
)


def run_trl(args, model: str, prompts: Path, tmp: Path, tag: str, steps: int, lr: float) -> dict:
    script = tmp / "trl_grpo.py"
    script.write_text(TRL_SCRIPT)
    tick = time.perf_counter()
    result = run_json(
        [
            python(),
            script,
            model,
            prompts,
            tmp / f"trl-{tag}",
            REWARD_FILE,
            REWARD,
            args.batch,
            args.num_generations,
            args.max_completion_length,
            steps,
            lr,
            args.gradient_checkpointing,
            args.device,
        ],
        OMP_NUM_THREADS=str(args.threads),
    )
    result["process_s"] = time.perf_counter() - tick
    rewards = [row["reward"] for row in result["logs"]]
    lengths = [row.get("completions/mean_length", 0.0) for row in result["logs"]]
    return {
        "step_s": result["step_s"],
        "inside_step_s": result["inside_step_s"],
        "reward": rewards,
        "mean_length": lengths,
        "process_s": result["process_s"],
    }


def shardtune_argv(args, model: str, prompts: Path, out: Path, steps: int, lr: float, extra: tuple = ()) -> list:
    argv = [
        python(),
        "-m",
        "shardtune",
        "grpo",
        "--defaults",
        "trl",
        "--nproc_per_node",
        "1",
        "--model_name_or_path",
        model,
        "--dataset_name",
        prompts,
        "--reward_funcs",
        f"{REWARD_FILE}:{REWARD}",
        "--num_generations",
        args.num_generations,
        "--per_device_train_batch_size",
        args.batch,
        "--max_completion_length",
        args.max_completion_length,
        "--max_steps",
        steps,
        "--learning_rate",
        lr,
        "--gradient_checkpointing",
        args.gradient_checkpointing,
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--save_plots",
        "false",
        "--output_dir",
        out,
    ]
    if args.device == "cuda":
        argv += ["--bf16", "true"]
    return argv + list(extra)


def run_shardtune(
    args, model: str, prompts: Path, out: Path, steps: int, lr: float, extra: tuple = (), **env: str
) -> dict:
    tick = time.perf_counter()
    run(shardtune_argv(args, model, prompts, out, steps, lr, extra), OMP_NUM_THREADS=str(args.threads), **env)
    process_s = time.perf_counter() - tick
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    return {
        "rows": rows,
        "step_s": [r["step_time_s"] for r in rows],
        "reward": [r["reward"] for r in rows],
        "mean_length": [r.get("completions/mean_length", 0.0) for r in rows],
        "kl": [r.get("kl") for r in rows],
        "process_s": process_s,
    }


def summary(runs: list[dict], warmup: int, key: str = "step_s") -> dict:
    """The median step over all runs' steps after the warm-up, each run's median, and their spread."""
    per_run = [statistics.median(r[key][warmup:]) for r in runs]
    return {
        "step_s": statistics.median([t for r in runs for t in r[key][warmup:]]),
        "per_repeat_step_s": per_run,
        "spread": spread(per_run),
    }


def speed(args, model: str, prompts: Path, tmp: Path) -> dict:
    trl_runs, ours_runs = [], []
    for repeat in range(args.repeats):
        order = ("trl", "shardtune") if repeat % 2 == 0 else ("shardtune", "trl")
        for tool in order:
            print(f"speed: repeat {repeat + 1}/{args.repeats}: {tool}", file=sys.stderr, flush=True)
            if tool == "trl":
                trl_runs.append(run_trl(args, model, prompts, tmp, str(repeat), args.warmup + args.steps, args.lr))
            else:
                out = tmp / f"shardtune-{repeat}"
                ours = run_shardtune(args, model, prompts, out, args.warmup + args.steps, args.lr)
                ours.pop("rows")
                ours_runs.append(ours)
    theirs = {
        **summary(trl_runs, args.warmup),
        "inside_step_s": summary(trl_runs, args.warmup, "inside_step_s")["step_s"],
        "process_s": statistics.median(r["process_s"] for r in trl_runs),
        "mean_length": statistics.mean(x for r in trl_runs for x in r["mean_length"]),
        "mean_reward": statistics.mean(x for r in trl_runs for x in r["reward"]),
        "runs": trl_runs,
    }
    ours = {
        **summary(ours_runs, args.warmup),
        "process_s": statistics.median(r["process_s"] for r in ours_runs),
        "mean_length": statistics.mean(x for r in ours_runs for x in r["mean_length"]),
        "mean_reward": statistics.mean(x for r in ours_runs for x in r["reward"]),
        "runs": ours_runs,
    }
    return {
        "trl_grpo": theirs,
        "shardtune_grpo": ours,
        "step_speedup": theirs["step_s"] / ours["step_s"],
        "process_speedup": theirs["process_s"] / ours["process_s"],
    }


PROFILE_MARKS = ("grpo.sample", "grpo.prefill", "grpo.decode", "grpo.score", "grpo.policy_logps")
TRAINING_PARTS = ("forward", "backward", "optimizer")  # the rest's outermost events, by what they are (part_of)


def part_of(name: str) -> str:
    """Which part of the training step an outermost event of the trace is: the model's forward (its wrapper's),
    autograd's backward, the optimizer step with clipping's gradient norm, or other."""
    if name.endswith(".forward") or name.endswith("_forward"):
        return "forward"
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name.startswith("Optimizer.") or name.startswith("aten::_foreach_") or "clip_grad" in name:
        return "optimizer"
    return "other"


def outermost(spans: list[dict], step: dict) -> list[dict]:
    """The events of ``step``'s thread inside it that no other event of that thread holds."""
    inside = [
        e
        for e in spans
        if e is not step
        and e["tid"] == step["tid"]
        and step["ts"] <= e["ts"]
        and e["ts"] + e["dur"] <= step["ts"] + step["dur"]
    ]
    inside.sort(key=lambda e: (e["ts"], -e["dur"]))
    top, end = [], -1.0
    for e in inside:
        if e["ts"] >= end:
            top.append(e)
            end = e["ts"] + e["dur"]
    return top


def profile(args, model: str, prompts: Path, tmp: Path) -> dict:
    """Milliseconds per step of each mark of ``PROFILE_MARKS`` and of the whole step, from rank 0's trace of the
    profiler's active steps (a step there spans step end to step end, so it holds the next step's sampling); the
    rest split into TRAINING_PARTS and other by its outermost events."""
    print("profile: shardtune grpo under --use_profiler", file=sys.stderr, flush=True)
    traces = tmp / "profile-trace"
    extra = ("--use_profiler", "true", "--profiler_dir", traces)
    run_shardtune(args, model, prompts, tmp / "profile", 8, args.lr, extra)
    events = json.loads(next(traces.glob("rank0*.json")).read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    steps = [e for e in spans if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    marks = [e for e in spans if e.get("cat") == "user_annotation"]
    per_step = {name: sum(e["dur"] for e in marks if e["name"] == name) / len(steps) / 1e3 for name in PROFILE_MARKS}
    per_step["step"] = sum(e["dur"] for e in steps) / len(steps) / 1e3
    per_step["rest"] = per_step["step"] - sum(per_step[m] for m in ("grpo.sample", "grpo.score", "grpo.policy_logps"))
    parts = dict.fromkeys(TRAINING_PARTS, 0.0)
    for step in steps:
        for e in outermost(spans, step):
            part = part_of(e["name"])
            if part in parts and not e["name"].startswith("grpo."):
                parts[part] += e["dur"] / len(steps) / 1e3
    per_step.update(parts)
    per_step["other"] = per_step["rest"] - sum(parts.values())
    return {"steps": len(steps), "ms_per_step": per_step}


def curve(rewards: list[float], lengths: list[float]) -> dict:
    """A run's reward per step, and the first five steps' mean against the last five's."""
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    return {
        "steps": len(rewards),
        "reward": rewards,
        "first5_mean_reward": first,
        "last5_mean_reward": last,
        "gain": last / first if first else None,
        "mean_length": lengths,
    }


def learn(args, model: str, prompts: Path, tmp: Path) -> dict:
    print(f"learn: shardtune grpo, {args.learn_steps} steps at lr {args.learn_lr:g}", file=sys.stderr, flush=True)
    ours = run_shardtune(args, model, prompts, tmp / "learn", args.learn_steps, args.learn_lr)
    result = {
        "lr": args.learn_lr,
        "shardtune_grpo": {
            **curve(ours["reward"], ours["mean_length"]),
            "step_s": statistics.median(ours["step_s"][1:]),
            "process_s": ours["process_s"],
        },
    }
    if args.learn_trl == "true":
        print(f"learn: TRL GRPOTrainer, {args.learn_steps} steps at lr {args.learn_lr:g}", file=sys.stderr, flush=True)
        theirs = run_trl(args, model, prompts, tmp, "learn", args.learn_steps, args.learn_lr)
        result["trl_grpo"] = {
            **curve(theirs["reward"], theirs["mean_length"]),
            "step_s": statistics.median(theirs["step_s"][1:]),
            "process_s": theirs["process_s"],
        }
    return result


# bench/gpu.sh's GRPO row: shardtune grpo on the GPU in bf16 (beta > 0: the reference is loaded and kl reported);
# --cpu_smoke: the same code on the tiny preset on the CPU, fp32 (what tests/e2e/test_gpu_bench_smoke.py runs)
GPU_ROW = dict(preset="demo", batch=64, num_generations=8, max_completion_length=128, warmup=2, steps=8, lr=3e-3)
SMOKE_ROW = dict(preset="tiny", batch=4, num_generations=2, max_completion_length=8, warmup=1, steps=2, lr=3e-3)
GPU_ROW_BETA = 0.04


def gpu_row(args, tmp: Path) -> dict:
    """One short ``shardtune grpo`` run (one process) on this machine's GPU: the median step (sampling included,
    the warm-up steps left out), completion tokens per second (sampled and trained), MFU (training FLOPs only, as
    metrics.jsonl), the peak memory, the reward of the first and last steps, and whether every step's reward, kl,
    loss and grad_norm are finite."""
    import datetime
    import math

    from shardtune.model.loading import init_model

    spec = SMOKE_ROW if args.cpu_smoke else GPU_ROW
    row_args = argparse.Namespace(**{**vars(args), **spec, "device": "cpu" if args.cpu_smoke else "cuda"})
    model = args.model or str(init_model(spec["preset"], tmp / spec["preset"], seed=0))
    prompts = write_prompts(tmp / "prompts.jsonl", args.prompts)
    env = {"CUDA_VISIBLE_DEVICES": ""} if args.cpu_smoke else {}
    steps = spec["warmup"] + spec["steps"]
    out = run_shardtune(
        row_args, model, prompts, tmp / "gpu_row", steps, spec["lr"], ("--beta", str(GPU_ROW_BETA)), **env
    )
    rows = out["rows"]
    timed = rows[spec["warmup"] :]
    step_s = statistics.median(r["step_time_s"] for r in timed)
    tokens = [r["completions/mean_length"] * spec["batch"] / r["step_time_s"] for r in timed]
    checked = [r.get(key) for r in rows for key in ("reward", "kl", "loss", "grad_norm")]
    result = {
        "config": "grpo",
        "model": "smoke" if args.cpu_smoke else spec["preset"],
        "device": "cpu" if args.cpu_smoke else __import__("torch").cuda.get_device_name(0),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "completions_per_step": spec["batch"],
        "num_generations": spec["num_generations"],
        "max_completion_length": spec["max_completion_length"],
        "beta": GPU_ROW_BETA,
        "steps": len(rows),
        "step_s": step_s,
        "completion_tokens_per_s": statistics.median(tokens),
        "mfu": statistics.median(r["mfu"] for r in timed),
        "peak_memory_gib": max(r["peak_memory_bytes"] for r in rows) / 2**30,
        "reward_first": rows[0]["reward"],
        "reward_last": rows[-1]["reward"],
        "kl_last": rows[-1].get("kl"),
        "mean_length_last": rows[-1]["completions/mean_length"],
        "finite": all(v is not None and math.isfinite(v) for v in checked),
        "process_s": out["process_s"],
    }
    if not args.cpu_smoke:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"gpu-grpo-{result['date'][:10]}.json").write_text(
            json.dumps({"machine": machine_info(), **result}, indent=2) + "\n"
        )
        with open(RESULTS / "gpu.md", "a") as fh:
            fh.write(f"| {result['date']} | {result['device']} | {gpu_row_cells(result)} |\n")
    return result


def gpu_row_cells(r: dict) -> str:
    """bench/results/gpu.md's cells: model config | seq | batch/GPU | tokens/s/GPU | MFU | peak memory (notes)."""
    kl = f"{r['kl_last']:.2g}" if isinstance(r["kl_last"], (int, float)) else "none"
    return (
        f"{r['model']} grpo | {r['max_completion_length']} | {r['completions_per_step']} | "
        f"{r['completion_tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_memory_gib']:.1f} GiB (GRPO, "
        f"{r['num_generations']} generations, beta {r['beta']:g}: step {r['step_s']:.2f} s with sampling; "
        f"completion tokens/s; reward {r['reward_first']:.3f} to {r['reward_last']:.3f}, kl {kl}, "
        f"{'all finite' if r['finite'] else 'NOT FINITE'})"
    )


def markdown(result: dict) -> str:
    s, m = result["settings"], result["machine"]
    lines = [
        f"# GRPO: shardtune grpo vs TRL's GRPOTrainer ({result['date']})",
        "",
        f"{m['cpu'] if s['device'] == 'cpu' else m['gpu']} ({m['cpu_count']} cores), torch {m['torch']}, "
        f"transformers {m['transformers']}, trl {result.get('trl_version', '-')}; load average at start "
        f"{m['load_average_at_start'][0]:.1f}, at end {result['load_average_at_end'][0]:.1f}; took "
        f"{result['took_s'] / 60:.1f} min.",
        "",
    ]
    if "speed" in result:
        sp = result["speed"]
        t, o = sp["trl_grpo"], sp["shardtune_grpo"]
        model = s["model"] or f"{s.get('preset', 'demo')} preset"
        lines += [
            f"**Step time** ({model}, {s['prompts']} prompts, {s['batch']} completions per step = "
            f"{s['batch'] // s['num_generations']} prompts x {s['num_generations']} generations, at most "
            f"{s['max_completion_length']} new tokens, fp32, gradient checkpointing {s['gradient_checkpointing']}, "
            f"reward {REWARD}, lr {s['lr']:g}; {s['repeats']} runs each of {s['warmup']} + {s['steps']} steps, "
            f"alternating; the median of the steps after the first {s['warmup']}, step end to step end, sampling "
            "included)",
            "",
            "| | median step | per run | run-to-run spread | whole process (median) | mean completion length |",
            "|---|---|---|---|---|---|",
            f"| TRL `GRPOTrainer` | {t['step_s']:.2f} s (on_step_begin to end: {t['inside_step_s']:.2f} s) | "
            + ", ".join(f"{x:.2f}" for x in t["per_repeat_step_s"])
            + f" s | {t['spread']:.0%} | {t['process_s']:.1f} s | {t['mean_length']:.1f} |",
            f"| `shardtune grpo` | {o['step_s']:.2f} s | "
            + ", ".join(f"{x:.2f}" for x in o["per_repeat_step_s"])
            + f" s | {o['spread']:.0%} | {o['process_s']:.1f} s | {o['mean_length']:.1f} |",
            f"| shardtune faster by | **{sp['step_speedup']:.2f}x** | | | {sp['process_speedup']:.2f}x | |",
            "",
        ]
    if "profile" in result:
        ms = result["profile"]["ms_per_step"]
        lines += [
            f"**Where a step goes** (`shardtune grpo` under `--use_profiler`, the speed part's settings; ms per step, "
            f"mean of the profiler's {result['profile']['steps']} active steps; the profiler's own cost included)",
            "",
            "| step | sampling (prefill + decode) | scoring | policy log-probabilities | training and the rest: "
            "forward, backward, optimizer, other |",
            "|---|---|---|---|---|",
            f"| {ms['step']:.0f} | {ms['grpo.sample']:.0f} ({ms['grpo.prefill']:.0f} + {ms['grpo.decode']:.0f}) | "
            f"{ms['grpo.score']:.0f} | {ms['grpo.policy_logps']:.0f} | {ms['rest']:.0f}: "
            + ", ".join(f"{ms.get(k, float('nan')):.0f}" for k in (*TRAINING_PARTS, "other"))
            + " |",
            "",
        ]
    if "learn" in result:
        le = result["learn"]
        tools = [("`shardtune grpo`", le["shardtune_grpo"])]
        if "trl_grpo" in le:
            tools.append(("TRL `GRPOTrainer`", le["trl_grpo"]))
        lines += [
            f"**Reward curve** ({le['shardtune_grpo']['steps']} steps at lr {le['lr']:g}, linear decay; the same "
            f"prompts, reward {REWARD} and batch; mean reward of the step's {s['batch']} completions)",
            "",
            "| | first 5 steps | last 5 steps | gain | completion length, last 5 steps | median step |",
            "|---|---|---|---|---|---|",
        ]
        for name, c in tools:
            lines.append(
                f"| {name} | {c['first5_mean_reward']:.3f} | **{c['last5_mean_reward']:.3f}** | {c['gain']:.1f}x | "
                f"{statistics.mean(c['mean_length'][-5:]):.1f} | {c['step_s']:.2f} s |"
            )
        lines.append("")
        for name, c in tools:
            lines += [f"{name} per step: " + ", ".join(f"{r:.3f}" for r in c["reward"]), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--part",
        default="all",
        choices=("all", "speed", "profile", "learn", "gpu", "speed,profile"),
        help="all: speed, profile and learn; gpu: bench/gpu.sh's GRPO row",
    )
    ap.add_argument("--cpu_smoke", action="store_true", help="--part gpu on the CPU, tiny preset: a functional check")
    ap.add_argument("--model", default="", help="a model directory (default: --preset's, built once)")
    ap.add_argument("--preset", default="demo", help="the preset built when --model is not given (demo, demo-32k)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="completions per step")
    ap.add_argument("--num_generations", type=int, default=4)
    ap.add_argument("--max_completion_length", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="steps per run left out of the medians")
    ap.add_argument("--repeats", type=int, default=4, help="runs of each tool, alternating which goes first")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--gradient_checkpointing", default="true", choices=("true", "false"))
    ap.add_argument("--learn_steps", type=int, default=40)
    ap.add_argument("--learn_lr", type=float, default=3e-3)
    ap.add_argument("--learn_trl", default="true", choices=("true", "false"), help="TRL's curve beside ours")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of both tools' processes (1: on a shared machine, two threads per process wait on "
        "each other behind other jobs' threads, and a small model's step takes many times as long)",
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--name", default="grpo")
    ap.add_argument("--write_prompts", default="", help="write the prompts to this JSONL file and exit")
    args = ap.parse_args()
    if args.write_prompts:
        write_prompts(Path(args.write_prompts), args.prompts)
        return
    if args.part == "gpu":
        with tempfile.TemporaryDirectory(prefix="shardtune-bench-grpo-") as tmp:
            row = gpu_row(args, Path(tmp))
        print("grpo row: " + json.dumps(row))  # not a line of its own JSON: bench.gpu's rows are those
        print(f"| {gpu_row_cells(row)} |")
        return 0 if row["finite"] else 1
    started = time.perf_counter()
    result: dict = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d"), "settings": vars(args)}
    with tempfile.TemporaryDirectory(prefix="shardtune-bench-grpo-") as tmp:
        tmp = Path(tmp)
        model = args.model
        if not model:
            from shardtune.model.loading import init_model

            model = str(init_model(args.preset, tmp / args.preset, seed=0))
        prompts = write_prompts(tmp / "prompts.jsonl", args.prompts)
        if args.part in ("all", "speed", "speed,profile"):
            import trl

            result["trl_version"] = trl.__version__
            result["speed"] = speed(args, model, prompts, tmp)
        if args.part in ("all", "profile", "speed,profile"):
            result["profile"] = profile(args, model, prompts, tmp)
        if args.part in ("all", "learn"):
            result["learn"] = learn(args, model, prompts, tmp)
    result["took_s"] = time.perf_counter() - started
    result["load_average_at_end"] = list(__import__("os").getloadavg())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    sys.exit(main())
