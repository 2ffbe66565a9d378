"""Plain data parallel: every rank holds the whole model; gradients are all-reduced (averaged). One process alone
runs the model as it is (no DistributedDataParallel: it would average over one rank)."""

from __future__ import annotations

import contextlib
import inspect
from typing import ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardtune.model.loss import hf_model
from shardtune.parallel.base import Strategy
from shardtune.parallel.fsdp import checkpoint_activations


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        model.to(self.env.device)
        checkpoint_activations(model, self.cfg)
        if self.compute_dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(self.env.device.type)
        if self.env.world_size == 1:  # nothing to average: DDP would only copy every gradient into its buckets
            return model  # and back (exactly: x 1/1, an all-reduce over one rank), ~2-7% of a small model's step
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        # No buffer sync in forward: the rotary inv_freq buffer is identical on every rank, and a buffer broadcast
        # in forward would make eval passes collectives that every rank must join.
        params = inspect.signature(DistributedDataParallel).parameters
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
        # A vision-language model has weights no loss reaches (the vision tower's layers after the one whose features
        # it takes, its pooled output's norm): they get no gradient, which DDP must be told to expect (as TRL does)
        unused = {"find_unused_parameters": True} if has_vision_tower(model) else {}
        return DistributedDataParallel(model, device_ids=device_ids, **no_sync, **unused)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def accumulating(self, model: nn.Module) -> ContextManager:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        if self.env.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}


def has_vision_tower(model: nn.Module) -> bool:
    return getattr(getattr(hf_model(model), "config", None), "vision_config", None) is not None
