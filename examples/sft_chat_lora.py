"""SFT with LoRA on chat rows, as TRL's SFT quick start writes it, with shardtune's import.

    python examples/sft_chat_lora.py [MODEL] [OUTPUT_DIR] [BATCH] [ACCUMULATION]
    torchrun --nproc_per_node 2 examples/sft_chat_lora.py preset:tiny runs/chat 1 2   # the same steps

MODEL: a local Hugging Face directory, a hub id, or preset:tiny (default). The same effective batch (BATCH x
processes x ACCUMULATION) gives the same per-step losses on any number of processes (tests/e2e/test_python_scripts.py).
"""

import json
import os
import sys

from datasets import Dataset
from peft import LoraConfig

from shardtune import SFTConfig, SFTTrainer  # was: from trl import SFTConfig, SFTTrainer

model = sys.argv[1] if len(sys.argv) > 1 else "preset:tiny"
output_dir = sys.argv[2] if len(sys.argv) > 2 else "runs/sft-chat-lora"
batch, accumulation = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (4, 1)

rows = [
    {
        "messages": [
            {"role": "user", "content": f"repeat {i} and {i * 7}"},
            {"role": "assistant", "content": f"{i} and {i * 7}, again {i}"},
        ]
    }
    for i in range(40)
]
dataset = Dataset.from_list(rows).train_test_split(test_size=8, seed=0)

training_args = SFTConfig(
    output_dir=output_dir,
    per_device_train_batch_size=batch,
    gradient_accumulation_steps=accumulation,
    max_steps=5,
    learning_rate=2e-3,
    logging_steps=1,
    eval_strategy="steps",
    eval_steps=5,
)
trainer = SFTTrainer(
    model=model,
    args=training_args,
    train_dataset=dataset["train"],
    eval_dataset=dataset["test"],
    peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]),
)
result = trainer.train()
trainer.save_model(output_dir + "-saved")

metrics = trainer.evaluate()  # every process evaluates the trained adapter (all must call it)
if int(os.environ.get("RANK", "0")) == 0:  # every process of the run reaches this line; one prints
    summary = {
        "eval": metrics,
        "history": trainer.state.log_history,
        "global_step": result.global_step,
        "model": type(trainer.model).__name__,
        "epoch": trainer.state.epoch,
    }
    print("RESULT " + json.dumps(summary))
