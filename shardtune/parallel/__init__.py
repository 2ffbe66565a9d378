"""Parallel strategies, all with the face of :class:`shardtune.parallel.base.Strategy`."""

from __future__ import annotations

from shardtune.config.schema import TrainConfig
from shardtune.parallel.base import Strategy
from shardtune.runtime.distributed import DistEnv


def make_strategy(cfg: TrainConfig, env: DistEnv) -> Strategy:
    if cfg.parallel.strategy == "fsdp":
        from shardtune.parallel.fsdp import FSDPStrategy

        return FSDPStrategy(cfg, env)
    if cfg.parallel.strategy == "deepspeed":
        from shardtune.parallel.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(cfg, env)
    from shardtune.parallel.ddp import DDPStrategy

    return DDPStrategy(cfg, env)
