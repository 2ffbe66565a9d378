"""`shardtune sft --dry_run`: the checks, the meta-device model, the mesh and the per-rank shards of a run without
hardware, processes or weights; then the plan. The per-rank state of a dry run equals a real run's start log:
tests/distributed/test_fsdp.py (folded into its 4-process run)."""

from __future__ import annotations

import re

import pytest

from tests.e2e.test_bad_input import assert_one_line_error

GIB = 2**30


def table_row(stdout: str, setup: str) -> str:
    """The plan table's row of ``setup`` (exact name, then the peak)."""
    return next(line for line in stdout.splitlines() if re.match(rf"\s+{re.escape(setup)}\s+[\d,.]+ GiB", line))


def test_dry_run_of_llama3_8b_on_8_gpus_shards_it_and_fsdp_fits_where_ddp_does_not(run_cli, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "sft",
        "--dry_run",
        "--model_name",
        "llama3-8b",
        "--enable_fsdp",
        "--gpus_per_node",
        8,
        "--gpu_memory",
        "80GB",
        "--output_dir",
        out,
    )
    print(proc.stdout)
    assert (
        "meta model: llama3-8b (8,030,261,248 parameters, 8,030,261,248 trainable), on the meta device" in proc.stdout
    )
    assert "mesh: dp_replicate 1 x dp_shard 8 x cp 1 x sp 1 (world size 8" in proc.stdout
    # fp32 master weights sharded 8 ways: 16 bytes per parameter over 8 ranks (4 + 4 + 8), from the meta shards
    share = 8_030_261_248 * 4 / 8 / GIB
    assert (
        f"fsdp: per-rank training state (rank 0's local shards): params {share:.1f} GiB, grads {share:.1f} GiB, "
        f"AdamW state {2 * share:.1f} GiB"
    ) in proc.stdout
    assert table_row(proc.stdout, "FULL_SHARD").split()[5] == "yes"  # setup, peak GiB, host/node GiB, fits
    assert table_row(proc.stdout, "DDP").split()[5] == "no"
    assert "recommended: FULL_SHARD" in proc.stdout
    assert not out.exists(), "a dry run writes nothing"


@pytest.mark.parametrize(
    "args,needles",
    [  # the same rows as tests/e2e/test_bad_input.py's real runs
        (["--nproc_per_node", "4", "--sp_size", "3"], ["--sequence_parallel_size 3 = 3", "world size 4"]),
        (
            ["--gpus_per_node", "8", "--sequence_parallel_size", "8"],
            ["--sequence_parallel_size 8 must divide the model's 4 attention heads (2 KV heads"],
        ),
    ],
)
def test_dry_run_refuses_an_impossible_mesh_with_the_line_of_a_real_run(
    args, needles, cli_in_process, tiny_model, tmp_path
):
    out = tmp_path / "never-created"
    proc = cli_in_process("sft", "--dry_run", "--model_name", tiny_model, "--output_dir", out, *args)
    assert_one_line_error(proc, *needles)
    assert proc.stdout == "" and not out.exists()
