"""``RLOOConfig`` / ``RLOOTrainer``: TRL 1.16's RLOO trainer in TRL's shape, on ``shardtune rloo``'s objective
(shardtune.training.objectives.grpo.rloo): GRPO's keyed sampling and reward functions with the leave-one-out
baseline and RLOO's sequence-level clipped loss.

Beyond TRL's: ``RLOOTrainer(tools=[...])`` and ``RLOOConfig.max_tool_calling_iterations`` (GRPOTrainer's and
GRPOConfig's, which TRL's RLOO has not): shardtune's RLOO samples as its GRPO does, tools included (docs/rloo.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from shardtune.api.configs import _TrlModelArguments, help_of, with_help
from shardtune.api.trainer import GRPO_REFUSED, GRPOTrainer, _refuse_streamed, _Trainer, given


@with_help
@dataclass
class RLOOConfig(_TrlModelArguments):
    """TRL 1.16's ``RLOOConfig`` for :class:`RLOOTrainer` (and GRPOConfig's max_tool_calling_iterations)."""

    objective: ClassVar[str] = "rloo"

    learning_rate: float = field(default=1e-6, metadata={"help": help_of("learning_rate")})
    disable_dropout: bool = False
    # TRL's override of TrainingArguments' bool
    remove_unused_columns: bool | None = field(  # type: ignore[assignment]
        default=False, metadata={"help": help_of("remove_unused_columns")}
    )
    num_generations: int | None = 2
    num_generations_eval: int | None = None
    max_completion_length: int | None = 512
    ds3_gather_for_generation: bool = True
    shuffle_dataset: bool | None = True
    pad_to_multiple_of: int | str | None = "auto"
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    generation_kwargs: dict | str | None = None
    chat_template_kwargs: dict | str | None = None
    repetition_penalty: float = 1.0
    cache_implementation: str | None = None
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_model_impl: str = "vllm"
    vllm_enable_sleep_mode: bool = False
    vllm_structured_outputs_regex: str | None = None
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0
    vllm_group_port: int = 51216
    vllm_gpu_memory_utilization: float = 0.3
    vllm_max_model_length: int | None = None
    vllm_tensor_parallel_size: int = 1
    beta: float = 0.05
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    reward_weights: list[float] | None = None
    normalize_advantages: bool = False
    reward_clip_range: tuple[float, float] | None = None
    mask_truncated_completions: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    log_completions: bool = False
    log_multimodal: bool = True
    num_completions_to_print: int | None = None
    log_unique_prompts: bool = False
    use_transformers_continuous_batching: bool = False
    transformers_continuous_batching_config: dict | str | None = None
    use_transformers_paged: bool = False
    # GRPOConfig's: shardtune's RLOO samples with tools as its GRPO does
    max_tool_calling_iterations: int | None = None

    def _trl_post_init(self) -> None:
        """TRL's derived generation sizes (an unset one reads what it reads in TRL)."""
        super()._trl_post_init()
        per_step = self.per_device_train_batch_size * self.world_size
        size, steps = self.generation_batch_size, self.steps_per_generation
        if size is None and steps is None:
            self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = per_step * self.steps_per_generation
        elif size is not None and steps is None and size % per_step == 0:
            self.steps_per_generation = size // per_step
        elif size is None and steps is not None:
            self.generation_batch_size = per_step * steps


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
