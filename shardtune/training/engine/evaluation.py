"""The evaluator: runs the objective's evaluation at the times the loop asks, and records it (a metrics row, the
score --load_best_model_at_end compares, generated samples) and says it on rank 0. When the script asked for its
predictions (shardtune.training.engine.predictions: compute_metrics, predict()), the evaluation keeps them and the
metrics of
compute_metrics join its row."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from torch import nn

from shardtune.config.schema import ConfigError
from shardtune.training.engine.checkpoint.best import BestModel
from shardtune.training.engine.metrics import MetricsWriter
from shardtune.training.engine.objective import Objective
from shardtune.training.engine.predictions import PredictionKeeper, requested


class Evaluator:
    def __init__(
        self,
        objective: Objective,
        model: nn.Module,
        writer: MetricsWriter,
        best: BestModel | None,
        say: Callable[[str], None],
    ):
        self.objective, self.model, self.writer, self.best, self.say = objective, model, writer, best, say
        self.last: dict[str, float] = {}

    def __call__(self, step: int, epoch: float, when: str) -> dict[str, float]:
        """Collective: evaluate the model as it is after optimizer step ``step``."""
        keeper = self.objective.predictions = self._keeper()
        try:
            row, samples = self.objective.evaluate(self.model)
        finally:
            self.objective.predictions = None
        if keeper is not None:
            row = {**row, **keeper.finish(self.objective.env.device, row)}
        if self.best:
            self.best.record(step, row)
        self.writer.write({"step": step, "epoch": epoch, **row})
        if samples:
            self.writer.write_samples(samples, step)
        self.say(f"{when}: {self.objective.describe_eval(row)}")
        self.last = row
        return row

    def _keeper(self) -> PredictionKeeper | None:
        """This evaluation's keeper of predictions, when the script asked for them (every rank alike)."""
        wanted, objective = requested(), self.objective
        if wanted is None:
            return None
        if not objective.predicts or objective.strategy.dims.sequence_split:  # the Python face refuses these first
            raise ConfigError(f"shardtune {objective.name}'s evaluation keeps no predictions in this layout")
        env = objective.env
        return PredictionKeeper(wanted, Path(objective.cfg.output.dir), env.rank, env.world_size)
