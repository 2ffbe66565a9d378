"""One epoch of TRL's SFTTrainer on the same rows as shardtune, at its fastest setting on CPU: packing with the
``bfd`` strategy (best-fit decreasing blocks of ``--pack_length`` tokens, padding-free rows with position ids),
completion-only loss (TRL's own ``completion_mask`` column, built from shardtune's labels: the summary tokens).
Single process, single device. Prints one JSON line; ``epoch_s`` is ``trainer.train()`` only.

    python -m bench.trl_trainer --model DIR --num_train 200 --num_validation 50 --pack_batch 2 --pack_length 512 \
        --lr 1e-3 --out DIR [--samsum F] [--chatter] [--device cpu|cuda] [--max_steps N]

On ``cuda`` the Trainer places the model and computes in bf16 mixed precision, as shardtune does by default.

Needs ``pip install shardtune[bench]`` (trl, pinned).
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
    ap.add_argument("--pack_batch", type=int, required=True, help="packed blocks per step")
    ap.add_argument("--pack_length", type=int, required=True, help="tokens per packed block (TRL's max_length)")
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--samsum", default="")
    ap.add_argument("--chatter", action="store_true")
    ap.add_argument("--context_length", type=int, default=1024)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: bf16 mixed precision")
    ap.add_argument("--max_steps", type=int, default=-1, help="stop after N steps (-1: one epoch)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    start = time.perf_counter()

    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from bench.data import bench_config, eval_loss_of
    from shardtune import data
    from shardtune.model.loss import IGNORE_INDEX
    from shardtune.model.loading import load_tokenizer

    cfg = bench_config(args.model, args.num_train, args.num_validation, args.samsum, args.context_length,
                       args.chatter)
    tokenizer = load_tokenizer(args.model)
    train_examples, _ = data.load_examples(cfg, tokenizer, "train")
    eval_examples, _ = data.load_examples(cfg, tokenizer, "validation")
    # shardtune's rows, tokenised once: TRL takes them as processed (input_ids) and builds labels from the
    # completion mask itself (completion_only_loss)
    rows = [{"input_ids": e["input_ids"], "completion_mask": [int(x != IGNORE_INDEX) for x in e["labels"]]}
            for e in train_examples]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    config = SFTConfig(
        output_dir=args.out, per_device_train_batch_size=args.pack_batch, gradient_accumulation_steps=1,
        num_train_epochs=1, max_steps=args.max_steps, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, optim="adamw_torch", max_grad_norm=1.0, seed=42,
        use_cpu=args.device == "cpu", bf16=args.device == "cuda", dataloader_num_workers=0, dataloader_drop_last=True,
        save_strategy="no", eval_strategy="no", logging_steps=10**9, report_to=[], disable_tqdm=True,
        packing=True, packing_strategy="bfd", padding_free=True, max_length=args.pack_length,
        completion_only_loss=True, dataset_num_proc=None)
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    computed = {"tokens": 0, "label_tokens": 0}
    collate = trainer.data_collator

    def counting_collator(features):  # what the model computes on, and the tokens the loss counts
        batch = collate(features)
        computed["tokens"] += batch["input_ids"].numel()
        computed["label_tokens"] += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        return batch

    trainer.data_collator = counting_collator
    tick = time.perf_counter()
    output = trainer.train()
    epoch_s = time.perf_counter() - tick
    loss = eval_loss_of(model.cpu(), eval_examples, tokenizer.pad_token_id)
    print(json.dumps({"epoch_s": epoch_s, "steps": output.global_step, "examples": len(rows),
                      "label_tokens": computed["label_tokens"], "computed_tokens": computed["tokens"],
                      "eval_loss": loss, "eval_ppl": math.exp(loss), "process_s": time.perf_counter() - start,
                      "train_loss": output.training_loss, "trl": trl.__version__}))


if __name__ == "__main__":
    main()
