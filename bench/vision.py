"""Vision-language SFT step time: TRL's SFTTrainer and ``shardtune sft`` on the same tiny vision model, images and
batch, one process, in one run.

    python -m bench.vision [--preset vlm-llava-tiny] [--rows 64] [--batch 8] [--steps 16] [--repeats 2]

The rows are tests/vision_data.py's coloured squares (TRL's ``images`` + ``messages`` format, image paths in a
JSONL file); TRL reads them as a ``datasets`` table with the images opened (what an Image column gives it). Both run
TRL's defaults (``--defaults trl`` for shardtune: gradient checkpointing on, lr 2e-5, linear schedule), fp32 on CPU,
rows in order (``train_sampling_strategy sequential``), no evaluation, no saving. Step time: TRL's per-step times from
a callback, shardtune's ``step_time_s`` rows (each the median, the first step left out); each tool's whole process;
the first losses side by side (the same model, rows and order: they should agree to ~1e-6). Runs alternate
(TRL, shardtune, TRL, ...) so that a busy machine slows both alike. Prints one JSON object and writes
bench/results/vision.json. Needs trl (the dev extra).
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
from datasets import Dataset
from PIL import Image
from transformers import AutoModelForImageTextToText, TrainerCallback
from trl import SFTConfig, SFTTrainer
from shardtune.model.vision import load_processor_from

model_dir, data, out, batch, steps = sys.argv[1:6]
steps_s, tick = [], [0.0]

class StepTimes(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        tick[0] = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        steps_s.append(time.perf_counter() - tick[0])

rows = [json.loads(line) for line in open(f"{data}/train.jsonl")]
for row in rows:
    row["images"] = [Image.open(f"{data}/{p}").convert("RGB") for p in row["images"]]
config = SFTConfig(output_dir=out, per_device_train_batch_size=int(batch), max_steps=int(steps), seed=0,
                   use_cpu=True, bf16=False, dataloader_num_workers=0, save_strategy="no", eval_strategy="no",
                   logging_steps=1, report_to=[], disable_tqdm=True, train_sampling_strategy="sequential")
trainer = SFTTrainer(model=AutoModelForImageTextToText.from_pretrained(model_dir), args=config,
                     train_dataset=Dataset.from_list(rows), processing_class=load_processor_from(model_dir),
                     callbacks=[StepTimes()])
train_start = time.perf_counter()
output = trainer.train()
losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
print(json.dumps({"train_s": time.perf_counter() - train_start, "steps": output.global_step, "step_s": steps_s,
                  "process_s": time.perf_counter() - start, "first_loss": losses[0]}))
"""


def steady(times: list[float]) -> float:
    """The median step time, the first (warm-up) step left out."""
    return statistics.median(times[1:] if len(times) > 1 else times)


def shardtune_run(model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict:
    """``shardtune sft`` with the TRL script's settings: its steady step, training and whole-process seconds."""
    tick = time.perf_counter()
    run(
        [
            *(python(), "-m", "shardtune", "sft", "--defaults", "trl", "--nproc_per_node", "1"),
            *("--model_name", str(model), "--dataset_name", str(data), "--output_dir", str(out)),
            *("--per_device_train_batch_size", str(args.batch), "--max_steps", str(args.steps), "--seed", "0"),
            *("--bf16", "false", "--train_sampling_strategy", "sequential", "--logging_steps", "1"),
            *("--eval_strategy", "no", "--save_strategy", "no", "--save_model", "false", "--save_plots", "false"),
            *("--dataloader_num_workers", "0", "--report_to", "none"),
        ]
    )
    process_s = time.perf_counter() - tick
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time_s" in r]
    return {
        "steps": len(steps),
        "step_s": steady([r["step_time_s"] for r in steps]),
        "train_s": sum(r["step_time_s"] for r in steps),
        "process_s": process_s,
        "first_loss": steps[0]["loss"],
    }


def trl_run(script: Path, model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict:
    tick = time.perf_counter()
    trl = run_json([python(), str(script), str(model), str(data), str(out), str(args.batch), str(args.steps)])
    return {
        "steps": trl["steps"],
        "step_s": steady(trl["step_s"]),
        "train_s": trl["train_s"],
        "process_s": time.perf_counter() - tick,
        "first_loss": trl["first_loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="vlm-llava-tiny", help="a vision preset (shardtune.model.vision_presets)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each tool, alternating")
    args = ap.parse_args()
    from shardtune.model.loading import init_model
    from tests.vision_data import write_squares

    runs: dict[str, list[dict]] = {"trl": [], "shardtune": []}
    with tempfile.TemporaryDirectory(prefix="shardtune-bench-vision-") as tmp:
        tmp = Path(tmp)
        model = init_model(args.preset, tmp / args.preset, seed=0)
        data = write_squares(tmp / "squares", {"train": args.rows}, seed=2)
        script = tmp / "trl_sft.py"
        script.write_text(TRL_SCRIPT)
        for i in range(args.repeats):
            runs["trl"].append(trl_run(script, model, data, tmp / f"trl-{i}", args))
            runs["shardtune"].append(shardtune_run(model, data, tmp / f"shardtune-{i}", args))
    best = {name: min(results, key=lambda r: r["step_s"]) for name, results in runs.items()}
    result = {
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": vars(args),
        "runs": runs,
        "step_speedup": statistics.median(r["step_s"] for r in runs["trl"])
        / statistics.median(r["step_s"] for r in runs["shardtune"]),
        "process_speedup": statistics.median(r["process_s"] for r in runs["trl"])
        / statistics.median(r["process_s"] for r in runs["shardtune"]),
        "first_loss": {name: r["first_loss"] for name, r in best.items()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "vision.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
