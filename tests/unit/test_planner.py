"""shardtune plan: parameter counts against real models, the state formulas' anchors, the recommendation and its
failure message through the CLI. The peak-memory prediction against measurement is bench/plan_check.py (and one
row of it here)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from shardtune.planner.estimate import Setup, estimate, host_loading_bytes
from shardtune.planner.hardware import DEVICES
from shardtune.planner.search import alternatives, fits, sequence_splits
from shardtune.planner.shapes import Adapter, Arch, read_arch
from shardtune.planner.speed import Traffic, sequence_traffic_per_step, step_time_s, traffic_per_step
from tests.conftest import main_in_process

GIB = 2**30


def real_count(config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(
            vocab_size=1024,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=176,
        ),
        LlamaConfig(
            vocab_size=1024,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=128,
            tie_word_embeddings=True,
        ),
        Qwen2Config(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
        ),
    ],
    ids=["llama-gqa", "llama-tied", "qwen2-bias"],
)
def test_parameter_count_from_config_equals_the_real_model(config):
    assert Arch.from_config(config.to_dict()).num_params == real_count(config)


def test_builtin_llama3_8b_shape_has_its_published_size():
    assert read_arch("llama3-8b").num_params == pytest.approx(8.03e9, rel=1e-3)
    assert read_arch("llama3-70b").num_params == pytest.approx(70.55e9, rel=1e-3)


@pytest.mark.parametrize("method", ["lora", "llama_adapter", "prefix"])
def test_trainable_counts_equal_peft(method, tiny_model):
    from shardtune.config.flags import config_from
    from shardtune.model.loading import load_model
    from shardtune.model.peft import apply_peft

    cfg = config_from(model_name=str(tiny_model), use_peft=True, peft_method=method)
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
    llama8 = Setup(
        arch=read_arch("llama3-8b"),
        strategy="FULL_SHARD",
        gpus_per_node=8,
        batch_size=4,
        seq_len=2048,
        activation_checkpointing=True,
    )
    assert fits(llama8, h100)
    assert not fits(Setup(arch=llama8.arch, strategy="DDP", gpus_per_node=8, seq_len=2048), h100)  # 16 B x 8B > 80 GB
    qlora = Setup(
        arch=read_arch("llama3-70b"),
        strategy="FULL_SHARD",
        gpus_per_node=4,
        seq_len=2048,
        activation_checkpointing=True,
        adapter=Adapter(method="lora", lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")),
        quantization="4bit",
    )
    assert fits(qlora, h100)
    assert not fits(
        Setup(arch=qlora.arch, strategy="FULL_SHARD", gpus_per_node=4, seq_len=2048, activation_checkpointing=True),
        h100,
    )  # the same 70B fully fine-tuned does not


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
    return main_in_process("plan", *args)


def test_plan_recommends_a_fitting_command_and_reports_limits():
    proc = plan_cli("--model_name", "llama3-8b", "--enable_fsdp", "--gpus_per_node", "8", "--gpu", "H100", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["recommended"]["fits"] and "--enable_fsdp" in result["recommended"]["flags"] + ["--enable_fsdp"]
    assert result["largest_micro_batch"] >= 1 and result["longest_sequence"] >= 4096
    text = plan_cli("--model_name", "llama3-8b", "--gpus_per_node", "8", "--gpu", "H100").stdout
    # the model as the user named it, with the process count; a built-in shape says which weights to give sft
    assert "recommended:" in text and "shardtune sft --nproc_per_node 8 --model_name llama3-8b " in text
    assert (
        "(llama3-8b is a shape the planner knows, not weights: give sft a model directory or a hub id, e.g. "
        "--model_name meta-llama/Llama-3.1-8B-Instruct)" in text
    )


def test_host_memory_is_a_constraint_like_gpu_memory():
    """405B on one 8 x H100 node with FSDP: offloading fits a GPU but needs ~6 TiB of host memory per node (every
    rank's AdamW state and master weights): it must not be recommended on a 2 TiB host, every row states its host
    memory, and a node with enough (--host_memory) makes it fit; more nodes shard the host state too."""
    args = ("--model_name", "llama3.1-405b", "--gpus_per_node", "8", "--enable_fsdp", "--low_cpu_fsdp", "true")
    proc = plan_cli(*args, "--json")
    assert proc.returncode == 1, proc.stdout[-2000:]  # nothing fits
    result = json.loads(proc.stdout)
    offload = next(r for r in result["alternatives"] if r["setup"] == "FULL_SHARD +AC +offload")
    assert offload["peak_bytes"] < result["usable_bytes"] and not offload["fits"]
    assert offload["host_bytes_per_node"] > 5 * 2**40 and result["usable_host_bytes"] < 2 * 2**40
    assert result["would_fit"]["gpus"]["nnodes"] > 1
    text = plan_cli(*args).stdout
    assert "host memory per node:" in text and "host/node" in text
    assert "nothing fits the host memory: what fits a GPU needs at least" in text
    roomy = plan_cli(*args, "--host_memory", "8TiB", "--json")
    assert roomy.returncode == 0 and json.loads(roomy.stdout)["recommended"]["setup"].endswith("+offload")
    bad = plan_cli(*args, "--host_memory", "lots")
    assert bad.returncode == 2 and "--host_memory 'lots' is not a size" in bad.stderr


def test_plan_when_nothing_fits_names_the_smallest_and_the_miss():
    proc = plan_cli("--model_name", "llama3-70b", "--gpus_per_node", "1", "--gpu_memory", "16GB")
    assert proc.returncode == 1
    assert "nothing fits: DDP (as given) misses by" in proc.stdout and "GiB over what a GPU can use" in proc.stdout
    assert "would fit: FULL_SHARD +AC +offload on GPUs of 22 GiB (--gpu_memory)" in proc.stdout
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
    measured = run_json(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "bench.plan_check",
            "--worker",
            "--shape",
            "tiny",
            "--seq_len",
            "2048",
            "--strategy",
            ",".join(strategies),
        ],
        timeout=600,
        OMP_NUM_THREADS="1",
    )
    for strategy in strategies:
        predicted = predicted_total(predict(Row("tiny", 2, strategy)))
        assert predicted == pytest.approx(measured[strategy]["peak_bytes"], rel=0.10), strategy
        assert abs(measured[strategy]["drift_bytes"]) < 0.02 * measured[strategy]["peak_bytes"], strategy
    # not vacuous: activations and loss buffers are most of the FSDP peak (a state-only count misses it 10x), and
    # DeepSpeed's reduce bucket most of ZeRO's
    fsdp = measured["FULL_SHARD"]
    assert fsdp["peak_bytes"] > 10 * fsdp["before_step_bytes"]
    assert measured["ZERO2"]["peak_bytes"] > 10 * fsdp["peak_bytes"]


# -- sequence / context parallel -------------------------------------------------------------------------------------


def test_sequence_splits_are_valid_for_the_heads_and_the_world():
    """Ulysses' degree divides the query heads and stays in a node; every product divides the world; a model with
    12 heads on 8 GPUs takes Ulysses 4 and a ring of 2 for a split of 8, and the pure ring of 8."""
    arch = Arch.from_config(
        dict(
            vocab_size=1024,
            hidden_size=768,
            num_hidden_layers=2,
            num_attention_heads=12,
            num_key_value_heads=4,
            intermediate_size=2048,
        )
    )
    pairs = sequence_splits(arch, world_size=8, gpus_per_node=8)
    assert all(arch.num_heads % sp == 0 and 8 % (sp * cp) == 0 and sp <= 8 for sp, cp in pairs)
    assert (4, 2) in pairs and (1, 8) in pairs and (8, 1) not in pairs
    assert (16, 1) in sequence_splits(read_arch("llama3-8b"), world_size=16, gpus_per_node=16)
    assert (8, 2) in sequence_splits(read_arch("llama3-8b"), world_size=16, gpus_per_node=8)  # sp inside a node


def test_activations_are_divided_by_the_sequence_split_and_kv_heads_repeat_beyond_their_count():
    arch = read_arch("llama3-8b")  # 32 query heads, 8 KV heads
    base = Setup(arch=arch, strategy="FULL_SHARD", gpus_per_node=16, seq_len=65536)
    whole = estimate(base).activations
    for sp, cp in ((4, 1), (1, 4), (2, 2), (8, 2)):
        assert estimate(replace(base, sequence_parallel=sp, context_parallel=cp)).activations == pytest.approx(
            whole / (sp * cp)
        )
    # Ulysses 16 > 8 KV heads: each rank holds one (repeated) KV head of the whole row instead of half of one
    sp16 = estimate(replace(base, sequence_parallel=16)).activations
    repeated = arch.num_layers * 2 * 2 * arch.head_dim * 65536 * (1 - arch.num_kv_heads / 16)  # K and V, bf16
    assert sp16 == pytest.approx(whole / 16 + repeated)


def test_sequence_traffic_counts_ulysses_all_to_all_and_ring_kv_bytes():
    arch = read_arch("llama3-8b")
    base = Setup(arch=arch, strategy="FULL_SHARD", gpus_per_node=8, seq_len=65536)
    assert sequence_traffic_per_step(base) == (Traffic(0.0, 0.0), Traffic(0.0, 0.0))
    ulysses, ring = sequence_traffic_per_step(replace(base, sequence_parallel=4))
    tokens, width = 65536 // 4, 2 * 32 * 128 + 2 * 8 * 128  # q and output, k and v, per token
    assert ulysses == Traffic(2 * 32 * tokens * 2 * width * 3 / 4, 0.0) and ring == Traffic(0.0, 0.0)
    ulysses, ring = sequence_traffic_per_step(replace(base, context_parallel=4))
    kv_chunk = tokens * 2 * 2 * 8 * 128
    assert ulysses == Traffic(0.0, 0.0) and ring == Traffic(3 * 32 * kv_chunk * 3, 0.0)  # 3 passes, 3 hops
    _, across = sequence_traffic_per_step(replace(base, num_nodes=2, context_parallel=16))
    assert across.intra_node == 0 and across.inter_node > 0  # a ring of 16 spans the two nodes
    h100 = DEVICES["H100"]
    assert step_time_s(replace(base, sequence_parallel=4), h100)[2] > step_time_s(base, h100)[2]


def test_128k_tokens_on_8_h100_fit_with_a_sequence_split_which_is_recommended():
    from shardtune.planner.search import plan

    h100 = DEVICES["H100"]
    setup = Setup(
        arch=read_arch("llama3-8b"),
        strategy="FULL_SHARD",
        gpus_per_node=8,
        seq_len=131072,
        activation_checkpointing=True,
    )
    result = plan(setup, h100, 1)
    unsplit = [r for r in result["alternatives"] if r["_setup"].sequence_parallel * r["_setup"].context_parallel == 1]
    # without a split only host offload (parameters, gradients and AdamW state in CPU memory) fits, at PCIe speed
    assert unsplit and all(r["_setup"].cpu_offload for r in unsplit if r["fits"])
    best = result["recommended"]["_setup"]
    assert best.sequence_parallel * best.context_parallel > 1 and fits(best, h100)
    flags = result["recommended"]["flags"]
    assert "--sp_size" in flags or "--cp_size" in flags
    short = plan(replace(setup, seq_len=4096), h100, 1)  # a short row gets no split rows
    assert all(r["_setup"].sequence_parallel * r["_setup"].context_parallel == 1 for r in short["alternatives"])


def test_plan_takes_sft_sequence_flags_and_refuses_an_impossible_mesh_like_sft():
    proc = plan_cli(
        "--model_name",
        "llama3-8b",
        "--enable_fsdp",
        "--gpus_per_node",
        "8",
        "--sp_size",
        "4",
        "--cp_size",
        "2",
        "--context_length",
        "65536",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["given"]["setup"] == "FULL_SHARD sp 4 cp 2"
    bad = plan_cli("--model_name", "llama3-8b", "--enable_fsdp", "--gpus_per_node", "8", "--sp_size", "16")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--sequence_parallel_size 16 = 16 does not divide the world size 8" in bad.stderr


def test_nothing_fits_names_the_miss_and_the_gpus_that_would_fit():
    """1M tokens of llama3-8b on 8 x 80 GB: no split of 8 fits; the smallest world that fits is named (and it fits
    there), next to the GPU memory the smallest configuration needs."""
    from shardtune.planner.render import render
    from shardtune.planner.search import plan

    h100 = DEVICES["H100"]
    setup = Setup(arch=read_arch("llama3-8b"), strategy="FULL_SHARD", gpus_per_node=8, seq_len=1 << 20)
    result = plan(setup, h100, 1)
    assert result["recommended"] is None
    grow = result["would_fit"]["gpus"]
    grown = replace(setup, num_nodes=grow["nnodes"], gpus_per_node=grow["gpus_per_node"])
    assert any(fits(c, h100) for c in alternatives(grown))
    fewer = replace(grown, num_nodes=grow["nnodes"] - 1)
    assert not any(fits(c, h100) for c in alternatives(fewer))  # control: the smallest, not just one that fits
    memory = result["would_fit"]["gpu_memory_bytes"]
    assert fits(replace(result["smallest"]["_setup"]), replace(h100, memory_bytes=memory))
    assert not fits(result["smallest"]["_setup"], replace(h100, memory_bytes=memory - GIB))
    text = render(result, [])
    miss = (result["given"]["peak_bytes"] - result["usable_bytes"]) / GIB
    assert f"nothing fits: FULL_SHARD (as given) misses by {miss:,.1f} GiB" in text
    assert f"on {grow['nnodes'] * 8} GPUs (--nnodes {grow['nnodes']} --gpus_per_node 8)" in text


def test_dpo_plans_two_rows_a_pair_and_the_reference_sharded_like_the_policy(tiny_model):
    """``shardtune dpo --dry_run``: a pair computes two rows through the lean head (the loss buffers of SFT's);
    full fine-tuning holds a frozen reference placed like the policy (DDP whole and FSDP sharded, in the master
    dtype; ZeRO in the engine's compute dtype, whole for ZeRO-1 / 2, partitioned for ZeRO-3). LoRA: none (the base
    with the adapter off); --precompute_ref_log_probs: none while training (the registration decides both)."""
    from shardtune.config.objectives import OBJECTIVES
    from shardtune.config.schema import TrainConfig
    from shardtune.planner.estimate import loss_buffer_bytes

    dpo_setup = dict(rows_per_unit=OBJECTIVES["dpo"].rows_per_unit, reference_model=True)
    arch = read_arch("llama3-8b")
    for strategy, reference_bytes in (("DDP", 4), ("FULL_SHARD", 4 / 8), ("ZERO2", 2), ("ZERO3", 2 / 8)):
        sft = estimate(Setup(arch=arch, strategy=strategy, batch_size=2, seq_len=1024))
        dpo = estimate(Setup(arch=arch, strategy=strategy, batch_size=2, seq_len=1024, **dpo_setup))
        assert dpo.params - sft.params == pytest.approx(arch.num_params * reference_bytes), strategy
        assert dpo.activations == pytest.approx(2 * sft.activations)
        assert dpo.loss_buffers == loss_buffer_bytes(arch, 2 * 2 * 1024)  # the lean head's chunks, on both rows
    offloaded = estimate(Setup(arch=arch, strategy="ZERO3", cpu_offload=True, **dpo_setup))
    assert offloaded.params == 0 and offloaded.host_state == pytest.approx(
        estimate(Setup(arch=arch, strategy="ZERO3", cpu_offload=True)).host_state + arch.num_params * 2 / 8
    )
    assert {"ZERO1", "ZERO2", "ZERO3"} <= {s.strategy for s in alternatives(Setup(arch=arch, **dpo_setup))}
    from shardtune.config.flags import config_from

    reference = OBJECTIVES["dpo"].frozen_reference
    assert reference(config_from(objective="dpo"))
    assert not reference(config_from(objective="dpo", use_peft=True))
    precomputed = config_from(objective="dpo")
    precomputed.dpo.precompute_ref_log_probs = True
    assert not reference(precomputed)  # --precompute_ref_log_probs: the reference is gone before training
    assert not OBJECTIVES["sft"].frozen_reference(TrainConfig())
    proc = main_in_process("dpo", "--dry_run", "--model_name", tiny_model, "--gpus_per_node", 2, "--enable_fsdp")
    assert proc.returncode == 0, proc.stderr
    assert "\n  shardtune dpo --nproc_per_node 2 " in proc.stdout


def plan_json(*flags) -> dict:
    proc = main_in_process("plan", "--model_name", "llama3-8b", "--gpus_per_node", 8, "--json", *flags)
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    "strategy", [("--enable_fsdp",), ("--enable_deepspeed", "--deepspeed_config.zero_stage", 3)], ids=["fsdp", "zero3"]
)
def test_plan_objective_dpo_adds_the_reference_weights_per_shard_for_full_fine_tuning_only(strategy):
    """``shardtune plan --objective dpo``: the full fine-tuning plan's per-GPU parameters exceed SFT's by the frozen
    reference's bytes per shard (8 shards; fp32 master under FSDP, the bf16 engine's under ZeRO-3); LoRA and
    --precompute_ref_log_probs add none; its recommended command is a shardtune dpo command."""
    num_params = plan_json(*strategy)["parameters"]
    reference_bytes = num_params * (4 if "--enable_fsdp" in strategy else 2) / 8

    def given(*flags) -> dict:
        return plan_json(*strategy, *flags)["given"]

    sft, dpo = given(), given("--objective", "dpo")
    assert dpo["breakdown"]["parameters"] - sft["breakdown"]["parameters"] == pytest.approx(reference_bytes)
    assert dpo["peak_bytes"] > sft["peak_bytes"] + reference_bytes  # and two rows per pair, full logits
    precomputed = given("--objective", "dpo", "--precompute_ref_log_probs")
    assert precomputed["breakdown"]["parameters"] == sft["breakdown"]["parameters"]
    lora = ("--use_peft", "--peft_method", "lora")
    assert given(*lora, "--objective", "dpo")["breakdown"]["parameters"] == given(*lora)["breakdown"]["parameters"]
    proc = main_in_process("plan", "--model_name", "llama3-8b", "--gpus_per_node", 8, "--objective", "dpo", *strategy)
    assert "\n  shardtune dpo --nproc_per_node 8 --model_name llama3-8b " in proc.stdout
    assert (
        "one of shardtune dpo's flags: add --objective dpo"
        in main_in_process("plan", "--model_name", "llama3-8b", "--precompute_ref_log_probs").stderr
    )


def test_grpo_plans_the_sampling_kv_cache_and_zero3_gathering_the_whole_model_for_it():
    """``shardtune plan --objective grpo``: the sampling term is the KV cache of the rows a rank samples at once
    (accumulation x batch, or steps_per_generation x batch) plus their last logits; ZeRO-3 with
    ds3_gather_for_generation (TRL's default) adds the whole model in bf16 beyond the step's gathered layers; the
    peak is the larger of the step and the sampling; sft plans none."""
    arch = read_arch("llama3-8b")
    per_row = 4096 * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 2 + arch.vocab_size * 24

    def given(*flags) -> dict:
        return plan_json("--context_length", 4096, "--batch_size_training", 4, *flags)["given"]

    assert "sampling (KV cache)" not in given("--enable_fsdp")["breakdown"]
    fsdp = given("--enable_fsdp", "--objective", "grpo", "--gradient_accumulation_steps", 2)
    assert fsdp["breakdown"]["sampling (KV cache)"] == pytest.approx(8 * per_row)
    more = given(
        "--enable_fsdp", "--objective", "grpo", "--gradient_accumulation_steps", 2, "--steps_per_generation", 64
    )
    assert more["breakdown"]["sampling (KV cache)"] == pytest.approx(256 * per_row)  # beyond the step
    resident = sum(more["breakdown"][k] for k in ("parameters", "optimizer state", "communication buffers"))
    assert more["peak_bytes"] == pytest.approx(resident + more["breakdown"]["gathered parameters"] + 256 * per_row)
    zero3 = ("--enable_deepspeed", "--deepspeed_config.zero_stage", 3, "--objective", "grpo")
    whole, layered = given(*zero3), given(*zero3, "--grpo.ds3_gather_for_generation", "false")
    gathered = whole["breakdown"]["gathered parameters"]
    assert whole["breakdown"]["sampling (KV cache)"] == pytest.approx(4 * per_row + arch.num_params * 2 - gathered)
    assert layered["breakdown"]["sampling (KV cache)"] == pytest.approx(4 * per_row)


@pytest.mark.parametrize("preset,vocab", [("demo", 1024), ("demo-32k", 32000), ("llama-8b-shape", 128256)])
def test_dry_run_describes_a_preset_with_its_own_vocabulary(tmp_path, preset, vocab):
    # --dry_run writes the preset's config.json for the planner: a preset that names its vocabulary (the benchmark
    # shapes) keeps it, the others get the shared tokenizer's size, as the built preset does
    from shardtune.planner.dry_run import model_directory

    written = model_directory(f"preset:{preset}", tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == vocab and written == str(tmp_path)
    assert read_arch(f"preset:{preset}").vocab_size == vocab


# -- vision-language models ------------------------------------------------------------------------------------------

VISION_PRESET_NAMES = ("vlm-llava-tiny", "vlm-qwen2vl-tiny", "vlm-mllama-tiny", "vlm-idefics3-tiny", "vlm-gemma3-tiny")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("preset", VISION_PRESET_NAMES)
def test_vision_preset_counts_equal_the_model_built_on_meta_with_and_without_lora(preset, tmp_path):
    """The planner's count of each vision preset (language model + tower + projector, mllama's cross-attention
    layers) equals sum(numel) of the model transformers builds from the preset's config on the meta device (the run's
    own build_model_on_meta), and LoRA's trainable count equals peft's on the language model only
    (shardtune.model.vision.language_model_targets), for the default targets and every linear layer."""
    from shardtune.config.flags import config_from
    from shardtune.model.loading import build_model_on_meta, count_parameters
    from shardtune.model.peft import apply_peft
    from shardtune.planner.vision import write_preset_config

    write_preset_config(preset, tmp_path)
    arch = read_arch(f"preset:{preset}")
    assert arch.vision is not None and arch.vision.num_params > 0
    assert arch.num_params == count_parameters(build_model_on_meta(str(tmp_path)))[0]
    assert read_arch(str(tmp_path)).num_params == arch.num_params  # the folder reads as the preset does
    for targets in (("q_proj", "v_proj"), ALL_LINEAR):
        cfg = config_from(model_name=str(tmp_path), use_peft=True, peft_method="lora", lora_target_modules=targets)
        model = apply_peft(build_model_on_meta(str(tmp_path)), cfg)
        trainable = count_parameters(model)[1]
        assert Adapter(method="lora", lora_targets=targets).trainable_params(arch) == trainable, targets


def llava_7b_config() -> dict:
    """LLaVA-1.5-7B's shape: CLIP ViT-L/14 at 336 pixels (576 patch tokens), a two-layer projector, Vicuna-7B."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32)
    text.num_attention_heads = text.num_key_value_heads = 32
    vision = CLIPVisionConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
        projection_dim=768,
    )
    return LlavaConfig(vision_config=vision, text_config=text, image_seq_length=576).to_dict()


