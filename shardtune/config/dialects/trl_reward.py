"""TRL's RewardConfig names (``trl reward``), as shardtune reward's settings (shardtune.config.reward_settings), and
the adapter task type a one-label head trains with (ModelConfig's ``--lora_task_type SEQ_CLS``)."""

from __future__ import annotations

from typing import Any

from shardtune.config.dialects import Pairs, Spelling, text
from shardtune.config.objectives import OBJECTIVES, registration
from shardtune.config.reward_settings import RewardModelConfig
from shardtune.config.schema import ConfigError, TrainConfig

STATE = "trl:"  # trl.py's state keys: settled by its finish, which calls :func:`settle`
# peft's task types, by the model head an objective trains (Registration.model_head)
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "score": "SEQ_CLS"}


def _center_rewards_coefficient(value: Any) -> Pairs:
    """TRL's None (no centring term): shardtune's 0."""
    given = text(value).lower()
    return [("reward.center_rewards_coefficient", 0.0 if given in ("none", "null", "") else value)]


def lora_task_type(value: Any) -> Pairs:
    """ModelConfig's --lora_task_type: CAUSAL_LM (TRL's default) or SEQ_CLS (TRL's advice for reward models): the
    adapter's task type is the head the objective trains (settled by :func:`settle`)."""
    given = text(value).upper()
    if given in ("CAUSAL_LM", "NONE"):
        return []  # the default: for shardtune reward the adapter is SEQ_CLS all the same (docs/reward.md)
    if given == "SEQ_CLS":
        return [(STATE + "lora_task_type", given)]
    raise ConfigError(
        f"--lora_task_type {value} is not built: shardtune trains CAUSAL_LM adapters (sft, dpo, grpo ...) and SEQ_CLS "
        "adapters (shardtune reward's score head): pass one of those, or drop the flag"
    )


SPELLINGS: dict[str, Spelling] = {
    "center_rewards_coefficient": Spelling(
        "reward.center_rewards_coefficient",
        RewardModelConfig.__dataclass_fields__["center_rewards_coefficient"].metadata["help"],
        _center_rewards_coefficient,
    ),
}


def settle(cfg: TrainConfig, given: dict[str, Any]) -> None:
    """--lora_task_type SEQ_CLS: an adapter for a one-label score head, which only an objective with that head
    trains."""
    task = given.get("lora_task_type")
    head = registration(cfg.objective).model_head
    if task and task != TASK_TYPES.get(head):
        owners = " / ".join(name for name, entry in OBJECTIVES.items() if TASK_TYPES.get(entry.model_head) == task)
        raise ConfigError(
            f"--lora_task_type {task} trains a sequence-classification head (shardtune {owners}), but shardtune "
            f"{cfg.objective} trains a {TASK_TYPES.get(head, head)} model: run shardtune {owners}, or drop the flag"
        )
