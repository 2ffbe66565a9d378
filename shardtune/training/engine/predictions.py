"""An evaluation's predictions, as transformers' Trainer hands them to ``compute_metrics`` and returns them from
``predict()``: ``EvalPrediction(predictions, label_ids)``, numpy arrays with one row per evaluated example in the
order of the evaluation split, each row padded to the longest with -100 (Trainer's padding index, for both).
predictions: the logits at every position of the example (float32), or what the script's
``preprocess_logits_for_metrics(logits, labels)`` made of its batch; label_ids: the example's labels as the model sees
them (unshifted, -100 where no loss is taken), as a causal LM's ``labels`` column is in Trainer.

Exact on any layout: every rank evaluates its chunks of the split (shardtune.data.batching.eval_chunk_starts says
where their rows sit) and appends each row to its own file in the output directory's staging folder as its batch is
computed, so no rank holds more than a batch of logits. Rank 0 then writes the two arrays row by row in the split's
order into .npy files, calls ``compute_metrics`` on them (memory-mapped) and broadcasts its metrics: every rank
writes and returns the same row, whatever the number of processes or the batch size (the batches' own padding never
reaches a row). ``predict()`` keeps the two files in its output directory (every process maps them); an evaluation
of a training run removes them once measured.

The script's callables come in-process (the Python face's worker runs in the script's process): the API installs a
:class:`PredictionRequest` around its run (:func:`request`), and the run's evaluator finds it (:func:`requested`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
from dataclasses import dataclass
from numbers import Number
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shardtune.config.schema import ConfigError
from shardtune.data.formatting import IGNORE_INDEX
from shardtune.model.loss import model_inputs, next_token_targets, prediction_sums
from shardtune.runtime.distributed import all_reduce_sum, barrier, broadcast_from_main

PAD_INDEX = -100  # Trainer's padding index, for the predictions and the labels alike
STAGING = ".staging-predictions"  # the ranks' rows while an evaluation runs (a dead run's: removed at the next start)
PREDICTIONS_FILE, LABELS_FILE = "predictions.npy", "label_ids.npy"


@dataclass
class PredictionRequest:
    """What the script asks of the run's evaluations: ``compute_metrics(EvalPrediction) -> dict`` (its metrics join
    the evaluation row, ``eval_``-prefixed), ``preprocess_logits(logits, labels) -> tensor`` per batch (Trainer's
    preprocess_logits_for_metrics), ``keep``: the arrays stay in the output directory (predict()); ``written``: the
    folder they were written to."""

    compute_metrics: Callable[[Any], dict] | None = None
    preprocess_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    keep: bool = False
    written: Path | None = None


_requested: PredictionRequest | None = None


def requested() -> PredictionRequest | None:
    return _requested


@contextlib.contextmanager
def request(wanted: PredictionRequest | None) -> Iterator[None]:
    """``wanted`` for the runs started inside (one at a time in a process)."""
    global _requested
    previous, _requested = _requested, wanted
    try:
        yield
    finally:
        _requested = previous


def loss_and_logits(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the batch's token loss sum, its PREDICTION_SUMS, its logits (rows, T, vocabulary)): shardtune.model.loss's
    full-logits path (what the lean head is tested against, equal to float rounding), its logits kept."""
    logits = model(**model_inputs(batch, device), use_cache=False).logits
    flat = logits.reshape(-1, logits.size(-1))
    targets = next_token_targets(batch).to(device, non_blocking=True).reshape(-1)
    loss = F.cross_entropy(flat.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    keep = targets != IGNORE_INDEX
    return loss, prediction_sums(flat[keep], targets[keep]), logits


def host_array(values: torch.Tensor) -> np.ndarray:
    """A tensor as numpy on the host, floating point as float32 (bf16 has no numpy type; Trainer numpifies so)."""
    values = values.detach().cpu()
    return (values.float() if values.is_floating_point() else values).numpy()


class PredictionKeeper:
    """One evaluation's predictions on one rank: each evaluated row appended to the rank's file as its batch is done."""

    def __init__(self, wanted: PredictionRequest, folder: Path, rank: int, world_size: int) -> None:
        self.wanted, self.folder, self.rank, self.world_size = wanted, folder, rank, world_size
        self.staging = folder / STAGING
        self.staging.mkdir(parents=True, exist_ok=True)
        self.file = open(self.staging / f"rank-{rank}.pkl", "wb")  # noqa: SIM115 -- closed by finish()
        self.rows: list[tuple[int, tuple[int, ...], str, int]] = []  # (index, shape, dtype, labels) of each row
        self.error: str | None = None

    def add(self, first: int | None, batch: dict[str, torch.Tensor], logits: torch.Tensor) -> None:
        """The rows of one evaluated (right-padded) batch; ``first``: the split index of its first row (None: a batch
        this rank runs only to join the collectives). A failure of the script's preprocess is kept for finish(),
        where every rank learns of it, instead of leaving the other ranks waiting in the next forward."""
        labels = batch["labels"]
        if first is None:  # what eval_batches adds for a rank short of chunks: one pad token, label -100
            if labels.numel() > 1 or bool((labels != IGNORE_INDEX).any()):
                self.error = self.error or (
                    "an evaluated batch has no place in the split: shardtune.data.batching.eval_chunk_starts must "
                    "count the items eval_batches chunks"
                )
            return
        if self.error:
            return
        try:
            values = self._preprocessed(logits, labels)
        except Exception as e:  # the script's own function
            self.error = f"preprocess_logits_for_metrics raised {type(e).__name__}: {e}"
            return
        length = labels.shape[1]
        for row, n in enumerate(batch["attention_mask"].sum(1).tolist()):
            per_position = values[row].dim() > 0 and values[row].shape[0] == length
            array = host_array(values[row, :n] if per_position else values[row])  # without the batch's pads
            pickle.dump((first + row, array, labels[row, :n].numpy()), self.file, protocol=pickle.HIGHEST_PROTOCOL)
            self.rows.append((first + row, array.shape, array.dtype.str, n))

    def _preprocessed(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        preprocess = self.wanted.preprocess_logits
        if preprocess is None:
            return logits
        values = preprocess(logits, labels.to(logits.device))
        if not isinstance(values, torch.Tensor) or values.dim() == 0 or values.shape[0] != labels.shape[0]:
            raise TypeError(
                f"it returned {type(values).__name__} {tuple(getattr(values, 'shape', ()))}: return a tensor whose "
                f"first dimension is the batch's {labels.shape[0]} rows"
            )
        return values

    def finish(self, device: torch.device, taken: dict[str, Any]) -> dict[str, float]:
        """Collective: the metrics ``compute_metrics`` returned (``eval_``-prefixed; {} without it), the same on every
        rank; the arrays written into the folder when kept. ``taken``: the evaluation row's own names."""
        self.file.close()
        failed = all_reduce_sum(torch.tensor([1.0 if self.error else 0.0]), device)[0] > 0
        if failed:
            raise RuntimeError(
                self.error or "preprocess_logits_for_metrics failed on another rank (its error is above)"
            )
        with open(self.staging / f"rank-{self.rank}.rows", "wb") as f:
            pickle.dump(self.rows, f)
        barrier()
        cause: BaseException | None = None
        outcome: tuple[str, Any] = ("ok", {})
        if self.rank == 0:
            try:
                outcome = ("ok", self._assemble_and_measure(taken))
            except Exception as e:  # every rank must hear of it, not wait in the broadcast
                cause, outcome = e, ("error", str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}")
        kind, value = broadcast_from_main(outcome)
        if kind == "error":
            raise RuntimeError(f"the evaluation's predictions: {value}") from cause
        if self.wanted.keep:
            self.wanted.written = self.folder
        return value

    def _assemble_and_measure(self, taken: dict[str, Any]) -> dict[str, float]:
        """Rank 0: the arrays from the ranks' files, then compute_metrics on them; the staging folder removed."""
        try:
            target = self.folder if self.wanted.keep else self.staging
            files = [self.staging / f"rank-{r}.pkl" for r in range(self.world_size)]
            rows = [row for r in range(self.world_size) for row in _load(self.staging / f"rank-{r}.rows")]
            predictions, labels = assemble(rows, files, target)
            if self.wanted.compute_metrics is None:
                return {}
            from transformers import EvalPrediction

            returned = self.wanted.compute_metrics(
                EvalPrediction(np.load(predictions, mmap_mode="c"), np.load(labels, mmap_mode="c"))
            )
            return eval_metrics(returned, taken)
        finally:
            shutil.rmtree(self.staging, ignore_errors=True)


def _load(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def _records(path: Path) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    with open(path, "rb") as f:
        while True:
            try:
                yield pickle.load(f)
            except EOFError:
                return


def padded_shapes(rows: list[tuple[int, tuple[int, ...], str, int]]) -> tuple[tuple[int, ...], tuple[int, int], str]:
    """(the predictions' shape, the labels' shape, the predictions' dtype) of the rows: one per example, index 0..N-1,
    each padded on its first dimension (the positions) to the longest, as Trainer concatenates batches."""
    if not rows:
        return (0, 0), (0, 0), "<f4"
    indices = sorted(index for index, *_ in rows)
    assert indices == list(range(len(rows))), "the ranks' rows are not the split's rows 0..N-1 once each"
    shapes = {shape for _, shape, _, _ in rows}
    trailing = {shape[1:] for shape in shapes}
    if len({len(shape) for shape in shapes}) > 1 or len(trailing) > 1:
        raise ConfigError(
            f"preprocess_logits_for_metrics gave rows of shapes {sorted(shapes)[:2]}: they may differ only in the "
            "sequence dimension (the second of the batch's)"
        )
    first = next(iter(shapes))
    longest = max(shape[0] for shape in shapes) if first else None
    prediction_shape = (len(rows),) if longest is None else (len(rows), longest, *first[1:])
    dtype = np.result_type(*{dtype for _, _, dtype, _ in rows}).str
    return prediction_shape, (len(rows), max(n for *_, n in rows)), dtype


def assemble(rows: list[tuple[int, tuple[int, ...], str, int]], files: list[Path], folder: Path) -> tuple[Path, Path]:
    """predictions.npy and label_ids.npy in ``folder`` from the ranks' files (records in any order), written row by
    row through memory maps (no copy of the arrays in memory) under temporary names, then renamed."""
    prediction_shape, label_shape, dtype = padded_shapes(rows)
    paths = folder / PREDICTIONS_FILE, folder / LABELS_FILE
    if not rows:  # nothing evaluated (a memory map cannot be empty)
        np.save(paths[0], np.zeros(prediction_shape, dtype=dtype))
        np.save(paths[1], np.zeros(label_shape, dtype=np.int64))
        return paths
    staged = [path.with_name(f".{path.name}.tmp") for path in paths]
    predictions = np.lib.format.open_memmap(staged[0], mode="w+", dtype=np.dtype(dtype), shape=prediction_shape)
    labels = np.lib.format.open_memmap(staged[1], mode="w+", dtype=np.int64, shape=label_shape)
    predictions[...] = PAD_INDEX
    labels[...] = PAD_INDEX
    for path in files:
        for index, values, row_labels in _records(path):
            predictions[(index, slice(0, len(values))) if values.ndim else index] = values
            labels[index, : len(row_labels)] = row_labels
    for array in (predictions, labels):
        array.flush()
    del predictions, labels
    for source, path in zip(staged, paths):
        os.replace(source, path)
    return paths


def eval_metrics(returned: Any, taken: dict[str, Any]) -> dict[str, float]:
    """compute_metrics' dict as the row's numbers: names ``eval_``-prefixed as Trainer prefixes them, numpy and torch
    scalars as Python numbers; a value that is not a number, or a name the evaluation computes itself, refused."""
    if not isinstance(returned, dict):
        raise ConfigError(
            f"compute_metrics returned a {type(returned).__name__}: return a dict of metric names to numbers"
        )
    metrics: dict[str, float] = {}
    for key, value in returned.items():
        name = str(key) if str(key).startswith("eval_") else f"eval_{key}"
        if isinstance(value, (np.ndarray, np.generic, torch.Tensor)) and np.prod(value.shape, dtype=int) == 1:
            value = value.item()
        if not isinstance(value, Number) or isinstance(value, complex):
            raise ConfigError(
                f"compute_metrics returned {key}={str(value)[:40]!r}: a metrics row holds numbers: return a number"
            )
        if name in taken:
            raise ConfigError(
                f"compute_metrics returned {key}, which the evaluation computes itself ({name}): rename it"
            )
        metrics[name] = value
    return metrics