def mllama_11b_config() -> dict:
    """Llama-3.2-11B-Vision's shape: a 32 + 8 layer tower over up to 4 tiles of 560 pixels, 8 cross-attention
    layers among the text model's 40."""
    from transformers import MllamaConfig

    text = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38],
    )
    vision = dict(
        hidden_size=1280,
        intermediate_size=5120,
        num_hidden_layers=32,
        num_global_layers=8,
        attention_heads=16,
        image_size=560,
        patch_size=14,
        max_num_tiles=4,
        vision_output_dim=7680,
        intermediate_layers_indices=[3, 7, 15, 23, 30],
    )
    return MllamaConfig(text_config=text, vision_config=vision).to_dict()


def write_config(folder, config: dict) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("family", ["llava-1.5-7b", "llama-3.2-11b-vision"])
def test_real_size_vision_plan_is_the_text_plan_plus_the_tower(family, tmp_path):
    """A real-size config.json (no download): the count equals the meta-built model's (LLaVA-1.5-7B: 7.06 B;
    Llama-3.2-11B-Vision: 10.67 B as published), and the peak against the plan of its text model alone:

    - LoRA (DDP, one GPU): the tower is frozen and nothing before it trains, so autograd keeps none of its
      activations: the peak is the text plan's plus exactly the tower's and projector's bf16 weights (and, for mllama,
      the cross-attention layers' keys and values over the tiles, which train through LoRA on v_proj);
    - full fine-tuning (FSDP on 8 GPUs): plus the tower's sharded training state (16 bytes a parameter over 8) and
      its activations; a LLaVA image's 577 tower positions go through 24 layers of width 1024, narrower and fewer than
      the text's 32 layers of width 4096, so they keep less than 577 text tokens' rows do; more than nothing."""
    from shardtune.model.loading import build_model_on_meta, count_parameters

    config = llava_7b_config() if family.startswith("llava") else mllama_11b_config()
    folder = write_config(tmp_path / "vlm", config)
    arch = read_arch(folder)
    assert arch.num_params == count_parameters(build_model_on_meta(folder))[0]
    published = {"llava-1.5-7b": 7.06e9, "llama-3.2-11b-vision": 10.67e9}[family]
    assert arch.num_params == pytest.approx(published, rel=2e-3)
    text = Arch.from_config(config["text_config"])
    v = arch.vision
    lora = Adapter(method="lora")
    one = dict(strategy="DDP", gpus_per_node=1, seq_len=4096, adapter=lora)
    with_images, text_only = estimate(Setup(arch=arch, **one)), estimate(Setup(arch=text, **one))
    cross_kv = 0.0
    if arch.cross_attention_layers:  # 8 layers x one image's 4 x 1601 features: k, v, head-major, fp32 key norm input
        tokens = v.cross_tokens_per_image
        cross_kv = tokens * 2 * arch.hidden_size + 8 * tokens * (4 * 2 + 4) * arch.num_kv_heads * arch.head_dim
    assert arch.text_params == text.num_params  # the text model alone (mllama's: its cross-attention layers too)
    assert with_images.peak - text_only.peak == pytest.approx(2 * v.num_params + cross_kv, rel=1e-9)
    full = dict(strategy="FULL_SHARD", gpus_per_node=8, seq_len=4096)
    with_images, text_only = estimate(Setup(arch=arch, **full)), estimate(Setup(arch=text, **full))
    state = 16 * v.num_params / 8
    images = with_images.activations - text_only.activations
    assert with_images.state - text_only.state == pytest.approx(state)
    assert with_images.peak > text_only.peak + state
    assert 0 < images - cross_kv
    if family.startswith("llava"):
        assert images < text_only.activations * v.positions_per_image / 4096


