"""RLOO step time: TRL's RLOOTrainer and ``shardtune rloo`` on the same prompts, model, reward function and batch, one
process, in one run.

    python -m bench.rloo [--preset demo-32k | --model DIR] [--prompts 64] [--batch 8] [--num_generations 4]
                         [--max_completion_length 16] [--beta 0] [--steps 10] [--warmup 2] [--repeats 2]
                         [--gradient_checkpointing false] [--threads 0]

bench/grpo.py's workload with RLOO's loss: both tools train ``warmup + steps`` steps of ``batch`` completions
(``num_generations`` per prompt, at most ``max_completion_length`` new tokens, temperature 1) of bench/grpo.py's
prompts, reward ``examples/grpo_rewards.py:single_characters`` (the same file: TRL imports the function, shardtune
takes it by path), beta 0 by default (no reference model: the fastest setting of both; TRL's RLOO default 0.05 loads
one: ``--beta 0.05``), lr 1e-3 constant, fp32, gradient checkpointing off, fused AdamW, no saving
(bench/side_by_side.py: the shared settings, the alternating runs, a step timed step end to step end on both sides,
so that sampling and scoring are in it wherever each tool does them; the warm-up left out). Writes
bench/results/NAME.json (default rloo). Needs trl (the dev extra).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench import side_by_side as sbs
from bench.grpo import REWARD, REWARD_FILE, write_prompts

TRL_BODY = r"""
import importlib.util
from datasets import load_dataset
from trl import RLOOConfig, RLOOTrainer

spec = importlib.util.spec_from_file_location("grpo_rewards", job["reward_file"])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
config = RLOOConfig(**job["config"], model_init_kwargs={"dtype": torch.float32})
trainer = RLOOTrainer(model=job["model"], reward_funcs=getattr(module, job["reward"]), args=config,
                      train_dataset=load_dataset("json", data_files=job["data"], split="train"),
                      callbacks=[StepTimes()])
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sbs.add_settings(ap, batch=8, warmup=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--num_generations", type=int, default=4)
    ap.add_argument("--max_completion_length", type=int, default=16)
    ap.add_argument("--beta", type=float, default=0.0)
    args = ap.parse_args()
    started, machine = sbs.start()
    with tempfile.TemporaryDirectory(prefix="shardtune-bench-rloo-") as tmp:
        tmp = Path(tmp)
        model = sbs.model_dir(args, tmp)
        prompts = write_prompts(tmp / "prompts.jsonl", args.prompts)
        rl = {
            "num_generations": args.num_generations,
            "max_completion_length": args.max_completion_length,
            "beta": args.beta,
            "learning_rate": 1e-3,
        }

        def trl(repeat: int) -> dict:
            job = {"model": model, "data": str(prompts), "reward_file": str(REWARD_FILE), "reward": REWARD}
            job["config"] = sbs.trl_config(args, tmp / f"trl-{repeat}", **rl)
            return sbs.run_trl(args, TRL_BODY, job, tmp)

        def ours(out: Path, steps: int | None = None, extra: tuple = ()) -> dict:
            flags = [
                *sbs.shardtune_flags(args, model, prompts, out, steps),
                "--reward_funcs",
                f"{REWARD_FILE}:{REWARD}",
            ]
            flags += [item for key, value in rl.items() for item in (f"--{key}", value)]
            return sbs.run_shardtune(args, "rloo", [*flags, *extra], out)

        result = sbs.measure(args, "rloo", trl, ours, tmp)
    result = sbs.write(args, "rloo", result, started, machine)
    print(sbs.brief(result))


if __name__ == "__main__":
    sys.exit(main())
