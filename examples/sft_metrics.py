"""compute_metrics, preprocess_logits_for_metrics and predict() as transformers' Trainer takes them, with shardtune's
import.

    python examples/sft_metrics.py [MODEL] [OUTPUT_DIR] [BATCH] [ACCUMULATION]
    torchrun --nproc_per_node 2 examples/sft_metrics.py preset:tiny runs/metrics 1 2   # the same numbers

The run evaluates every 2 steps: each evaluation row carries the metrics compute_metrics made of the predictions
(here the log-probability of each next label, which preprocess_logits_for_metrics keeps of the logits: the
perplexity it gives is the evaluation's own eval_ppl). predict() returns the arrays, one row per test row in its
order, padded with -100, the same on any number of processes (tests/e2e/test_python_metrics.py).
"""

import json
import os
import sys

import numpy as np
import torch

from shardtune import SFTConfig, SFTTrainer  # was: from trl import SFTConfig, SFTTrainer

model = sys.argv[1] if len(sys.argv) > 1 else "preset:tiny"
output_dir = sys.argv[2] if len(sys.argv) > 2 else "runs/sft-metrics"
batch, accumulation = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (4, 1)

rows = [
    {"prompt": f"count from {i}:", "completion": " " + " ".join(str(i + j) for j in range(i % 5 + 1))}
    for i in range(40)
]
train, test = rows[:32], rows[32:]


def next_label_logps(logits, labels):
    """Per position, the log-probability the model gives the next token's label (0 where there is none)."""
    logps = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
    targets = labels[:, 1:]
    picked = logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked * (targets != -100), (0, 1))


def compute_metrics(prediction):
    scored = prediction.label_ids[:, 1:] != -100
    logps = prediction.predictions[:, :-1][scored]
    return {"mean_logp": float(logps.mean()), "perplexity": float(np.exp(-logps.mean())), "rows": len(scored)}


args = SFTConfig(
    output_dir=output_dir,
    per_device_train_batch_size=batch,
    gradient_accumulation_steps=accumulation,
    per_device_eval_batch_size=3,
    max_steps=4,
    learning_rate=2e-3,
    logging_steps=1,
    eval_strategy="steps",
    eval_steps=2,
    report_to="none",
)
trainer = SFTTrainer(
    model=model,
    args=args,
    train_dataset=train,
    eval_dataset=test,
    compute_metrics=compute_metrics,
    preprocess_logits_for_metrics=next_label_logps,
)
trainer.train()
predicted = trainer.predict(test)  # every process predicts (all must call it)

# the logits themselves: the starting model, no preprocessing
logits = SFTTrainer(
    model=model, args=SFTConfig(output_dir=output_dir + "-logits", report_to="none"), train_dataset=train
)
raw = logits.predict(test)

if int(os.environ.get("RANK", "0")) == 0:  # every process of the run reaches this line; one prints
    summary = {
        "evaluations": [row for row in trainer.state.log_history if "eval_loss" in row],
        "predicted": {"predictions": predicted.predictions.tolist(), "label_ids": predicted.label_ids.tolist()},
        "metrics": predicted.metrics,
        "logits": {"shape": list(raw.predictions.shape), "values": raw.predictions.ravel()[::97].tolist()},
        "logit_labels": raw.label_ids.tolist(),
        "logit_metrics": raw.metrics,
    }
    print("RESULT " + json.dumps(summary))
