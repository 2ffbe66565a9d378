"""The data every vs-Trainer run sees: shardtune's own loading (same prompts, labels and examples)."""

from __future__ import annotations

import torch

from shardtune.config.schema import TrainConfig
from shardtune.data.batching import collate_padding
from shardtune.model.loss import num_label_tokens, token_loss_sum


def bench_config(model: str, num_train: int, num_validation: int, samsum: str, context_length: int,
                 chatter: bool = False) -> TrainConfig:
    cfg = TrainConfig(model_name=model, context_length=context_length)
    if samsum:
        cfg.dataset = "samsum_dataset"
        cfg.samsum_dataset.data_path = samsum
    else:
        cfg.synthetic_dialogues.num_train = num_train
        cfg.synthetic_dialogues.num_validation = num_validation
        cfg.synthetic_dialogues.chatter = chatter
    return cfg


def dataset_flags(num_train: int, num_validation: int, samsum: str, chatter: bool = False) -> list[str]:
    if samsum:
        return ["--dataset", "samsum_dataset", "--samsum_dataset.data_path", samsum]
    return ["--synthetic_dialogues.num_train", str(num_train), "--synthetic_dialogues.num_validation",
            str(num_validation), "--synthetic_dialogues.chatter", str(chatter).lower()]


def mean_example_length(cfg: TrainConfig) -> float:
    from shardtune import data
    from shardtune.model.loading import load_tokenizer

    examples, _ = data.load_examples(cfg, load_tokenizer(cfg.model_name), "train")
    return sum(len(e["input_ids"]) for e in examples) / len(examples)


@torch.no_grad()
def eval_loss_of(model: torch.nn.Module, examples: list[dict], pad_id: int, batch_size: int = 1) -> float:
    """Token-weighted eval loss, the same definition shardtune's evaluation writes to metrics.jsonl."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = collate_padding(examples[start:start + batch_size], pad_id)
        total += float(token_loss_sum(model, batch, torch.device("cpu")))
        count += num_label_tokens(batch["labels"])
    model.train()
    return total / count
