"""llama-cookbook's train_config flags that are more than a plain setting: what each one means here.

    check_model_flags(cfg)            # before any process group, with cfg.model_name resolved
    freeze_first_layers(model, cfg)   # --freeze_layers, between build_model and strategy.wrap

Validation of the flags themselves is listed in shardtune.training.checks (``check_cookbook_flags``). Where a
flag cannot mean in shardtune what it means in the cookbook, it is refused in one line that says what to use.
The checkpoint folder (``dist_checkpoint_root_folder`` / ``dist_checkpoint_folder``) lives with the checkpoint
layout (checkpoint.checkpoint_root); ``--hsdp`` selecting hybrid sharding lives with the parser (config.py).
"""

from __future__ import annotations

import os
import sys

from torch import nn

from shardtune.config.schema import ConfigError, TrainConfig


def check_cookbook_flags(cfg: TrainConfig, world_size: int) -> None:
    if cfg.freeze_layers:
        if cfg.use_peft:
            raise ConfigError("--freeze_layers applies to full fine-tuning; with --use_peft the base model is frozen "
                              "already: drop one of them")
        if cfg.num_freeze_layers <= 0:
            raise ConfigError(f"--num_freeze_layers {cfg.num_freeze_layers} must be positive: pass the number of "
                              "decoder layers to freeze, counted from the embeddings")
    if cfg.one_gpu and world_size > 1:
        raise ConfigError(f"--one_gpu trains in one process, but this launch has {world_size}: drop --one_gpu, or "
                          "launch one process (--nproc_per_node 1)")
    if cfg.optimizer != "AdamW":
        raise ConfigError(f"--fsdp_config.optimizer {cfg.optimizer} (torchdistx's AnyPrecisionAdamW) is not "
                          "available: use AdamW (the default), with --fsdp_config.pure_bf16 for bf16 optimizer state")
    if cfg.activation_checkpointing_use_reentrant:
        raise ConfigError("--activation_checkpointing_use_reentrant true is not supported: shardtune recomputes "
                          "layers non-reentrantly (same result, works with FSDP2): drop the flag")
    if not cfg.save_optimizer and cfg.enable_deepspeed:
        raise ConfigError("--save_optimizer false is not supported with --enable_deepspeed (DeepSpeed writes its "
                          "partitions with the optimizer state): drop the flag")
    if cfg.dist_checkpoint_root_folder and not cfg.dist_checkpoint_folder:
        raise ConfigError("--dist_checkpoint_folder is empty: name the checkpoint folder (llama-cookbook writes "
                          "<dist_checkpoint_root_folder>/<dist_checkpoint_folder>-<model_name>)")


def check_model_flags(cfg: TrainConfig) -> None:
    """The flags that depend on the model: freeze_LLM_only needs a vision model, num_freeze_layers its depth."""
    from transformers import AutoConfig

    if not (cfg.freeze_layers or cfg.freeze_LLM_only):
        return
    config = AutoConfig.from_pretrained(cfg.model_name, trust_remote_code=cfg.trust_remote_code)
    if cfg.freeze_LLM_only:
        if getattr(config, "vision_config", None) is None:
            raise ConfigError(f"--freeze_LLM_only applies to vision models (llama-cookbook's mllama recipe); "
                              f"{cfg.model_name} ({config.model_type}) is text-only: drop the flag (or use "
                              "--freeze_layers --num_freeze_layers N)")
        raise ConfigError(f"--freeze_LLM_only: {cfg.model_name} is a vision model ({config.model_type}), and "
                          "shardtune trains causal language models only: use llama-cookbook for vision fine-tuning")
    depth = getattr(config, "num_hidden_layers", None)
    if depth is not None and cfg.num_freeze_layers > depth:
        raise ConfigError(f"--num_freeze_layers {cfg.num_freeze_layers} exceeds the {depth} decoder layers of "
                          f"{cfg.model_name}: pass at most {depth}")


def freeze_first_layers(model: nn.Module, cfg: TrainConfig) -> None:
    """--freeze_layers: the first num_freeze_layers decoder layers keep their weights (llama-cookbook's
    freeze_transformer_layers); embeddings, the other layers and the head train."""
    from shardtune.runtime.distributed import print0
    from shardtune.model.structure import decoder_layers

    if not cfg.freeze_layers:
        return
    for layer in decoder_layers(model)[:cfg.num_freeze_layers]:
        layer.requires_grad_(False)
    print0(f"freeze_layers: the first {cfg.num_freeze_layers} decoder layers are frozen")


# Accelerate's switches for its own rank-0 loading (the lesson's QLoRA command sets them). With both set,
# transformers' from_pretrained leaves the weights of every process but local rank 0 unloaded, expecting
# Accelerate's FSDP to broadcast them; shardtune loads (or, with --low_cpu_fsdp, broadcasts) weights itself.
ACCELERATE_LOADING_VARIABLES = ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING")


def clear_accelerate_loading_variables() -> None:
    """Remove Accelerate's loading switches from this process (and so from the workers it launches), saying so."""
    found = [name for name in ACCELERATE_LOADING_VARIABLES if name in os.environ]
    for name in found:
        del os.environ[name]
    if found and os.environ.get("RANK", "0") == "0":
        print(f"shardtune: ignoring {' and '.join(found)} (Accelerate's loading switches): every rank loads the "
              "model, or only rank 0 with --low_cpu_fsdp", file=sys.stderr)
