"""The training loop: micro-batches, accumulation, token-normalised loss, clipping, step, evaluation.

The loss of an optimizer step is sum(token losses over all its micro-batches on all ranks) / N, where N is
the global number of labelled tokens of the step. Each micro-batch contributes sum x W / N to backward,
where W is the number of ranks the strategy averages gradients over: the average then yields exactly
sum / N. Nothing is divided by the accumulation steps. So 1 x 8 x 1, 1 x 2 x 4 and 4 x 2 x 1
(processes x batch x accumulation) compute the same gradients up to float rounding. With sequence / context
parallelism each labelled token of a split row lives on one rank of its group, so N and W stay as they are.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from shardtune import data
from shardtune.training.best_model import BestModel, every, load_best
from shardtune.training.checkpoint import Checkpointer, Position
from shardtune.config.schema import TrainConfig
from shardtune.runtime.distributed import DistEnv, all_reduce_sum, print0
from shardtune.runtime.errors import TrainingStopped
from shardtune.model.flops import (
    ModelShape, micro_batch_flops, model_shape, num_input_tokens, palm_micro_batch_flops,
)
from shardtune.model.generation import mean_rouge
from shardtune.model.lora_dropout import keyed_masks
from shardtune.model.loss import batch_label_tokens, token_loss_sum
from shardtune.training.metrics import MetricsWriter, perplexity
from shardtune.runtime.distributed import peak_memory_bytes
from shardtune.parallel.optim import build_optimizer, build_scheduler  # noqa: F401 (build_optimizer: re-exported for bench/)
from shardtune.parallel.base import Strategy
from shardtune.model.peak_flops import PeakMeter
from shardtune.training.profiling import StepProbe
from shardtune.runtime import startup
from shardtune.parallel.sequence import RowSlice


@dataclass
class TrainResult:
    steps: int = 0
    num_tokens: int = 0
    train_time_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    eval_loss: float | None = None
    eval_ppl: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.train_time_s if self.train_time_s > 0 else 0.0


def train_step(model: nn.Module, strategy: Strategy, optimizer: torch.optim.Optimizer,
               micro_batches: list[dict[str, torch.Tensor]], cfg: TrainConfig, env: DistEnv,
               shape: ModelShape | None = None, step: int = 0) -> dict:
    """One optimizer step (number ``step``) over this rank's micro-batches; returns the global loss and counts (and
    the step's model FLOPs on all ranks when ``shape`` is given). LoRA dropout masks are keyed by the step and each
    example's global index (shardtune.model.lora_dropout), so they do not depend on which rank holds the example."""
    local_counts = torch.tensor([sum(batch_label_tokens(mb) for mb in micro_batches),
                                 sum(num_input_tokens(mb) for mb in micro_batches),
                                 sum(micro_batch_flops(shape, mb) for mb in micro_batches) if shape is not None
                                 else 0,
                                 sum(palm_micro_batch_flops(shape, mb) for mb in micro_batches) if shape is not None
                                 else 0])
    num_tokens, input_tokens, flops, palm_flops = (int(x) for x in all_reduce_sum(local_counts, env.device))
    scale = strategy.grad_average_size / max(num_tokens, 1)
    local_loss_sum = torch.zeros((), dtype=torch.float64)
    last = len(micro_batches) - 1
    for i, mb in enumerate(micro_batches):
        sync = strategy.accumulating(model) if i < last else contextlib.nullcontext()
        with sync, keyed_masks(mb, cfg.seed, step):  # backward too: activation checkpointing recomputes the masks
            with strategy.autocast():
                loss_sum = token_loss_sum(model, mb, env.device)
            strategy.backward(loss_sum * scale)
        local_loss_sum += loss_sum.detach().double().cpu()
    loss = float(all_reduce_sum(local_loss_sum, env.device)) / max(num_tokens, 1)

    def allow_step(grad_norm: float | None) -> bool:
        # loss and grad norm are global (all-reduced), so every rank takes the same decision
        if math.isfinite(loss) and (grad_norm is None or strategy.scaler is not None or math.isfinite(grad_norm)):
            return True
        if cfg.nan_policy == "stop":
            raise NonFiniteLossError(loss, grad_norm)
        return False

    max_norm = cfg.gradient_clipping_threshold if cfg.gradient_clipping else None
    grad_norm, stepped = strategy.clip_and_step(model, optimizer, max_norm, allow_step)
    stats = {"loss": loss, "num_tokens": num_tokens, "input_tokens": input_tokens, "grad_norm": grad_norm,
             "flops": flops, "palm_flops": palm_flops}
    return stats if stepped else {**stats, "skipped": True}


class NonFiniteLossError(RuntimeError):
    """A NaN / Inf loss or gradient norm; raised on every rank before the optimizer step."""

    def __init__(self, loss: float, grad_norm: float | None):
        super().__init__(f"loss {loss}" + (f", gradient norm {grad_norm}" if grad_norm is not None else ""))


