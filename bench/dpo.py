"""DPO step time: TRL's DPOTrainer and ``shardtune dpo`` on the same pairs, model and batch, one process, in one run.

    python -m bench.dpo [--model DIR] [--pairs 64] [--batch 4] [--steps 12] [--context_length 512] [--device cpu]

The pairs are the embedded dialogues as conversational preference rows (chosen: the dialogue's own summary,
rejected: the next one's), written once to a JSONL file that both read (TRL with ``load_dataset``, shardtune with
``--dataset_name``). Both train full fine-tuning with a frozen reference copy, sigmoid loss, beta 0.1, constant lr,
no evaluation, no saving. Step time: TRL's ``train()`` over its steps (warm-up step left out: the median of the
per-step times its callback records); shardtune's ``step_time_s`` rows (median, first step left out), and each
tool's whole process. Prints one JSON object and writes bench/results/dpo.json. Needs trl (the dev extra).
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
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer

model_dir, pairs, out, batch, steps, length, device = sys.argv[1:8]
steps_s, tick = [], [0.0]

class StepTimes(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        tick[0] = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        steps_s.append(time.perf_counter() - tick[0])

load = lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
config = DPOConfig(output_dir=out, per_device_train_batch_size=int(batch), gradient_accumulation_steps=1,
                   max_steps=int(steps), learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0,
                   max_grad_norm=1.0, seed=42, use_cpu=device == "cpu", bf16=device == "cuda",
                   dataloader_num_workers=0, save_strategy="no", eval_strategy="no", logging_steps=10**9,
                   report_to=[], disable_tqdm=True, max_length=int(length), beta=0.1, loss_type=["sigmoid"])
trainer = DPOTrainer(model=load(), ref_model=load(), args=config,
                     train_dataset=load_dataset("json", data_files=pairs, split="train"),
                     processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[StepTimes()])
train_start = time.perf_counter()
output = trainer.train()
print(json.dumps({"train_s": time.perf_counter() - train_start, "steps": output.global_step, "step_s": steps_s,
                  "process_s": time.perf_counter() - start, "train_loss": output.training_loss}))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="a model directory (default: the demo preset, built once)")
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--context_length", type=int, default=512)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardtune-bench-dpo-") as tmp:
        tmp = Path(tmp)
        model = args.model
        if not model:
            from shardtune.model.loading import init_model

            model = str(init_model("demo", tmp / "demo", seed=0))
        pairs = write_pairs(tmp / "pairs.jsonl", args.pairs)
        script = tmp / "trl_dpo.py"
        script.write_text(TRL_SCRIPT)
        tick = time.perf_counter()
        trl = run_json(
            [
                python(),
                str(script),
                model,
                str(pairs),
                str(tmp / "trl"),
                str(args.batch),
                str(args.steps),
                str(args.context_length),
                args.device,
            ]
        )
        trl["process_s"] = time.perf_counter() - tick
        out = tmp / "shardtune"
        tick = time.perf_counter()
        run(
            [
                python(),
                "-m",
                "shardtune",
                "dpo",
                "--nproc_per_node",
                "1",
                "--model_name",
                model,
                "--output_dir",
                str(out),
                "--dataset_name",
                str(pairs),
                "--batch_size_training",
                str(args.batch),
                "--max_train_step",
                str(args.steps),
                "--context_length",
                str(args.context_length),
                "--lr",
                "1e-5",
                "--beta",
                "0.1",
                "--lr_scheduler",
                "constant",
                "--gradient_clipping",
                "true",
                "--run_validation",
                "false",
                "--save_model",
                "false",
                "--save_plots",
                "false",
                "--num_workers_dataloader",
                "0",
            ]
        )
        process_s = time.perf_counter() - tick
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
    }
    result = {
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": vars(args),
        "trl_dpo": theirs,
        "shardtune_dpo": ours,
        "step_speedup": theirs["step_s"] / ours["step_s"],
        "process_speedup": theirs["process_s"] / process_s,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dpo.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
