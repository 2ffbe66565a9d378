"""How far two training runs that must agree up to float rounding (layouts, strategies, thread counts, CPUs) may
drift apart after Adam's steps: a bound derived from how the optimizer amplifies rounding, not from one machine.

Adam moves a weight by lr * m / (sqrt(v) + 1e-8) per step: about lr whatever the size of its gradient. Where a
gradient element is far above its float rounding, another layout's rounding changes the update by the element's
relative rounding (~eps, far below lr / 100). Where the element nearly cancels (its terms have mixed signs), the
rounding changes the update by more than lr / 100 once the element is within ~100 roundings of zero, and by 2 lr at a
sign flip: no bound on single elements below Adam's own (~2 lr a step) holds on every CPU. Such elements are rare.
A gradient element sums one term per token of the step (K tokens, terms of spread s): it spreads as sqrt(K) s around
zero, while two orders of a sequential float32 sum differ by ~eps s K / 2 (a random walk of K roundings of partial
sums of size ~sqrt(k) s; blocked sums, as the kernels compute, round sqrt(K) times less). So it lies within 100
roundings of zero with probability 100 eps s K / (sqrt(2 pi K) s) = 40 eps sqrt(K) per step: 1.7e-4 for K = 1,236.
Allowed: that fraction of each tensor's elements per step, plus 2 (a flip or two in the small tensors), may differ
by more than lr / 100. A run that trained differently moves most elements by ~lr.
"""

from __future__ import annotations

import math

import torch

EPS = torch.finfo(torch.float32).eps  # 1.19e-7


def step_token_counts(rows: list[dict]) -> list[int]:
    """Tokens of each optimizer step, from metrics.jsonl's rows (num_tokens is TRL's running total)."""
    running = [r["num_tokens"] for r in rows]
    return [b - a for a, b in zip([0, *running], running)]


def adam_outliers(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], lr: float) -> dict[str, int]:
    """Per tensor, how many elements of ``a`` and ``b`` differ by more than lr / 100."""
    assert a.keys() == b.keys(), f"different tensors: {sorted(a.keys() ^ b.keys())}"
    return {name: int(((a[name].double() - b[name].double()).abs() > lr / 100).sum()) for name in a}


def allowed_adam_outliers(weights: dict[str, torch.Tensor], rows: list[dict]) -> dict[str, int]:
    """The module's bound, per tensor of ``weights``: how many elements rounding may move by more than lr / 100 over
    the Adam steps of ``rows`` (a run's step rows: their number and their largest token count)."""
    tokens = step_token_counts(rows)
    per_step = 100 / math.sqrt(2 * math.pi) * EPS * math.sqrt(max(tokens))
    return {name: 2 + math.floor(t.numel() * len(tokens) * per_step) for name, t in weights.items()}


def assert_same_adam_training(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], lr: float, rows: list[dict], label: str
) -> dict[str, int]:
    """Weights ``a`` and ``b`` after the same Adam steps at ``lr`` (``rows``: one of the runs' step rows) agree up to
    rounding as the module derives it; returns the outliers per tensor."""
    outliers, allowed = adam_outliers(a, b, lr), allowed_adam_outliers(a, rows)
    for name, count in outliers.items():
        assert count <= allowed[name], (
            f"{label}: {name}: {count} elements differ by > lr / 100 (allowed {allowed[name]})"
        )
    return outliers
