"""DPO step time: TRL's DPOTrainer and ``shardtune dpo`` on the same pairs, model and batch, one process, in one run.

    python -m bench.dpo [--preset demo-32k | --model DIR] [--pairs 64] [--batch 4] [--steps 10] [--warmup 1]
                        [--repeats 2] [--context_length 512] [--gradient_checkpointing false] [--threads 0]

The pairs are the embedded dialogues as conversational preference rows (chosen: the dialogue's own summary,
rejected: the next one's), written once to a JSONL file that both read (TRL with ``load_dataset``, shardtune with
``--dataset_name``). Both train full fine-tuning with a frozen reference copy, sigmoid loss, beta 0.1, lr 1e-5
constant, fp32, gradient checkpointing off, fused AdamW, no evaluation, no saving (bench/side_by_side.py: the shared
settings, the alternating runs, and a step timed step end to step end on both sides, the warm-up left out). Writes
bench/results/NAME.json (default dpo). Needs trl (the dev extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench import side_by_side as sbs

TRL_BODY = r"""
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

load = lambda: AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation="sdpa")
trainer = DPOTrainer(model=load(), ref_model=load(), args=DPOConfig(**job["config"]),
                     train_dataset=load_dataset("json", data_files=job["data"], split="train"),
                     processing_class=AutoTokenizer.from_pretrained(job["model"]), callbacks=[StepTimes()])
"""


def write_pairs(path: Path, num: int) -> Path:
    from shardtune.config.schema import TrainConfig
    from shardtune.data.preference import synthetic_pair_rows

    cfg = TrainConfig()
    cfg.data.synthetic_dialogues.num_train = num
    _, rows, _ = synthetic_pair_rows(cfg, "train")
    path.write_text("".join(json.dumps(row) + "\n" for _, _, row in rows))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sbs.add_settings(ap, batch=4)
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--context_length", type=int, default=512)
    args = ap.parse_args()
    started, machine = sbs.start()
    with tempfile.TemporaryDirectory(prefix="shardtune-bench-dpo-") as tmp:
        tmp = Path(tmp)
        model = sbs.model_dir(args, tmp)
        pairs = write_pairs(tmp / "pairs.jsonl", args.pairs)
        loss = {"max_length": args.context_length, "beta": 0.1, "learning_rate": 1e-5}

        def trl(repeat: int) -> dict:
            config = sbs.trl_config(args, tmp / f"trl-{repeat}", loss_type=["sigmoid"], **loss)
            return sbs.run_trl(args, TRL_BODY, {"model": model, "data": str(pairs), "config": config}, tmp)

        def ours(out: Path, steps: int | None = None, extra: tuple = ()) -> dict:
            flags = sbs.shardtune_flags(args, model, pairs, out, steps)
            flags += [item for key, value in loss.items() for item in (f"--{key}", value)]
            return sbs.run_shardtune(args, "dpo", [*flags, *extra], out)

        result = sbs.measure(args, "dpo", trl, ours, tmp)
    result = sbs.write(args, "dpo", result, started, machine)
    print(sbs.brief(result))


if __name__ == "__main__":
    sys.exit(main())