@torch.no_grad()
def evaluate(model: nn.Module, strategy: Strategy, batches: list[dict[str, torch.Tensor]],
             env: DistEnv) -> tuple[float, float, int]:
    """Token-weighted eval loss over all ranks' shards: (loss, perplexity, labelled tokens)."""
    model.eval()
    local = torch.zeros(2, dtype=torch.float64)
    for mb in batches:
        with strategy.autocast():
            local[0] += token_loss_sum(model, mb, env.device).double().cpu()
        local[1] += batch_label_tokens(mb)
    model.train()
    loss_sum, num_tokens = all_reduce_sum(local, env.device).tolist()
    loss = loss_sum / num_tokens if num_tokens else float("nan")
    return loss, perplexity(loss), int(num_tokens)


@torch.no_grad()
def generate_samples(model: nn.Module, strategy: Strategy, sampler: Callable[[nn.Module], list[dict]]) -> list[dict]:
    """--log_eval_samples: the sampler's generations with the model as it is now (every rank runs them)."""
    model.eval()
    with strategy.autocast(), strategy.generating(model):
        samples = sampler(strategy.unwrap(model))
    model.train()
    return samples


def planned_steps(cfg: TrainConfig, num_units: int, dp_size: int) -> int:
    """Optimizer steps the run trains to: all epochs (or ceil(--fractional_epochs x steps per epoch), as Trainer
    counts a fractional --num_train_epochs), or --max_train_step when it is fewer."""
    per_epoch = data.steps_per_epoch(num_units, cfg, dp_size)
    total = math.ceil(cfg.fractional_epochs * per_epoch) if cfg.fractional_epochs else per_epoch * cfg.num_epochs
    return min(total, cfg.max_train_step) if cfg.max_train_step else total