QWEN2VL_7B = {  # as on the hub: the text model's settings at the top level, no text_config
    "model_type": "qwen2_vl",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}
GEMMA3_4B = {
    "model_type": "gemma3",
    "mm_tokens_per_image": 256,
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 262208,
        "sliding_window": 1024,
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "image_size": 896,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


@pytest.mark.parametrize(
    "config,published,image_tokens",
    [(QWEN2VL_7B, 8_291_375_616, 1280), (GEMMA3_4B, 4_300_079_472, 258)],
    ids=["qwen2-vl-7b", "gemma-3-4b"],
)
def test_real_size_qwen2vl_and_gemma3_counts_are_the_published_ones(config, published, image_tokens, tmp_path):
    """Qwen2-VL-7B's config as the hub has it (flat, defaults omitted) and Gemma-3-4B's (q / k norms, four norms a
    layer, tied): the count is the meta-built model's and the published one; the image tokens are Qwen2-VL's grid at
    transformers' default max_pixels (28 x 28 x 1280: 1,280 tokens) and Gemma 3's 256 soft tokens plus two markers."""
    from shardtune.model.loading import build_model_on_meta, count_parameters

    folder = write_config(tmp_path / "vlm", config)
    arch = read_arch(folder)
    assert arch.num_params == count_parameters(build_model_on_meta(folder))[0] == published
    assert arch.vision.image_tokens == image_tokens


def test_image_activations_grow_linearly_with_images_and_shrink_with_checkpointing(tmp_path):
    """Each image adds the same bytes (its tower positions through every layer); activation checkpointing keeps only
    each tower layer's input (2 bytes x 1024 per position and layer instead of the layer's ~45 KB), LoRA none."""
    arch = read_arch(write_config(tmp_path / "llava", llava_7b_config()))
    base = Setup(arch=arch, strategy="FULL_SHARD", gpus_per_node=8, seq_len=4096)
    acts = [estimate(replace(base, images_per_example=n)).activations for n in (1, 2, 3, 4)]
    steps = [b - a for a, b in zip(acts, acts[1:])]
    assert steps[0] > 0 and steps == pytest.approx([steps[0]] * 3, rel=1e-12)
    assert estimate(replace(base, batch_size=2)).activations - 2 * acts[0] == pytest.approx(0, abs=1)
    checkpointed = [
        estimate(replace(base, images_per_example=n, activation_checkpointing=True)).activations for n in (1, 2)
    ]
    per_image_ac = checkpointed[1] - checkpointed[0]
    positions = arch.vision.positions_per_image
    assert 0 < per_image_ac < steps[0] / 5
    assert per_image_ac > 24 * 2 * 1024 * positions  # each tower layer's input, at least
    lora = [estimate(replace(base, images_per_example=n, adapter=Adapter(method="lora"))).activations for n in (1, 2)]
    assert lora[1] == lora[0]  # a frozen tower with nothing trainable before it keeps nothing


def test_plan_cli_counts_a_vision_preset_and_checks_the_image_flags():
    """``shardtune plan`` on a vision preset: checked as sft checks a vision run (packing refused), the parameter
    total includes the tower, one line says what was counted for the images, --images_per_example grows the
    activations; the flags are refused where they mean nothing (a text model; --image_tokens of a fixed-size family)
    or cannot fit (--context_length), one line each; sft --dry_run builds the same total on the meta device."""
    model = ("--model_name", "preset:vlm-llava-tiny")
    packed = main_in_process("plan", *model, "--gpu", "cpu")  # llama-cookbook's default batching packs rows
    assert packed.returncode == 2 and "is a vision-language model; --packing: rows with images" in packed.stderr
    args = ("plan", *model, "--batching_strategy", "padding", "--gpus_per_node", 2, "--gpu", "cpu")
    proc = main_in_process(*args)
    assert proc.returncode == 0, proc.stderr
    assert (
        "images: 1 per example (--images_per_example) x 17 tokens of the row (image_seq_length); llava" in proc.stdout
    )
    one = json.loads(main_in_process(*args, "--json").stdout)
    three = json.loads(main_in_process(*args, "--json", "--images_per_example", 3).stdout)
    assert one["parameters"] == 253888 and one["images"]["tower_parameters"] == 23936 + 6272
    grown = three["given"]["breakdown"]["activations"] - one["given"]["breakdown"]["activations"]
    assert grown == pytest.approx(2 * one["images"]["activation_bytes"], rel=1e-9) and grown > 0
    for flags, message in (
        (("--model_name", "llama3-8b", "--images_per_example", 2), "--images_per_example: llama3-8b is a text model"),
        ((*args[1:], "--image_tokens", 64), "--image_tokens 64: a llava image is always 17 tokens (image_seq_length)"),
        ((*args[1:], "--images_per_example", "0"), "--images_per_example '0': give a positive whole number"),
        ((*args[1:], "--context_length", 16), "--context_length 16 is shorter than 1 image(s) of 17 tokens each"),
    ):
        bad = main_in_process("plan", *flags)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and message in bad.stderr, bad.stderr
    dry = main_in_process(
        "sft",
        "--dry_run",
        "--model_name",
        "preset:vlm-mllama-tiny",
        "--gpus_per_node",
        2,
        "--enable_fsdp",
        "--batching_strategy",
        "padding",
        "--images_per_example",
        2,
    )
    assert dry.returncode == 0, dry.stderr
    assert "meta model: preset:vlm-mllama-tiny (308,103 parameters" in dry.stdout  # the plan's total, built
    assert "images: 2 per example (--images_per_example) x 1 token of the row (<|image|>; 2 tiles" in dry.stdout
    qwen = (
        "plan",
        "--model_name",
        "preset:vlm-qwen2vl-tiny",
        "--batching_strategy",
        "padding",
        "--gpu",
        "cpu",
        "--json",
    )
    sized = json.loads(main_in_process(*qwen, "--image_tokens", 64).stdout)["images"]
    assert sized["image_tokens"] == 64 and sized["tower_positions_per_image"] == 64 * 4  # 2 x 2 patches merged


def saved_for_backward_bytes(model, run) -> int:
    """Bytes of the tensors autograd saves while ``run()`` runs (each storage once), the model's parameters excluded:
    what the planner calls activations, measured."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def test_tower_activations_equal_what_autograd_saves():
    """The image term against measurement: a LLaVA tower (CLIP, 65 positions of width 128) and its projector run
    forward with a graph, counting the bytes of every tensor autograd saves (fp32, this torch's CPU SDPA). A tower
    layer's count is a count of tensors, not of rounded floats: equal to the byte. The whole image (pixels, the
    LayerNorm before the layers, the projector too) within 1%: the pixels are counted per position where they are
    per patch (64 of the 65: 768 bytes of ~1.5 MB), the LayerNorm's statistics as 8 bytes a position."""
    from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlavaConfig

    from shardtune.planner.estimate import image_activation_bytes
    from shardtune.planner.shapes import arch_of
    from shardtune.planner.vision import vit_layer_activation_bytes

    def measured(num_layers: int, num_images: int, frozen_tower: bool = False) -> tuple[int, Arch]:
        vision = CLIPVisionConfig(
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            image_size=64,
            patch_size=8,
        )
        text = LlamaConfig(
            vocab_size=300, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128
        )
        config = LlavaConfig(
            vision_config=vision,
            text_config=text,
            image_seq_length=65,
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
        )
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")
        if frozen_tower:  # --freeze_vision_tower
            model.model.vision_tower.requires_grad_(False)
        pixels = torch.randn(num_images, 3, 64, 64)
        features = dict(vision_feature_layer=-1, vision_feature_select_strategy="full")
        saved = saved_for_backward_bytes(model, lambda: model.model.get_image_features(pixels, **features))
        return saved, arch_of(config.to_dict(), "llava", {})

    one_layer, arch = measured(1, 1)
    two_layers, _ = measured(2, 1)
    v = arch.vision
    assert two_layers - one_layer == vit_layer_activation_bytes(v, 4) * v.positions_per_image
    two_images, arch = measured(2, 2)
    setup = Setup(arch=arch, compute_bytes=4, batch_size=1)
    predicted = image_activation_bytes(replace(setup, images_per_example=2))[0]
    assert predicted - image_activation_bytes(setup)[0] == pytest.approx(two_images - two_layers, rel=0.01)
    assert predicted == pytest.approx(two_images, rel=0.01)
    # a frozen tower (nothing trainable before it) keeps nothing; the trained projector keeps its input and hidden
    frozen, _ = measured(2, 2, frozen_tower=True)
    tower_frozen = replace(setup, images_per_example=2, frozen_parts=frozenset({"vision_tower"}))
    assert 0 < frozen < two_images / 10
    assert image_activation_bytes(tower_frozen)[0] == pytest.approx(frozen, rel=0.01)


FREEZING_FLAGS = {
    "vision_tower": "--freeze_vision_tower",
    "multi_modal_projector": "--freeze_multi_modal_projector",
    "language_model": "--freeze_language_model",
    "llm_only": "--freeze_LLM_only",
}


@pytest.mark.parametrize("preset", VISION_PRESET_NAMES)
def test_frozen_parts_count_what_the_freezing_flags_freeze(preset, tmp_path):
    """Each freezing flag (and two together) on the preset built on the meta device (the run's apply_freezing): the
    plan's trainable count is the model's, and the frozen count each part's (mllama's --freeze_LLM_only leaves its
    cross-attention layers trainable, other families' freeze the whole language model)."""
    from shardtune.config.flags import parse_args
    from shardtune.model.freezing import apply_freezing
    from shardtune.model.loading import build_model_on_meta, count_parameters
    from shardtune.planner.shapes import frozen_params
    from shardtune.planner.vision import write_preset_config

    write_preset_config(preset, tmp_path)
    arch = read_arch(f"preset:{preset}")
    for parts in (
        *([p] for p in FREEZING_FLAGS),
        ["vision_tower", "multi_modal_projector"],
        ["vision_tower", "llm_only"],
    ):
        model = build_model_on_meta(str(tmp_path))
        apply_freezing(model, parse_args(["--model_name", str(tmp_path), *(FREEZING_FLAGS[p] for p in parts)]))
        total, trainable = count_parameters(model)
        setup = Setup(arch=arch, frozen_parts=frozenset(parts))
        assert (arch.num_params, setup.trainable_params) == (total, trainable), parts
    v = arch.vision
    assert frozen_params(arch, frozenset({"vision_tower", "multi_modal_projector"})) == v.num_params
    llm_only = frozen_params(arch, frozenset({"llm_only"}))
    if preset == "vlm-mllama-tiny":
        assert 0 < llm_only < arch.text_params
    else:
        assert llm_only == arch.text_params


def test_a_frozen_part_has_weights_but_no_gradient_optimizer_state_or_tower_activations(tmp_path):
    """LLaVA-1.5-7B, FSDP on 8 GPUs: a frozen tower keeps its fp32 weight shards but drops its gradients (4 bytes a
    parameter over 8) and AdamW state (8), and its activations (nothing trainable before it; the projector still
    keeps its input); tower and projector frozen keep no image activation, as LoRA's; the language model frozen
    keeps the tower's (it trains). Under ZeRO-3 in bf16 a frozen weight is bf16 with no fp32 master (12 bytes)."""
    from shardtune.planner.estimate import image_activation_bytes

    arch = read_arch(write_config(tmp_path / "llava", llava_7b_config()))
    v, base = arch.vision, Setup(arch=arch, strategy="FULL_SHARD", gpus_per_node=8, seq_len=4096)

    def frozen(*parts: str, setup: Setup = base) -> Setup:
        return replace(setup, frozen_parts=frozenset(parts))

    full, tower = estimate(base), estimate(frozen("vision_tower"))
    assert tower.params == full.params
    assert full.grads - tower.grads == pytest.approx(4 * v.tower_params / 8)
    assert full.optimizer - tower.optimizer == pytest.approx(8 * v.tower_params / 8)
    images = image_activation_bytes(base)[0]
    tower_images = image_activation_bytes(frozen("vision_tower"))[0]
    assert 0 < tower_images < images / 10
    assert full.activations - tower.activations == pytest.approx(images - tower_images)
    lora = image_activation_bytes(replace(base, adapter=Adapter(method="lora")))[0]
    assert image_activation_bytes(frozen("vision_tower", "multi_modal_projector"))[0] == lora == 0
    language = estimate(frozen("language_model"))
    assert image_activation_bytes(frozen("language_model"))[0] == images
    assert full.optimizer - language.optimizer == pytest.approx(8 * arch.text_params / 8)
    zero3 = replace(base, strategy="ZERO3")
    full3, tower3 = estimate(zero3), estimate(frozen("vision_tower", setup=zero3))
    assert tower3.params == full3.params == pytest.approx(2 * arch.num_params / 8)
    assert full3.optimizer - tower3.optimizer == pytest.approx(12 * v.tower_params / 8)


def test_plan_and_dry_run_count_the_freezing_flags():
    """``shardtune plan`` on the mllama preset: --freeze_LLM_only trains the tower, projector and cross-attention
    layers (83,911 of 308,103, what sft --dry_run builds on the meta device); --freeze_vision_tower keeps no tower
    activation (one line says so); sft --dry_run under ZeRO-2 computes the state from the same count."""
    args = ("plan", "--model_name", "preset:vlm-mllama-tiny", "--batching_strategy", "padding", "--gpu", "cpu")
    plain = json.loads(main_in_process(*args, "--json").stdout)
    llm_only = json.loads(main_in_process(*args, "--json", "--freeze_LLM_only").stdout)
    assert (plain["trainable_parameters"], llm_only["trainable_parameters"]) == (308103, 83911)
    assert llm_only["given"]["breakdown"]["gradients"] < plain["given"]["breakdown"]["gradients"] / 3
    tower = main_in_process(*args, "--freeze_vision_tower")
    assert tower.returncode == 0, tower.stderr
    assert "(tower frozen: no activations kept but the projector's input)" in tower.stdout
    dry = ["sft", "--dry_run", "--model_name", "preset:vlm-mllama-tiny", "--gpus_per_node", 2]
    dry += ["--batching_strategy", "padding", "--freeze_LLM_only"]
    meta = main_in_process(*dry, "--enable_fsdp")
    assert "meta model: preset:vlm-mllama-tiny (308,103 parameters, 83,911 trainable)" in meta.stdout, meta.stderr
    zero2 = main_in_process(*dry, "--enable_deepspeed", "--deepspeed_config.zero_stage", 2)
    assert "grads 81.9 KiB" in zero2.stdout, zero2.stdout  # 83,911 bf16 gradients over 2 ranks
