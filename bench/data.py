"""The data every vs-Trainer run sees: shardtune's own loading (same prompts, labels and examples)."""

from __future__ import annotations

import argparse

import torch

from shardtune.config.flags import config_from
from shardtune.config.schema import TrainConfig
from shardtune.data.batching import collate_padding
from shardtune.model.loss import num_label_tokens, token_loss_sum


def bench_config(
    model: str, num_train: int, num_validation: int, samsum: str, context_length: int, chatter: bool = False
) -> TrainConfig:
    cfg = config_from(model_name=model, context_length=context_length)
    if samsum:
        cfg.data.dataset = "samsum_dataset"
        cfg.data.samsum_dataset.data_path = samsum
    else:
        cfg.data.synthetic_dialogues.num_train = num_train
        cfg.data.synthetic_dialogues.num_validation = num_validation
        cfg.data.synthetic_dialogues.chatter = chatter
    return cfg


def dataset_flags(num_train: int, num_validation: int, samsum: str, chatter: bool = False) -> list[str]:
    if samsum:
        return ["--dataset", "samsum_dataset", "--samsum_dataset.data_path", samsum]
    return [
        "--synthetic_dialogues.num_train",
        str(num_train),
        "--synthetic_dialogues.num_validation",
        str(num_validation),
        "--synthetic_dialogues.chatter",
        str(chatter).lower(),
    ]


def mean_example_length(cfg: TrainConfig) -> float:
    from shardtune import data
    from shardtune.model.loading import load_tokenizer

    examples, _ = data.load_examples(cfg, load_tokenizer(cfg.model.name), "train")
    return sum(len(e["input_ids"]) for e in examples) / len(examples)


@torch.no_grad()
def eval_loss_of(model: torch.nn.Module, examples: list[dict], pad_id: int, batch_size: int = 1) -> float:
    """Token-weighted eval loss, the same definition shardtune's evaluation writes to metrics.jsonl."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = collate_padding(examples[start : start + batch_size], pad_id)
        total += float(token_loss_sum(model, batch, torch.device("cpu")))
        count += num_label_tokens(batch["labels"])
    model.train()
    return total / count


# -- what the peers' scripts (bench/hf_trainer.py, bench/trl_trainer.py) share --------------------------------------
def peer_parser(description: str) -> argparse.ArgumentParser:
    """The flags of a peer's one-epoch script; the script adds its batch flags."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", required=True)
    ap.add_argument("--num_train", type=int, required=True)
    ap.add_argument("--num_validation", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--samsum", default="")
    ap.add_argument("--chatter", action="store_true")
    ap.add_argument("--context_length", type=int, default=1024)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: bf16 mixed precision")
    ap.add_argument("--max_steps", type=int, default=-1, help="stop after N steps (-1: one epoch)")
    ap.add_argument("--optim", default="adamw_torch_fused", choices=OPTIMIZERS, help="TrainingArguments.optim")
    ap.add_argument("--out", required=True)
    return ap


def peer_inputs(args: argparse.Namespace):
    """(tokenizer, train examples, eval examples, model): shardtune's rows, tokenised once, and the model in fp32
    with SDPA attention, as each peer gets them."""
    from transformers import AutoModelForCausalLM

    from shardtune import data
    from shardtune.model.loading import load_tokenizer

    cfg = bench_config(args.model, args.num_train, args.num_validation, args.samsum, args.context_length, args.chatter)
    tokenizer = load_tokenizer(args.model)
    train_examples, _ = data.load_examples(cfg, tokenizer, "train")
    eval_examples, _ = data.load_examples(cfg, tokenizer, "validation")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    return tokenizer, train_examples, eval_examples, model


# AdamW as every tool may run it: torch's fused kernel (Trainer's and TRL's default optim, and 5x torch's per-tensor
# loop on a 2-core CPU at 21M parameters: 63 vs 319 ms a step), or that loop (shardtune's llama-cookbook default)
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")


def peer_training_arguments(args: argparse.Namespace, batch: int) -> dict:
    """The TrainingArguments both peers run with: one epoch (or --max_steps), constant lr, clipping at 1, no saving,
    no evaluation, no logging, no gradient checkpointing (TRL's SFTConfig turns it on by default: off is its fastest
    setting, as shardtune's runs have it off); bf16 mixed precision on cuda."""
    return dict(
        output_dir=args.out,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_train_epochs=1,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim=args.optim,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        seed=42,
        use_cpu=args.device == "cpu",
        bf16=args.device == "cuda",
        dataloader_num_workers=0,
        dataloader_drop_last=True,
        save_strategy="no",
        eval_strategy="no",
        logging_steps=10**9,
        report_to=[],
        disable_tqdm=True,
    )
