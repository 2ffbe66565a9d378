"""Two hosts (network namespaces with their own address and hostname) train exactly like one host.

Every successful run has 2 hosts x 2 processes and is compared with one host running 4 processes of DDP (same
losses per step, same weights; DDP, FSDP and DeepSpeed ZeRO-3 are equal on one host, tests/distributed): a
node that trained alone, or joined the wrong rendezvous, would see world size 2 and other losses. Each run
folds several properties: the Kubeflow pod simulation is the DDP case, the c10d flags the HYBRID_SHARD case
(one shard group per host), the SLURM recipe the DeepSpeed ZeRO-3 case. Then the preflight failures.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env
from tests.helpers import assert_same_training, step_rows
from tests.multihost.conftest import RDZV_PORT, assert_succeeded
from tests.multihost.slurm import SlurmCluster, missing_programs
from tests.netns import INTERFACE

TRAIN_ARGS = ("--config", "recipes/demo.yaml", "--batch_size_training", 2, "--context_length", 256,
              "--synthetic_dialogues.num_train", 96, "--synthetic_dialogues.num_validation", 8,
              "--max_train_step", 4, "--lr", 3e-3, "--warmup_steps", 0, "--num_workers_dataloader", 0,
              "--run_validation", "false")


@pytest.fixture(scope="module")
def one_host(tmp_path_factory, tiny_model, cache_dir) -> Path:
    """The reference: one host, 4 processes, DDP."""
    out = tmp_path_factory.mktemp("one-host") / "ddp4"
    subprocess.run([sys.executable, "-m", "shardtune", "sft", "--nproc_per_node", "4", "--model_name", str(tiny_model),
                    "--output_dir", str(out), *map(str, TRAIN_ARGS)], check=True, capture_output=True, text=True,
                   env=cli_env(cache_dir), cwd=REPO, timeout=300)
    losses = [r["loss"] for r in step_rows(out)]
    assert losses[-1] < losses[0], "the model did not learn: the comparisons would be vacuous"
    return out


def test_the_rig_gives_each_host_its_own_name_and_address(two_hosts):
    names = [two_hosts.run(i, ["sh", "-c", "hostname; getent hosts hostA hostB"], env={}).stdout.split()
             for i in (0, 1)]
    assert names[0][0] == "hostA" and names[1][0] == "hostB"
    assert names[0][1:] == names[1][1:] == ["10.77.0.1", "hostA", "10.77.0.2", "hostB"]


def test_kubeflow_pods_with_only_pet_variables_train_like_one_host(launch_on_two_hosts, one_host, tiny_model,
                                                                    tmp_path):
    """No launcher flags: PET_* as Kubeflow's TrainJob sets them (static rendezvous at the master pod)."""
    out = tmp_path / "kubeflow"
    pet = [{"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(i), "PET_MASTER_ADDR": "hostA",
            "PET_MASTER_PORT": str(RDZV_PORT)} for i in (0, 1)]
    argv = [sys.executable, "-m", "shardtune", "sft", "--model_name", str(tiny_model), "--output_dir", str(out),
            *map(str, TRAIN_ARGS)]
    results = launch_on_two_hosts([argv, argv], env_per_host=pet)
    assert_succeeded(results)
    assert ("topology: 2 nodes, this is node 1, static rendezvous at hostA:29500, 2 processes per node, from "
            "torchrun's environment (PET_NNODES=2") in results[1][1]
    assert "strategy: ddp, world size 4" in results[0][1] + results[1][1]
    assert "preflight: 2 nodes (" in results[0][1] and "output_dir is shared" in results[0][1]
    difference = assert_same_training(one_host, out, "kubeflow ddp 2x2")
    print(f"kubeflow pods (DDP 2 hosts x 2) vs one host: max relative weight difference {difference:.2e}")


def test_hybrid_shard_with_c10d_flags_shards_within_each_host(sft_on_two_hosts, one_host, tiny_model, tmp_path):
    """The TRL guide's manual commands (c10d rendezvous on host A), HYBRID_SHARD: one shard group per host."""
    out = tmp_path / "hsdp"
    results = sft_on_two_hosts(2, ["--model_name", tiny_model, "--output_dir", out, *TRAIN_ARGS, "--enable_fsdp",
                                   "--fsdp_config.sharding_strategy", "HYBRID_SHARD"])
    assert_succeeded(results)
    logs = results[0][1] + results[1][1]
    assert "fsdp2 HYBRID_SHARD, world size 4, mesh (replicate 2 x shard 2)" in logs
    assert "c10d rendezvous at hostA:29500, 2 processes per node, from flags" in results[0][1]
    difference = assert_same_training(one_host, out, "hybrid shard 2x2")
    print(f"HYBRID_SHARD 2 hosts x 2 vs one host: max relative weight difference {difference:.2e}")


def bin_dir_with_shardtune(bin_dir: Path) -> Path:
    """A folder for PATH with ``shardtune``, the entry point an installed shardtune has."""
    bin_dir.mkdir(exist_ok=True)
    write_executable(bin_dir / "shardtune", f'#!/bin/bash\nexec {shlex.quote(sys.executable)} -m shardtune "$@"\n')
    return bin_dir


def write_executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(stat.S_IRWXU)


