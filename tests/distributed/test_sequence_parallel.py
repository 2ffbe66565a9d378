"""Long rows split over ranks train and evaluate exactly like whole rows: Ulysses (sp), ring (cp), both, with FSDP,
with DeepSpeed ZeRO-3, with LoRA, with the memory levers.

Real launches of gloo processes with the tiny Llama (4 attention heads, 2 KV heads) on packed rows of 8k tokens
(32k for LoRA) that hold some 60 (250) dialogues of uneven lengths (85-200 tokens). Every configuration has the same
effective batch as its single-process reference (2 rows per step; 1 for LoRA), so each must reproduce it step by
step (losses, gradient norms), at the end (weights) and in the evaluation after training (eval rows are split like
training rows). The probe test at the end has the control: forgetting the documents' boundaries across the split
changes the logits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env
from tests.helpers import (
    assert_same_training,
    eval_rows,
    max_relative_difference,
    step_rows,
    train_once,
    weights,
)

ROWS_8K = ("--context_length", 8192, "--synthetic_dialogues.num_train", 540)  # 8 full rows and a partial one
# LoRA dropout off: each rank draws its own masks, so a split run could not equal the reference with it
LORA_ROWS_16K = (
    "--context_length",
    16384,
    "--synthetic_dialogues.num_train",
    540,
    "--use_peft",
    "--peft_method",
    "lora",
    "--lora_config.lora_dropout",
    0,
    "--lr",
    2e-2,
)
FSDP_SP2 = ("--enable_fsdp", "--fsdp_config.fsdp_activation_checkpointing", "true", "--sp_size", 2)
LEVERS = ("--tiled_mlp", "true", "--activation_offloading", "true")
# name -> (processes, per-device batch, flags); effective batch = batch x processes / (sp x cp) x accumulation
VARIANTS = {
    # checkpoints at steps 2 and 4: the step-2 one is resumed with sp 2 below
    "reference": (1, 2, (*ROWS_8K, "--save_steps", 2)),
    "sp4_kv_heads_repeated": (4, 2, (*ROWS_8K, "--sequence_parallel_size", 4)),
    "zero3_cp2_accumulation": (
        2,
        1,
        (
            *ROWS_8K,
            "--enable_deepspeed",
            "--deepspeed_config.zero_stage",
            3,
            "--cp_size",
            2,
            "--gradient_accumulation_steps",
            2,
        ),
    ),
    "sp2_cp2_tiled_mlp_activation_offloading": (4, 2, (*ROWS_8K, "--sp_size", 2, "--cp_size", 2, *LEVERS)),
    # checkpoints at steps 2 and 4: the step-2 one is resumed on a single process without a split below
    "fsdp_sp2_dp2_activation_checkpointing": (4, 1, (*ROWS_8K, *FSDP_SP2, "--save_steps", 2)),
    "lora_reference": (1, 1, LORA_ROWS_16K),
    "lora_cp4": (4, 1, (*LORA_ROWS_16K, "--cp_size", 4)),
}
TRAIN_ARGS = (
    "--batching_strategy",
    "packing",
    "--synthetic_dialogues.num_validation",
    8,
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
)


def reference_of(variant: str) -> str:
    return "lora_reference" if variant.startswith("lora") else "reference"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return {"root": tmp_path_factory.mktemp("sequence-runs")}


def trained(name: str, runs: dict, run_cli, model) -> Path:
    nproc, batch, flags = VARIANTS[name]
    return train_once(
        runs,
        name,
        run_cli,
        "--nproc_per_node",
        nproc,
        "--model_name",
        model,
        "--batch_size_training",
        batch,
        *TRAIN_ARGS,
        *flags,
    )


def assert_same_evaluation(reference: Path, other: Path, label: str) -> None:
    (r,), (o,) = eval_rows(reference), eval_rows(other)
    assert o["eval_label_tokens"] == r["eval_label_tokens"] > 0, label
    for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy"):
        assert o[key] == pytest.approx(r[key], rel=1e-5, abs=0), (label, key)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if not v.endswith("reference")])
def test_split_rows_train_and_evaluate_like_whole_rows(variant, runs, run_cli, tiny_model):
    if variant.startswith("zero"):
        pytest.importorskip("deepspeed", reason="pip install --no-build-isolation 'shardtune[deepspeed]'")
    reference = trained(reference_of(variant), runs, run_cli, tiny_model)
    losses = [r["loss"] for r in step_rows(reference)]
    assert losses[-1] < losses[0], "the model did not learn: the comparison would be vacuous"
    split = trained(variant, runs, run_cli, tiny_model)
    difference = assert_same_training(reference, split, variant)
    assert_same_evaluation(reference, split, variant)
    print(f"{variant}: max relative weight difference to one process {difference:.2e}")


def input_tokens(out: Path) -> list[int]:
    """Tokens the model computed at each step (labelled or not), all ranks together."""
    return [round(r["input_tokens_per_s"] * r["step_time_s"]) for r in step_rows(out)]


def test_the_runs_are_what_their_names_say(runs, run_cli, tiny_model):
    """Long packed rows, the levers really on, LoRA's adapter only: so the comparisons above are not vacuous."""
    reference = (trained("reference", runs, run_cli, tiny_model) / "stdout.log").read_text()
    assert "2 per device x 1 data-parallel devices x 1 accumulation = 2 packed blocks per step" in reference
    # two 8k rows per step (16k tokens) at 3 of the 4 steps at least: packing leaves one partial row, maybe drawn
    assert sum(n > 15_000 for n in input_tokens(trained("reference", runs, run_cli, tiny_model))) >= 3
    levers = (trained("sp2_cp2_tiled_mlp_activation_offloading", runs, run_cli, tiny_model) / "stdout.log").read_text()
    assert "long sequences: MLP of each of the 2 decoder layers over tiles of 64 tokens" in levers
    assert "long sequences: activation offloading" in levers
    if "zero3_cp2_accumulation" in runs:
        assert (
            "strategy: deepspeed ZeRO-3, world size 2, rows split over context parallel 2 x sequence parallel 1 "
            "(data parallel 1)"
        ) in (runs["zero3_cp2_accumulation"] / "stdout.log").read_text()
    lora = trained("lora_cp4", runs, run_cli, tiny_model)
    assert sum(n > 15_000 for n in input_tokens(lora)) >= 3  # one 16k row per step
    assert "ring context parallel 4" in (lora / "stdout.log").read_text()
    assert weights(lora).keys() and all("lora_" in k for k in weights(lora))


