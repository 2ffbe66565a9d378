"""LoRA dropout masks keyed by (seed, step, example, layer): an example's tokens get the same mask in a padded
batch, in a padding-free row beside other examples, and in the slices of a row split over sequence-parallel ranks
(the launched 1 x 8 == 2 x 4 run: tests/distributed/test_peft.py)."""

from __future__ import annotations

import torch

from shardtune.config.flags import config_from
from shardtune.config.schema import TrainConfig
from shardtune.data.batching import EXAMPLE_IDS, collate
from shardtune.model.lora_dropout import ExampleKeyedDropout, keyed_masks
from shardtune.parallel.sequence import RowSlice, split_row

FEATURES = 16


def example(n: int, first: int) -> dict[str, list[int]]:
    ids = list(range(first, first + n))
    return {"input_ids": ids, "labels": ids}


def masks_by_token(batch: dict, step: int = 3) -> dict[tuple[int, int], torch.Tensor]:
    """{(example, position): that token's mask row} as the dropout layer draws it for ``batch``."""
    layer = ExampleKeyedDropout(0.25, layer=5).train()
    x = torch.ones((*batch["input_ids"].shape, FEATURES))
    with keyed_masks(batch, seed=7, step=step):
        out = layer(x)
    found = {}
    for row, pos in zip(*torch.nonzero(batch[EXAMPLE_IDS] >= 0, as_tuple=True)):
        found[int(batch[EXAMPLE_IDS][row, pos]), int(batch["position_ids"][row, pos])] = out[row, pos]
    return found


def test_an_examples_mask_is_the_same_in_padded_flat_and_split_rows():
    units = [[example(5, 10)], [example(9, 20)], [example(3, 40)]]
    ids = [4, 11, 12]
    padded = masks_by_token(collate(units, TrainConfig(), pad_id=0, example_ids=ids))
    flat = masks_by_token(collate(units, config_from(padding_free=True), 0, ids))
    alone = masks_by_token(collate(units[1:2], TrainConfig(), 0, ids[1:2]))  # another batch, another rank
    row = collate(units, config_from(padding_free=True), 0, ids)
    split: dict = {}
    for sp_rank in range(2):
        split.update(masks_by_token(split_row(row, RowSlice(0, 1, sp_rank, 2), pad_id=0)))
    assert len(padded) == 17 and padded.keys() == flat.keys() == split.keys()
    for key in padded:
        assert torch.equal(padded[key], flat[key]) and torch.equal(padded[key], split[key]), key
        if key[0] == 11:
            assert torch.equal(padded[key], alone[key])
    values = torch.stack(list(padded.values()))
    assert set(values.unique().tolist()) == {0.0, torch.tensor(1 / 0.75).item()}  # inverted dropout, p = 0.25
    assert not torch.equal(padded[4, 0], padded[11, 0])  # examples differ
    assert not torch.equal(masks_by_token(collate(units, TrainConfig(), 0, ids), step=4)[4, 0], padded[4, 0])
