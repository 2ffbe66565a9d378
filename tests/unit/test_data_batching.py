"""Batching: packing, collation, the global-batch rule, per-rank loaders and eval sharding."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from shardtune.config.flags import config_from
from shardtune.config.schema import TrainConfig
from shardtune.data import (
    DataError,
    StepDataset,
    build_units,
    collate_flat,
    collate_padding,
    eval_batches,
    grouped_eval_batches,
    steps_per_epoch,
    train_loader,
)
from shardtune.data.batching import flattened
from shardtune.data.formatting import IGNORE_INDEX

PAD_ID = 0
FIRST_ID = 1000  # example i starts with token FIRST_ID + i, so every batch can be traced back to its examples


def make_examples(num: int, seed: int = 0, max_len: int = 40) -> list[dict]:
    rng = random.Random(seed)
    examples = []
    for i in range(num):
        length = rng.randint(3, max_len)
        ids = [FIRST_ID + i] + [rng.randint(4, 99) for _ in range(length - 1)]
        num_prompt = rng.randint(1, length - 1)
        examples.append({"input_ids": ids, "labels": [IGNORE_INDEX] * num_prompt + ids[num_prompt:]})
    return examples


def make_cfg(strategy: str, batch_size: int = 2, accumulation: int = 1, **overrides) -> TrainConfig:
    settings = {"context_length": 64, "seed": 3, "num_workers_dataloader": 0, **overrides}
    return config_from(
        batching_strategy=strategy, batch_size_training=batch_size, gradient_accumulation_steps=accumulation, **settings
    )


def example_ids(micro_batch: dict) -> list[int]:
    """Ids of the examples in a micro-batch, found by their first token."""
    starts = micro_batch["position_ids"] == 0
    ids = micro_batch["input_ids"][starts & (micro_batch["input_ids"] >= FIRST_ID)]
    return [int(t) - FIRST_ID for t in ids]


def unit_keys(micro_batch: dict, unit_of: dict[int, int]) -> list[int]:
    """The units of a micro-batch, in order: a padded row or a run of a padding-free row is found by its examples."""
    keys: list[int] = []
    for example in example_ids(micro_batch):
        if not keys or keys[-1] != unit_of[example]:
            keys.append(unit_of[example])
    return keys


def test_packed_blocks_fit_hold_every_example_once_and_ignore_batch_settings():
    examples = make_examples(100)
    units = build_units(examples, make_cfg("packing"))
    assert all(sum(len(ex["input_ids"]) for ex in unit) <= 64 for unit in units)
    assert sorted(ex["input_ids"][0] for unit in units for ex in unit) == [FIRST_ID + i for i in range(100)]
    assert len(units) < 100
    assert build_units(examples, make_cfg("packing", batch_size=7, accumulation=3)) == units
    # greedy: a block is closed only when the next example does not fit
    for block, following in zip(units, units[1:]):
        assert sum(len(ex["input_ids"]) for ex in block) + len(following[0]["input_ids"]) > 64
    assert build_units(examples, make_cfg("padding")) == [[ex] for ex in examples]


def test_flat_collation_restarts_positions_marks_boundaries_and_holds_no_pad():
    examples = [
        {"input_ids": [1000, 5, 6], "labels": [1000, 5, 6]},
        {"input_ids": [1001, 7], "labels": [IGNORE_INDEX, 7]},
        {"input_ids": [1002], "labels": [1002]},
    ]
    batch = collate_flat(examples)
    assert batch["input_ids"].tolist() == [[1000, 5, 6, 1001, 7, 1002]]
    assert batch["labels"].tolist() == [[-100, 5, 6, -100, 7, -100]]  # nothing predicted across a boundary
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert batch["cu_seq_lens"].tolist() == [0, 3, 5, 6] and batch["cu_seq_lens"].dtype == torch.int32
    assert int(batch["max_length"]) == 3 and "attention_mask" not in batch


def test_packing_and_padding_free_collate_flat_rows_padding_pads():
    examples = make_examples(12)
    for strategy, extra, flat in (
        ("packing", {}, True),
        ("padding", {"padding_free": True}, True),
        ("padding", {}, False),
    ):
        cfg = make_cfg(strategy, batch_size=3, **extra)
        units = build_units(examples, cfg)
        micro_batch = StepDataset(units, cfg, 0, 1, 0, PAD_ID)[0][0]
        assert ("cu_seq_lens" in micro_batch) == flat and ("attention_mask" in micro_batch) != flat
        if flat:
            chosen = [
                ex for unit in (units[i] for i in StepDataset(units, cfg, 0, 1, 0, PAD_ID).order[:3]) for ex in unit
            ]
            assert micro_batch["input_ids"].shape == (1, sum(len(ex["input_ids"]) for ex in chosen))


def test_padding_collation_pads_right_and_masks_pads():
    examples = [{"input_ids": [1000, 5, 6], "labels": [-100, 5, 6]}, {"input_ids": [1001], "labels": [1001]}]
    batch = collate_padding(examples, pad_id=PAD_ID)
    assert batch["input_ids"].tolist() == [[1000, 5, 6], [1001, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 5, 6], [1001, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert all(t.dtype == torch.long for t in batch.values())


LAYOUTS = [(1, 8, 1), (1, 2, 4), (2, 4, 1), (4, 2, 1)]  # (world size, micro-batch, accumulation)


def steps_by_layout(units: list, strategy: str, epoch: int, seed: int = 3) -> dict[tuple, list[list[list]]]:
    """layout -> step -> rank -> unit keys of that rank's micro-batches (in accumulation order)."""
    out = {}
    for world, batch_size, accumulation in LAYOUTS:
        cfg = make_cfg(strategy, batch_size, accumulation)
        cfg.train.seed = seed
        per_rank = [StepDataset(units, cfg, rank, world, epoch, PAD_ID) for rank in range(world)]
        unit_of = {example["input_ids"][0] - FIRST_ID: u for u, unit in enumerate(units) for example in unit}
        out[(world, batch_size, accumulation)] = [
            [[key for mb in ds[step] for key in unit_keys(mb, unit_of)] for ds in per_rank]
            for step in range(len(per_rank[0]))
        ]
    return out


