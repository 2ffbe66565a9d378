"""Bytes that cross node boundaries per optimizer step: the formula against values computed by hand."""

from __future__ import annotations

import pytest

from shardtune.accounting.memory import cross_node_bytes_per_step, cross_node_summary

# 1e9 parameters, all trainable, bf16 compute (2 bytes), fp32 gradients (4 bytes), 2 nodes x 8 GPUs (16 ranks)
SIZES = dict(num_params=1e9, num_trainable=1e9, num_nodes=2, gpus_per_node=8)


@pytest.mark.parametrize(
    "strategy, extra, expected_gb",
    [
        # all-reduce of 4 GB of gradients over a 16-rank ring: 2 x 15/16 x 4
        ("DDP", {}, 7.5),
        ("NO_SHARD", {}, 7.5),
        # two all-gathers of 2 GB of bf16 parameters (15/16 each) + one reduce-scatter of 4 GB (15/16)
        ("FULL_SHARD", {}, 2 * 15 / 16 * 2 + 15 / 16 * 4),
        # 4 micro-batches: the gathers repeat per micro-batch, the gradients are reduced once
        ("FULL_SHARD", {"micro_batches": 4}, 4 * 2 * 15 / 16 * 2 + 15 / 16 * 4),
        ("SHARD_GRAD_OP", {}, 15 / 16 * 2 + 15 / 16 * 4),
        # shard within a node: 8 rings of 2 replicas, each all-reducing a 4/8 GB shard: 8 x 2 x 1/2 x 0.5
        ("HYBRID_SHARD", {}, 4.0),
        # a shard group of 16 ranks is FULL_SHARD over both nodes, with a single replica
        ("HYBRID_SHARD", {"shard_group_size": 16}, 7.5),
        # shard groups of 4 ranks: 4 replicas (2 per node); 4 rings per node, each 2 x 3/4 x 1 GB
        ("HYBRID_SHARD", {"shard_group_size": 4}, 6.0),
    ],
)
def test_bytes_sent_by_each_node_per_step(strategy, extra, expected_gb):
    assert cross_node_bytes_per_step(strategy, **SIZES, **extra) == pytest.approx(expected_gb * 1e9, rel=1e-9)


def test_nothing_crosses_on_one_node_and_lora_sends_only_its_adapter_gradients():
    assert cross_node_bytes_per_step("FULL_SHARD", 1e9, 1e9, num_nodes=1, gpus_per_node=8) == 0
    # LoRA under DDP: 1e6 trainable fp32 parameters over 2 nodes x 1 rank: 2 x 1/2 x 4e6
    assert cross_node_bytes_per_step("DDP", 1e9, 1e6, num_nodes=2, gpus_per_node=1) == 4_000_000


def test_start_log_line_names_the_choice_and_the_alternatives():
    line = cross_node_summary("HYBRID_SHARD", 2, 8, num_params=1e9, num_trainable=1e9)
    assert line.startswith("traffic between nodes: 3.7 GiB sent by each node per optimizer step with HYBRID_SHARD")
    assert "DDP 7.0 GiB, FULL_SHARD 7.0 GiB" in line
