"""The data side of sequence / context parallelism: dimensions, the split of a packed row, checks on the model."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig

from shardtune.accounting.flops import num_input_tokens
from shardtune.config.flags import config_from
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.batching import collate_flat, eval_batches
from shardtune.model.loss import IGNORE_INDEX, SEQUENCE_LAYOUT, SHIFT_LABELS, batch_label_tokens
from shardtune.parallel.dims import ParallelDims
from shardtune.parallel.sequence import RowSlice, check_sequence_split, split_row


def config(**values) -> TrainConfig:
    return config_from(values)


def test_ranks_of_one_cp_x_sp_group_share_their_data_parallel_rank():
    dims = ParallelDims.from_config(config(sequence_parallel_size=2, context_parallel_size=2), world_size=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.sp, dims.dp_size) == (1, 2, 2, 2, 2)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [dims.sp_rank(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    hsdp = config(enable_fsdp=True, sequence_parallel_size=2, sharding_strategy="HYBRID_SHARD")
    assert (
        ParallelDims.from_config(hsdp, world_size=8, local_world_size=4).describe()
        == "dp_replicate 2 x dp_shard 2 x cp 1 x sp 2"
    )
    with pytest.raises(
        ConfigError, match="--context_parallel_size 3 x --sequence_parallel_size 1 = 3 does not divide the world size 4"
    ):
        ParallelDims.from_config(config(context_parallel_size=3), world_size=4)


def packed(lengths: list[int]) -> dict:
    start = 10
    examples = []
    for n in lengths:
        ids = list(range(start, start + n))
        examples.append({"input_ids": ids, "labels": [IGNORE_INDEX] + ids[1:]})
        start += n
    return collate_flat(examples)


@pytest.mark.parametrize("cp,sp", [(1, 2), (1, 4), (2, 1), (2, 2)])
def test_slices_cover_the_padded_row_once_with_labels_shifted_before_the_split(cp, sp):
    row = packed([5, 9, 3, 6])  # 23 tokens
    multiple = 2 * cp * sp
    padded = -(-23 // multiple) * multiple
    slices = [split_row(row, RowSlice(c, cp, s, sp), pad_id=0) for c in range(cp) for s in range(sp)]
    tokens = torch.cat([piece["input_ids"][0] for piece in slices])
    assert sorted(tokens.tolist()) == [0] * (padded - 23) + list(range(10, 33))
    # the target of every real token is the next token of its own document; documents' last tokens and padding
    # predict nothing; positions restart per document, padding included
    targets = {
        int(t): int(y) for piece in slices for t, y in zip(piece["input_ids"][0], piece[SHIFT_LABELS][0]) if t != 0
    }
    last_of_document = {14, 23, 26, 32}
    assert targets == {t: (IGNORE_INDEX if t in last_of_document else t + 1) for t in range(10, 33)}
    assert all((piece[SHIFT_LABELS][0][piece["input_ids"][0] == 0] == IGNORE_INDEX).all() for piece in slices)
    # summed over the group, the slices' counts are the row's: its 23 real tokens (TRL's num_tokens counts no padding,
    # the split's neither) and its labelled ones, each counted once
    assert sum(num_input_tokens(piece) for piece in slices) == 23
    assert sum(batch_label_tokens(piece) for piece in slices) == 23 - 4
    layout = slices[0][SEQUENCE_LAYOUT]
    assert layout.cu_seq_lens.tolist() == [0, 5, 14, 17, 23] + ([padded] if padded > 23 else [])
    assert layout.chunk_len * 2 * cp == padded
    if cp == 2:  # rank 0 holds the first and the last chunk (causal load balance)
        first = torch.cat([split_row(row, RowSlice(0, cp, s, sp), 0)["input_ids"][0] for s in range(sp)])
        assert first[0] == 10 and first[-1] == 0


def test_eval_rows_are_split_like_training_rows_by_the_ranks_of_a_group():
    """8 ranks as dp 2 x cp 2 x sp 2, 7 eval examples in chunks of 2: a data-parallel rank's cp x sp group shares
    its chunks, each rank holds a slice of every chunk's padding-free row, and every labelled token of the unsplit
    (padding-collated) eval batches is counted on exactly one rank."""
    cfg = config(sequence_parallel_size=2, context_parallel_size=2, val_batch_size=2)
    dims = ParallelDims.from_config(cfg, world_size=8)
    examples = packed([5, 9, 3, 6, 4, 8, 7])
    cu = examples["cu_seq_lens"].tolist()
    examples = [
        {"input_ids": examples["input_ids"][0, a:b].tolist(), "labels": examples["labels"][0, a:b].tolist()}
        for a, b in zip(cu, cu[1:])
    ]
    per_rank = [
        eval_batches(examples, cfg, dims.dp_rank(r), dims.dp_size, 0, RowSlice.of_rank(dims, r)) for r in range(8)
    ]
    assert {len(batches) for batches in per_rank} == {2}  # 4 chunks over 2 data-parallel ranks
    unsplit = [mb for dp in range(2) for mb in eval_batches(examples, cfg, dp, 2, 0)]
    assert (
        sum(batch_label_tokens(mb) for batches in per_rank for mb in batches)
        == sum(batch_label_tokens(mb) for mb in unsplit)
        > 0
    )
    for dp in range(2):
        group = per_rank[4 * dp : 4 * dp + 4]
        for i in range(2):  # the group's slices of batch i cover its row once (the chunk of examples 2i, 2i + 1)
            tokens = sorted(t for batches in group for t in batches[i]["input_ids"][0].tolist() if t)
            expected = sorted(t for e in examples[2 * (2 * i + dp) : 2 * (2 * i + dp) + 2] for t in e["input_ids"])
            assert tokens == expected and all(SEQUENCE_LAYOUT in batches[i] for batches in group)


def test_model_checks_name_the_head_counts_and_refuse_sliding_windows_for_the_ring():
    llama8b = LlamaConfig(num_attention_heads=32, num_key_value_heads=8)
    check_sequence_split(config(sequence_parallel_size=32), llama8b)  # KV heads repeated beyond 8
    with pytest.raises(
        ConfigError,
        match="--sequence_parallel_size 3 must divide the model's 32 attention heads "
        r"\(8 KV heads",
    ):
        check_sequence_split(config(sequence_parallel_size=3), llama8b)
    windowed = MistralConfig(sliding_window=4096)
    with pytest.raises(ConfigError, match="sliding window .4096 tokens"):
        check_sequence_split(config(context_parallel_size=2), windowed)
    check_sequence_split(config(sequence_parallel_size=2), windowed)
