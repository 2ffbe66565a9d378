"""``trainer.predict()``, ``compute_metrics`` and ``preprocess_logits_for_metrics`` as transformers' Trainer means
them, on the run's own evaluation (shardtune.training.engine.predictions): ``EvalPrediction(predictions, label_ids)``
with
one row per evaluated example in the dataset's order, padded with -100, the same on any number of processes.

Per objective, as TRL 1.16's trainers give them:

- SFT: the logits at every position (or what ``preprocess_logits_for_metrics(logits, labels)`` makes of each batch),
  and the labels as the model sees them (the ``labels`` column, unshifted, -100 where no loss is taken).
  ``compute_metrics``' metrics join every evaluation row of a training run (``eval_<name>``) and the results of
  ``evaluate()`` and ``predict()``.
- GRPO: TRL's ``prediction_step`` returns the loss only: ``predict()`` returns ``PredictionOutput(None, None,
  metrics)``, the metrics of ``evaluate()`` under the prefix; its constructor takes no ``compute_metrics``.
- DPO: refused (its registration's ``prediction_refusal``).

``compute_metrics`` runs once per evaluation, in the process of rank 0, on the gathered arrays (memory-mapped), and its
metrics reach every process; Trainer runs it in every process on the same arrays, which gives the same numbers.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

from shardtune.config.objectives import registration
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.training.engine.predictions import LABELS_FILE, PREDICTIONS_FILE, PredictionRequest, request

METRIC_FUNCTIONS = ("compute_metrics", "preprocess_logits_for_metrics")


def _refusal(objective: str) -> str:
    """Why ``objective``'s predictions are not built ("": they are): its registration says."""
    return registration(objective).prediction_refusal


class Predicting:
    """The trainers' predict() and metric functions (shardtune.api.trainer._Trainer mixes it in)."""

    objective: str
    _evaluation: Callable[[Any, Any, str], tuple[dict[str, Any], TrainConfig]]  # the trainer's
    _compute_metrics: Callable[[Any], dict] | None = None
    _preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None
    _prediction: PredictionRequest | None = None  # predict()'s, while it runs

    def _take_metric_functions(self, arguments: dict[str, Any]) -> None:
        """compute_metrics and preprocess_logits_for_metrics, taken out of the constructor's ``arguments`` and kept;
        a value that is not callable, or either for an objective whose predictions are not built, refused."""
        for name in METRIC_FUNCTIONS:
            value = arguments.pop(name, None)
            if value is None:
                continue
            if _refusal(self.objective):
                raise ConfigError(f"{name}: {_refusal(self.objective)}; drop it")
            if not callable(value):
                raise ConfigError(f"{name}: a {type(value).__name__} is not callable: pass a function, as to Trainer")
            setattr(self, f"_{name}", value)

    @contextlib.contextmanager
    def _predicting(self, cfg: TrainConfig) -> Iterator[None]:
        """Around a run of ``cfg`` in this process: its evaluations keep their predictions when compute_metrics is
        given or predict() asks (the worker runs here, so the script's functions are called in place)."""
        wanted = self._prediction or (
            PredictionRequest(self._compute_metrics, self._preprocess_logits_for_metrics)
            if self._compute_metrics is not None
            else None
        )
        if wanted is not None and cfg.parallel.context_parallel_size * cfg.parallel.sequence_parallel_size > 1:
            raise ConfigError(
                "compute_metrics / predict(): context_parallel_size or sequence_parallel_size > 1 splits each "
                "evaluated row over processes, and predictions are not gathered from slices: set both to 1"
            )
        with request(wanted):
            yield

    def predict(self, test_dataset: Any, ignore_keys: Any = None, metric_key_prefix: str = "test") -> Any:
        """Trainer's ``predict()``: transformers' ``PredictionOutput(predictions, label_ids, metrics)`` for the model
        as it is now (as evaluate() takes it) on ``test_dataset``, by the run's own evaluation in every process (all
        must call it): one row per row of ``test_dataset`` in its order, padded with -100; the metrics as evaluate()
        gives them (with compute_metrics') under ``metric_key_prefix``. The arrays are memory-mapped (copy on write)
        from output_dir/evaluations/NNN/predictions.npy and label_ids.npy, one copy on disk for every process."""
        from transformers.trainer_utils import PredictionOutput

        if _refusal(self.objective):
            raise ConfigError(f"predict(): {_refusal(self.objective)}")
        if test_dataset is None:
            raise ConfigError(
                "predict(): test_dataset is None: pass the rows to predict (a Dataset or a list of dicts)"
            )
        if registration(self.objective).predictions == "loss":  # TRL's prediction_step returns the loss alone
            metrics, _ = self._evaluation(test_dataset, ignore_keys, metric_key_prefix)  # not logged, as Trainer's
            # transformers types predictions as arrays, yet its Trainer.predict() returns None for a loss-only step
            return PredictionOutput(None, None, {k: v for k, v in metrics.items() if k != "epoch"})  # type: ignore[arg-type]
        self._prediction = PredictionRequest(self._compute_metrics, self._preprocess_logits_for_metrics, keep=True)
        try:
            metrics, _ = self._evaluation(test_dataset, ignore_keys, metric_key_prefix)
            folder = self._prediction.written
        finally:
            self._prediction = None
        return PredictionOutput(*kept_arrays(folder, test_dataset), {k: v for k, v in metrics.items() if k != "epoch"})


def kept_arrays(folder: Path | None, test_dataset: Any) -> tuple[Any, Any]:
    """predict()'s arrays from ``folder``, one row per row of ``test_dataset`` (a row the data floor skipped as bad
    would shift every later row: refused)."""
    import numpy as np

    assert folder is not None, "the evaluation wrote no predictions"
    predictions = np.load(folder / PREDICTIONS_FILE, mmap_mode="c")
    label_ids = np.load(folder / LABELS_FILE, mmap_mode="c")
    expected = len(test_dataset) if hasattr(test_dataset, "__len__") else len(predictions)
    if len(predictions) != expected:
        raise ConfigError(
            f"predict(): {len(predictions)} of test_dataset's {expected} rows were evaluated (the others were skipped "
            "as bad rows: the run's 'data (validation)' line counts them), so rows would not line up: fix or drop them"
        )
    return predictions, label_ids
