"""Checks of the model's structure before launch: what FSDP and --compile need to find in it.

Both wrap the model's decoder layers, which they find from its class (FSDP: the classes in ``_no_split_modules``;
--compile: the ``model.layers`` list). The model is built on the meta device (no memory, no weights read), so a
model they cannot handle is reported in one line before any process starts, not by a traceback on every rank.
"""

from __future__ import annotations

from shardtune.config import ConfigError, TrainConfig


def check_model_structure(cfg: TrainConfig) -> None:
    if not (cfg.enable_fsdp or cfg.compile):
        return
    from shardtune.models import build_model_on_meta

    model = build_model_on_meta(cfg.model_name)
    if cfg.enable_fsdp:
        from shardtune.parallel.fsdp import decoder_layers

        try:
            decoder_layers(model)
        except ValueError as e:
            raise ConfigError(f"--enable_fsdp: {e}; or train it with DDP or --enable_deepspeed, which need no "
                              "layer class") from None
    if cfg.compile:
        from shardtune.speed import decoder_layers

        try:
            decoder_layers(model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