def stand_in_srun(two_hosts, bin_dir: Path) -> None:
    """``srun`` standing in for SLURM's where slurm-wlm is not installed: one task per test host with the
    variables srun sets for a step."""
    step_env = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_STEP_NODELIST": "hostA,hostB", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    tasks = []
    for node in (0, 1):
        variables = {**step_env, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)}
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in variables.items())
        tasks.append(f'env {assignments} {shlex.join(two_hosts.command(node, []))} "${{argv[@]}}" & pids+=($!)')
    write_executable(bin_dir / "srun", "\n".join([
        "#!/bin/bash",
        "# stand-in srun: drop srun's own options, start the command once on each test host",
        'while [[ $# -gt 0 && $1 == -* ]]; do shift; done',
        'argv=("$@"); pids=()', *tasks,
        'status=0; for pid in "${pids[@]}"; do wait "$pid" || status=$?; done; exit $status', ""]))


def submit_slurm_recipe(two_hosts, args: list[str], env: dict[str, str], root: Path) -> tuple[int, str, str]:
    """``sbatch recipes/multinode.slurm ARGS`` on a real SLURM cluster on the two hosts (slurmctld + one slurmd
    per host) when slurm-wlm is installed; else the script run by bash as sbatch would on the first node,
    with sbatch's variables, and the stand-in srun. Returns (exit status, output, job id)."""
    missing = missing_programs()
    if not missing:
        cluster = SlurmCluster(two_hosts, root / "slurm")
        (root / "slurm").mkdir()
        try:
            cluster.start()
            # the recipe is written for 8 GPUs and 32 CPUs per node; these hosts have 2 and 2
            code, output = cluster.sbatch(["--gpus-per-node=2", "--cpus-per-task=1", "recipes/multinode.slurm",
                                           *args], env=env, cwd=REPO, timeout=480)
        finally:
            cluster.stop()
        print("SLURM recipe run by a real SLURM (slurmctld + 2 slurmd)")
        return code, output, re.search(r"Submitted batch job (\d+)", output).group(1)
    print(f"SLURM recipe run with the stand-in srun ({', '.join(missing)} not installed)")
    stand_in_srun(two_hosts, Path(env["PATH"].split(":")[0]))
    job_id = "4242"
    batch = {"SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "shardtune", "SLURM_NNODES": "2",
             "SLURM_JOB_NODELIST": "hostA,hostB", "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "2"}
    proc = subprocess.run(["bash", "recipes/multinode.slurm", *args], env={**env, **batch}, cwd=REPO,
                          capture_output=True, text=True, timeout=480)
    return proc.returncode, proc.stdout + proc.stderr, job_id


def test_slurm_recipe_runs_as_it_is_with_deepspeed_zero3(two_hosts, cache_dir, one_host, tiny_model, tmp_path):
    """recipes/multinode.slurm submitted unmodified; no torchrun flags: the topology comes from SLURM."""
    bin_dir = bin_dir_with_shardtune(tmp_path / "bin")
    env = {**cli_env(cache_dir), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SHARED": str(tmp_path / "shared"),
           "STRATEGY": "deepspeed", "GLOO_SOCKET_IFNAME": INTERFACE}
    code, output, job_id = submit_slurm_recipe(two_hosts, ["--model_name", str(tiny_model), *map(str, TRAIN_ARGS[2:])],
                                               env, tmp_path)
    assert code == 0, output[-6000:]
    assert "c10d rendezvous at hostA:29500, 2 processes per node, from SLURM (SLURM_NNODES=2" in output, output[-3000:]
    assert "processes per node from SLURM_GPUS_ON_NODE" in output
    assert "ZeRO-3" in output, output[-3000:]
    out = tmp_path / "shared" / "runs" / f"shardtune-{job_id}"
    assert (tmp_path / "shared" / "cache").is_dir()  # SHARDTUNE_CACHE on the shared path
    difference = assert_same_training(one_host, out, "slurm recipe zero3 2x2")
    print(f"SLURM recipe (ZeRO-3, 2 hosts x 2) vs one host: max relative weight difference {difference:.2e}")


def test_a_node_with_another_config_stops_every_node_naming_the_field(sft_on_two_hosts, tiny_model, tmp_path):
    results = sft_on_two_hosts(1, ["--model_name", tiny_model, "--output_dir", tmp_path / "out", *TRAIN_ARGS],
                               args_per_host=[[], ["--lr", "0.002"]], timeout=180)
    expected = "preflight: the nodes differ in --lr: "
    for code, out, err in results:
        assert code != 0
        lines = [line for line in err.splitlines() if expected in line]
        assert len(lines) == 1, err[-3000:]  # one line per node, not one per rank or a traceback
        assert "(rank 0) has 0.003" in lines[0] and "has 0.002" in lines[0], lines[0]
        assert "hostA" in lines[0] and "hostB" in lines[0], lines[0]
        assert "Traceback" not in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_node_local_output_dir_stops_every_node_with_the_fix(sft_on_two_hosts, tiny_model, tmp_path):
    """Host B gets its own (tmpfs) directory at the output_dir's path: a node-local disk."""
    local = tmp_path / "node-local"
    results = sft_on_two_hosts(1, ["--model_name", tiny_model, "--output_dir", local / "out", *TRAIN_ARGS],
                               node_local_dirs=[[], [local]], timeout=180)
    for code, out, err in results:
        assert code != 0
        lines = [line for line in err.splitlines() if "is not shared" in line]
        assert len(lines) == 1, err[-3000:]
        assert f"--output_dir {local / 'out'} is not shared: hostB cannot see" in lines[0], lines[0]
        assert "file system every node mounts at the same path" in lines[0]
    assert not (local / "out" / "metrics.jsonl").exists()