def test_start_log_states_the_split_and_the_data_parallel_batch(runs, run_cli, tiny_model):
    log = (trained("fsdp_sp2_dp2_activation_checkpointing", runs, run_cli, tiny_model) / "stdout.log").read_text()
    assert (
        "strategy: fsdp2 FULL_SHARD, world size 4, mesh (replicate 1 x shard 4), rows split over context "
        "parallel 1 x sequence parallel 2 (data parallel 2)"
    ) in log
    assert (
        "effective batch: 1 per device x 2 data-parallel devices (4 processes / 2 that split each row) x 1 "
        "accumulation = 2 packed blocks per step"
    ) in log


def resumed(run_cli, model, out: Path, checkpoint: Path, nproc: int, *flags):
    """Steps 3 and 4 from ``checkpoint`` (written at step 2), on rows of 8k tokens, 2 rows per step."""
    return run_cli(
        "sft",
        "--nproc_per_node",
        nproc,
        "--model_name",
        model,
        "--output_dir",
        out,
        "--batch_size_training",
        2,
        *TRAIN_ARGS,
        *ROWS_8K,
        *flags,
        "--resume",
        checkpoint,
    )


def assert_continues_the_reference(reference: Path, out: Path) -> None:
    rows, reference_rows = step_rows(out), step_rows(reference)
    assert [r["step"] for r in rows] == [3, 4]
    for r, o in zip(reference_rows[2:], rows):
        assert (o["num_tokens"], o["label_tokens"]) == (r["num_tokens"], r["label_tokens"])  # running total resumed
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-5), r["step"]
    assert max_relative_difference(weights(reference), weights(out)) <= 1e-5
    assert_same_evaluation(reference, out, "resumed")


def test_a_checkpoint_written_with_sp2_resumes_on_one_process(runs, run_cli, tiny_model, tmp_path):
    reference = trained("reference", runs, run_cli, tiny_model)
    split = trained("fsdp_sp2_dp2_activation_checkpointing", runs, run_cli, tiny_model)
    out = tmp_path / "resumed"
    proc = resumed(
        run_cli,
        tiny_model,
        out,
        split / "checkpoints" / "step-000002",
        1,
        "--enable_fsdp",
        "--fsdp_config.fsdp_activation_checkpointing",
        "true",
    )
    assert "saved by 4 processes, now 1" in proc.stdout and "data order kept" in proc.stdout
    assert "differ from the checkpoint" not in proc.stderr  # the split is not a training setting
    assert_continues_the_reference(reference, out)


def test_a_checkpoint_written_by_one_process_resumes_with_sp2(runs, run_cli, tiny_model, tmp_path):
    """The reverse, and the plain Ulysses run of 2 processes (DDP): steps 3 and 4 split over 2 ranks."""
    reference = trained("reference", runs, run_cli, tiny_model)
    out = tmp_path / "resumed"
    proc = resumed(run_cli, tiny_model, out, reference / "checkpoints" / "step-000002", 2, "--sp_size", 2)
    assert "saved by 1 process" in proc.stdout and "data order kept" in proc.stdout
    assert "differ from the checkpoint" not in proc.stderr
    assert "rows split over context parallel 1 x sequence parallel 2 (data parallel 1)" in proc.stdout
    assert_continues_the_reference(reference, out)


def test_split_row_logits_loss_and_gradients_equal_the_whole_row(cache_dir, tiny_model, tmp_path):
    """One packed row (6 documents, padded by the split) on cp 2 x sp 2 ranks against the whole row: logits of
    every token, the loss and every gradient (full model and LoRA). Control: a layout that forgets the
    documents' boundaries changes the logits, so the comparison can fail."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "4",
            "tests/distributed/sequence_probe.py",
            str(tiny_model),
            str(tmp_path),
            "2",
            "2",
        ],
        check=True,
        capture_output=True,
        text=True,
        env={**cli_env(cache_dir), "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        timeout=300,
    )
    for rank in range(4):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["row_length"] % 8 and result["slice_length"] * 4 > result["row_length"], "no padding tested"
        for model in ("full", "lora"):
            assert result[model]["logits_max_abs_diff"] <= 1e-5, (rank, model, result)
            assert result[model]["loss_relative_diff"] <= 1e-6, (rank, model, result)
            assert result[model]["grad_max_relative_diff"] <= 1e-5, (rank, model, result)
        assert result["lora"]["num_trainable"] == 16  # A and B of q, k, v, o in 2 layers
        assert result["control_logits_max_abs_diff"] > 1e-2, result
