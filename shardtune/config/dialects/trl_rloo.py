"""TRL's RLOOConfig names that GRPOConfig does not have (``trl rloo``), as shardtune rloo's own settings
(shardtune.config.rloo_settings). The names RLOOConfig shares with GRPOConfig, with the same meaning, are GRPO's
spellings (trl_grpo): they set GRPO's section, which shardtune rloo reads."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from shardtune.config.dialects import Pairs, Spelling, text
from shardtune.config.rloo_settings import RlooConfig
from shardtune.config.schema import ConfigError


def _clip_range(value: Any) -> Pairs:
    """TRL's reward_clip_range: (min, max) -- a tuple or list, or on the command line "min,max" / "(min, max)";
    None: no clipping."""
    if value is None or text(value).lower() in ("none", "null", ""):
        return [("rloo.reward_clip_range", [])]
    parts = value if isinstance(value, (list, tuple)) else re.split(r"[,\s]+", text(value).strip("()[] "))
    try:
        bounds = [float(v) for v in parts if text(v)]
    except ValueError:
        bounds = []
    if len(bounds) != 2 or bounds[0] > bounds[1]:
        raise ConfigError(f"--reward_clip_range {value!r}: give two numbers, min then max (-1,1), or drop the flag")
    return [("rloo.reward_clip_range", bounds)]


SPELLINGS: dict[str, Spelling] = {
    **{f.name: Spelling(f"rloo.{f.name}", f.metadata["help"]) for f in fields(RlooConfig)},
    "reward_clip_range": Spelling(
        "rloo.reward_clip_range", RlooConfig.__dataclass_fields__["reward_clip_range"].metadata["help"], _clip_range
    ),
}
