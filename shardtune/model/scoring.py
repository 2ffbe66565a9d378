"""A sequence-classification model that scores text (a reward model, what ``shardtune reward`` writes), loaded for
scoring: a model directory or hub id (AutoModelForSequenceClassification), or a PEFT adapter directory whose
``modules_to_save`` carries the score head (loaded on its base, one label). Its first logit is the score; its
config names the pad token its tokenizer pads with, so each row is read at its last non-pad token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtune.config.schema import ConfigError
from shardtune.model.peft import ADAPTER_CONFIG, read_adapter_config


def is_adapter(spec: str) -> bool:
    return (Path(spec).expanduser() / ADAPTER_CONFIG).is_file()


def check_scoring_model(spec: str, flag: str) -> None:
    """Before launch: ``spec`` is a model directory or hub id, or an adapter directory whose base is one (one line
    naming the problem otherwise)."""
    from shardtune.model.loading import check_model_source

    if not is_adapter(spec):
        check_model_source(spec, flag, False)
        return
    adapter = read_adapter_config(spec, f"--{flag}")
    base = adapter.get("base_model_name_or_path") or ""
    if not base:
        raise ConfigError(f"--{flag} {spec}: its {ADAPTER_CONFIG} names no base model: merge it first")
    if adapter.get("task_type") != "SEQ_CLS":
        raise ConfigError(
            f"--{flag} {spec}: a {adapter.get('task_type')} adapter has no score head: pass a reward model (the "
            "output of shardtune reward, a SEQ_CLS adapter or a sequence-classification model)"
        )
    check_model_source(base, flag, False)


def load_scoring_model(spec: str, device: torch.device | None) -> tuple[nn.Module, Any]:
    """(the model in eval mode on ``device``, its tokenizer with a pad token the config names)."""
    from transformers import AutoModelForSequenceClassification

    from shardtune.model.loading import load_tokenizer

    if is_adapter(spec):
        from peft import AutoPeftModelForSequenceClassification

        model = AutoPeftModelForSequenceClassification.from_pretrained(spec, num_labels=1).merge_and_unload()
    else:
        model = AutoModelForSequenceClassification.from_pretrained(spec, num_labels=1)
    tokenizer = load_tokenizer(spec, False)  # an adapter directory holds the tokenizer it was trained with
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval(), tokenizer
