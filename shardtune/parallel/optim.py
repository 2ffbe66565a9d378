"""The optimizer and the LR schedule (shared by the training loop and the strategies that own the optimizer)."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardtune.config.schema import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    """Returns (scheduler, steps_per_call): llama-cookbook's StepLR steps once per epoch; cosine once per step."""
    if cfg.lr_scheduler == "cosine":
        warmup = cfg.warmup_steps

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = (step - warmup) / max(1, total_steps - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor), "step"
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg.gamma), "epoch"
