"""Small helpers the tests share: reading outputs of real runs."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from shardtune.metrics import read_metrics


def step_rows(out_dir: Path) -> list[dict]:
    return [r for r in read_metrics(out_dir / "metrics.jsonl") if "loss" in r]


def eval_rows(out_dir: Path) -> list[dict]:
    return [r for r in read_metrics(out_dir / "metrics.jsonl") if "eval_loss" in r]


def weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out_dir / "model.safetensors"))


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a - b| / max|a| (the scale of each tensor, so tiny entries do not dominate)."""
    assert a.keys() == b.keys(), f"different tensors: {sorted(a.keys() ^ b.keys())}"
    worst = 0.0
    for name in a:
        x, y = a[name].double(), b[name].double()
        worst = max(worst, float((x - y).abs().max() / x.abs().max().clamp_min(1e-12)))
    return worst
