"""`python -m bench.objectives`: every objective beside its peer in one command, one table (issue 48): SFT with
packing and with padding against transformers.Trainer and TRL's SFTTrainer (the faster of the two), DPO, GRPO, KTO,
RLOO and the reward model against TRL's trainers, at one preset (default demo-32k: the demo with a 32k vocabulary;
GRPO at the demo preset too, where sampling weighs most), fp32 and gradient checkpointing off on both sides.

    python -m bench.objectives                                   # the whole table, ~40 min on 2 quiet cores
    python -m bench.objectives --preset tiny --steps 2 --repeats 1 --sft_num_train 16 --sft_num_validation 4
    python -m bench.objectives --only dpo,kto --repeats 3

Each row is its own bench, run as a child process, one after the other: ``python -m bench --only trainer`` (SFT: one
epoch per tool, the peers timed in ``train()``), bench/grpo.py ``--part speed``, bench/dpo.py, kto.py, rloo.py,
reward.py (bench/side_by_side.py: the same data and settings on both sides, runs alternating, a step timed step end
to step end, medians after the warm-up). Each writes its own detail to bench/results/NAME_ROW.json; this command
writes bench/results/NAME.md and NAME.json (default objectives): per row the peer's and shardtune's step and whole
process, their ratios, issue 48's target and whether it is met, with the machine and its load average at the start
and end. A row that fails is reported as failed (its error in the JSON) and the rest still run. ``--profile``: each
of dpo, kto, reward, rloo also runs shardtune once under the profiler (where a step's time goes: forward,
backward, optimizer, the rest) and GRPO runs bench/grpo.py's profile part.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, RESULTS, child_env, machine_info, python

ROWS = ("sft", "dpo", "grpo", "kto", "rloo", "reward")
SFT_TOOLS = "shardtune_packing,shardtune_padding,hf_trainer,trl_sft"
PEER_NAMES = {"hf_trainer": "transformers.Trainer", "trl_sft": "TRL SFTTrainer"}
# issue 48's "done when": (ratio the target is on, at least); SFT's whole process is the peer's train() against
# shardtune's command from start to exit (bench/__main__.py's process_speedup_vs_fastest_peer, as the issue measures)
TARGETS = {
    "sft packing": ("whole process", 3.0),
    "sft padding": ("whole process", 2.5),
    "grpo demo-32k": ("step", 4.0),
    "grpo demo": ("step", 2.0),
    "dpo": ("step", 5.0),
    "kto": ("step", 1.0),
    "rloo": ("step", 1.0),
    "reward": ("step", 1.0),
}


def run_row(argv: list, log: Path) -> str:
    """Run one row's bench; its output goes to ``log``. Returns '' or the error (the row is then marked failed)."""
    print("$ " + " ".join(map(str, argv)), flush=True)
    with open(log, "w") as fh:
        proc = subprocess.run([str(a) for a in argv], stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=child_env())
    if proc.returncode != 0:
        return f"exited {proc.returncode}: " + " | ".join(log.read_text().splitlines()[-6:])
    return ""


def common_flags(args: argparse.Namespace, preset: str) -> list:
    threads = args.threads or os.cpu_count() or 1  # bench/grpo.py takes the number itself
    flags = ["--preset", preset, "--repeats", args.repeats, "--threads", threads, "--steps", args.steps]
    return flags + ["--gradient_checkpointing", "false", "--device", args.device]


def sft_rows(args: argparse.Namespace, logs: Path) -> list[dict]:
    """SFT packing and padding from one ``python -m bench --only trainer`` run."""
    name = f"{args.name}_sft"
    argv = [python(), "-m", "bench", "--only", "trainer", "--preset", args.preset, "--datasets", args.sft_datasets]
    argv += ["--num_train", args.sft_num_train, "--num_validation", args.sft_num_validation, "--repeats", args.repeats]
    argv += ["--tools", SFT_TOOLS, "--device", args.device, "--name", name]
    error = run_row(argv, logs / "sft.log")
    rows = []
    for tool in ("packing", "padding"):
        row = {"row": f"sft {tool}", "preset": args.preset, "detail": f"{name}.json", "error": error}
        if not error:
            row.update(sft_figures(json.loads((RESULTS / f"{name}.json").read_text()), tool))
        rows.append(row)
    return rows


def sft_figures(result: dict, tool: str) -> dict:
    """A shardtune SFT tool's row against the faster peer: one epoch (a step: the epoch over its steps)."""
    table = next(iter(result["trainer"].values()))
    ours, peer_name = table[f"shardtune_{tool}"], table["fastest_peer"]
    peer = table[peer_name]
    return {
        "peer": PEER_NAMES[peer_name],
        "peer_step_s": peer["epoch_s"] / peer["steps"],
        "ours_step_s": ours["epoch_s"] / ours["steps"],
        "step_ratio": ours["speedup_vs_fastest_peer"],
        "peer_process_s": peer["process_s"],
        "ours_process_s": ours["process_s"],
        "process_ratio": peer["process_s"] / ours["process_s"],
        "target_ratio": ours["process_speedup_vs_fastest_peer"],
        "notes": f"epoch {peer['epoch_s']:.1f} s ({peer['steps']} steps) vs {ours['epoch_s']:.1f} s "
        f"({ours['steps']} steps); eval loss {peer['eval_loss']:.4f} vs {ours['eval_loss']:.4f}; target on the "
        "peer's train() over our whole process",
    }


