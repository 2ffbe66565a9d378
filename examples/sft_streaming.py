"""SFT on a streamed corpus (a ``datasets.IterableDataset``), as TRL takes one, with shardtune's import.

    python examples/sft_streaming.py [MODEL] [OUTPUT_DIR] [BATCH] [ACCUMULATION]
    torchrun --nproc_per_node 2 examples/sft_streaming.py preset:tiny runs/streamed 2 1   # the same steps

The rows are made by a generator as the steps need them (a corpus that need not fit in memory; with
``load_dataset(..., streaming=True)`` they come from files or the hub the same way). As in TRL, ``max_steps`` is
required. Every process reads the stream and trains its own share of each step's rows, so the same effective batch
(BATCH x processes x ACCUMULATION) gives the same per-step losses on any number of processes
(tests/e2e/test_python_scripts.py).
"""

import json
import os
import sys

from datasets import Dataset, IterableDataset

from shardtune import SFTConfig, SFTTrainer  # was: from trl import SFTConfig, SFTTrainer

model = sys.argv[1] if len(sys.argv) > 1 else "preset:tiny"
output_dir = sys.argv[2] if len(sys.argv) > 2 else "runs/sft-streaming"
batch, accumulation = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (4, 1)


def rows(first: int, count: int):
    for i in range(first, first + count):
        yield {"prompt": f"Count from {i}:", "completion": " " + " ".join(str(i + k) for k in range(1, 4 + i % 5))}


train = IterableDataset.from_generator(rows, gen_kwargs={"first": 0, "count": 30})
evaluation = Dataset.from_generator(rows, gen_kwargs={"first": 1000, "count": 6})

trainer = SFTTrainer(
    model=model,
    args=SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_steps=10,  # 30 rows are 7 steps of 4: the stream starts again at step 8
        learning_rate=2e-3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=5,
    ),
    train_dataset=train,
    eval_dataset=evaluation,
)
result = trainer.train()
if int(os.environ.get("RANK", "0")) == 0:
    print("RESULT " + json.dumps({"history": trainer.state.log_history, "global_step": result.global_step}))
