"""KTO's KL rows: each row's prompt with another row's completion, from which the step's KL reference point is
estimated, and the micro-batches that carry them.

TRL 1.16 pairs each row of a per-device batch with the completion of the row before it (the first with the last's),
in the data's order. Here the pairing is a function of the optimizer step's GLOBAL rows only: the step's rows sorted by
their index in the data, each given the completion of the row before it in that order (the first the last's). At one
process with one micro-batch a step's rows are TRL's batch, so the pairs are TRL's (with --train_sampling_strategy
sequential, TRL's KTO default, the same rows too); on any other layout of the same effective batch (processes x
per-device batch x accumulation) they are the same pairs, which TRL's per-device rotation is not.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from shardtune.data.batching import EXAMPLE_IDS, EXAMPLE_LENGTHS
from shardtune.data.unpaired import collate_rows

# the batch keys of a micro-batch's KL rows (shardtune.data.unpaired.collate_rows), and the optimizer step they train
KL_PREFIX = "KL_"
KL_STEP = "kl_step"


def rotated(indices: Sequence[int]) -> dict[int, int]:
    """Each index's partner among ``indices``: the one before it in increasing order (the first: the last)."""
    ordered = sorted(indices)
    return dict(zip(ordered, [ordered[-1], *ordered[:-1]]))


def chunk_partners(num_rows: int, chunk: int) -> np.ndarray:
    """Partners of rows taken ``chunk`` at a time in the data's order (the last chunk as long as it is): the steps of
    --train_sampling_strategy sequential, and the evaluation split's chunks."""
    partners = np.empty(num_rows, dtype=np.int64)
    for start in range(0, num_rows, chunk):
        for row, partner in rotated(range(start, min(start + chunk, num_rows))).items():
            partners[row] = partner
    return partners


def step_partners(order: Sequence[int], step_size: int, num_rows: int) -> np.ndarray:
    """Partners of an epoch's rows from its order (shardtune.data.batching.epoch_order: global step after global
    step); -1 for the rows no step of the epoch trains."""
    partners = np.full(num_rows, -1, dtype=np.int64)
    for start in range(0, len(order), step_size):
        for row, partner in rotated(order[start : start + step_size]).items():
            partners[row] = partner
    return partners


class KlRows:
    """What a collate needs to add each row's KL row: the rows (indexed by their ``index``) and their partners. A
    module-level class, so that data loader workers can take it."""

    def __init__(self, rows: Sequence, partners: np.ndarray, step_of: dict[int, int] | None = None) -> None:
        self.rows, self.partners, self.step_of = rows, partners, step_of or {}

    def completions(self, rows: list) -> list[list[int]]:
        return [self.rows[int(self.partners[row["index"]])]["completion_ids"] for row in rows]


def collate_kto_units(units: list[list], cfg, pad_id: int, kl: KlRows | None = None) -> dict[str, torch.Tensor]:
    """The training loader's collate for unpaired rows (one per unit): shardtune.data.unpaired.collate_rows with the
    run's --max_length, the KL rows when ``kl`` is given, and per token the keys of LoRA dropout's masks (the row's
    index; a KL row's: the number of rows + its row's index)."""
    rows = [row for unit in units for row in unit]
    batch = collate_rows(rows, pad_id, cfg.data.context_length, kl.completions(rows) if kl is not None else None)
    indices = [row["index"] for row in rows]
    batch.update(example_keys(batch, indices))
    if kl is not None:
        kl_ids = [len(kl.rows) + i for i in indices]
        batch.update({KL_PREFIX + k: v for k, v in example_keys(kl_view(batch), kl_ids).items()})
        batch[KL_STEP] = torch.tensor(kl.step_of.get(indices[0], 0))
    return batch


def example_keys(batch: dict[str, torch.Tensor], ids: list[int]) -> dict[str, torch.Tensor]:
    """Per token of right-padded rows: its sequence's key (-1 on padding), the sequence's length, and the positions
    (what the model computes by default for right-padded rows): shardtune.model.lora_dropout's masks."""
    rows, width = batch["input_ids"].shape
    real = batch["attention_mask"].bool()
    lengths = real.sum(dim=1, keepdim=True).expand(rows, width)
    return {
        EXAMPLE_IDS: torch.where(real, torch.tensor(ids)[:, None], -1),
        EXAMPLE_LENGTHS: torch.where(real, lengths, 0),
        "position_ids": torch.arange(width).expand(rows, width).clone(),
    }


def kl_view(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A micro-batch's KL rows as a micro-batch of their own (the keys without the ``KL_`` prefix)."""
    return {key[len(KL_PREFIX) :]: value for key, value in batch.items() if key.startswith(KL_PREFIX)}
