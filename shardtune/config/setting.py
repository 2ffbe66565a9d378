"""How a field of the canonical config is declared (:func:`setting` and its metadata), and the error every check
raises. The groups' dataclasses are in shardtune.config.schema (and the modules it gathers: data_settings,
peft_settings, dpo_settings)."""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import field, is_dataclass
from typing import Any


class ConfigError(ValueError):
    """A user-facing configuration error: one line naming the value and the fix."""


def setting(default: Any, help: str, **meta: Any) -> Any:
    """A field of the config: its default and its metadata (help, choices, at_least / above / below, interval,
    needs (a boolean setting that must be on when this one is set), affects, data_cache, reference, secret)."""
    if isinstance(default, (list, dict)) or is_dataclass(default):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


RUN = {"affects": "run"}
OPTIMIZER = {"affects": "optimizer"}
CACHE = {"data_cache": True}
REFERENCE = {"reference": True}


def interval_steps(value: float, total_steps: int) -> int:
    """An interval setting in optimizer steps: a fraction of the run's steps in (0, 1), rounded up (Trainer's rule for
    --save_steps / --eval_steps / --logging_steps / --warmup_steps below 1), else whole steps; 0: none."""
    if 0 < value < 1:
        return max(1, math.ceil(value * total_steps))
    return int(value)
