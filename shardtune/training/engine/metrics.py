"""Metrics: one JSON object per optimizer step / evaluation in metrics.jsonl, written by rank 0.

Imports no torch at module level: `shardtune plot` reads metrics with it and starts at once."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

from shardtune.training.engine.trackers import Tracker, tracker_scalars

EVAL_SAMPLES_FILE = "eval_samples.jsonl"


class MetricsWriter:
    """Appends JSON lines and flushes each one, so a crash keeps every step logged so far; the trackers (rank 0's
    --report_to sinks) receive the same rows."""

    def __init__(
        self, path: Path | None, append: bool = False, trackers: Sequence[Tracker] = (), tracker_every: int = 1
    ):
        self.path = path
        self.trackers = list(trackers)
        self.tracker_every = tracker_every  # --logging_steps: step rows sent to the trackers (eval rows: all)
        self._fh = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a" if append else "w", encoding="utf-8")
            if not append:
                (path.parent / EVAL_SAMPLES_FILE).unlink(missing_ok=True)
                (path.parent / "completions.jsonl").unlink(missing_ok=True)

    def write(self, row: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(strict_json_row(row), allow_nan=False) + "\n")
            self._fh.flush()
        if "loss" in row and row["step"] % self.tracker_every:
            return
        for tracker in self.trackers:
            tracker.log(tracker_scalars(row), row["step"])

    def write_samples(self, samples: list[dict[str, str]], step: int, file: str = EVAL_SAMPLES_FILE) -> None:
        """Generated answers of one evaluation (or GRPO's sampled completions: ``file``): appended to
        eval_samples.jsonl next to metrics.jsonl, and sent to the trackers as a table."""
        if self.path is not None:
            with open(self.path.parent / file, "a", encoding="utf-8") as fh:
                fh.writelines(json.dumps({"step": step, **sample}) + "\n" for sample in samples)
        for tracker in self.trackers:
            tracker.log_samples(samples, step)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


# metrics.jsonl is strict JSON (RFC 8259 has no NaN / Infinity): a non-finite number is written as one of these
# strings, the spellings of JavaScript and of Python's float(); read_metrics turns them back into floats.
NON_FINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def strict_json_row(row: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (
            ("NaN" if math.isnan(v) else "Infinity" if v > 0 else "-Infinity")
            if isinstance(v, float) and not math.isfinite(v)
            else v
        )
        for k, v in row.items()
    }


def _float_back(row: dict[str, Any]) -> dict[str, Any]:
    return {k: NON_FINITE_STRINGS.get(v, v) if isinstance(v, str) else v for k, v in row.items()}


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [_float_back(json.loads(line)) for line in fh if line.strip()]


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")