def train(model: nn.Module, strategy: Strategy, cfg: TrainConfig, env: DistEnv,
          train_units: list, eval_examples: list[dict], pad_id: int, writer: MetricsWriter,
          checkpointer: Checkpointer | None = None,
          eval_sampler: Callable[[nn.Module], list[dict]] | None = None,
          publish: Callable[[TrainResult], None] | None = None,
          step_fn: Callable[..., dict] = train_step, collate_fn: Callable | None = None,
          eval_fn: Callable[[nn.Module, list], dict] | None = None) -> TrainResult:
    """Trains to the end; ``publish`` (writing the final model) is called once the last step is done, before the
    final evaluation: a failure there never costs the trained model. ``step_fn`` (as :func:`train_step`) and
    ``collate_fn`` (as ``data.collate``) give another objective (DPO: shardtune.training.dpo); the keys of its stats
    listed in ``stats["metrics"]`` go into the metrics rows. ``eval_fn(model, eval_examples)`` evaluates for such an
    objective: a row of metrics with ``eval_loss`` among them (default: the token-weighted loss and perplexity)."""
    optimizer = strategy.build_optimizer(model)
    dims = strategy.dims  # the sampler sees data-parallel ranks; the ranks of one cp x sp group split each row
    steps_per_epoch = data.steps_per_epoch(len(train_units), cfg, dims.dp_size)
    total_steps = planned_steps(cfg, len(train_units), dims.dp_size)
    scheduler, scheduler_unit = build_scheduler(optimizer, cfg, total_steps, steps_per_epoch)
    shape = model_shape(model)
    peak = PeakMeter(env.device, strategy.compute_dtype, lambda t: all_reduce_sum(t, env.device))
    print0(peak.describe())
    row_slice = RowSlice.of_rank(dims, env.rank)  # eval rows are split like training rows
    eval_batches = (data.eval_batches(eval_examples, cfg, dims.dp_rank(env.rank), dims.dp_size, pad_id, row_slice)
                    if cfg.run_validation and eval_fn is None else [])

    result = TrainResult()
    probe = StepProbe(cfg, env, total_steps)
    eval_every = every(cfg.eval_steps, cfg.eval_fraction, total_steps)
    best = BestModel(cfg, total_steps) if cfg.load_best_model_at_end and checkpointer else None
    if checkpointer:
        checkpointer.best = best

    def run_eval(epoch: float, when: str) -> None:
        if eval_fn is not None:
            metrics = eval_fn(model, eval_examples)
            result.eval_loss = metrics["eval_loss"]
            if best:
                best.record(result.steps, metrics)
            writer.write({"step": result.steps, "epoch": epoch, **metrics})
            if env.is_main:
                bar.write(f"{when}: eval loss {result.eval_loss:.4f}")
            return
        loss, ppl, n = evaluate(model, strategy, eval_batches, env)
        result.eval_loss, result.eval_ppl = loss, ppl
        samples = generate_samples(model, strategy, eval_sampler) if eval_sampler else []
        row = {"eval_loss": loss, "eval_ppl": ppl, "eval_num_tokens": n, **mean_rouge(samples)}
        if best:
            best.record(result.steps, row)
        writer.write({"step": result.steps, "epoch": epoch, **row})
        if samples:
            writer.write_samples(samples, result.steps)
        if env.is_main:
            bar.write(f"{when}: eval loss {loss:.4f}, perplexity {ppl:.2f}")

    start = (checkpointer.start(model, optimizer, scheduler, result, steps_per_epoch, total_steps)
             if checkpointer else Position())
    startup.mark("optimizer, eval batches, checkpoint")
    startup_s: float | None = startup.seconds_since_command()  # to this process's first step; in its first row
    if cfg.debug:  # before the progress bar, so that the line stands alone
        print0(startup.phase_report())
    bar = tqdm(total=total_steps, initial=result.steps, desc="train", unit="step", disable=not env.is_main,
               dynamic_ncols=True)
    model.train()
    for epoch in range(start.epoch, cfg.num_epochs):
        if result.steps >= total_steps:
            break
        tick = time.perf_counter()
        first = start.step_in_epoch if epoch == start.epoch else 0
        done_in_epoch = first
        for step_in_epoch, micro_batches in enumerate(
                data.train_loader(train_units, cfg, dims.dp_rank(env.rank), dims.dp_size, epoch, pad_id, first,
                                  row_slice, collate_fn), start=first):
            if result.steps >= total_steps:
                break
            lr = optimizer.param_groups[0]["lr"]
            try:
                with probe.step(result.steps + 1):
                    stats = step_fn(model, strategy, optimizer, micro_batches, cfg, env, shape, result.steps + 1)
            except NonFiniteLossError as e:
                raise TrainingStopped(f"non-finite {e} at step {result.steps + 1} (epoch {epoch + 1}), found before "
                                      "the optimizer step, so the weights were not touched; "
                                      f"{checkpointer.describe_last() if checkpointer else 'no checkpoint'}: "
                                      "lower --lr or enable --gradient_clipping, or pass --nan_policy skip") from None
            if scheduler_unit == "step":
                scheduler.step()
            now = time.perf_counter()
            step_time_s, tick = now - tick, now
            result.steps += 1
            result.num_tokens += stats["num_tokens"]
            result.train_time_s += step_time_s
            result.losses.append(stats["loss"])
            metered = time.perf_counter()
            peak_flops = peak.after_step(result.steps, stats["flops"] / step_time_s)
            tick += time.perf_counter() - metered  # a peak measurement is not part of the next step
            row = {
                "step": result.steps,
                "epoch": round(epoch + (step_in_epoch + 1) / steps_per_epoch, 6),
                "loss": stats["loss"],
                "num_tokens": stats["num_tokens"],
                "lr": lr,
                "tokens_per_s": stats["num_tokens"] / step_time_s,
                "input_tokens_per_s": stats["input_tokens"] / step_time_s,
                "step_time_s": step_time_s,
                "peak_memory_bytes": peak_memory_bytes(env.device),
                "model_flops_per_s": stats["flops"] / step_time_s,
                "mfu": stats["flops"] / step_time_s / peak_flops,
                "mfu_palm": stats["palm_flops"] / step_time_s / peak_flops,
                "peak_flops_per_s": peak_flops,
            }
            row.update({name: stats[name] for name in stats.get("metrics", ())})
            if startup_s is not None:
                row["startup_s"], startup_s = startup_s, None
            if stats["grad_norm"] is not None:
                row["grad_norm"] = stats["grad_norm"]
            if stats.get("skipped"):
                row["skipped"] = True
            flop_report = probe.report(result.steps, row, stats)
            writer.write(row)
            if flop_report and env.is_main:
                bar.write(flop_report)
            done_in_epoch = step_in_epoch + 1
            # --eval_steps: inside the epoch (its end, and the run's last step, evaluate anyway)
            if cfg.run_validation and eval_every and result.steps % eval_every == 0 \
                    and done_in_epoch < steps_per_epoch and result.steps < total_steps:
                run_eval(row["epoch"], f"step {result.steps}")
            if checkpointer:
                checkpointer.after_step(epoch, done_in_epoch)
                if result.steps < total_steps:
                    checkpointer.stop_if_requested(epoch, done_in_epoch)
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                            mfu=f"{row['mfu']:.1%}", refresh=False)
        if scheduler_unit == "epoch":
            scheduler.step()
        if publish is not None and result.steps >= total_steps and not best:  # best: after the last evaluation
            publish(result)
            publish = None
        if cfg.run_validation:  # the epoch as training rows count it (fractional when a run stops inside one)
            run_eval(round(epoch + done_in_epoch / steps_per_epoch, 6), f"epoch {epoch + 1}")
        if checkpointer:
            checkpointer.after_epoch(epoch, done_in_epoch)
    bar.close()
    probe.close()
    if best and publish is not None and checkpointer:
        load_best(model, strategy, optimizer, checkpointer, best, result)
    if publish is not None:  # a resumed run that was already finished, or one stopped early
        publish(result)
    return result
