"""Long rows split over ranks train exactly like whole rows: Ulysses (sp), ring (cp), both, and with FSDP.

Real launches of gloo processes with the tiny Llama (4 attention heads, 2 KV heads) on rows of up to 1024 tokens
that pack several dialogues of uneven lengths. Every configuration has the same effective batch (2 rows per
step), so each must reproduce the single-process run step by step (losses) and at the end (weights).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env
from tests.helpers import assert_same_training, max_relative_difference, step_rows, weights

# name -> (processes, per-device batch, flags); effective batch = batch x processes / (sp x cp) x accumulation = 2
VARIANTS = {
    "reference": (1, 2, ()),
    "sp4_kv_heads_repeated": (4, 2, ("--sequence_parallel_size", 4)),
    "cp2_accumulation": (2, 1, ("--cp_size", 2, "--gradient_accumulation_steps", 2)),
    "sp2_cp2": (4, 2, ("--sp_size", 2, "--cp_size", 2)),
    # checkpoints at steps 2 and 4: the step-2 one is resumed on a single process without a split below
    "fsdp_sp2_dp2": (4, 1, ("--enable_fsdp", "--sp_size", 2, "--save_steps", 2)),
}
TRAIN_ARGS = ("--batching_strategy", "packing", "--context_length", 1024, "--synthetic_dialogues.num_train", 64,
              "--synthetic_dialogues.num_validation", 8, "--max_train_step", 4, "--lr", 3e-3,
              "--gradient_clipping", "true", "--num_workers_dataloader", 0, "--val_batch_size", 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return {"root": tmp_path_factory.mktemp("sequence-runs")}


def trained(name: str, runs: dict, run_cli, model):
    if name not in runs:
        nproc, batch, flags = VARIANTS[name]
        out = runs["root"] / name
        proc = run_cli("sft", "--nproc_per_node", nproc, "--model_name", model, "--output_dir", out,
                       "--batch_size_training", batch, *TRAIN_ARGS, *flags)
        (out / "stdout.log").write_text(proc.stdout)
        runs[name] = out
    return runs[name]


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "reference"])
def test_split_rows_train_like_whole_rows(variant, runs, run_cli, tiny_model):
    reference = trained("reference", runs, run_cli, tiny_model)
    losses = [r["loss"] for r in step_rows(reference)]
    assert losses[-1] < losses[0], "the model did not learn: the comparison would be vacuous"
    difference = assert_same_training(reference, trained(variant, runs, run_cli, tiny_model), variant)
    print(f"{variant}: max relative weight difference to one process {difference:.2e}")


def test_start_log_states_the_split_and_the_data_parallel_batch(runs, run_cli, tiny_model):
    log = (trained("fsdp_sp2_dp2", runs, run_cli, tiny_model) / "stdout.log").read_text()
    assert ("strategy: fsdp2 FULL_SHARD, world size 4, mesh (replicate 1 x shard 4), rows split over context "
            "parallel 1 x sequence parallel 2 (data parallel 2)") in log
    assert ("effective batch: 1 per device x 2 data-parallel devices (4 processes / 2 that split each row) x 1 "
            "accumulation = 2 packed blocks per step") in log


def test_a_checkpoint_written_with_sp2_resumes_on_one_process(runs, run_cli, tiny_model, tmp_path):
    reference, split = (trained("reference", runs, run_cli, tiny_model),
                        trained("fsdp_sp2_dp2", runs, run_cli, tiny_model))
    out = tmp_path / "resumed"
    proc = run_cli("sft", "--nproc_per_node", 1, "--model_name", tiny_model, "--output_dir", out,
                   "--batch_size_training", 2, *TRAIN_ARGS, "--enable_fsdp",
                   "--resume", split / "checkpoints" / "step-000002")
    assert "saved by 4 processes, now 1" in proc.stdout and "data order kept" in proc.stdout
    assert "differ from the checkpoint" not in proc.stderr  # the split is not a training setting
    rows, reference_rows = step_rows(out), step_rows(reference)
    assert [r["step"] for r in rows] == [3, 4]
    for r, o in zip(reference_rows[2:], rows):
        assert o["num_tokens"] == r["num_tokens"]
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-5), r["step"]
    assert max_relative_difference(weights(reference), weights(out)) <= 1e-5


def test_split_row_logits_loss_and_gradients_equal_the_whole_row(cache_dir, tiny_model, tmp_path):
    """One packed row (6 documents, padded by the split) on cp 2 x sp 2 ranks against the whole row: logits of
    every token, the loss and every gradient (full model and LoRA). Control: a layout that forgets the
    documents' boundaries changes the logits, so the comparison can fail."""
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                    "tests/distributed/sequence_probe.py", str(tiny_model), str(tmp_path), "2", "2"],
                   check=True, capture_output=True, text=True, env={**cli_env(cache_dir), "OMP_NUM_THREADS": "1"},
                   cwd=REPO, timeout=300)
    for rank in range(4):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["row_length"] % 8 and result["slice_length"] * 4 > result["row_length"], "no padding tested"
        for model in ("full", "lora"):
            assert result[model]["logits_max_abs_diff"] <= 1e-5, (rank, model, result)
            assert result[model]["loss_relative_diff"] <= 1e-6, (rank, model, result)
            assert result[model]["grad_max_relative_diff"] <= 1e-5, (rank, model, result)
        assert result["lora"]["num_trainable"] == 16  # A and B of q, k, v, o in 2 layers
        assert result["control_logits_max_abs_diff"] > 1e-2, result
