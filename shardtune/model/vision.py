"""Vision-language models (``AutoModelForImageTextToText``: LLaVA, Llama 3.2 Vision, Qwen2-VL, Gemma 3, Idefics3 ...):
how a run tells one (its config has a vision tower), and its processor (tokenizer + image processor, saved with the
model so that its outputs load as they were given)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.model.loading import IMAGE_TEXT, auto_config, is_vision_model, resolve_model_name, vision_run

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
        processor = _without_videos(source, trust_remote_code)
        if processor is not None:
            return _with_pad_token(processor)
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
    return _with_pad_token(processor)


def _with_pad_token(processor: Any) -> Any:
    tokenizer = processor.tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return processor


def _without_videos(source: str, trust_remote_code: bool) -> Any:
    """A processor of images and videos (Qwen2-VL, Qwen2.5-VL ...) built without its video part, where torchvision is
    not installed: transformers makes a video processor only with torchvision (its processors then fail to load, even
    for images), and a CPU or ROCm machine often lacks a matching torchvision build. Images are processed as the
    whole processor does (the same class, image processor and template); videos are refused by the processor itself.
    None where torchvision is installed or the processor has no video part (the original error stands)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        return None
    try:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

        saved = Path(source) / "processor_config.json"
        name = json.loads(saved.read_text()).get("processor_class") if saved.is_file() else None
        if not name:
            model_type = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code).model_type
            name = PROCESSOR_MAPPING_NAMES.get(model_type) or ""
        whole = processor_class_from_name(name)
        if whole is None or "video_processor" not in whole.get_attributes():
            return None

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):  # noqa: N807
            whole.__init__(
                self, image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs
            )

        # the whole processor's name, so that what it saves names a class transformers has
        images_only = type(whole.__name__, (whole,), {"__init__": __init__, "__module__": whole.__module__})
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        return images_only(
            image_processor=AutoImageProcessor.from_pretrained(source, trust_remote_code=trust_remote_code),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
    except Exception:  # noqa: BLE001 - the original error is the one to report
        return None


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def saved_processor(folder: str | Path, trust_remote_code: bool = False) -> Any:
    """The processor saved in ``folder`` (a vision-language model's output, checkpoint or adapter), or None where the
    folder holds a tokenizer only: what an export or a merge writes beside the weights, so that its output loads
    as the run's did."""
    if not any((Path(folder) / name).is_file() for name in PROCESSOR_FILES):
        return None
    return load_processor_from(str(folder), trust_remote_code)


def forward_keywords(cfg: TrainConfig) -> frozenset[str] | None:
    """The keywords the vision-language model's forward names (what a batch may carry to it), read from its class
    before it is built; None where the class is not transformers' own (remote code: not checked)."""
    import inspect

    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    config = auto_config(resolve_model_name(cfg.model.name), cfg.model.trust_remote_code)
    try:
        model_class = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    except KeyError:
        return None
    return frozenset(inspect.signature(model_class.forward).parameters) - {"self", "kwargs"}


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


def generate_from_images(
    model: Any, processor: Any, messages: list[dict], images: list, stop_at_eos: bool = True, **sampling: Any
) -> str:
    """The model's answer to ``messages`` about ``images`` (PIL images; placed as training places them:
    shardtune.data.vision.structured_messages), greedy unless ``do_sample``; the continuation only.
    ``stop_at_eos=False`` runs all max_new_tokens steps and cuts the text at the first eos: a sharded model (FSDP2,
    ZeRO-3) needs every rank to run the same forwards."""
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
    if not stop_at_eos:
        sampling = {**sampling, "eos_token_id": None}
    with torch.no_grad():
        out = model.generate(**inputs, pad_token_id=tokenizer.pad_token_id, **sampling)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new, skip_special_tokens=True).strip()
