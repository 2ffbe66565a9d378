"""One epoch of transformers.Trainer on the same data as shardtune, with DataCollatorForSeq2Seq padding: what a
Hugging Face / TRL user gets by default. Single process, single device (CPU). Prints one JSON line.

    python -m bench.hf_trainer --model DIR --num_train 800 --num_validation 100 --batch 8 --lr 1e-3 [--samsum F]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--num_train", type=int, required=True)
    ap.add_argument("--num_validation", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--samsum", default="")
    ap.add_argument("--chatter", action="store_true")
    ap.add_argument("--context_length", type=int, default=1024)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: bf16 mixed precision")
    ap.add_argument("--max_steps", type=int, default=-1, help="stop after N steps (-1: one epoch)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    start = time.perf_counter()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from bench.data import bench_config, eval_loss_of
    from shardtune import data
    from shardtune.model.loading import load_tokenizer

    cfg = bench_config(args.model, args.num_train, args.num_validation, args.samsum, args.context_length,
                       args.chatter)
    tokenizer = load_tokenizer(args.model)
    train_examples, _ = data.load_examples(cfg, tokenizer, "train")
    eval_examples, _ = data.load_examples(cfg, tokenizer, "validation")
    rows = [{"input_ids": e["input_ids"], "attention_mask": [1] * len(e["input_ids"]), "labels": e["labels"]}
            for e in train_examples]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    training_args = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        num_train_epochs=1, max_steps=args.max_steps, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", max_grad_norm=1.0, seed=42, use_cpu=args.device == "cpu",
        bf16=args.device == "cuda", dataloader_num_workers=0,
        dataloader_drop_last=True, save_strategy="no", eval_strategy="no", logging_steps=10**9, report_to=[],
        disable_tqdm=True)
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    computed = {"tokens": 0, "real_tokens": 0}

    def counting_collator(features):  # what the model computes on: real and pad tokens of each batch
        batch = collator(features)
        computed["tokens"] += batch["input_ids"].numel()
        computed["real_tokens"] += int(batch["attention_mask"].sum())
        return batch

    trainer = Trainer(model=model, args=training_args, train_dataset=Dataset.from_list(rows),
                      data_collator=counting_collator)
    tick = time.perf_counter()
    output = trainer.train()
    epoch_s = time.perf_counter() - tick
    num_label_tokens = sum(sum(1 for x in e["labels"][1:] if x != -100) for e in train_examples)
    steps = output.global_step
    used = steps * args.batch  # drop_last: the examples the epoch trained on
    loss = eval_loss_of(model.cpu(), eval_examples, tokenizer.pad_token_id)
    print(json.dumps({"epoch_s": epoch_s, "steps": steps, "examples": used,
                      "label_tokens": round(num_label_tokens * used / len(train_examples)),
                      "eval_loss": loss, "eval_ppl": math.exp(loss), "process_s": time.perf_counter() - start,
                      "computed_tokens": computed["tokens"], "real_tokens": computed["real_tokens"],
                      "train_loss": output.training_loss}))


if __name__ == "__main__":
    main()
