"""Callbacks on shardtune: transformers' EarlyStoppingCallback and a callback of one's own.

    python examples/early_stopping.py [MODEL] [OUTPUT_DIR]

The run evaluates every step; greater_is_better=True makes a falling eval loss count as worse, so with patience 2
the run stops at its third evaluation (step 3 of 20). The recorder asks for a checkpoint at step 2.
"""

import json
import os
import sys

from transformers import EarlyStoppingCallback, TrainerCallback

from shardtune import SFTConfig, SFTTrainer


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(["begin", state.max_steps])

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(["step", state.global_step])
        if state.global_step == 2:
            control.should_save = True  # a checkpoint the cadence would not write

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "eval_loss" in logs:  # an evaluation's row is logged too, before on_evaluate (as Trainer's)
            self.events.append(["log_eval", state.global_step])
        else:
            self.events.append(["log", sorted(k for k in ("loss", "learning_rate", "grad_norm") if k in logs)])

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(["evaluate", state.global_step, "eval_loss" in metrics])

    def on_save(self, args, state, control, **kwargs):
        self.events.append(["save", state.global_step])

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(["end", state.global_step])


model = sys.argv[1] if len(sys.argv) > 1 else "preset:tiny"
output_dir = sys.argv[2] if len(sys.argv) > 2 else "runs/early-stopping"
rows = [{"prompt": f"count to {i}:", "completion": " " + " ".join(str(j) for j in range(i % 7 + 2))} for i in range(48)]
recorder = Recorder()
trainer = SFTTrainer(
    model=model,
    args=SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        max_steps=20,
        learning_rate=1e-3,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="no",
        logging_steps=1,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
    ),
    train_dataset=rows[:40],
    eval_dataset=rows[40:],
    callbacks=[EarlyStoppingCallback(early_stopping_patience=2), recorder],
)
trainer.train()

if int(os.environ.get("RANK", "0")) == 0:
    state = trainer.state
    best = {"metric": state.best_metric, "step": state.best_global_step, "checkpoint": state.best_model_checkpoint}
    print("RESULT " + json.dumps({"events": recorder.events, "steps": state.global_step, "best": best}))
