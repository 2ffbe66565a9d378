"""--compile changes how the model computes, not what: the same losses as the default run, step by step, through
the real CLI. Every step row also reports throughput and MFU.

--use_fast_kernels is a GPU-only flag: flash-attention 2 and liger-kernel (Triton) need CUDA, so on CPU it changes
nothing, which the run states (checked here). Its kernels are compared with the default run's losses by
bench/gpu_smoke.sh (check fast_kernels_vs_default)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO, cli_env, shardtune_argv
from tests.helpers import eval_rows, step_rows

ARGS = (
    "--context_length",
    256,
    "--batch_size_training",
    4,
    "--synthetic_dialogues.num_train",
    64,
    "--synthetic_dialogues.num_validation",
    8,
    "--max_train_step",
    3,
    "--lr",
    3e-3,
    "--num_workers_dataloader",
    0,
    "--save_model",
    "false",
)


def sft(cache_dir, model, out, *extra):
    argv = ["sft", "--model_name", model, "--output_dir", out, *ARGS, *extra]
    proc = subprocess.run(
        shardtune_argv(*argv), capture_output=True, text=True, env=cli_env(cache_dir), cwd=REPO, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (out / "stdout.log").write_text(proc.stdout)
    return out


@pytest.fixture(scope="module")
def reference(tiny_model, cache_dir, tmp_path_factory):
    return sft(cache_dir, tiny_model, tmp_path_factory.mktemp("reference"))


def assert_same_numbers(ref, other):
    rows, ref_rows = step_rows(other), step_rows(ref)
    assert len(rows) == len(ref_rows) == 3
    for r, o in zip(ref_rows, rows):
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=0), r["step"]
    assert eval_rows(other)[-1]["eval_loss"] == pytest.approx(eval_rows(ref)[-1]["eval_loss"], rel=1e-5)


def test_step_rows_report_tokens_per_second_and_mfu(reference):
    for row in step_rows(reference):
        assert row["tokens_per_s"] > 0 and row["model_flops_per_s"] > 0
        assert 0 < row["mfu"] < 1


def test_compiled_decoder_layers_give_the_same_losses_and_fast_kernels_say_they_need_cuda(
    reference, tiny_model, cache_dir, tmp_path
):
    out = sft(cache_dir, tiny_model, tmp_path / "compiled", "--compile", "--use_fast_kernels")
    log = (out / "stdout.log").read_text()
    assert "speed: torch.compile of each of the 2 decoder layers" in log
    assert (
        "speed: fast kernels: on CPU the fastest attention is PyTorch SDPA (already in use); flash-attention and "
        "liger-kernel need CUDA" in log
    )
    assert_same_numbers(reference, out)
