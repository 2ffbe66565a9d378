"""The evaluator: runs the objective's evaluation at the times the loop asks, and records it (a metrics row, the
score --load_best_model_at_end compares, generated samples) and says it on rank 0."""

from __future__ import annotations

from typing import Callable

from torch import nn

from shardtune.training.best_model import BestModel
from shardtune.training.metrics import MetricsWriter
from shardtune.training.objective import Objective


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
        row, samples = self.objective.evaluate(self.model)
        if self.best:
            self.best.record(step, row)
        self.writer.write({"step": step, "epoch": epoch, **row})
        if samples:
            self.writer.write_samples(samples, step)
        self.say(f"{when}: {self.objective.describe_eval(row)}")
        self.last = row
        return row
