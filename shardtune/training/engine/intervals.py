"""When things happen in a run, in optimizer steps: how many steps it trains, and the intervals of evaluations,
checkpoints and tracker rows."""

from __future__ import annotations

import importlib
import math

from shardtune import data
from shardtune.config.objectives import registration
from shardtune.config.schema import TrainConfig, interval_steps


def every(interval: float, total_steps: int) -> int:
    """An interval setting in optimizer steps (shardtune.config.schema.interval_steps): a fraction of the run's steps
    in (0, 1), rounded up (Trainer's rule for --save_steps / --eval_steps / --logging_steps below 1), else whole steps;
    0: none."""
    return interval_steps(interval, total_steps)


def epoch_steps(cfg: TrainConfig, units, dp_size: int) -> int:
    """Optimizer steps of an epoch; a streamed run (shardtune.data.streaming) is one epoch of --max_steps (the passes
    over its stream are the data position's business)."""
    if cfg.data.streaming:
        return cfg.train.max_steps
    own = registration(cfg.objective).epoch_steps  # an objective whose epoch is not units / effective batch (GRPO)
    if own:
        module, _, function = own.partition(":")
        return getattr(importlib.import_module(module), function)(cfg, len(units), dp_size)
    return data.steps_per_epoch(len(units), cfg, dp_size)


def planned_steps(cfg: TrainConfig, units, dp_size: int) -> int:
    """Optimizer steps the run trains to: --max_steps when given (TRL's: it overrides the epochs), else ceil(epochs x
    steps per epoch) (a fractional --num_train_epochs, as Trainer counts it), or --max_train_step when it is fewer."""
    if cfg.train.max_steps:
        return cfg.train.max_steps
    per_epoch = epoch_steps(cfg, units, dp_size)
    total = math.ceil(cfg.train.num_epochs * per_epoch)
    return min(total, cfg.train.stop_after_steps) if cfg.train.stop_after_steps else total


def epochs_reached(total_steps: int, steps_per_epoch: int) -> int:
    """Epochs of data order a run of ``total_steps`` reaches into (the last one perhaps in part)."""
    return math.ceil(total_steps / steps_per_epoch) if steps_per_epoch else 0
