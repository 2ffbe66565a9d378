"""--freeze_layers (llama-cookbook's freeze_transformer_layers): the first decoder layers keep their weights.

check_freeze_layers(cfg)          # before any process group, with the model's name resolved
freeze_first_layers(model, cfg)   # between build_model and strategy.wrap
"""

from __future__ import annotations

from torch import nn

from shardtune.config.flags import spelling_of
from shardtune.config.schema import ConfigError, TrainConfig


def check_freeze_layers(cfg: TrainConfig) -> None:
    """The layers to freeze exist in the model (its config.json's depth)."""
    from transformers import AutoConfig

    if not cfg.model.freeze_layers:
        return
    config = AutoConfig.from_pretrained(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code)
    depth = getattr(config, "num_hidden_layers", None)
    if depth is not None and cfg.model.freeze_layers > depth:
        raise ConfigError(
            f"{spelling_of(cfg, 'model.freeze_layers')} {cfg.model.freeze_layers} exceeds the {depth} "
            f"decoder layers of {cfg.model.name}: pass at most {depth}"
        )


def freeze_first_layers(model: nn.Module, cfg: TrainConfig) -> None:
    """The first model.freeze_layers decoder layers keep their weights; embeddings, the other layers and the head
    train."""
    from shardtune.model.structure import decoder_layers
    from shardtune.runtime.distributed import print0

    if not cfg.model.freeze_layers:
        return
    for layer in decoder_layers(model)[: cfg.model.freeze_layers]:
        layer.requires_grad_(False)
    print0(f"freeze_layers: the first {cfg.model.freeze_layers} decoder layers are frozen")
