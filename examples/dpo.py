"""DPO with LoRA on preference pairs, as TRL's DPO quick start writes it, with shardtune's import.

python examples/dpo.py [MODEL] [OUTPUT_DIR]
torchrun --nproc_per_node 2 examples/dpo.py preset:tiny runs/dpo
"""

import json
import os
import sys

from datasets import Dataset
from peft import LoraConfig

from shardtune import DPOConfig, DPOTrainer  # was: from trl import DPOConfig, DPOTrainer

model = sys.argv[1] if len(sys.argv) > 1 else "preset:tiny"
output_dir = sys.argv[2] if len(sys.argv) > 2 else "runs/dpo"

pairs = [
    {
        "prompt": [{"role": "user", "content": f"what is {i} plus {i}?"}],
        "chosen": [{"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}],
        "rejected": [{"role": "assistant", "content": f"{i} plus {i} is {2 * i + 1}."}],
    }
    for i in range(24)
]
training_args = DPOConfig(
    output_dir=output_dir,
    per_device_train_batch_size=4,
    max_steps=4,
    learning_rate=5e-4,
    beta=0.1,
    logging_steps=1,
)
trainer = DPOTrainer(
    model=model,
    args=training_args,
    train_dataset=Dataset.from_list(pairs),
    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
)
trainer.train()

if int(os.environ.get("RANK", "0")) == 0:
    print("RESULT " + json.dumps({"history": trainer.state.log_history, "model": type(trainer.model).__name__}))
