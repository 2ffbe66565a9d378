"""FSDP2 trains exactly like DDP, shards what it says it shards, and loads on rank 0 only when asked.

Real torchrun launches of gloo processes, real tiny Llama. Every configuration has processes x per-device batch = 8,
so each must reproduce the DDP run step by step (losses) and at the end (weights), up to float32 rounding.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, shardtune_argv
from tests.helpers import (
    assert_plain_hf_directory,
    assert_same_training,
    step_rows,
    train_once,
    weights,
)

FSDP = ("--enable_fsdp",)
# name -> (processes, per-device batch, flags); flags combined to keep the number of launches small. Later flags
# override TRAIN_ARGS (accumulation 2 exercises FSDP's no-sync micro-batches).
VARIANTS = {
    "ddp": (2, 4, ()),
    "full_shard+activation_checkpointing+low_cpu_fsdp": (
        2,
        4,
        (
            *FSDP,
            "--fsdp_config.sharding_strategy",
            "FULL_SHARD",
            "--fsdp_config.fsdp_activation_checkpointing",
            "true",
            "--low_cpu_fsdp",
        ),
    ),
    "shard_grad_op+cpu_offload+accumulation": (
        2,
        2,
        (
            *FSDP,
            "--fsdp_config.sharding_strategy",
            "SHARD_GRAD_OP",
            "--fsdp_cpu_offload",
            "true",
            "--gradient_accumulation_steps",
            "2",
        ),
    ),
    "no_shard": (2, 4, (*FSDP, "--fsdp_config.sharding_strategy", "NO_SHARD")),
    "hybrid_shard_2x2": (
        4,
        2,
        (
            *FSDP,
            "--fsdp_config.sharding_strategy",
            "HYBRID_SHARD",
            "--fsdp_config.hsdp",
            "true",
            "--fsdp_config.sharding_group_size",
            "2",
        ),
    ),
}
TRAIN_ARGS = (
    "--gradient_accumulation_steps",
    1,
    "--batching_strategy",
    "packing",
    "--context_length",
    256,
    "--synthetic_dialogues.num_train",
    96,
    "--synthetic_dialogues.num_validation",
    16,
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Output dirs of the runs so far, shared by the tests of this module (each launch costs ~10 s)."""
    return {"root": tmp_path_factory.mktemp("fsdp-runs")}


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


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "ddp"])
def test_sharding_strategy_trains_like_ddp(variant, runs, run_cli, tiny_model):
    ddp = trained("ddp", runs, run_cli, tiny_model)
    losses = [r["loss"] for r in step_rows(ddp)]
    assert losses[-1] < losses[0], "the model did not learn: the comparison would be vacuous"
    difference = assert_same_training(ddp, trained(variant, runs, run_cli, tiny_model), variant)
    print(f"{variant}: max relative weight difference to DDP {difference:.2e}")


def test_start_log_states_strategy_mesh_and_per_rank_state(runs, run_cli, tiny_model):
    log = (trained("hybrid_shard_2x2", runs, run_cli, tiny_model) / "stdout.log").read_text()
    assert (
        "strategy: fsdp2 HYBRID_SHARD, world size 4, mesh (replicate 2 x shard 2), weights float32, compute "
        "float32, gradient reduction float32" in log
    )
    assert "fsdp: per-rank training state (rank 0's local shards): params" in log
    assert "fsdp: peak host memory per rank after loading and sharding: rank 0" in log


def per_rank_state(log: str) -> str:
    return next(line for line in log.splitlines() if line.startswith("fsdp: per-rank training state"))


