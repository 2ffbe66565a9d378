"""``RewardConfig`` / ``RewardTrainer``: TRL 1.16's reward-model trainer in TRL's shape, on ``shardtune reward``'s
objective (shardtune.training.objectives.reward): a one-label score head on the causal LM, the Bradley-Terry loss on
preference pairs, written as an AutoModelForSequenceClassification directory (or a SEQ_CLS adapter carrying the
head)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from shardtune.api.configs import _TrlArguments, help_of, with_help
from shardtune.api.trainer import REFUSED, _Trainer, given
from shardtune.config.schema import ConfigError


@with_help
@dataclass
class RewardConfig(_TrlArguments):
    """TRL 1.16's ``RewardConfig`` for :class:`RewardTrainer`."""

    objective: ClassVar[str] = "reward"

    learning_rate: float = field(default=1e-4, metadata={"help": help_of("learning_rate")})
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    chat_template_path: str | None = None
    disable_dropout: bool = True
    dataset_num_proc: int | None = None
    eos_token: str | None = None
    max_length: int | None = 1024
    pad_to_multiple_of: int | str | None = "auto"
    center_rewards_coefficient: float | None = None
    activation_offloading: bool = False
    pad_token: str | None = None


def _one_label(model: Any) -> None:
    """TRL's rule for a model object: a reward model outputs one scalar per sequence."""
    if isinstance(model, (str, os.PathLike)):
        return
    labels = getattr(getattr(model, "config", None), "num_labels", None)
    if labels != 1:
        raise ConfigError(
            f"model: a {type(model).__name__} with num_labels={labels}: a reward model has num_labels=1 (one scalar "
            "per sequence): load it with AutoModelForSequenceClassification.from_pretrained(..., num_labels=1), or "
            "pass its directory or name (the score head is then added, as TRL adds it)"
        )


class RewardTrainer(_Trainer):
    """TRL's ``RewardTrainer`` on shardtune (same constructor names). ``model``: a causal LM's directory, hub id or
    preset (the one-label score head is added, drawn from ``args.seed``), or a sequence-classification model with
    num_labels=1 (a directory or an object)."""

    objective = "reward"
    refusals = REFUSED

    def __init__(
        self,
        model: Any,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Any = None,
        quantization_config: Any = None,
        peft_config: Any = None,
    ) -> None:
        if train_dataset is None:
            raise ConfigError("train_dataset is required: pass the preference pairs (chosen / rejected)")
        _one_label(model)
        super().__init__(**given(locals()))

    def _default_args(self, model: Any) -> Any:
        """TRL's default when a script passes no args: ``<model's name>-Reward`` as output_dir."""
        name = str(model) if isinstance(model, (str, os.PathLike)) else getattr(model.config, "_name_or_path", "")
        name = Path(name.rstrip("/")).name.removeprefix("preset:") or "model"
        return RewardConfig(output_dir=f"{name}-Reward")

    @property
    def model(self) -> Any:
        """After train(): the trained reward model (a PeftModel with the SEQ_CLS adapter for adapter runs), loaded on
        the CPU from the run's published output; before: the starting model with its score head (drawn from the
        run's seed, as the run draws it)."""
        if self._model is None:
            self._model = _load_published(self.output_dir) if self._trained else _load_starting(self.config)
        return self._model


def _load_published(folder: Path) -> Any:
    if (folder / "adapter_config.json").is_file():
        from peft import AutoPeftModelForSequenceClassification

        return AutoPeftModelForSequenceClassification.from_pretrained(str(folder), num_labels=1)
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(folder))


def _load_starting(cfg: Any) -> Any:
    from shardtune.model.loading import load_model, model_head, resolve_model_name

    trust = cfg.model.trust_remote_code
    return load_model(
        resolve_model_name(cfg.model.name), trust_remote_code=trust, head=model_head(cfg), seed=cfg.train.seed
    )


__all__ = ["RewardConfig", "RewardTrainer"]