def grpo_row(args: argparse.Namespace, preset: str, logs: Path) -> dict:
    name = f"{args.name}_grpo_{preset}"
    part = "speed,profile" if args.profile else "speed"
    argv = [python(), "-m", "bench.grpo", "--part", part, *common_flags(args, preset), "--name", name]
    if args.warmup is not None:
        argv += ["--warmup", args.warmup]
    row = {"row": f"grpo {preset}", "preset": preset, "detail": f"{name}.json", "peer": "TRL GRPOTrainer"}
    row["error"] = run_row(argv, logs / f"grpo_{preset}.log")
    if row["error"]:
        return row
    result = json.loads((RESULTS / f"{name}.json").read_text())
    speed, theirs, ours = result["speed"], result["speed"]["trl_grpo"], result["speed"]["shardtune_grpo"]
    row.update(
        peer_step_s=theirs["step_s"],
        ours_step_s=ours["step_s"],
        step_ratio=speed["step_speedup"],
        peer_process_s=theirs["process_s"],
        ours_process_s=ours["process_s"],
        process_ratio=speed["process_speedup"],
        notes=f"spread TRL {theirs['spread']:.0%}, ours {ours['spread']:.0%}",
    )
    if "profile" in result:
        row["profile_ms"] = result["profile"]["ms_per_step"]
    return row


PEERS = {"dpo": "TRL DPOTrainer", "kto": "TRL KTOTrainer", "rloo": "TRL RLOOTrainer", "reward": "TRL RewardTrainer"}


def pair_row(args: argparse.Namespace, objective: str, logs: Path) -> dict:
    """A bench/side_by_side.py bench's row (dpo, kto, rloo, reward)."""
    name = f"{args.name}_{objective}"
    argv = [python(), "-m", f"bench.{objective}", *common_flags(args, args.preset), "--name", name]
    if args.warmup is not None:
        argv += ["--warmup", args.warmup]
    if args.profile:
        argv += ["--profile", "true"]
    row = {"row": objective, "preset": args.preset, "detail": f"{name}.json", "peer": PEERS[objective]}
    row["error"] = run_row(argv, logs / f"{objective}.log")
    if row["error"]:
        return row
    result = json.loads((RESULTS / f"{name}.json").read_text())
    theirs, ours = result["trl"], result["shardtune"]
    row.update(
        peer_step_s=theirs["step_s"],
        ours_step_s=ours["step_s"],
        step_ratio=result["step_speedup"],
        peer_process_s=theirs["process_s"],
        ours_process_s=ours["process_s"],
        process_ratio=result["process_speedup"],
        notes=f"spread TRL {theirs['spread']:.0%}, ours {ours['spread']:.0%}; TRL on_step_begin to end "
        f"{theirs['inside_step_s']:.3f} s",
    )
    if "profile" in result:
        row["profile_ms"] = result["profile"]["ms_per_step"]
    return row


def judge(row: dict) -> None:
    """The row's target and whether its ratio meets it."""
    fallback = TARGETS["grpo demo"] if row["row"].startswith("grpo") else ("step", 1.0)  # grpo at another preset
    on, least = TARGETS.get(row["row"], fallback)
    row["target"] = f"{on} >= {least:g}x" if least > 1 else f"{on} ahead (> 1x)"
    if row.get("error"):
        row["met"] = None
        return
    ratio = row.get("target_ratio") or (row["step_ratio"] if on == "step" else row["process_ratio"])
    row["target_ratio"] = ratio
    row["met"] = ratio >= least if least > 1 else ratio > 1


def grpo_presets(args: argparse.Namespace) -> list[str]:
    if args.grpo_presets:
        return [p for p in args.grpo_presets.split(",") if p]
    return [args.preset, "demo"] if args.preset == "demo-32k" else [args.preset]


