"""The tokenised corpus stays on disk: every process memory-maps the cache entry (shardtune.data.cache.TokenStore)
and examples, units and micro-batches are views into it. The batches are exactly those of the examples as lists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardtune.config.schema import TrainConfig
from shardtune.data.batching import build_units, collate, epoch_order, micro_batch_slice, steps_per_epoch
from shardtune.data.cache import ExampleView, TokenStore, load_examples_cached
from shardtune.data.packing import TokenSlice
from shardtune.model.loading import train_tokenizer


@pytest.mark.parametrize(
    "batching,padding_free,packing_strategy",
    [("padding", False, "greedy"), ("padding", True, "greedy")]
    + [("packing", False, strategy) for strategy in ("greedy", "bfd", "bfd_split", "wrapped")],
)
def test_batches_from_the_memory_mapped_store_equal_those_from_lists(
    tmp_path, batching, padding_free, packing_strategy
):
    """Every packing strategy too: wrapped blocks and split rows are slices of the maps (nothing copied)."""
    cfg = TrainConfig()
    cfg.data.synthetic_dialogues.num_train = 40
    cfg.data.batching, cfg.data.padding_free, cfg.data.context_length = batching, padding_free, 256
    cfg.data.packing_strategy = packing_strategy
    if packing_strategy in ("bfd_split", "wrapped"):
        cfg.data.context_length = 96  # dialogues longer than a block: split (with greedy / bfd they would be skipped)
    cfg.train.batch_size, cfg.train.gradient_accumulation_steps = 2, 2
    tokenizer = train_tokenizer()
    written, _ = load_examples_cached(cfg, tokenizer, "train", tmp_path)  # the process that tokenised
    store, _ = load_examples_cached(cfg, tokenizer, "train", tmp_path)  # the others: the same files, mapped
    assert isinstance(store, TokenStore) and isinstance(written, TokenStore)
    assert isinstance(store.input_ids, np.memmap) and isinstance(store.labels, np.memmap)  # no token held as a list
    lists = [dict(example) for example in store]
    assert all(isinstance(e["input_ids"], list) and isinstance(e["input_ids"][0], int) for e in lists)
    assert [v.length for v in store] == [len(e["input_ids"]) for e in lists] == store.lengths.tolist()
    assert store == lists and store[-1] == lists[-1] and store[1:3] == lists[1:3]
    with pytest.raises(IndexError):
        store[len(store)]
    units = {"store": build_units(store, cfg), "lists": build_units(lists, cfg)}
    assert isinstance(units["store"][0][0], ExampleView if packing_strategy != "wrapped" else TokenSlice)
    assert packing_strategy != "bfd_split" or any(isinstance(e, TokenSlice) for u in units["store"] for e in u)
    dp = 2
    for epoch in range(2):
        orders = {name: epoch_order(u, cfg, dp, epoch) for name, u in units.items()}
        assert orders["store"] == orders["lists"]
        for step in range(steps_per_epoch(len(units["store"]), cfg, dp)):
            for micro in range(2):
                for rank in range(dp):
                    where = orders["store"][micro_batch_slice(step, micro, rank, cfg, dp)]
                    a, b = (collate([units[n][i] for i in where], cfg, pad_id=0, example_ids=where) for n in units)
                    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (epoch, step, micro)


def test_a_store_whose_files_disagree_is_refused(tmp_path):
    cfg = TrainConfig()
    cfg.data.synthetic_dialogues.num_train = 8
    store, _ = load_examples_cached(cfg, train_tokenizer(), "train", tmp_path)
    [entry] = [p for p in (tmp_path / "tokenized").iterdir() if p.is_dir()]
    np.save(entry / "offsets.npy", store.offsets[:-1])  # the last example's end lost
    with pytest.raises(ValueError, match="offsets end at"):
        TokenStore(entry)
