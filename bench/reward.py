"""Reward-model step time: TRL's RewardTrainer and ``shardtune reward`` on the same pairs, model and batch, one
process, in one run.

    python -m bench.reward [--model DIR] [--pairs 64] [--batch 8] [--steps 12] [--device cpu]

The pairs are the embedded dialogues as conversational preference rows (chosen: the dialogue's own summary,
rejected: the next one's), written once to a JSONL file that both read (TRL with ``load_dataset``, shardtune with
``--dataset_name``). Both train full fine-tuning of the one-label score head on the model (drawn from seed 42), TRL's
defaults otherwise (lr 1e-4, gradient checkpointing on), constant lr, fp32 on CPU, no evaluation, no saving. Step time:
TRL's per-step times from a callback, shardtune's ``step_time_s`` rows (each the median, the first step left out), and
each tool's whole process; the first losses side by side (the same head, the same pairs in the first batch only when
the samplers agree: they are compared, not asserted). Prints one JSON object and writes bench/results/reward.json.
Needs trl (the dev extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, machine_info, python, run, run_json

TRL_SCRIPT = r"""
import json, sys, time
start = time.perf_counter()
from datasets import load_dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import RewardConfig, RewardTrainer

model_dir, pairs, out, batch, steps, device = sys.argv[1:7]
steps_s, tick = [], [0.0]

class StepTimes(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        tick[0] = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        steps_s.append(time.perf_counter() - tick[0])

config = RewardConfig(output_dir=out, per_device_train_batch_size=int(batch), max_steps=int(steps),
                      lr_scheduler_type="constant", seed=42, use_cpu=device == "cpu", bf16=device == "cuda",
                      dataloader_num_workers=0, save_strategy="no", eval_strategy="no", logging_steps=1,
                      report_to=[], disable_tqdm=True)
dataset = load_dataset("json", data_files=pairs, split="train")
trainer = RewardTrainer(model=model_dir, args=config, train_dataset=dataset,
                        processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[StepTimes()])
train_start = time.perf_counter()
output = trainer.train()
losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
print(json.dumps({"train_s": time.perf_counter() - train_start, "steps": output.global_step, "step_s": steps_s,
                  "process_s": time.perf_counter() - start, "first_loss": losses[0]}))
"""


def write_pairs(path: Path, num: int) -> Path:
    from shardtune.config.schema import TrainConfig
    from shardtune.data.preference import synthetic_pair_rows

    cfg = TrainConfig()
    cfg.data.synthetic_dialogues.num_train = num
    _, rows, _ = synthetic_pair_rows(cfg, "train")
    path.write_text("".join(json.dumps(row) + "\n" for _, _, row in rows))
    return path


def steady(times: list[float]) -> float:
    """The median step time, the first (warm-up) step left out."""
    return statistics.median(times[1:] if len(times) > 1 else times)


def shardtune_run(model: str, pairs: Path, out: Path, args: argparse.Namespace) -> float:
    """``shardtune reward`` with the TRL script's settings; its whole process's seconds."""
    tick = time.perf_counter()
    run(
        [
            *(python(), "-m", "shardtune", "reward", "--nproc_per_node", "1", "--model_name_or_path", model),
            *("--output_dir", str(out), "--dataset_name", str(pairs)),
            *("--per_device_train_batch_size", str(args.batch), "--max_steps", str(args.steps)),
            *("--lr_scheduler_type", "constant", "--seed", "42", "--bf16", str(args.device == "cuda").lower()),
            *("--eval_strategy", "no", "--save_strategy", "no", "--save_model", "false", "--save_plots", "false"),
            *("--dataloader_num_workers", "0", "--report_to", "none"),
        ]
    )
    return time.perf_counter() - tick


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="a model directory (default: the demo preset, built once)")
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardtune-bench-reward-") as tmp:
        tmp = Path(tmp)
        model = args.model
        if not model:
            from shardtune.model.loading import init_model

            model = str(init_model("demo", tmp / "demo", seed=0))
        pairs = write_pairs(tmp / "pairs.jsonl", args.pairs)
        script = tmp / "trl_reward.py"
        script.write_text(TRL_SCRIPT)
        tick = time.perf_counter()
        trl = run_json(
            [python(), str(script), model, str(pairs), str(tmp / "trl"), str(args.batch), str(args.steps), args.device]
        )
        trl["process_s"] = time.perf_counter() - tick
        out = tmp / "shardtune"
        process_s = shardtune_run(model, pairs, out, args)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "step_time_s" in r]
    ours = {
        "steps": len(steps),
        "step_s": steady([r["step_time_s"] for r in steps]),
        "train_s": sum(r["step_time_s"] for r in steps),
        "process_s": process_s,
        "first_loss": steps[0]["loss"],
    }
    theirs = {
        "steps": trl["steps"],
        "step_s": steady(trl["step_s"]),
        "train_s": trl["train_s"],
        "process_s": trl["process_s"],
        "first_loss": trl["first_loss"],
    }
    result = {
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": vars(args),
        "trl_reward": theirs,
        "shardtune_reward": ours,
        "step_speedup": theirs["step_s"] / ours["step_s"],
        "process_speedup": theirs["process_s"] / process_s,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "reward.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