def markdown(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    lines = [
        f"# Every objective beside its peer ({result['date']})",
        "",
        f"`python -m bench.objectives` on {m['cpu']} ({m['cpu_count']} cores, {m['memory_gib']} GiB), torch "
        f"{m['torch']}, transformers {m['transformers']}, trl {result['trl_version']}; load average at start "
        f"{m['load_average_at_start'][0]:.1f}, at end {result['load_average_at_end'][0]:.1f}; took "
        f"{result['took_s'] / 60:.1f} min. fp32, gradient checkpointing off and fused AdamW on both sides; "
        f"runs per tool: {s['repeats']}, alternating; threads per process: {s['threads'] or 'all cores'}. A step: "
        "SFT the epoch (the peer's train(), ours the logged steps) over its steps, the rest the median step end to "
        "step end after the warm-up (sampling included for GRPO / RLOO). Whole process: the command from start "
        "to exit. Each row's detail (every run's steps): the file in bench/results/ its last column names.",
        "",
        "| objective | preset | peer | peer step | ours | per step | peer process | ours process | whole process "
        "| target (issue 48) | met | detail |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r.get("error"):
            lines.append(
                f"| {r['row']} | {r['preset']} | {r.get('peer', '')} | | | | | | | {r['target']} | "
                f"FAILED | {r['detail']} |"
            )
            continue
        met = "**yes**" if r["met"] else "no"
        lines.append(
            f"| {r['row']} | {r['preset']} | {r['peer']} | {r['peer_step_s']:.3f} s | {r['ours_step_s']:.3f} s | "
            f"**{r['step_ratio']:.2f}x** | {r['peer_process_s']:.1f} s | {r['ours_process_s']:.1f} s | "
            f"{r['process_ratio']:.2f}x | {r['target']}: {r['target_ratio']:.2f}x | {met} | {r['detail']} |"
        )
    lines += ["", "Notes:", ""]
    lines += [f"- {r['row']}: {r['notes'] if not r.get('error') else r['error']}" for r in result["rows"]]
    profiled = [r for r in result["rows"] if r.get("profile_ms")]
    if profiled:
        lines += [
            "",
            "**Where a step goes** (shardtune under `--use_profiler`, ms per step, the profiler's own cost "
            "included; GRPO / RLOO: sampling, scoring and log-probabilities before the training parts)",
            "",
            "| objective | step | " + " | ".join(PROFILE_LABELS) + " |",
            "|---|---|" + "---|" * len(PROFILE_PARTS),
        ]
        for r in profiled:
            ms = r["profile_ms"]
            cells = " | ".join(f"{ms[p]:.0f}" if p in ms else "-" for p in PROFILE_PARTS)
            lines.append(f"| {r['row']} | {ms['step']:.0f} | {cells} |")
    return "\n".join(lines) + "\n"


# bench/side_by_side.py's profile_summary (ops: operators outside the policy's forward, backward and optimizer, mostly
# the reference's forward; other: time no event covers) and bench/grpo.py's profile (other: all that is left)
PROFILE_PARTS = ("grpo.sample", "grpo.score", "grpo.policy_logps", "forward", "backward", "optimizer", "ops", "other")
PROFILE_LABELS = ("sampling", "scoring", "log-probabilities", "forward", "backward", "optimizer", "ops", "other")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.objectives", description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(ROWS), help="comma-separated rows: " + ", ".join(ROWS))
    ap.add_argument("--preset", default="demo-32k", help="every row's model (tiny: a functional check)")
    ap.add_argument("--grpo_presets", default="", help="GRPO's presets (default: --preset, and demo with demo-32k)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run (not SFT: one epoch)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out per run (default: each bench's)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each tool, alternating")
    ap.add_argument("--threads", type=int, default=0, help="threads per process of every row but SFT (0: all cores)")
    ap.add_argument("--sft_datasets", default="chatter", help="bench --datasets: plain or chatter (SAMSum-like)")
    ap.add_argument("--sft_num_train", type=int, default=200)
    ap.add_argument("--sft_num_validation", type=int, default=50)
    ap.add_argument("--profile", action="store_true", help="one more shardtune run per row under the profiler")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: bf16 on both sides (bench/gpu.sh)")
    ap.add_argument("--name", default="objectives", help="bench/results/NAME.md, NAME.json, NAME_ROW.json")
    args = ap.parse_args()
    only = [r for r in args.only.split(",") if r]
    unknown = sorted(set(only) - set(ROWS))
    if unknown or not only:
        ap.error(f"--only {','.join(unknown)}: not a row; the rows are {', '.join(ROWS)}")
    import trl

    started, machine = time.perf_counter(), machine_info()
    logs = Path(tempfile.mkdtemp(prefix="shardtune-bench-objectives-"))  # each row's output, for a failed row
    print(f"objectives: each row's output in {logs}", file=sys.stderr, flush=True)
    rows: list[dict] = []
    for objective in only:
        print(f"objectives: {objective}", file=sys.stderr, flush=True)
        if objective == "sft":
            found = sft_rows(args, logs)
        elif objective == "grpo":
            found = [grpo_row(args, preset, logs) for preset in grpo_presets(args)]
        else:
            found = [pair_row(args, objective, logs)]
        for row in found:
            judge(row)
        rows += found
        result = {  # written after each objective: a run stopped by a time limit keeps the rows it finished
            "machine": machine,
            "date": time.strftime("%Y-%m-%d"),
            "trl_version": trl.__version__,
            "settings": vars(args),
            "rows": rows,
            "load_average_at_end": list(os.getloadavg()),
            "took_s": time.perf_counter() - started,
        }
        (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
