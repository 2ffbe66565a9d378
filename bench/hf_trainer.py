"""One epoch of transformers.Trainer on the same data as shardtune, with DataCollatorForSeq2Seq padding: what a
Hugging Face / TRL user gets by default. Single process, single device (CPU). Prints one JSON line.

    python -m bench.hf_trainer --model DIR --num_train 800 --num_validation 100 --batch 8 --lr 1e-3 [--samsum F]
"""

from __future__ import annotations

import json
import math
import time

from bench.data import peer_inputs, peer_parser, peer_training_arguments


def main() -> None:
    ap = peer_parser(__doc__)
    ap.add_argument("--batch", type=int, required=True)
    args = ap.parse_args()
    start = time.perf_counter()

    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from bench.data import eval_loss_of

    tokenizer, train_examples, eval_examples, model = peer_inputs(args)
    rows = [
        {"input_ids": e["input_ids"], "attention_mask": [1] * len(e["input_ids"]), "labels": e["labels"]}
        for e in train_examples
    ]
    training_args = TrainingArguments(**peer_training_arguments(args, args.batch))
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    computed = {"tokens": 0, "real_tokens": 0}

    def counting_collator(features):  # what the model computes on: real and pad tokens of each batch
        batch = collator(features)
        computed["tokens"] += batch["input_ids"].numel()
        computed["real_tokens"] += int(batch["attention_mask"].sum())
        return batch

    trainer = Trainer(
        model=model, args=training_args, train_dataset=Dataset.from_list(rows), data_collator=counting_collator
    )
    tick = time.perf_counter()
    output = trainer.train()
    epoch_s = time.perf_counter() - tick
    num_label_tokens = sum(sum(1 for x in e["labels"][1:] if x != -100) for e in train_examples)
    steps = output.global_step
    used = steps * args.batch  # drop_last: the examples the epoch trained on
    loss = eval_loss_of(model.cpu(), eval_examples, tokenizer.pad_token_id)
    print(
        json.dumps(
            {
                "epoch_s": epoch_s,
                "steps": steps,
                "examples": used,
                "label_tokens": round(num_label_tokens * used / len(train_examples)),
                "eval_loss": loss,
                "eval_ppl": math.exp(loss),
                "process_s": time.perf_counter() - start,
                "computed_tokens": computed["tokens"],
                "real_tokens": computed["real_tokens"],
                "train_loss": output.training_loss,
            }
        )
    )


if __name__ == "__main__":
    main()
