"""GRPO on prompts made in the script, with reward functions of its own, as TRL's GRPO quick start writes it, with
shardtune's import.

    python examples/grpo.py [MODEL] [OUTPUT_DIR] [BATCH]
    torchrun --nproc_per_node 2 examples/grpo.py preset:tiny runs/grpo 2   # the same completions and steps

MODEL: a local Hugging Face directory, a hub id, or preset:tiny (default). BATCH: completions per process and step
(default 4). The same completions per step (BATCH x processes: one prompt's group of 4 here) sample the same
completions and train the same steps on any number of processes, and evaluate alike (tests/e2e/test_python_scripts.py).
"""

import json
import os
import sys

from datasets import Dataset

from shardtune import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer

model = sys.argv[1] if len(sys.argv) > 1 else "preset:tiny"
output_dir = sys.argv[2] if len(sys.argv) > 2 else "runs/grpo"
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 4

# a "prompt" column (text, or a list of messages); the other columns reach the reward functions by name
prompts = [{"prompt": f"Count on from {i}: {i},", "target": str(i + 1)} for i in range(40)]  # 32 to train, 8 held out


def short(completions, **kwargs):
    """Shorter completions score higher."""
    return [-len(completion) / 20 for completion in completions]


def counts_on(completions, target, **kwargs):
    """1 where the completion holds the next number (the row's "target" column), 0.5 where it holds a digit."""
    return [1.0 if t in c else 0.5 if any(ch.isdigit() for ch in c) else 0.0 for c, t in zip(completions, target)]


training_args = GRPOConfig(
    output_dir=output_dir,
    per_device_train_batch_size=batch,
    num_generations=4,
    max_completion_length=8,
    max_steps=4,
    learning_rate=1e-3,
    beta=0.04,
    logging_steps=1,
    eval_strategy="steps",  # the held-out prompts' rewards every 2 steps (eval_reward, eval_loss, ...)
    eval_steps=2,
    per_device_eval_batch_size=4,
)
trainer = GRPOTrainer(
    model=model,
    reward_funcs=[short, counts_on],
    args=training_args,
    train_dataset=Dataset.from_list(prompts[:32]),
    eval_dataset=Dataset.from_list(prompts[32:]),
)
result = trainer.train()

if int(os.environ.get("RANK", "0")) == 0:
    print(
        "RESULT "
        + json.dumps(
            {"history": trainer.state.log_history, "global_step": result.global_step, "loss": result.training_loss}
        )
    )
