"""Reward-model step time: TRL's RewardTrainer and ``shardtune reward`` on the same pairs, model and batch, one
process, in one run.

    python -m bench.reward [--preset demo-32k | --model DIR] [--pairs 64] [--batch 8] [--steps 10] [--warmup 1]
                           [--repeats 2] [--gradient_checkpointing false] [--threads 0]

The pairs are the embedded dialogues as conversational preference rows (chosen: the dialogue's own summary,
rejected: the next one's), written once to a JSONL file that both read (TRL with ``load_dataset``, shardtune with
``--dataset_name``). Both train full fine-tuning of the one-label score head on the model (drawn from seed 42), lr
1e-4 (TRL's default) constant, fp32 (TRL loads the model in float32), gradient checkpointing off (TRL's default is
on: ``--gradient_checkpointing true`` for both), fused AdamW, no evaluation, no saving (bench/side_by_side.py: the
shared settings, the alternating runs, a step timed step end to step end on both sides, the warm-up left out). The
first losses side by side (the same head, the same pairs in the first batch only when the samplers agree: they are
compared, not asserted). Writes bench/results/NAME.json (default reward). Needs trl (the dev extra).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench import side_by_side as sbs
from bench.dpo import write_pairs

TRL_BODY = r"""
from datasets import load_dataset
from transformers import AutoTokenizer
from trl import RewardConfig, RewardTrainer

config = RewardConfig(**job["config"], model_init_kwargs={"dtype": torch.float32})
trainer = RewardTrainer(model=job["model"], args=config,
                        train_dataset=load_dataset("json", data_files=job["data"], split="train"),
                        processing_class=AutoTokenizer.from_pretrained(job["model"]), callbacks=[StepTimes()])
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sbs.add_settings(ap, batch=8)
    ap.add_argument("--pairs", type=int, default=64)
    args = ap.parse_args()
    started, machine = sbs.start()
    with tempfile.TemporaryDirectory(prefix="shardtune-bench-reward-") as tmp:
        tmp = Path(tmp)
        model = sbs.model_dir(args, tmp)
        pairs = write_pairs(tmp / "pairs.jsonl", args.pairs)

        def trl(repeat: int) -> dict:
            config = sbs.trl_config(args, tmp / f"trl-{repeat}", learning_rate=1e-4)
            return sbs.run_trl(args, TRL_BODY, {"model": model, "data": str(pairs), "config": config}, tmp)

        def ours(out: Path, steps: int | None = None, extra: tuple = ()) -> dict:
            flags = [*sbs.shardtune_flags(args, model, pairs, out, steps), "--learning_rate", 1e-4]
            return sbs.run_shardtune(args, "reward", [*flags, *extra], out)

        result = sbs.measure(args, "reward", trl, ours, tmp)
    result = sbs.write(args, "reward", result, started, machine)
    print(sbs.brief(result))


if __name__ == "__main__":
    sys.exit(main())
