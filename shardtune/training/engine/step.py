"""One optimizer step, the same for every objective: accumulate, scale, backward, clip, and step, skip or stop.

The objective's counts of the step (its normaliser N: labelled tokens, pairs) are all-reduced once, on the device,
before the first backward; each micro-batch contributes its loss sum x W / N to backward, where W is the number of
ranks the strategy averages gradients over, so the average yields exactly sum / N. Nothing is divided by the
accumulation steps. So 1 x 8 x 1, 1 x 2 x 4 and 4 x 2 x 1 (processes x batch x accumulation) compute the same
gradients up to float rounding. With sequence / context parallelism the ranks of a split group each hold a slice of
the same rows: the objective counts what they share once.

Nothing is read back to the host per micro-batch: the statistics add up on the device and are read once, with the
gradient norm, when the step decides whether to update (the one host sync of a step). That decision is made here
and only here: a non-finite loss or gradient norm (on any rank: both are global) stops the run before the update
(--nan_policy stop) or skips it (skip), whatever the objective.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.accounting.flops import ModelShape
from shardtune.model.lora_dropout import keyed_masks
from shardtune.parallel.base import Strategy
from shardtune.runtime.distributed import all_reduce_max, all_reduce_sum
from shardtune.runtime.errors import TrainingStopped
from shardtune.training.engine.objective import Objective


class NonFiniteLossError(RuntimeError):
    """A NaN / Inf loss or gradient norm; raised on every rank before the optimizer step."""

    def __init__(self, loss: float, grad_norm: float | None):
        super().__init__(f"loss {loss}" + (f", gradient norm {grad_norm}" if grad_norm is not None else ""))


@dataclass
class StepResult:
    """A step's global figures: the objective's metrics (``loss`` first), its counts, the gradient norm before
    clipping (measured every step, clipping or not; None only where the strategy cannot tell), and whether the
    weights were updated."""

    metrics: dict[str, float]
    counts: dict[str, float]
    grad_norm: float | None
    stepped: bool

    @property
    def loss(self) -> float:
        return self.metrics["loss"]


class StatReductions:
    """An objective's step statistics combined by their reductions (sum, min, max), over its micro-batches and then
    its ranks: the sums in one all-reduce, the extremes in one more (a minimum as the maximum of its negation), both
    on the device; the step's one host read reads them."""

    def __init__(self, kinds: tuple[str, ...], device: torch.device) -> None:
        unknown = set(kinds) - {"sum", "min", "max"}
        assert not unknown, f"stat reductions are sum, min or max: {unknown}"
        self.device = device
        self.is_sum = torch.tensor([k == "sum" for k in kinds], device=device)
        self.is_min = torch.tensor([k == "min" for k in kinds], device=device)
        self.extremes = not bool(self.is_sum.all())

    def start(self) -> torch.Tensor:
        inf = torch.full(self.is_sum.shape, math.inf, dtype=torch.float64, device=self.device)
        return torch.where(self.is_sum, 0.0, torch.where(self.is_min, inf, -inf))

    def combine(self, stats: torch.Tensor, more: torch.Tensor) -> torch.Tensor:
        more = more.to(self.device)
        if not self.extremes:
            return stats + more
        extreme = torch.where(self.is_min, torch.minimum(stats, more), torch.maximum(stats, more))
        return torch.where(self.is_sum, stats + more, extreme)

    def across_ranks(self, stats: torch.Tensor) -> torch.Tensor:
        sums = all_reduce_sum(torch.where(self.is_sum, stats, 0.0), self.device, to_host=False)
        if not self.extremes:
            return sums
        largest = all_reduce_max(torch.where(self.is_min, -stats, stats), self.device)
        return torch.where(self.is_sum, sums, torch.where(self.is_min, -largest, largest))


def train_step(
    model: nn.Module,
    strategy: Strategy,
    optimizer: torch.optim.Optimizer,
    objective: Objective,
    micro_batches: list[dict[str, torch.Tensor]],
    step: int = 1,
    shape: ModelShape | None = None,
) -> StepResult:
    """Optimizer step number ``step`` over this rank's micro-batches. LoRA dropout masks are keyed by the step and
    each example's global index (shardtune.model.lora_dropout), so they do not depend on which rank holds it."""
    cfg, device = objective.cfg, objective.env.device
    counts = objective.counts(micro_batches, shape)  # numbers, or a float64 tensor computed on the device
    local = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, dtype=torch.float64)
    totals = all_reduce_sum(local, device, to_host=False)
    scale = strategy.grad_average_size / totals[0].clamp(min=1)
    reductions = StatReductions(objective.stat_reductions or ("sum",) * len(objective.stat_names), device)
    stats = reductions.start()
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        sync = strategy.accumulating(model) if i < last else contextlib.nullcontext()
        with sync, keyed_masks(batch, cfg.train.seed, step):  # backward too: activation checkpointing recomputes masks
            with strategy.autocast():
                loss_sum, batch_stats = objective.loss(model, batch, totals)
            strategy.backward(loss_sum * scale.to(loss_sum.dtype))
        stats = reductions.combine(stats, batch_stats.detach().double())
    stats = reductions.across_ranks(stats)
    decided: dict = {}

    def allow_step(grad_norm: torch.Tensor | float | None) -> bool:
        """The step's one host read: counts, statistics and gradient norm; every rank decides alike (all global)."""
        norm = None if grad_norm is None else torch.as_tensor(grad_norm, dtype=torch.float64, device=device)
        values = torch.cat([totals, stats, norm.reshape(1) if norm is not None else stats[:0]]).tolist()
        counts = dict(zip(objective.count_names, values))
        decided.update(
            counts=counts,
            norm=values[-1] if norm is not None else None,
            metrics=objective.step_metrics(counts, values[len(totals) : len(totals) + len(stats)]),
        )
        loss, norm_value = decided["metrics"]["loss"], decided["norm"]
        if math.isfinite(loss) and (norm_value is None or strategy.scaler is not None or math.isfinite(norm_value)):
            return True
        if cfg.train.nan_policy == "stop":
            raise NonFiniteLossError(loss, norm_value)
        return False

    grad_norm, stepped = strategy.clip_and_step(model, optimizer, cfg.optim.max_grad_norm, allow_step)
    norm = decided["norm"] if grad_norm is None or decided["norm"] is not None else float(grad_norm)
    if strategy.measures_norm_after_update and norm is not None and not math.isfinite(norm):
        stop_after_update(strategy, norm, step)
    return StepResult(decided["metrics"], decided["counts"], norm, stepped)


def stop_after_update(strategy: Strategy, norm: float, step: int) -> None:
    """A non-finite gradient norm that a strategy measures only after its update (DeepSpeed): the run stops, saying
    the weights took it, unless it is an overflow the strategy's loss scaler skipped (fp16)."""
    if strategy.skips_overflow_itself:
        return
    raise TrainingStopped(
        f"non-finite gradient norm {norm} at optimizer step {step}, found by {strategy.title}'s step, which clips and "
        "updates in one call, so the weights took that update: lower --lr, or use --enable_fsdp with --nan_policy "
        "stop to stop before the update"
    )
