"""shardtune's Python face, in TRL's shape: ``from shardtune import SFTTrainer, SFTConfig`` in a script written for
TRL (``from trl import ...``) runs it on shardtune, under ``python``, ``torchrun`` (one node or several) or SLURM's
``srun torchrun``, with the guarantees of the command line (same effective batch -> same steps, verified
checkpoints). The configs take TRL's field names with TRL's defaults and go through the same canonical config and
checks as ``shardtune sft`` / ``dpo`` / ``grpo``; docs/python-api.md says what is honoured and what is refused."""

from shardtune.api.configs import DPOConfig, GRPOConfig, SFTConfig
from shardtune.api.trainer import DPOTrainer, GRPOTrainer, SFTTrainer

__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "SFTConfig", "SFTTrainer"]