def test_dry_run_reports_the_per_rank_state_of_the_real_run(runs, run_cli, tiny_model, tmp_path):
    """`sft --dry_run` with the 4-process HSDP run's flags: the model sharded on the meta device over a fake process
    group gives the start log's line of the real run, and no process starts (nothing is written)."""
    real = per_rank_state((trained("hybrid_shard_2x2", runs, run_cli, tiny_model) / "stdout.log").read_text())
    nproc, batch, flags = VARIANTS["hybrid_shard_2x2"]
    out = tmp_path / "dry"
    proc = run_cli(
        "sft",
        "--dry_run",
        "--nproc_per_node",
        nproc,
        "--model_name",
        tiny_model,
        "--output_dir",
        out,
        "--batch_size_training",
        batch,
        *TRAIN_ARGS,
        *flags,
    )
    assert per_rank_state(proc.stdout) == real
    num_params = int(re.search(r"meta model: .* \(([\d,]+) parameters", proc.stdout).group(1).replace(",", ""))
    assert f"params {num_params * 4 / 2 / 1024:.1f} KiB" in real  # control: fp32 shards of 2 ranks, not 1 or 4
    assert "dry run: no process started" in proc.stdout and not out.exists()
    assert "mesh: dp_replicate 2 x dp_shard 2 x cp 1 x sp 1" in proc.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hybrid_shard_across_two_nodes_matches_one_node(runs, run_cli, cache_dir, tiny_model, tmp_path):
    """Two launcher invocations as two nodes of 2 processes: the default sharding group is one node's processes."""
    one_node = trained("hybrid_shard_2x2", runs, run_cli, tiny_model)
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node_rank in (0, 1):
        args = [
            "sft",
            "--nnodes",
            "2",
            "--node_rank",
            str(node_rank),
            "--nproc_per_node",
            "2",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            endpoint,
            "--rdzv_id",
            "fsdp-test",
            "--model_name",
            str(tiny_model),
            "--output_dir",
            str(tmp_path / "two-nodes"),
            "--batch_size_training",
            "2",
            *map(str, TRAIN_ARGS),
            "--enable_fsdp",
            "--fsdp_config.sharding_strategy",
            "HYBRID_SHARD",
        ]
        procs.append(
            subprocess.Popen(
                shardtune_argv(*args),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=cli_env(cache_dir),
                cwd=REPO,
            )
        )
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, f"--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    assert "mesh (replicate 2 x shard 2)" in outputs[0][0]
    difference = assert_same_training(one_node, tmp_path / "two-nodes", "two nodes")
    print(f"two nodes vs one node: max relative weight difference {difference:.2e}")


def test_saved_model_after_fsdp_training_is_a_plain_hf_directory(runs, run_cli, tiny_model):
    out = trained("full_shard+activation_checkpointing+low_cpu_fsdp", runs, run_cli, tiny_model)
    assert_plain_hf_directory(out)
    assert not any("_checkpoint_wrapped_module" in k or "_fsdp" in k for k in weights(out))


def test_full_shard_ranks_hold_their_share_and_low_cpu_fsdp_loads_rank0_weights(cache_dir, tiny_model, tmp_path):
    """From the real local shards of 4 ranks: at most 1/N of the model plus one layer; low_cpu_fsdp builds on
    the meta device on ranks 1..3 and ends with rank 0's exact weights, buffers (rotary inv_freq) and logits.

    CPU offload: every fully_shard unit received the CPU offload policy and keeps its sharded parameters on the CPU
    (and the default wrap does not); after a step the local shards, their gradients and AdamW's state are on the CPU.
    On a CPU device that placement is where everything is anyway: what offloading moves on a GPU (and that its loss
    equals the GPU-resident run's) is checked by bench/gpu_smoke.sh (check fsdp_cpu_offload)."""
    world_size = 4
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(world_size),
            "tests/distributed/fsdp_probe.py",
            str(tiny_model),
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        text=True,
        env={**cli_env(cache_dir), "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        timeout=300,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    total = ranks[0]["total_numel"]
    for r in ranks:
        assert r["local_numel"] <= total / world_size + r["layer_numel"], r
        assert r["low_cpu_local_numel"] == r["local_numel"], r
        assert r["built_on_meta"] == (r["rank"] != 0), r
        assert r["low_cpu_buffers_equal"], r
        assert r["low_cpu_logits_max_abs_diff"] == 0.0 and r["sharded_logits_max_abs_diff"] == 0.0, r
        offloaded, not_offloaded = r["offloaded"], r["not_offloaded"]
        assert offloaded["units_with_cpu_offload_policy"] == offloaded["num_units"] > 1, r
        assert offloaded["all_params_offloaded"] and not not_offloaded["all_params_offloaded"], r
        assert not_offloaded["units_with_cpu_offload_policy"] == 0, r
        assert all(offloaded[k] for k in ("local_shards_on_cpu", "grads_on_cpu", "optimizer_state_on_cpu")), r
    assert sum(r["local_numel"] for r in ranks) >= total  # the shards cover the model (plus padding)
    assert ranks[0]["low_cpu_weights_equal"]
    print("local numel per rank:", [r["local_numel"] for r in ranks], "of", total)
