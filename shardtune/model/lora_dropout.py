"""LoRA dropout whose masks do not depend on how examples are spread over ranks.

peft applies ``lora_dropout[adapter](x)`` (an ``nn.Dropout``) to each adapted layer's input; its mask comes from
the rank's generator, so 2 processes x batch 2 and 1 process x batch 4 draw other masks for the same example and
end apart. Here each mask row is drawn from a generator seeded by (seed, optimizer step, the example's global
index, the dropout layer, the adapter): the same example gets the same mask at the same step in every layout,
whether it sits in a padded row, in a padding-free row with other examples, or split over sequence-parallel ranks
(a token's row is found by its position in its example). Activation checkpointing recomputes the same mask.

The training loop states where the examples are (``keyed_masks(batch, step)``) around each micro-batch's forward
and backward; the batch carries per token the example's global index and full length (shardtune.data.batching:
EXAMPLE_IDS, EXAMPLE_LENGTHS).
Outside that (a forward with no example index) the layer falls back to plain dropout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.data.batching import EXAMPLE_IDS, EXAMPLE_LENGTHS


@dataclass
class _Layout:
    seed: int
    step: int
    example_ids: torch.Tensor  # (rows, tokens)
    example_lengths: torch.Tensor  # (rows, tokens)
    positions: torch.Tensor  # (rows, tokens): position of each token in its example


_current: _Layout | None = None


@contextlib.contextmanager
def keyed_masks(batch: dict[str, torch.Tensor], seed: int, step: int):
    """Within: LoRA dropout draws the masks of ``batch``'s examples at optimizer ``step`` (no-op without ids)."""
    global _current
    if EXAMPLE_IDS not in batch:
        yield
        return
    previous, _current = (
        _current,
        _Layout(seed, step, batch[EXAMPLE_IDS], batch[EXAMPLE_LENGTHS], batch["position_ids"]),
    )
    try:
        yield
    finally:
        _current = previous


def _generator_seed(*parts: int) -> int:
    return hash(tuple(parts)) & (2**63 - 1)  # tuples of ints hash alike in every process


class ExampleKeyedDropout(nn.Module):
    """Inverted dropout with p; masks keyed by (seed, step, example, ``layer``) under :func:`keyed_masks`."""

    def __init__(self, p: float, layer: int):
        super().__init__()
        self.p, self.layer = p, layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = _current
        if not self.training or self.p == 0:
            return x
        if layout is None or x.dim() != 3 or x.shape[:2] != layout.example_ids.shape:
            return nn.functional.dropout(x, self.p, training=True)
        return x * self.mask(layout, x.shape[-1], x.device).to(x.dtype)

    def mask(self, layout: _Layout, features: int, device: torch.device) -> torch.Tensor:
        ids, lengths, positions = (t.to(device) for t in (layout.example_ids, layout.example_lengths, layout.positions))
        mask = torch.ones((*ids.shape, features), device=device)
        keep = 1.0 - self.p
        for example in ids.unique().tolist():
            if example < 0:
                continue
            where = ids == example
            generator = torch.Generator(device=device).manual_seed(
                _generator_seed(layout.seed, layout.step, example, self.layer)
            )
            length = int(lengths[where][0])
            example_mask = (torch.rand((length, features), generator=generator, device=device) < keep) / keep
            mask[where] = example_mask[positions[where]]
        return mask

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}, masks keyed by example and step"


def use_example_keyed_dropout(model: nn.Module) -> int:
    """Replace every LoRA ``nn.Dropout`` (peft's ``lora_dropout`` dicts) by ExampleKeyedDropout; returns how many.
    Layers are numbered in module order, which is the same on every rank and under every strategy."""
    count = 0
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, nn.ModuleDict):
            continue
        for adapter, dropout in list(dropouts.items()):
            if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                dropouts[adapter] = ExampleKeyedDropout(dropout.p, count)
                count += 1
    return count
