"""The model a run trains (or DPO's frozen reference), before any strategy wraps it."""

from __future__ import annotations

import torch

from shardtune.config.schema import TrainConfig
from shardtune.model.loading import build_model_on_meta, load_model, model_head, training_model_config
from shardtune.model.peft import load_quantized_model
from shardtune.model.quantized import load_quantized_on_rank0
from shardtune.runtime.distributed import DistEnv
from shardtune.runtime.precision import weights_dtype


def build_model(cfg: TrainConfig, env: DistEnv) -> torch.nn.Module:
    """The model to train, before wrapping: fp32 master weights (bf16 with pure_bf16), with the objective's head
    (a new head's weights drawn from --seed, alike on every rank). With low_cpu_fsdp only global rank 0 reads the
    weights; the others build on the meta device and receive theirs after sharding."""
    dtype = weights_dtype(cfg.parallel.strategy, cfg.train.precision)
    if cfg.model.quantization and cfg.parallel.low_cpu_fsdp:
        return load_quantized_on_rank0(cfg, env)
    if cfg.model.quantization:
        return load_quantized_model(cfg, env.device)
    config = training_model_config(cfg)  # with --rope_scaling; the 4-bit paths build from it too
    head = model_head(cfg)
    if cfg.parallel.low_cpu_fsdp and env.rank != 0:
        return build_model_on_meta(
            cfg.model.name, dtype=dtype, config=config, trust_remote_code=cfg.model.trust_remote_code, head=head
        )
    return load_model(
        cfg.model.name,
        dtype=dtype,
        config=config,
        trust_remote_code=cfg.model.trust_remote_code,
        head=head,
        seed=cfg.train.seed,
    )
