"""The optimizer and the LR schedule (shared by the training loop and the strategies that own the optimizer)."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardtune.config.schema import ConfigError, TrainConfig, interval_steps


def no_decay(name: str, param: nn.Parameter) -> bool:
    """Biases and norm weights (every parameter of fewer than 2 dims) get no weight decay, as in HF's Trainer."""
    return name.endswith("bias") or param.ndim < 2


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.optim.weight_decay:
        params: list = [
            {"params": [p for n, p in named if not no_decay(n, p)], "weight_decay": cfg.optim.weight_decay},
            {"params": [p for n, p in named if no_decay(n, p)], "weight_decay": 0.0},
        ]
    else:  # one group, as checkpoints written before weight decay was split hold
        params = [p for _, p in named]
    hyper = dict(
        lr=cfg.optim.lr,
        betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2),
        eps=cfg.optim.adam_epsilon,
        weight_decay=cfg.optim.weight_decay,
    )
    if (
        cfg.optim.optimizer in EIGHT_BIT
    ):  # bitsandbytes' blockwise 8-bit moments (tensors under 4096 values keep 32-bit ones)
        import bitsandbytes as bnb

        eight_bit = bnb.optim.PagedAdamW8bit if cfg.optim.optimizer == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        return eight_bit(params, **hyper)
    return torch.optim.AdamW(params, **hyper, fused=cfg.optim.optimizer == "adamw_torch_fused" or None)


EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit")


def check_optim(cfg: TrainConfig, world_size: int) -> None:
    """8-bit AdamW quantises each whole tensor in blocks: under DDP every rank holds the same tensors and steps them
    alike; FSDP's shards are DTensors its kernels do not take, and ZeRO keeps its own optimizer partitions."""
    if cfg.optim.optimizer not in EIGHT_BIT:
        return
    if cfg.parallel.strategy == "fsdp" or cfg.parallel.strategy == "deepspeed":
        raise ConfigError(
            f"--optim {cfg.optim.optimizer} runs under DDP (bitsandbytes steps whole tensors, not FSDP's or "
            "ZeRO's shards): drop --enable_fsdp / --enable_deepspeed, or use --optim adamw_torch "
            "(its state is sharded there)"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"--optim {cfg.optim.optimizer} needs bitsandbytes: pip install 'shardtune[qlora]' (or "
            "bitsandbytes), or use --optim adamw_torch"
        ) from None


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """The warm-up's optimizer steps: N, or a fraction of the run's steps rounded up."""
    return interval_steps(cfg.optim.warmup_steps, total_steps)


def lr_factor(cfg: TrainConfig, step: int, total_steps: int, steps_per_epoch: int) -> float:
    """The lr of optimizer step ``step`` (0-based) as a fraction of --lr: a linear warm-up ((s + 1) / (w + 1), so no
    step trains at lr 0), then the schedule over the remaining steps."""
    warmup = warmup_steps(cfg, total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    name = cfg.optim.lr_scheduler
    if name == "step":  # llama-cookbook: x gamma once per epoch
        return cfg.optim.gamma ** (step // max(1, steps_per_epoch))
    if name == "linear":
        return 1.0 - progress
    if name in ("constant", "constant_with_warmup"):
        return 1.0
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    if name == "cosine_with_min_lr":
        floor = cfg.optim.min_lr / cfg.optim.lr if cfg.optim.min_lr else cfg.optim.min_lr_rate
        return floor + (1.0 - floor) * cosine
    return cosine


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int, steps_per_epoch: int = 0):
    """Returns (scheduler, steps_per_call): llama-cookbook's step schedule without warm-up is a StepLR stepped once
    per epoch (as its checkpoints hold it); every other schedule a LambdaLR stepped once per optimizer step."""
    if cfg.optim.lr_scheduler == "step" and not warmup_steps(cfg, total_steps):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg.optim.gamma), "epoch"
    steps_per_epoch = steps_per_epoch or total_steps
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(cfg, step, total_steps, steps_per_epoch)
    ), "step"


def check_schedule(cfg: TrainConfig, world_size: int) -> None:
    if cfg.optim.lr_scheduler == "constant" and cfg.optim.warmup_steps:
        raise ConfigError(
            "--lr_scheduler constant has no warm-up, but a warm-up is set: use --lr_scheduler "
            "constant_with_warmup, or drop --warmup_steps / --warmup_ratio"
        )
    floors = {"min_lr_rate": cfg.optim.min_lr_rate, "min_lr": cfg.optim.min_lr}
    if cfg.optim.lr_scheduler != "cosine_with_min_lr":
        for name, value in floors.items():
            if value:
                raise ConfigError(
                    f"--{name} {value} has no effect with --lr_scheduler {cfg.optim.lr_scheduler}: use "
                    "--lr_scheduler cosine_with_min_lr, or drop it"
                )
        return
    if bool(cfg.optim.min_lr_rate) == bool(cfg.optim.min_lr):
        raise ConfigError(
            "--lr_scheduler cosine_with_min_lr needs exactly one of --min_lr_rate and --min_lr "
            "(TRL: --lr_scheduler_kwargs '{\"min_lr_rate\": 0.1}')"
        )
    if cfg.optim.min_lr >= cfg.optim.lr:
        raise ConfigError(f"--min_lr {cfg.optim.min_lr} must be below --lr {cfg.optim.lr}")


def apply_settings_on_resume(optimizer: torch.optim.Optimizer, scheduler, cfg: TrainConfig) -> None:
    """After a checkpoint's optimizer and scheduler state are loaded: this run's --lr, weight decay, betas and epsilon
    replace the checkpoint's (the moments are kept), and the schedule continues at its position with the new peak
    lr (each group's lr keeps its ratio to the schedule's peak). Without this the restored state silently puts the
    checkpoint's hyperparameters back while config.yaml records the new ones."""
    bases = list(getattr(scheduler, "base_lrs", [])) or [
        g.get("initial_lr", cfg.optim.lr) for g in optimizer.param_groups
    ]
    for group, base in zip(optimizer.param_groups, bases):
        group["lr"] = cfg.optim.lr * (group["lr"] / base) if base else cfg.optim.lr
        group["initial_lr"] = cfg.optim.lr
        if group.get("weight_decay"):  # groups without decay (biases, norms) stay without
            group["weight_decay"] = cfg.optim.weight_decay
        group["betas"] = (cfg.optim.adam_beta1, cfg.optim.adam_beta2)
        group["eps"] = cfg.optim.adam_epsilon
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [cfg.optim.lr] * len(optimizer.param_groups)
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
