"""The backbone property: configurations with the same effective batch train identically.

processes x per-device batch x accumulation = 8 in every configuration below (the CPU-sized version of the
TRL table 1 x 32 x 1, 1 x 4 x 8, 8 x 4 x 1). Real torchrun launches of gloo processes, real tiny Llama.
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_same_training, max_relative_difference, step_rows, weights

# (processes, batch_size_training, gradient_accumulation_steps)
PACKING_CONFIGS = [(1, 8, 1), (1, 2, 4), (2, 4, 1), (4, 2, 1)]
# --padding_free computes padding's micro-batches as one row without pad tokens: it must train the same way
PADDING_CONFIGS = [(1, 8, 1), (1, 2, 4, "padding_free"), (2, 2, 2), (2, 2, 2, "padding_free")]
# TRL's packing strategies (shardtune.data.packing): their blocks depend on the data alone, so 1 x 4 = 2 x 2 = 1 x 2 x 2
TRL_PACKING_CONFIGS = [(1, 4, 1), (2, 2, 1), (1, 2, 2)]


def sft(run_cli, model, out, nproc, batch, accum, batching, *extra):
    run_cli(
        "sft",
        "--nproc_per_node",
        nproc,
        "--model_name",
        model,
        "--output_dir",
        out,
        "--batch_size_training",
        batch,
        "--gradient_accumulation_steps",
        accum,
        "--batching_strategy",
        batching,
        "--context_length",
        256,
        "--synthetic_dialogues.num_train",
        96,
        "--synthetic_dialogues.num_validation",
        16,
        "--max_train_step",
        4,
        "--lr",
        3e-3,
        "--gradient_clipping",
        "true",
        "--num_workers_dataloader",
        0,
        "--val_batch_size",
        4,
        *extra,
    )
    return out


@pytest.mark.parametrize(
    "batching,strategy,configs",
    [
        ("packing", "greedy", PACKING_CONFIGS),
        ("padding", "", PADDING_CONFIGS),
        ("packing", "bfd", TRL_PACKING_CONFIGS),
        ("packing", "wrapped", TRL_PACKING_CONFIGS),
    ],
)
def test_same_effective_batch_gives_same_losses_and_weights(batching, strategy, configs, tiny_model, run_cli, tmp_path):
    outs = {}
    for cfg in configs:
        # padded rows asked for by name: on CPU, padding's default is padding-free (SFT.padding_free_by_default)
        extra = ("--padding_free", "true" if "padding_free" in cfg else "false") if batching == "padding" else ()
        extra += ("--packing_strategy", strategy) if strategy else ()
        outs[cfg] = sft(run_cli, tiny_model, tmp_path / "x".join(map(str, cfg)), *cfg[:3], batching, *extra)
    ref = outs[configs[0]]
    losses = [r["loss"] for r in step_rows(ref)]
    assert losses[-1] < losses[0], "the model did not learn: the comparison would be vacuous"
    for cfg, out in outs.items():
        assert_same_training(ref, out, f"{batching} {strategy} {cfg}")


def test_a_different_effective_batch_trains_differently(tiny_model, run_cli, tmp_path):
    """Control: the comparison above can fail (same data, effective batch 4 instead of 8)."""
    a = sft(run_cli, tiny_model, tmp_path / "a", 1, 8, 1, "packing")
    b = sft(run_cli, tiny_model, tmp_path / "b", 1, 4, 1, "packing")
    assert step_rows(a)[0]["label_tokens"] != step_rows(b)[0]["label_tokens"]
    assert max_relative_difference(weights(a), weights(b)) > 1e-3


def test_two_runs_with_the_same_seed_log_identical_metrics(tiny_model, run_cli, tmp_path):
    a = sft(run_cli, tiny_model, tmp_path / "a", 2, 2, 2, "padding")
    b = sft(run_cli, tiny_model, tmp_path / "b", 2, 2, 2, "padding")
    keys = ("step", "epoch", "loss", "num_tokens", "label_tokens", "lr", "grad_norm", "mean_token_accuracy", "entropy")
    assert [{k: r[k] for k in keys} for r in step_rows(a)] == [{k: r[k] for k in keys} for r in step_rows(b)]
    assert max_relative_difference(weights(a), weights(b)) == 0.0
