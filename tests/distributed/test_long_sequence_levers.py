"""--tiled_mlp and --activation_offloading train exactly as without them, in a real launch: 2 gloo processes,
FSDP2 with activation checkpointing (the setting they are meant for), packed rows of up to 256 tokens (tiles of
the tiny preset's 64)."""

from __future__ import annotations

from tests.helpers import assert_same_training


def sft(run_cli, model, out, *extra):
    return run_cli(
        "sft",
        "--nproc_per_node",
        2,
        "--model_name",
        model,
        "--output_dir",
        out,
        "--enable_fsdp",
        "--fsdp_config.fsdp_activation_checkpointing",
        "true",
        "--batch_size_training",
        2,
        "--context_length",
        256,
        "--synthetic_dialogues.num_train",
        64,
        "--synthetic_dialogues.num_validation",
        8,
        "--run_validation",
        "false",
        "--max_train_step",
        4,
        "--lr",
        3e-3,
        "--gradient_clipping",
        "true",
        "--num_workers_dataloader",
        0,
        *extra,
    )


def test_tiled_mlp_and_activation_offloading_train_identically(tiny_model, run_cli, tmp_path):
    sft(run_cli, tiny_model, tmp_path / "plain")
    levers = sft(run_cli, tiny_model, tmp_path / "levers", "--tiled_mlp", "true", "--activation_offloading", "true")
    assert "long sequences: MLP of each of the 2 decoder layers over tiles of 64 tokens" in levers.stdout
    print("weights relative difference:", assert_same_training(tmp_path / "plain", tmp_path / "levers", "levers"))
