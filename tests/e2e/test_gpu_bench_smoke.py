"""The GPU benchmark script runs end to end in its CPU mode: FSDP full fine-tune, FSDP + LoRA and the long-sequence
rows (LoRA with the memory levers), tiny shapes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env


def test_gpu_benchmark_cpu_smoke_mode_reports_throughput_mfu_and_memory(cache_dir):
    proc = subprocess.run(
        ["bash", "bench/gpu.sh", "--cpu-smoke"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=cli_env(cache_dir),
        timeout=480,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["config"] for r in rows] == ["full", "lora", "long-128k", "long-512k", "long-1m"]
    for r in rows:
        assert r["tokens_per_s_per_gpu"] > 0 and 0 < r["mfu"] < 1 and r["peak_memory_gib"] > 0
        assert r["plan_error"] is None  # measured is the resident size on the CPU
    full, lora, *long = rows
    assert full["planned_peak_gib"] > 0 and lora["planned_peak_gib"] > 0
    assert all(r["planned_peak_gib"] is None for r in long)  # the plan does not model tiled MLP and offloading
    assert lora["num_trainable_params"] < full["num_trainable_params"] / 10
    assert [r["seq_len"] for r in long] == [256, 512, 1024] and all(r["steps"] == 1 for r in long)
    assert all(r["levers"] == "activation checkpointing, tiled MLP, lean loss, activation offloading" for r in long)
    assert "| config | seq | batch/GPU | tokens/s/GPU | MFU | peak memory |" in proc.stdout
    assert "| config | predicted peak (shardtune plan) | measured peak (max_memory_allocated) | error |" in proc.stdout


def test_long_rows_of_the_gpu_benchmark_are_planned_to_fit_an_h200_or_skipped_with_the_reason():
    """The plan the GPU run takes for the Llama-3-8B-shaped long rows on one H200 (141 GB, 128 GiB host memory)."""
    from bench.gpu import LONG, plan_long_row
    from shardtune.model.loading import PRESETS

    config = dict(PRESETS["llama-8b-shape"])
    plans = {
        name: plan_long_row(config, tokens, 2, device_gib=139.8, host_gib=120, flops_per_s=3e14, seconds_left=400)
        for name, tokens in LONG.items()
    }
    assert plans["long-128k"].run and not plans["long-128k"].offload, plans["long-128k"]
    assert 40 < plans["long-128k"].device_gib < 120
    assert not plans["long-512k"].run and "host memory" in plans["long-512k"].reason
    assert not plans["long-1m"].run and "host memory" in plans["long-1m"].reason
    # control: with time too short even the 128k row is skipped, and says why
    short = plan_long_row(config, LONG["long-128k"], 2, 139.8, 120, 3e14, seconds_left=30)
    assert not short.run and "s left before the deadline" in short.reason


def test_varlen_check_of_the_gpu_smoke_suite_passes_in_its_cpu_mode(cache_dir):
    """bench/gpu_smoke.sh runs it on CUDA in bf16 (flash varlen kernel); on CPU it takes SDPA per example."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.varlen_check", "--device", "cpu", "--dtype", "float32", "--preset", "tiny"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=cli_env(cache_dir),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["kernel"] == "SDPA per example" and result["loss_rel_diff"] <= 1e-5


def test_gpu_smoke_suite_compares_losses_in_its_cpu_mode(cache_dir, tmp_path):
    """bench/gpu_smoke.sh's CPU mode: FSDP2 in bf16 (the test-only switch) against the fp32 run, for shardtune sft and
    shardtune dpo (the bf16 reference starts at ln 2 as the fp32 one), a table at the end."""
    proc = subprocess.run(
        [
            "bash",
            "bench/gpu_smoke.sh",
            "--cpu-smoke",
            "--only",
            "fsdp2_bf16_vs_fp32,dpo_fsdp2_bf16_vs_fp32",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=cli_env(cache_dir),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| check | result | max loss rel diff | tolerance | note |" in proc.stdout
    for check in ("fsdp2_bf16_vs_fp32", "dpo_fsdp2_bf16_vs_fp32"):
        row = next(line for line in proc.stdout.splitlines() if line.startswith(f"| {check} |"))
        _, name, status, diff, tolerance, _, _ = row.split("|")
        assert status.strip() == "PASS" and 0 < float(diff) <= float(tolerance), row
    for run in ("fsdp_bf16", "dpo_fsdp_bf16"):
        assert "compute bfloat16" in (tmp_path / f"{run}.log").read_text(), run
    assert "preference pairs" in (tmp_path / "dpo_fsdp_bf16.log").read_text()


def test_gpu_smoke_comparison_fails_beyond_its_tolerance_and_on_missing_steps():
    from bench.gpu_smoke import LOSS_RTOL, Check, compare

    check = Check("x", "run", "reference", "bf16")
    reference = [{"loss": 2.0}, {"loss": 1.5}]
    inside = [{"loss": 2.0}, {"loss": 1.5 * (1 + LOSS_RTOL["bf16"] / 2)}]
    outside = [{"loss": 2.0}, {"loss": 1.5 * (1 + LOSS_RTOL["bf16"] * 2)}]
    assert compare(check, inside, reference).status == "PASS"
    assert compare(check, outside, reference).status == "FAIL"
    assert compare(check, inside[:1], reference).status == "FAIL"


def test_gpu_benchmark_runs_the_peers_side_by_side_in_its_cpu_mode(cache_dir, tmp_path):
    """bench/gpu.sh --peers-only --cpu-smoke: shardtune, transformers.Trainer and TRL's SFTTrainer on the same rows
    (tiny model, 16 dialogues, CPU), the table with the ratios against the faster peer and the eval losses."""
    pytest.importorskip("trl")
    env = {**cli_env(cache_dir), "PEERS_RESULTS_DIR": str(tmp_path)}
    proc = subprocess.run(
        ["bash", "bench/gpu.sh", "--peers-only", "--cpu-smoke"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=960,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trainer = json.loads((tmp_path / "peers_smoke.json").read_text())["trainer"]["plain"]
    assert trainer["fastest_peer"] in ("hf_trainer", "trl_sft")
    assert trainer["trl_sft"]["steps"] > 0 and trainer["hf_trainer"]["steps"] > 0
    assert trainer["trl_sft"]["label_tokens"] > 0  # completion-only: the summaries' tokens, not the prompts'
    x = trainer["shardtune_packing"]
    assert x["speedup_vs_fastest_peer"] > 0 and x["process_speedup_vs_fastest_peer"] > 0 and x["eval_loss"] > 0
    table = (tmp_path / "peers_smoke.md").read_text()
    assert "| TRL SFTTrainer, packing bfd (padding-free), completion-only loss |" in table
    assert "vs " in table and "whole process" in table