@pytest.mark.parametrize("strategy", ["padding", "packing"])
def test_every_layout_trains_on_the_same_global_batches(strategy):
    units = build_units(make_examples(70 if strategy == "padding" else 150), make_cfg(strategy))
    layouts = steps_by_layout(units, strategy, epoch=0)
    reference = layouts[(1, 8, 1)]
    assert len(reference) == len(units) // 8
    for layout, steps in layouts.items():
        assert len(steps) == len(reference), layout
        for step, ranks in enumerate(steps):
            union = [key for rank in ranks for key in rank]
            assert Counter(union) == Counter(reference[step][0]), (layout, step)
            assert len(set(union)) == len(union) == 8, (layout, step)  # ranks are disjoint
    seen = [key for step in reference for key in step[0]]
    assert len(set(seen)) == len(seen) == 8 * len(reference)  # no unit twice in an epoch

    assert steps_by_layout(units, strategy, epoch=0) == layouts  # same seed, same order
    next_epoch = steps_by_layout(units, strategy, epoch=1)[(1, 8, 1)]
    assert [set(s[0]) for s in next_epoch] != [set(s[0]) for s in reference]
    other_seed = steps_by_layout(units, strategy, epoch=0, seed=4)[(1, 8, 1)]
    assert [set(s[0]) for s in other_seed] != [set(s[0]) for s in reference]


