"""shardtune: fine-tune Llama-family models on one GPU, all GPUs of a machine, or many machines.

``shardtune sft ...`` is the command line; ``from shardtune import SFTTrainer, SFTConfig`` (DPO, GRPO alike) the Python
face in TRL's shape (shardtune.api), imported on first use (the command line does not pay for it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "SFTConfig", "SFTTrainer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from shardtune import api

        return getattr(api, name)
    raise AttributeError(f"module 'shardtune' has no attribute {name!r}")
