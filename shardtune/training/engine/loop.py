"""The training loop: epochs of optimizer steps (shardtune.training.engine.step), with evaluations, checkpoints and the
model published once trained, the same for every objective (shardtune.training.engine.objective).

The loop itself is :func:`train`; what it is handed and builds at the start (optimizer, schedule, resume position,
evaluator, step reporter) is :class:`Run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from shardtune.accounting.flops import model_shape
from shardtune.accounting.peak_flops import PEAK_CACHE_FILE, PeakMeter
from shardtune.model.loading import cache_dir
from shardtune.parallel.base import Strategy
from shardtune.parallel.optim import build_scheduler
from shardtune.parallel.sequence import RowSlice
from shardtune.runtime import startup
from shardtune.runtime.distributed import all_reduce_sum, print0
from shardtune.runtime.errors import TrainingStopped
from shardtune.training.engine.checkpoint.best import BestModel, load_best
from shardtune.training.engine.checkpoint.checkpointer import Checkpointer, Position
from shardtune.training.engine.checkpoint.layout import objective_file
from shardtune.training.engine.evaluation import Evaluator
from shardtune.training.engine.hooks import installed
from shardtune.training.engine.intervals import epoch_steps, epochs_reached, every, planned_steps
from shardtune.training.engine.metrics import MetricsWriter
from shardtune.training.engine.objective import Objective
from shardtune.training.engine.profiling import StepProbe
from shardtune.training.engine.reporting import StepReporter
from shardtune.training.engine.step import NonFiniteLossError, train_step


@dataclass
class TrainResult:
    """The run so far (a resumed run continues the checkpoint's): ``num_tokens`` is TRL's, the real input tokens of all
    ranks seen so far; ``label_tokens`` the tokens that carried a loss."""

    steps: int = 0
    num_tokens: int = 0
    label_tokens: int = 0
    train_time_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    eval_loss: float | None = None
    eval_summary: str = ""  # what the objective adds to the closing report's eval line (Objective.report_eval)

    @property
    def tokens_per_s(self) -> float:
        """Label tokens per second, as the rows' ``tokens_per_s``."""
        return self.label_tokens / self.train_time_s if self.train_time_s > 0 else 0.0


def train(
    model: nn.Module,
    strategy: Strategy,
    objective: Objective,
    units: list,
    writer: MetricsWriter,
    checkpointer: Checkpointer | None = None,
    publish: Callable[[TrainResult], None] | None = None,
) -> TrainResult:
    """Trains to the end. ``publish`` (writing the final model) is called once, when the last step is done and
    before the final evaluation (a failure there never costs the trained model); with --load_best_model_at_end
    after it, with the best checkpoint's weights."""
    run = Run(model, strategy, objective, units, writer, checkpointer, publish)
    cfg, result, hooks = objective.cfg, run.result, run.hooks
    if cfg.eval.only:  # trainer.evaluate(): the model as it is, nothing trained or written but the row
        run.evaluate(run.start.epoch, 0, "evaluation")
        run.reporter.close()
        run.probe.close()
        return result
    if hooks:
        hooks.on_train_begin(run.total_steps)
    if cfg.eval.enabled and cfg.eval.on_start and result.steps == 0:  # --eval_on_start: the baseline, once a run
        run.evaluate(run.start.epoch, 0, "start")
    stopped = False
    for epoch in range(run.start.epoch, epochs_reached(run.total_steps, run.steps_per_epoch)):
        if result.steps >= run.total_steps or stopped:
            break
        run.reporter.start_epoch()
        done_in_epoch = run.start.step_in_epoch if epoch == run.start.epoch else 0
        for micro_batches in run.batches(epoch, done_in_epoch):
            if result.steps >= run.total_steps:
                break
            done_in_epoch += 1
            run.step(micro_batches, epoch, done_in_epoch)
            evaluated = False
            if (
                run.eval_every
                and result.steps % run.eval_every == 0
                and done_in_epoch < run.steps_per_epoch
                and result.steps < run.total_steps
            ):  # --eval_steps; the epoch's end evaluates anyway
                run.evaluate(epoch, done_in_epoch, f"step {result.steps}")
                evaluated = True
            if hooks and hooks.take_evaluate() and cfg.eval.enabled and not evaluated:
                run.evaluate(epoch, done_in_epoch, f"step {result.steps} (a callback asked)")
            if checkpointer:
                checkpointer.after_step(epoch, done_in_epoch)
                if hooks and hooks.take_save():
                    if done_in_epoch < run.steps_per_epoch:
                        checkpointer.save_now(epoch, done_in_epoch)
                    else:  # after the epoch's end, where an epoch's last step is saved
                        run.save_at_epoch_end = True
                run.said_saved()
                if result.steps < run.total_steps:
                    checkpointer.stop_if_requested(epoch, done_in_epoch)
            if hooks and result.steps < run.total_steps and run.stop_agreed():
                stopped = True  # a callback's should_training_stop (EarlyStoppingCallback): as Trainer, at once
                break
        if not stopped:
            run.end_epoch(epoch, done_in_epoch)
    run.finish()
    if hooks:
        hooks.on_train_end()
    return result


class Run:
    """One run's training state and the units the loop calls: optimizer and schedule, resume position, the step,
    the evaluator, the step reporter, publishing."""

    def __init__(
        self,
        model: nn.Module,
        strategy: Strategy,
        objective: Objective,
        units: list,
        writer: MetricsWriter,
        checkpointer: Checkpointer | None,
        publish: Callable | None,
    ):
        cfg, env = objective.cfg, objective.env
        self.model, self.strategy, self.objective, self.units, self.cfg, self.env = (
            model,
            strategy,
            objective,
            units,
            cfg,
            env,
        )
        self.checkpointer, self.publish = checkpointer, publish
        dims = strategy.dims  # the sampler sees data-parallel ranks; the ranks of one cp x sp group split each row
        self.optimizer = strategy.build_optimizer(model)
        self.steps_per_epoch = epoch_steps(cfg, units, dims.dp_size)
        self.total_steps = planned_steps(cfg, units, dims.dp_size)
        self.scheduler, self.scheduler_unit = build_scheduler(
            self.optimizer, cfg, self.total_steps, self.steps_per_epoch
        )
        self.shape = model_shape(model)
        peak = PeakMeter(  # before the first step: a CPU's peak is measured here, or read from the machine's cache
            env.device,
            strategy.compute_dtype,
            lambda t: all_reduce_sum(t, env.device),
            cache_file=cache_dir() / PEAK_CACHE_FILE,
            writes_cache=env.local_rank == 0,
        )
        print0(peak.describe())
        self.result = TrainResult()
        self.probe = StepProbe(cfg, env, self.total_steps)
        self.eval_every = every(cfg.eval.steps, self.total_steps) if cfg.eval.enabled else 0
        self.best = BestModel(cfg, self.total_steps) if cfg.eval.load_best_model_at_end and checkpointer else None
        if checkpointer:
            checkpointer.best = self.best
        self.start = (
            checkpointer.start(
                model, self.optimizer, self.scheduler, self.result, self.steps_per_epoch, self.total_steps
            )
            if checkpointer
            else Position()
        )
        startup.mark("optimizer, eval batches, checkpoint")
        if cfg.run.debug:  # before the progress bar, so that the line stands alone
            print0(startup.phase_report())
        self.reporter = StepReporter(env, writer, peak, self.probe, self.total_steps, self.result.steps)
        self.evaluator = Evaluator(objective, model, writer, self.best, self.reporter.say)
        objective.writer = writer
        self.row_slice = RowSlice.of_rank(dims, env.rank)
        self.hooks = installed()  # a script's callbacks (the Python face); None on the command line
        self.last_row: dict = {}
        self.save_at_epoch_end = False  # a callback's should_save at an epoch's last step
        self.saved = checkpointer.last_saved if checkpointer else None
        objective.resume_data = objective.data_position = self.start.data  # a streamed run's position (None else)
        if checkpointer and cfg.data.streaming:
            checkpointer.data_position = lambda: objective.data_position
        if checkpointer:
            checkpointer.objective_state = objective.state_to_save
            saved = checkpointer.resume_from and objective_file(checkpointer.resume_from, env.rank)
            objective.restore_state(torch.load(saved, weights_only=True) if saved and saved.is_file() else None)
        model.train()

    def stop_agreed(self) -> bool:
        """Whether a callback on any rank asked to stop (collective: every rank asks the same step)."""
        wants = torch.tensor([1.0 if self.hooks and self.hooks.wants_stop() else 0.0], device=self.env.device)
        return bool(all_reduce_sum(wants, self.env.device).item() > 0)

    def said_saved(self) -> None:
        """A checkpoint written since the last call: the callbacks' on_save."""
        if self.checkpointer and self.checkpointer.last_saved != self.saved:
            self.saved = self.checkpointer.last_saved
            if self.hooks:
                self.hooks.on_save(self.result.steps)

    def batches(self, epoch: int, first: int):
        dims = self.strategy.dims
        return self.objective.batches(
            self.units, epoch, first, dims.dp_rank(self.env.rank), dims.dp_size, self.row_slice
        )

    def step(self, micro_batches: list[dict], epoch: int, done_in_epoch: int) -> None:
        step, lr = self.result.steps + 1, self.optimizer.param_groups[0]["lr"]
        try:
            with self.probe.step(step):
                stats = train_step(
                    self.model, self.strategy, self.optimizer, self.objective, micro_batches, step, self.shape
                )
        except NonFiniteLossError as e:
            last = self.checkpointer.describe_last() if self.checkpointer else "no checkpoint"
            raise TrainingStopped(
                f"non-finite {e} at step {step} (epoch {epoch + 1}), found before the optimizer "
                f"step, so the weights were not touched; {last}: lower --lr or enable "
                "--gradient_clipping, or pass --nan_policy skip"
            ) from None
        if self.scheduler_unit == "step":
            self.scheduler.step()
        self.result.steps = step
        self.result.num_tokens += int(stats.counts["input_tokens"])
        self.result.label_tokens += int(stats.counts["label_tokens"])
        self.result.losses.append(stats.loss)
        row = self.reporter.step(step, self.epoch_float(epoch, done_in_epoch), lr, stats, self.result.num_tokens)
        self.result.train_time_s += row["step_time_s"]
        self.last_row = row
        if self.hooks:
            self.hooks.on_step_end(row)

    def epoch_float(self, epoch: int, done_in_epoch: int) -> float:
        """The epoch as the rows count it (fractional inside an epoch)."""
        return round(epoch + done_in_epoch / self.steps_per_epoch, 6)

    def evaluate(self, epoch: int, done_in_epoch: int, when: str) -> None:
        row = self.evaluator(self.result.steps, self.epoch_float(epoch, done_in_epoch), when)
        self.result.eval_loss, self.result.eval_summary = row["eval_loss"], self.objective.report_eval(row)
        if self.hooks:
            self.hooks.on_evaluate(row)

    def end_epoch(self, epoch: int, done_in_epoch: int) -> None:
        """The epoch's LR step (a completed epoch's: a run that ends inside an epoch checkpoints the schedule where
        the epoch stands), the model published once trained (unless the best is chosen after the last evaluation),
        the evaluation and the checkpoint."""
        if self.scheduler_unit == "epoch" and done_in_epoch == self.steps_per_epoch:
            self.scheduler.step()
        if self.result.steps >= self.total_steps and not self.best:
            self.publish_once()
        on_interval = bool(self.eval_every) and self.result.steps % self.eval_every == 0
        if self.cfg.eval.enabled and (self.cfg.eval.at_epoch_ends or on_interval):
            self.evaluate(
                epoch,
                done_in_epoch,
                f"epoch {epoch + 1}" if self.cfg.eval.at_epoch_ends else f"step {self.result.steps}",
            )
        if self.checkpointer:
            self.checkpointer.after_epoch(epoch, done_in_epoch)
            if self.save_at_epoch_end:
                self.save_at_epoch_end = False
                self.checkpointer.save_now(epoch + 1, 0)
            self.said_saved()

    def publish_once(self) -> None:
        if self.publish is not None:
            publish, self.publish = self.publish, None
            publish(self.result)

    def finish(self) -> None:
        self.reporter.close()
        self.probe.close()
        if self.best and self.publish is not None and self.checkpointer:
            load_best(self.model, self.strategy, self.optimizer, self.checkpointer, self.best, self.result)
        self.publish_once()  # a resumed run that was already finished, or one stopped early