def test_padding_micro_batches_are_length_grouped():
    examples = make_examples(64, max_len=60)
    cfg = make_cfg("padding", batch_size=2, accumulation=4)
    units = build_units(examples, cfg)
    world = 2
    loaders = [StepDataset(units, cfg, rank, world, 0, PAD_ID) for rank in range(world)]
    for step in range(len(loaders[0])):
        # micro-batch j of rank r is slice j * world + r of the length-sorted global batch
        ordered = [mb for j in range(4) for rank in range(world) for mb in [loaders[rank][step][j]]]
        lengths = [int(n) for mb in ordered for n in mb["attention_mask"].sum(dim=1)]
        assert lengths == sorted(lengths)
        assert all(mb["input_ids"].shape[1] == int(mb["attention_mask"].sum(dim=1).max()) for mb in ordered)


def test_steps_per_epoch_drops_the_partial_global_batch():
    cfg = make_cfg("padding", batch_size=2, accumulation=3)
    assert steps_per_epoch(25, cfg, dp_size=2) == 2
    with pytest.raises(DataError, match="dataset too small for effective batch 12"):
        steps_per_epoch(11, cfg, dp_size=2)


@pytest.mark.parametrize("packing_strategy", ["greedy", "bfd", "bfd_split", "wrapped"])
def test_start_step_resumes_the_same_sequence(packing_strategy):
    """A resumed run packs its examples again: the same blocks, so the same micro-batches from its step on."""
    cfg = make_cfg("packing", batch_size=2, accumulation=2, packing_strategy=packing_strategy)
    units = build_units(make_examples(120), cfg)
    full = StepDataset(units, cfg, dp_rank=1, dp_size=2, epoch=2, pad_id=PAD_ID)
    again = build_units(make_examples(120), cfg)
    resumed = StepDataset(again, cfg, dp_rank=1, dp_size=2, epoch=2, pad_id=PAD_ID, start_step=3)
    assert len(resumed) == len(full) - 3
    for i in range(len(resumed)):
        for a, b in zip(resumed[i], full[i + 3]):
            assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(IndexError):
        resumed[len(resumed)]


def test_resuming_at_a_late_step_collates_no_earlier_batch():
    """Resume without replay: the loader starts at its step; the micro-batches it collates are that step's alone,
    whatever the step (a loader that iterated the earlier steps and threw them away would collate them)."""
    cfg = make_cfg("padding", batch_size=2, accumulation=2)
    units = build_units(make_examples(400), cfg)
    last = steps_per_epoch(len(units), cfg, 2) - 1
    for start in (1, last // 2, last):
        collated: list[list] = []

        def counting_collate(chosen, cfg, pad_id, collated=collated):
            collated.append(chosen)
            return collate_padding([example for unit in chosen for example in unit], pad_id)

        loader = train_loader(units, cfg, 1, 2, 0, PAD_ID, start_step=start, collate_fn=counting_collate)
        first = next(iter(loader))
        assert len(collated) == 2, start  # the step's two micro-batches, nothing before them
        expected = StepDataset(units, cfg, 1, 2, 0, PAD_ID)[start]
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, expected))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_train_loader_yields_the_step_dataset(num_workers):
    cfg = make_cfg("padding", batch_size=3, accumulation=2, num_workers_dataloader=num_workers)
    units = build_units(make_examples(40), cfg)
    loader = train_loader(units, cfg, dp_rank=0, dp_size=2, epoch=0, pad_id=PAD_ID, start_step=1)
    dataset = StepDataset(units, cfg, 0, 2, 0, PAD_ID, start_step=1)
    steps = list(loader)
    assert len(steps) == len(dataset) == len(units) // 12 - 1
    for got, expected in zip(steps, (dataset[i] for i in range(len(dataset)))):
        assert len(got) == 2
        assert all(torch.equal(g[k], e[k]) for g, e in zip(got, expected) for k in e)


