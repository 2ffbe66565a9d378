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
        assert r["planned_peak_gib"] > 0 and r["plan_error"] is None  # measured is the resident size on the CPU
    full, lora = rows
    assert lora["num_trainable_params"] < full["num_trainable_params"] / 10
    assert "| config | seq | batch/GPU | tokens/s/GPU | MFU | peak memory |" in proc.stdout
    assert "| config | predicted peak (shardtune plan) | measured peak (max_memory_allocated) | error |" in proc.stdout


def test_varlen_check_of_the_gpu_smoke_suite_passes_in_its_cpu_mode(cache_dir):
    """bench/gpu_smoke.sh runs it on CUDA in bf16 (flash varlen kernel); on CPU it takes SDPA per example."""
    proc = subprocess.run([sys.executable, "-m", "bench.varlen_check", "--device", "cpu", "--dtype", "float32",
                           "--preset", "tiny"], capture_output=True, text=True, cwd=REPO, env=cli_env(cache_dir),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["kernel"] == "SDPA per example" and result["loss_rel_diff"] <= 1e-5


def test_gpu_smoke_suite_compares_losses_in_its_cpu_mode(cache_dir, tmp_path):
    """bench/gpu_smoke.sh's CPU mode: FSDP2 in bf16 (the test-only switch) against the fp32 run, a table at the end."""
    proc = subprocess.run(["bash", "bench/gpu_smoke.sh", "--cpu-smoke", "--only", "fsdp2_bf16_vs_fp32",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO, env=cli_env(cache_dir),
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| check | result | max loss rel diff | tolerance | note |" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| fsdp2_bf16_vs_fp32 |"))
    _, name, status, diff, tolerance, _, _ = row.split("|")
    assert status.strip() == "PASS" and 0 < float(diff) <= float(tolerance), row
    assert "compute bfloat16" in (tmp_path / "fsdp_bf16.log").read_text()


def test_gpu_smoke_comparison_fails_beyond_its_tolerance_and_on_missing_steps():
    from bench.gpu_smoke import LOSS_RTOL, Check, compare

    check = Check("x", "run", "reference", "bf16")
    reference = [{"loss": 2.0}, {"loss": 1.5}]
    inside = [{"loss": 2.0}, {"loss": 1.5 * (1 + LOSS_RTOL["bf16"] / 2)}]
    outside = [{"loss": 2.0}, {"loss": 1.5 * (1 + LOSS_RTOL["bf16"] * 2)}]
    assert compare(check, inside, reference).status == "PASS"
    assert compare(check, outside, reference).status == "FAIL"
    assert compare(check, inside[:1], reference).status == "FAIL"
