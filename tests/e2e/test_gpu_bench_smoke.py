"""The GPU benchmark script runs end to end in its CPU mode: FSDP full fine-tune and FSDP + LoRA, tiny shapes."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, cli_env


def test_gpu_benchmark_cpu_smoke_mode_reports_throughput_mfu_and_memory(cache_dir):
    proc = subprocess.run(["bash", "bench/gpu.sh", "--cpu-smoke"], capture_output=True, text=True, cwd=REPO,
                          env=cli_env(cache_dir), timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["config"] for r in rows] == ["full", "lora"]
    for r in rows:
        assert r["tokens_per_s_per_gpu"] > 0 and 0 < r["mfu"] < 1 and r["peak_memory_gib"] > 0
    full, lora = rows
    assert lora["num_trainable_params"] < full["num_trainable_params"] / 10
    assert "| config | seq | batch/GPU | tokens/s/GPU | MFU | peak memory |" in proc.stdout


def test_varlen_check_of_the_gpu_smoke_suite_passes_in_its_cpu_mode(cache_dir):
    """bench/gpu_smoke.sh runs it on CUDA in bf16 (flash varlen kernel); on CPU it takes SDPA per example."""
    proc = subprocess.run([sys.executable, "-m", "bench.varlen_check", "--device", "cpu", "--dtype", "float32",
                           "--preset", "tiny"], capture_output=True, text=True, cwd=REPO, env=cli_env(cache_dir),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["kernel"] == "SDPA per example" and result["loss_rel_diff"] <= 1e-5
