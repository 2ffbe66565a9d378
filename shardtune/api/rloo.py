"""``RLOOConfig`` / ``RLOOTrainer``: TRL 1.16's RLOO trainer in TRL's shape, on ``shardtune rloo``'s objective
(shardtune.training.objectives.grpo.rloo): GRPO's keyed sampling and reward functions with the leave-one-out
baseline and RLOO's sequence-level clipped loss.

Beyond TRL's: ``RLOOTrainer(tools=[...])`` and ``RLOOConfig.max_tool_calling_iterations`` (GRPOTrainer's and
GRPOConfig's, which TRL's RLOO has not): shardtune's RLOO samples as its GRPO does, tools included (docs/rloo.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from shardtune.api.configs import _SamplingArguments, with_help
from shardtune.api.trainer import GRPO_REFUSED, GRPOTrainer, _refuse_streamed, _Trainer, given


@with_help
@dataclass
class RLOOConfig(_SamplingArguments):
    """TRL 1.16's ``RLOOConfig`` for :class:`RLOOTrainer` (and GRPOConfig's max_tool_calling_iterations): GRPOConfig's
    sampling fields (_SamplingArguments) and RLOO's own."""

    objective: ClassVar[str] = "rloo"

    num_generations: int | None = 2
    beta: float = 0.05
    normalize_advantages: bool = False
    reward_clip_range: tuple[float, float] | None = None
    # GRPOConfig's: shardtune's RLOO samples with tools as its GRPO does
    max_tool_calling_iterations: int | None = None


class RLOOTrainer(GRPOTrainer):
    """TRL's ``RLOOTrainer`` on shardtune (same constructor names, and GRPOTrainer's ``tools``). ``reward_funcs`` as
    GRPOTrainer takes them: callables, strings as ``--reward_funcs`` takes them, or a list of them."""

    objective = "rloo"
    refusals = GRPO_REFUSED

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Any = None,
    ) -> None:
        _refuse_streamed(train_dataset)
        _Trainer.__init__(self, **given(locals()))


__all__ = ["RLOOConfig", "RLOOTrainer"]
