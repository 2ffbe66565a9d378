"""On a machine with a CUDA device (`pytest -m gpu`): the GPU smoke suite, every GPU-only path (bf16 FSDP, LoRA,
QLoRA with the CUDA kernels, generation, varlen attention) against its CPU-proven reference, one GPU, under 5
minutes. Skipped without a GPU; its CPU mode runs in tests/e2e/test_gpu_bench_smoke.py."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO, cli_env


@pytest.mark.gpu
def test_gpu_smoke_suite_passes_on_the_gpu(cache_dir):
    proc = subprocess.run(
        ["bash", "bench/gpu_smoke.sh"], capture_output=True, text=True, cwd=REPO, env=cli_env(cache_dir), timeout=420
    )
    assert proc.returncode == 0, f"{proc.returncode} check(s) failed\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