@pytest.mark.parametrize("world, val_batch_size", [(1, 1), (2, 2), (3, 2), (4, 3)])
def test_eval_batches_cover_each_example_once_with_equal_counts(world, val_batch_size):
    examples = make_examples(11)
    cfg = make_cfg("packing", val_batch_size=val_batch_size)
    per_rank = [eval_batches(examples, cfg, rank, world, PAD_ID) for rank in range(world)]
    assert len({len(batches) for batches in per_rank}) == 1
    seen = [i for batches in per_rank for mb in batches for i in example_ids(mb)]
    assert sorted(seen) == list(range(11))
    for batches in per_rank:
        for mb in batches:
            assert mb["input_ids"].shape[0] <= val_batch_size and mb["attention_mask"].dim() == 2
            if not example_ids(mb):  # a dummy batch: joins the collectives, contributes no loss
                assert (mb["labels"] == IGNORE_INDEX).all() and mb["attention_mask"].all()


@pytest.mark.parametrize(
    "strategy, world, val_batch_size, max_eval_step",
    [("packing", 1, 1, 0), ("padding", 2, 1, 0), ("padding", 3, 2, 0), ("packing", 4, 3, 0), ("padding", 3, 1, 2)],
)
def test_grouped_eval_batches_run_each_ranks_examples_in_fewer_forwards(strategy, world, val_batch_size, max_eval_step):
    """Evaluation's grouped micro-batches hold exactly the examples eval_batches gives the rank, in its order, with
    the same labelled tokens; at most a training micro-batch's tokens each (context_length x batch_size; padded: rows
    x their longest) unless one chunk alone is more; padding-free rows where training's are, padded batches
    otherwise; as many batches on every rank; fewer than the chunks when --val_batch_size is 1."""
    from shardtune.model.loss import batch_label_tokens

    examples = make_examples(23)
    cfg = make_cfg(strategy, batch_size=2, val_batch_size=val_batch_size, max_eval_step=max_eval_step)
    budget = cfg.data.context_length * cfg.train.batch_size
    counts = set()
    for rank in range(world):
        chunks = eval_batches(examples, cfg, rank, world, PAD_ID)
        grouped = grouped_eval_batches(examples, cfg, rank, world, PAD_ID)
        counts.add(len(grouped))
        assert [i for mb in grouped for i in example_ids(mb)] == [i for mb in chunks for i in example_ids(mb)]
        assert sum(map(batch_label_tokens, grouped)) == sum(map(batch_label_tokens, chunks))
        for mb in grouped:
            assert ("cu_seq_lens" in mb) == (strategy == "packing")
            if len(example_ids(mb)) > val_batch_size:  # joined chunks stay within the budget
                assert mb["input_ids"].numel() <= budget
        if val_batch_size == 1 and max_eval_step == 0:
            assert len(grouped) < len(chunks)
    assert len(counts) == 1


def test_max_eval_step_caps_batches_per_rank():
    cfg = make_cfg("padding", val_batch_size=2, max_eval_step=2)
    per_rank = [eval_batches(make_examples(20), cfg, rank, 3, PAD_ID) for rank in range(3)]
    assert [len(b) for b in per_rank] == [2, 2, 2]
    seen = [i for batches in per_rank for mb in batches for i in example_ids(mb)]
    assert len(seen) == len(set(seen)) == 12


def test_padding_free_not_given_is_the_objectives_choice():
    """--padding_free not given: text SFT computes padded micro-batches as padding-free rows on CPU (the same numbers:
    tests/distributed/test_equivalence.py), padded rows on CUDA; given, it is kept; DPO's rows stay padded."""
    from shardtune.runtime.distributed import local_gpu_count
    from shardtune.training.engine.checks import resolve_padding_free

    on_cpu = local_gpu_count() == 0
    for settings, resolved in (
        ({"batching_strategy": "padding"}, on_cpu),
        ({"batching_strategy": "padding", "padding_free": False}, False),
        ({"batching_strategy": "padding", "padding_free": True}, True),
        ({"batching_strategy": "packing"}, False),  # packed blocks are flat rows whatever the flag
        ({"objective": "dpo"}, False),
    ):
        cfg = config_from(settings)
        assert cfg.data.padding_free is settings.get("padding_free")
        resolve_padding_free(cfg)
        assert cfg.data.padding_free is resolved, settings
        assert flattened(cfg) == (resolved or cfg.data.batching == "packing")
