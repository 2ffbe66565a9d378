"""Vision-language models (``AutoModelForImageTextToText``: LLaVA, Llama 3.2 Vision, Qwen2-VL, Gemma 3, Idefics3 ...):
how a run tells one (its config has a vision tower), and its processor (tokenizer + image processor, saved with the
model so that its outputs load as they were given)."""

from __future__ import annotations

from typing import Any

import torch

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.model.loading import IMAGE_TEXT, is_vision_model, resolve_model_name, vision_run

__all__ = ["IMAGE_TEXT", "is_vision_model", "vision_run"]  # homed in shardtune.model.loading (it builds the model)


def load_processor(cfg: TrainConfig) -> Any:
    """The model's processor (--tokenizer_name names another folder holding one), with a pad token as the tokenizer
    gets one (shardtune.model.loading.load_tokenizer)."""
    return load_processor_from(resolve_model_name(cfg.model.tokenizer or cfg.model.name), cfg.model.trust_remote_code)


def load_processor_from(source: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
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


def language_model_targets(model: Any, targets: Any) -> Any:
    """LoRA's target modules on a vision-language model: the named layers (or every linear one, ``all-linear``) of its
    language model only, as full module names; the vision tower and projector stay as they are (trainable in full
    only when asked). ``targets`` unchanged for a text model."""
    from torch import nn

    if getattr(getattr(model, "config", None), "vision_config", None) is None:
        return targets
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    prefix = next((name for name, module in model.named_modules() if module is decoder and name), None)
    if prefix is None:
        raise ConfigError(
            f"{type(model).__name__}: its language model could not be found (get_decoder()) to put LoRA on: name the "
            "layers to adapt with full module names in --lora_target_modules"
        )
    wanted = None if targets == "all-linear" else set([targets] if isinstance(targets, str) else targets)
    names = [
        name
        for name, module in model.named_modules()
        if name.startswith(prefix + ".")
        and isinstance(module, nn.Linear)
        and (wanted is None or name.rsplit(".", 1)[-1] in wanted)
    ]
    if not names:
        raise ConfigError(f"--lora_target_modules {targets}: no such linear layer in the language model of {prefix}")
    return names


def processor_source(model_name: str, adapter: str) -> str:
    """Where a trained model's processor is: beside the adapter when it was saved there, else with the model."""
    from pathlib import Path

    return adapter if adapter and (Path(adapter) / "processor_config.json").is_file() else model_name


def generate_from_images(model: Any, processor: Any, messages: list[dict], images: list, **sampling: Any) -> str:
    """The model's answer to ``messages`` about ``images`` (PIL images; placed as training places them:
    shardtune.data.vision.structured_messages), greedy unless ``do_sample``; the continuation only."""
    from shardtune.data.vision import structured_messages

    if not getattr(processor, "chat_template", None):
        raise ConfigError("the model's processor has no chat template: train or save it with one to ask about images")
    inputs = processor.apply_chat_template(
        structured_messages(messages, images),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    ).to(next(model.parameters()).device)
    tokenizer = processor.tokenizer
    with torch.no_grad():
        out = model.generate(**inputs, pad_token_id=tokenizer.pad_token_id, **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
