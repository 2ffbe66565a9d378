"""Vision-language models (``AutoModelForImageTextToText``: LLaVA, Llama 3.2 Vision, Qwen2-VL, Gemma 3, Idefics3 ...):
how a run tells one (its config has a vision tower), and its processor (tokenizer + image processor, saved with the
model so that its outputs load as they were given)."""

from __future__ import annotations

import functools
from typing import Any

from shardtune.config.schema import ConfigError, TrainConfig

IMAGE_TEXT = "image_text"  # shardtune.model.loading.MODEL_HEADS: a vision-language model's own head


@functools.lru_cache(maxsize=16)
def is_vision_model(name_or_path: str, trust_remote_code: bool = False) -> bool:
    """Whether the model's config has a vision tower (``vision_config``): then it loads as AutoModelForImageTextToText.
    An unreadable config is not one (the model checks say why elsewhere)."""
    from shardtune.model.loading import auto_config, resolve_model_name

    try:
        config = auto_config(resolve_model_name(name_or_path), trust_remote_code)
    except Exception:  # noqa: BLE001 - the model checks report a model that cannot be read, in their words
        return False
    return getattr(config, "vision_config", None) is not None


def vision_run(cfg: TrainConfig) -> bool:
    return bool(cfg.model.name) and is_vision_model(cfg.model.name, cfg.model.trust_remote_code)


def load_processor(cfg: TrainConfig) -> Any:
    """The model's processor (--tokenizer_name names another folder holding one), with a pad token as the tokenizer
    gets one (shardtune.model.loading.load_tokenizer)."""
    from transformers import AutoProcessor

    from shardtune.model.loading import resolve_model_name

    source = resolve_model_name(cfg.model.tokenizer or cfg.model.name)
    try:
        processor = AutoProcessor.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure means the same fix
        raise ConfigError(
            f"{source}: its processor could not be loaded ({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
            "a vision-language model's folder needs its processor files (preprocessor_config.json, the tokenizer): "
            "save them with processor.save_pretrained(DIR)"
        ) from None
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None or not hasattr(processor, "image_processor"):
        raise ConfigError(
            f"{source}: its AutoProcessor is a {type(processor).__name__}, not a processor with a tokenizer and an "
            "image processor: save the model's processor beside it"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return processor
