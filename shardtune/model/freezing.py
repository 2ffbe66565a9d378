"""Parts of a model that keep their weights in full fine-tuning.

- --freeze_layers (llama-cookbook's freeze_transformer_layers): the first decoder layers of the language model.
- A vision-language model's parts, by the peers' names: --freeze_vision_tower, --freeze_multi_modal_projector and
  --freeze_language_model (LLaMA-Factory's), --freeze_LLM_only (llama-cookbook's: the language model frozen except
  mllama's cross-attention layers, which with the tower and projector train; a family without cross-attention
  layers has its whole language model frozen).

check_freezing_settings(cfg, world_size)   # the settings alone (validate)
check_freeze_layers(cfg)                   # with the model's config.json
check_vision_freezing(cfg)                 # with the model's structure (built on the meta device)
apply_freezing(model, cfg)                 # between build_model and strategy.wrap

Refused with an adapter: --use_peft freezes the whole base already (the tower and projector included: LoRA goes on
the language model only), so a freezing flag beside it would ask for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardtune.config.flags import spelling_of
from shardtune.config.schema import ConfigError, TrainConfig

# the vision-language freezing settings, in the order their parts are named
VISION_FREEZING = (
    "model.freeze_vision_tower",
    "model.freeze_multi_modal_projector",
    "model.freeze_language_model",
    "model.freeze_llm_only",
)
# the module names transformers' vision-language families give the projector between tower and language model
# (LLaVA, Gemma 3, mllama: multi_modal_projector; Idefics3 / SmolVLM: connector; Qwen2-VL / 2.5-VL: the tower's merger)
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "merger")


def _asked(cfg: TrainConfig) -> list[str]:
    return [key for key in VISION_FREEZING if getattr(cfg.model, key.split(".", 1)[1])]


def check_freezing_settings(cfg: TrainConfig, world_size: int) -> None:
    """Freezing settings that cannot go together (or with an adapter), from the settings alone."""
    asked = _asked(cfg)
    if asked and cfg.peft.method:
        raise ConfigError(
            f"{spelling_of(cfg, asked[0])} applies to full fine-tuning; with --use_peft the whole base model (vision "
            "tower and projector included) is frozen already: drop one of them"
        )
    whole, except_cross = cfg.model.freeze_language_model, cfg.model.freeze_llm_only
    if whole and except_cross:
        raise ConfigError(
            f"{spelling_of(cfg, 'model.freeze_language_model')} freezes the whole language model and "
            f"{spelling_of(cfg, 'model.freeze_llm_only')} all of it but the cross-attention layers: drop one of them"
        )
    if cfg.model.freeze_layers and (whole or except_cross):
        flag = spelling_of(cfg, "model.freeze_language_model" if whole else "model.freeze_llm_only")
        raise ConfigError(
            f"{spelling_of(cfg, 'model.freeze_layers')} freezes decoder layers of the language model, which "
            f"{flag} freezes already: drop {spelling_of(cfg, 'model.freeze_layers')}"
        )


def check_freeze_layers(cfg: TrainConfig) -> None:
    """The layers to freeze exist in the model (its config.json's depth; a vision-language model's: its text
    model's)."""
    from transformers import AutoConfig

    if not cfg.model.freeze_layers:
        return
    config = AutoConfig.from_pretrained(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code)
    depth = getattr(config.get_text_config(), "num_hidden_layers", None)
    if depth is not None and cfg.model.freeze_layers > depth:
        raise ConfigError(
            f"{spelling_of(cfg, 'model.freeze_layers')} {cfg.model.freeze_layers} exceeds the {depth} "
            f"decoder layers of {cfg.model.name}: pass at most {depth}"
        )


def apply_freezing(model: nn.Module, cfg: TrainConfig) -> None:
    """Every freezing setting of the run, on the model as built (before adapters and sharding)."""
    freeze_first_layers(model, cfg)
    freeze_vision_parts(model, cfg)


def freeze_first_layers(model: nn.Module, cfg: TrainConfig) -> None:
    """The first model.freeze_layers decoder layers keep their weights; embeddings, the other layers and the head
    train. On a vision-language model the layers are its language model's (the tower's blocks are not counted)."""
    from shardtune.runtime.distributed import print0

    if not cfg.model.freeze_layers:
        return
    for layer in language_model_layers(model)[: cfg.model.freeze_layers]:
        layer.requires_grad_(False)
    print0(f"freeze_layers: the first {cfg.model.freeze_layers} decoder layers are frozen")


def language_model_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of the language model, in order (a vision-language model's tower blocks left out)."""
    from shardtune.model.structure import decoder_layers

    if getattr(getattr(model, "config", None), "vision_config", None) is None:
        return decoder_layers(model)
    return list(model.get_decoder().layers)


@dataclass(frozen=True)
class VisionParts:
    """A vision-language model's parameters by part, as names of ``model.named_parameters()``: the parts partition
    them; ``cross_attention`` is the language model's cross-attention layers (mllama's; empty for other families)."""

    vision_tower: frozenset[str]
    multi_modal_projector: frozenset[str]
    language_model: frozenset[str]
    cross_attention: frozenset[str]


def vision_parts(model: nn.Module) -> VisionParts:
    """The tower (``get_encoder(modality="image")``, its merger excepted), the projector (PROJECTOR_NAMES), the
    language model (``get_decoder()`` and the output embeddings) and its cross-attention layers (the text config's
    ``cross_attention_layers``)."""
    modules = {id(module): name for name, module in model.named_modules()}
    params = [name for name, _ in model.named_parameters()]

    def under(module: nn.Module | None) -> frozenset[str]:
        prefix = modules.get(id(module)) if module is not None and module is not model else None
        if prefix is None:
            return frozenset()
        return frozenset(p for p in params if p.startswith(prefix + "."))

    encoder = model.get_encoder(modality="image")
    tower = (
        under(encoder) if encoder is not model and encoder is not getattr(model, "base_model", None) else frozenset()
    )
    projector: frozenset[str] = frozenset()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTOR_NAMES:
            projector |= under(module)
    decoder = model.get_decoder()
    language = under(decoder) | under(model.get_output_embeddings())
    cross = frozenset()
    indices = getattr(model.config.get_text_config(), "cross_attention_layers", None) or ()
    for index in indices:
        cross |= under(decoder.layers[index])
    return VisionParts(tower - projector, projector - language, language, cross)


def frozen_parameters(model: nn.Module, cfg: TrainConfig) -> frozenset[str]:
    """The names of the parameters the vision-language freezing settings keep as they are."""
    if not _asked(cfg):
        return frozenset()
    parts = vision_parts(model)
    frozen: frozenset[str] = frozenset()
    if cfg.model.freeze_vision_tower:
        frozen |= parts.vision_tower
    if cfg.model.freeze_multi_modal_projector:
        frozen |= parts.multi_modal_projector
    if cfg.model.freeze_language_model:
        frozen |= parts.language_model
    if cfg.model.freeze_llm_only:
        frozen |= parts.language_model - parts.cross_attention
    return frozen


def freeze_vision_parts(model: nn.Module, cfg: TrainConfig) -> None:
    from shardtune.runtime.distributed import print0

    frozen = frozen_parameters(model, cfg)
    if not frozen:
        return
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    parts = ", ".join(spelling_of(cfg, key) for key in _asked(cfg))
    print0(f"freezing ({parts}): {len(frozen)} parameter tensors keep their weights")


def check_vision_freezing(cfg: TrainConfig) -> None:
    """The vision-language freezing settings name parts the model has, and leave something to train: checked on
    the model's structure (built on the meta device: no weights read)."""
    from shardtune.model.loading import build_model_on_meta, is_vision_model

    asked = _asked(cfg)
    if not asked:
        return
    flag = spelling_of(cfg, asked[0])
    if not is_vision_model(cfg.model.name, cfg.model.trust_remote_code):
        raise ConfigError(
            f"{flag} applies to vision-language models, and {cfg.model.name} has no vision tower (its config has no "
            "vision_config): drop the flag (--freeze_layers N freezes a text model's first decoder layers)"
        )
    model = build_model_on_meta(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code)
    parts = vision_parts(model)
    for key in (k for k in asked if k in VISION_FREEZING[:2]):  # the parts a family may lack
        if not getattr(parts, key.split(".", 1)[1].removeprefix("freeze_")):
            raise ConfigError(
                f"{spelling_of(cfg, key)}: no such part was found in {type(model).__name__} (tower: "
                f"get_encoder(modality='image'); projector: a module named {' / '.join(PROJECTOR_NAMES)}): drop it"
            )
    frozen = frozen_parameters(model, cfg)
    if all(name in frozen for name, _ in model.named_parameters()):
        raise ConfigError(
            f"{' '.join(spelling_of(cfg, key) for key in asked)} leave no weight of {cfg.model.name} to train: "
            "drop one of them"
        )
