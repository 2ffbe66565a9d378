"""shardtune plan: parameter counts against real models, the state formulas' anchors, the recommendation and its
failure message through the CLI. The peak-memory prediction against measurement is bench/plan_check.py (and one
row of it here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from shardtune.planner import (
    DEVICES, Adapter, Arch, Setup, estimate, fits, host_loading_bytes, read_arch, traffic_per_step,
)
from tests.conftest import REPO, cli_env

GIB = 2**30


def real_count(config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("config", [
    LlamaConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=176),
    LlamaConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=128, tie_word_embeddings=True),
    Qwen2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96),
], ids=["llama-gqa", "llama-tied", "qwen2-bias"])
def test_parameter_count_from_config_equals_the_real_model(config):
    assert Arch.from_config(config.to_dict()).num_params == real_count(config)


def test_builtin_llama3_8b_shape_has_its_published_size():
    assert read_arch("llama3-8b").num_params == pytest.approx(8.03e9, rel=1e-3)
    assert read_arch("llama3-70b").num_params == pytest.approx(70.55e9, rel=1e-3)


@pytest.mark.parametrize("method", ["lora", "llama_adapter", "prefix"])
def test_trainable_counts_equal_peft(method, tiny_model):
    from shardtune.config import TrainConfig
    from shardtune.models import load_model
    from shardtune.peft import apply_peft

    cfg = TrainConfig(model_name=str(tiny_model), use_peft=True, peft_method=method)
    model = apply_peft(load_model(str(tiny_model)), cfg)
    real = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert Adapter(method=method).trainable_params(read_arch(str(tiny_model))) == real


def test_full_fine_tuning_state_is_16_bytes_per_parameter():
    arch = read_arch("llama3-8b")
    b = estimate(Setup(arch=arch, strategy="NO_SHARD", gpus_per_node=1))
    assert b.state == 16 * arch.num_params
    sharded = estimate(Setup(arch=arch, strategy="FULL_SHARD", gpus_per_node=8))
    assert sharded.state == pytest.approx(16 * arch.num_params / 8)


def test_anchors_8b_full_fsdp_on_8_gpus_and_70b_qlora_on_4():
    h100 = DEVICES["H100"]
    llama8 = Setup(arch=read_arch("llama3-8b"), strategy="FULL_SHARD", gpus_per_node=8, batch_size=4, seq_len=2048,
                   activation_checkpointing=True)
    assert fits(llama8, h100)
    assert not fits(Setup(arch=llama8.arch, strategy="DDP", gpus_per_node=8, seq_len=2048), h100)  # 16 B x 8B > 80 GB
    qlora = Setup(arch=read_arch("llama3-70b"), strategy="FULL_SHARD", gpus_per_node=4, seq_len=2048,
                  activation_checkpointing=True, adapter=Adapter(method="lora", lora_r=16,
                                                                  lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")),
                  quantization="4bit")
    assert fits(qlora, h100)
    assert not fits(Setup(arch=qlora.arch, strategy="FULL_SHARD", gpus_per_node=4, seq_len=2048,
                          activation_checkpointing=True), h100)  # the same 70B fully fine-tuned does not


def test_low_cpu_fsdp_host_memory_of_70b_on_an_8_gpu_node():
    """llama-cookbook's lesson: rank-0-only loading takes a 70B node from over 2 TB of host memory to ~280 GB."""
    arch = read_arch("llama3-70b")
    every_rank = host_loading_bytes(Setup(arch=arch, strategy="FULL_SHARD", gpus_per_node=8))
    rank0 = host_loading_bytes(Setup(arch=arch, strategy="FULL_SHARD", gpus_per_node=8, low_cpu_fsdp=True))
    assert every_rank > 2e12
    assert rank0 == pytest.approx(282e9, rel=0.01)


def test_hybrid_shard_keeps_parameter_traffic_inside_the_node():
    arch = read_arch("llama3-8b")
    full = traffic_per_step(Setup(arch=arch, strategy="FULL_SHARD", num_nodes=2, gpus_per_node=8))
    hybrid = traffic_per_step(Setup(arch=arch, strategy="HYBRID_SHARD", num_nodes=2, gpus_per_node=8))
    assert full.intra_node == 0 and hybrid.intra_node > 0
    assert hybrid.inter_node < full.inter_node / 5


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtune", "plan", *args], capture_output=True, text=True,
                          env=cli_env(REPO / ".no-cache"), cwd=REPO, timeout=120)


def test_plan_recommends_a_fitting_command_and_reports_limits():
    proc = plan_cli("--model_name", "llama3-8b", "--enable_fsdp", "--gpus_per_node", "8", "--gpu", "H100", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["recommended"]["fits"] and "--enable_fsdp" in result["recommended"]["flags"] + ["--enable_fsdp"]
    assert result["largest_micro_batch"] >= 1 and result["longest_sequence"] >= 4096
    text = plan_cli("--model_name", "llama3-8b", "--gpus_per_node", "8", "--gpu", "H100").stdout
    assert "recommended:" in text and "shardtune sft --model_name meta-llama/Llama-3.1-8B-Instruct" in text


def test_plan_when_nothing_fits_names_the_smallest_and_the_miss():
    proc = plan_cli("--model_name", "llama3-70b", "--gpus_per_node", "1", "--gpu_memory", "16GB")
    assert proc.returncode == 1
    assert "nothing fits: the smallest is" in proc.stdout and "GiB over what a GPU can use" in proc.stdout
    bad = plan_cli("--model_name", "llama3-8b", "--gpu", "K80")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--gpu 'K80' is unknown" in bad.stderr


def test_predicted_peak_within_10_percent_of_measured_for_ddp_fsdp_and_zero():
    """Three rows of bench/plan_check.py in one launch of 2 processes (tiny preset, 2048 tokens): a real train_step
    per strategy, the peak of live tensor bytes from the CPU allocator's total under torch's profiler (process
    overhead excluded)."""
    pytest.importorskip("deepspeed", reason="pip install --no-build-isolation 'shardtune[deepspeed]'")
    from bench.common import run_json
    from bench.plan_check import Row, predict, predicted_total

    strategies = ("DDP", "FULL_SHARD", "ZERO2")
    measured = run_json([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                         "bench.plan_check", "--worker", "--shape", "tiny", "--seq_len", "2048", "--strategy",
                         ",".join(strategies)], timeout=600, OMP_NUM_THREADS="1")
    for strategy in strategies:
        predicted = predicted_total(predict(Row("tiny", 2, strategy)))
        assert predicted == pytest.approx(measured[strategy]["peak_bytes"], rel=0.10), strategy
        assert abs(measured[strategy]["drift_bytes"]) < 0.02 * measured[strategy]["peak_bytes"], strategy
    # not vacuous: activations and loss buffers are most of the FSDP peak (a state-only count misses it 10x), and
    # DeepSpeed's reduce bucket most of ZeRO's
    fsdp = measured["FULL_SHARD"]
    assert fsdp["peak_bytes"] > 10 * fsdp["before_step_bytes"]
    assert measured["ZERO2"]["peak_bytes"] > 10 * fsdp["peak_bytes"]
