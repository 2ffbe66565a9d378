"""Metrics: one JSON object per optimizer step / evaluation in metrics.jsonl, written by rank 0."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch


class MetricsWriter:
    """Appends JSON lines and flushes each one, so a crash keeps every step logged so far."""

    def __init__(self, path: Path | None, append: bool = False):
        self.path = path
        self._fh = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        if self._fh is None:
            return
        self._fh.write(json.dumps(row, allow_nan=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss_kib * (1 if sys.platform == "darwin" else 1024))


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")
