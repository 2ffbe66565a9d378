"""The data pipeline: sources -> tokenised examples -> units -> per-rank micro-batches.

The training loop uses::

    check_data_config(cfg)                        # before any process group, no tokenizer
    check_context_length(cfg, tokenizer)
    examples, report = load_examples(cfg, tokenizer, "train")      # on every rank, deterministic
    units = build_units(examples, cfg)
    steps = steps_per_epoch(len(units), cfg, world_size)
    for batch in train_loader(units, cfg, rank, world_size, epoch, pad_id, start_step): ...
    eval_batches(validation_examples, cfg, dp_rank, dp_size, pad_id, row_slice)
"""

from shardtune.data.batching import (
    StepDataset,
    build_units,
    collate_flat,
    collate_padding,
    eval_batches,
    flattened,
    grouped_eval_batches,
    steps_per_epoch,
    train_loader,
)
from shardtune.data.chat import apply_tokenizer_options
from shardtune.data.report import DataError, DataReport
from shardtune.data.sources import check_context_length, check_data_config, load_examples
from shardtune.data.trl_loading import drop_absent_validation

__all__ = [
    "DataError",
    "DataReport",
    "StepDataset",
    "apply_tokenizer_options",
    "build_units",
    "check_context_length",
    "check_data_config",
    "collate_flat",
    "flattened",
    "collate_padding",
    "drop_absent_validation",
    "eval_batches",
    "grouped_eval_batches",
    "load_examples",
    "steps_per_epoch",
    "train_loader",
]
