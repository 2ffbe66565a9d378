"""``KTOConfig`` / ``KTOTrainer``: TRL 1.16's KTO face on shardtune kto (docs/kto.md).

The config is a dataclass on transformers' ``TrainingArguments`` with KTOConfig's fields, types and defaults (checked
field by field against trl's in tests/unit/test_kto.py), read as the command line's settings (shardtune.api.configs);
the trainer takes KTOTrainer's constructor arguments: ``ref_model`` is the reference (a model object or its
directory), else the starting weights (with ``peft_config``: the base with the adapter off).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from shardtune.api.configs import _TrlModelArguments, help_of, with_help
from shardtune.api.trainer import REFUSED, _Trainer, given, ref_model_settings


@with_help
@dataclass
class KTOConfig(_TrlModelArguments):
    """TRL 1.16's ``KTOConfig`` for :class:`KTOTrainer`."""

    objective: ClassVar[str] = "kto"

    learning_rate: float = field(default=1e-6, metadata={"help": help_of("learning_rate")})
    # TRL's override of TrainingArguments' random: its KL pairs are each batch's neighbours in the data's order
    train_sampling_strategy: str = field(default="sequential", metadata={"help": help_of("train_sampling_strategy")})
    disable_dropout: bool = True
    dataset_num_proc: int | None = None
    max_length: int | None = 1024
    pad_to_multiple_of: int | str | None = "auto"
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    loss_type: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    activation_offloading: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512


class KTOTrainer(_Trainer):
    """TRL's ``KTOTrainer`` on shardtune (same constructor names)."""

    objective = "kto"
    refusals = REFUSED

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ) -> None:
        super().__init__(**given(locals()))

    def _objective_settings(self, arguments: dict[str, Any]) -> list[tuple[str, Any]]:
        return ref_model_settings(arguments)
