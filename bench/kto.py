"""KTO step time: TRL's KTOTrainer and ``shardtune kto`` on the same unpaired rows, model and batch, one process, in
one run.

    python -m bench.kto [--preset demo-32k | --model DIR] [--pairs 64] [--batch 8] [--steps 10] [--warmup 1]
                        [--repeats 2] [--context_length 512] [--gradient_checkpointing false] [--threads 0]

The rows are bench/dpo.py's pairs (the embedded dialogues: chosen the dialogue's own summary, rejected the next
one's) unpaired into conversational ``prompt`` / ``completion`` / ``label`` rows, each pair's desirable row then its
undesirable one (so that every step holds both), written once to a JSONL file that both read (TRL with
``load_dataset``, shardtune with ``--dataset_name``). Both train full fine-tuning with a frozen reference copy, loss
kto (the KL reference point from each step's mismatched completions: one more forward of the policy and the
reference per step on both sides), beta 0.1, lr 1e-5 constant, the rows in their order (TRL's KTO default), fp32,
gradient checkpointing off, fused AdamW, no evaluation, no saving (bench/side_by_side.py: the shared settings, the
alternating runs, a step timed step end to step end on both sides, the warm-up left out). Writes
bench/results/NAME.json (default kto). Needs trl (the dev extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench import side_by_side as sbs
from bench.dpo import write_pairs

TRL_BODY = r"""
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import KTOConfig, KTOTrainer

load = lambda: AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation="sdpa")
trainer = KTOTrainer(model=load(), ref_model=load(), args=KTOConfig(**job["config"]),
                     train_dataset=load_dataset("json", data_files=job["data"], split="train"),
                     processing_class=AutoTokenizer.from_pretrained(job["model"]), callbacks=[StepTimes()])
"""


def write_unpaired(path: Path, num_pairs: int) -> Path:
    """bench/dpo.py's ``num_pairs`` pairs as 2 x ``num_pairs`` unpaired rows, desirable and undesirable in turn."""
    pairs = [json.loads(line) for line in write_pairs(path, num_pairs).read_text().splitlines()]
    rows = [
        {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
        for pair in pairs
        for side in ("chosen", "rejected")
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sbs.add_settings(ap, batch=8)
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--context_length", type=int, default=512)
    args = ap.parse_args()
    started, machine = sbs.start()
    with tempfile.TemporaryDirectory(prefix="shardtune-bench-kto-") as tmp:
        tmp = Path(tmp)
        model = sbs.model_dir(args, tmp)
        rows = write_unpaired(tmp / "unpaired.jsonl", args.pairs)
        loss = {"max_length": args.context_length, "beta": 0.1, "learning_rate": 1e-5, "loss_type": "kto"}

        def trl(repeat: int) -> dict:
            config = sbs.trl_config(args, tmp / f"trl-{repeat}", **loss)
            return sbs.run_trl(args, TRL_BODY, {"model": model, "data": str(rows), "config": config}, tmp)

        def ours(out: Path, steps: int | None = None, extra: tuple = ()) -> dict:
            flags = sbs.shardtune_flags(args, model, rows, out, steps)
            flags += [item for key, value in loss.items() for item in (f"--{key}", value)]
            return sbs.run_shardtune(args, "kto", [*flags, *extra], out)

        result = sbs.measure(args, "kto", trl, ours, tmp)
    result = sbs.write(args, "kto", result, started, machine)
    print(sbs.brief(result))


if __name__ == "__main__":
    sys.exit(main())
