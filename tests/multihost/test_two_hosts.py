"""Two hosts (network namespaces with their own address and hostname) train exactly like one host.

Every successful run has 2 hosts x 2 processes and is compared with one host running 4 processes of DDP (same
losses per step, same weights; DDP, FSDP and DeepSpeed ZeRO-3 are equal on one host, tests/distributed): a
node that trained alone, or joined the wrong rendezvous, would see world size 2 and other losses. Each run
folds several properties: the Kubeflow pod simulation is the DDP case, the c10d flags the HYBRID_SHARD case
(one shard group per host) with a lost node restarted mid-run, the SLURM recipe the DeepSpeed ZeRO-3 case. Then
the preflight failures.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.runtime.preemption import EXIT_PREEMPTED
from shardtune.training.engine.checkpoint.layout import latest_checkpoint
from tests.conftest import REPO, cli_env
from tests.helpers import assert_same_training, step_rows
from tests.multihost.conftest import RDZV_PORT, assert_succeeded, sft_argvs
from tests.multihost.slurm import SlurmCluster, missing_programs
from tests.netns import INTERFACE

TRAIN_ARGS = (
    "--config",
    "recipes/demo.yaml",
    "--batch_size_training",
    2,
    "--context_length",
    256,
    "--synthetic_dialogues.num_train",
    96,
    "--synthetic_dialogues.num_validation",
    8,
    "--max_train_step",
    4,
    "--lr",
    3e-3,
    "--warmup_steps",
    0,
    "--num_workers_dataloader",
    0,
    "--run_validation",
    "false",
)


@pytest.fixture(scope="module")
def one_host(tmp_path_factory, tiny_model, cache_dir) -> Path:
    """The reference: one host, 4 processes, DDP."""
    out = tmp_path_factory.mktemp("one-host") / "ddp4"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "shardtune",
            "sft",
            "--nproc_per_node",
            "4",
            "--model_name",
            str(tiny_model),
            "--output_dir",
            str(out),
            *map(str, TRAIN_ARGS),
        ],
        check=True,
        capture_output=True,
        text=True,
        env=cli_env(cache_dir),
        cwd=REPO,
        timeout=300,
    )
    losses = [r["loss"] for r in step_rows(out)]
    assert losses[-1] < losses[0], "the model did not learn: the comparisons would be vacuous"
    return out


def test_the_rig_gives_each_host_its_own_name_and_address(two_hosts):
    names = [
        two_hosts.run(i, ["sh", "-c", "hostname; getent hosts hostA hostB"], env={}).stdout.split() for i in (0, 1)
    ]
    assert names[0][0] == "hostA" and names[1][0] == "hostB"
    assert names[0][1:] == names[1][1:] == ["10.77.0.1", "hostA", "10.77.0.2", "hostB"]


def test_kubeflow_pods_with_only_pet_variables_train_like_one_host(launch_on_two_hosts, one_host, tiny_model, tmp_path):
    """No launcher flags: PET_* as Kubeflow's TrainJob sets them (static rendezvous at the master pod)."""
    out = tmp_path / "kubeflow"
    pet = [
        {
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "2",
            "PET_NODE_RANK": str(i),
            "PET_MASTER_ADDR": "hostA",
            "PET_MASTER_PORT": str(RDZV_PORT),
        }
        for i in (0, 1)
    ]
    argv = [
        sys.executable,
        "-m",
        "shardtune",
        "sft",
        "--model_name",
        str(tiny_model),
        "--output_dir",
        str(out),
        *map(str, TRAIN_ARGS),
    ]
    results = launch_on_two_hosts([argv, argv], env_per_host=pet)
    assert_succeeded(results)
    assert (
        "topology: 2 nodes, this is node 1, static rendezvous at hostA:29500, 2 processes per node, from "
        "torchrun's environment (PET_NNODES=2"
    ) in results[1][1]
    assert "strategy: ddp, world size 4" in results[0][1] + results[1][1]
    assert "preflight: 2 nodes (" in results[0][1] and "output_dir is shared" in results[0][1]
    difference = assert_same_training(one_host, out, "kubeflow ddp 2x2")
    print(f"kubeflow pods (DDP 2 hosts x 2) vs one host: max relative weight difference {difference:.2e}")


def torchrun_workers(two_hosts, host: int) -> list[int]:
    """The training processes torchrun's agent started on host ``host`` (read from /proc: root reads any)."""
    found = []
    for pid in two_hosts.pids(host):
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(b"TORCHELASTIC_RUN_ID=") for v in env) and any(v.startswith(b"LOCAL_RANK=") for v in env):
            found.append(pid)
    return found


def test_hybrid_shard_with_c10d_flags_resumes_on_every_node_after_a_lost_node(
    two_hosts, cache_dir, one_host, tiny_model, tmp_path
):
    """The TRL guide's manual commands (c10d rendezvous on host A), HYBRID_SHARD: one shard group per host; and a
    lost node: host B's workers are SIGKILLed after the first checkpoint, with --max_restarts 1. Host B's agent
    restarts them, host A's agent restarts its own for the membership change (without counting a restart of its
    own), and every worker resumes from the same checkpoint because all agree on the restart
    (shardtune/runtime/elastic.py)."""
    out = tmp_path / "hsdp"
    argvs = sft_argvs(
        two_hosts,
        2,
        [
            "--model_name",
            tiny_model,
            "--output_dir",
            out,
            *TRAIN_ARGS,
            "--enable_fsdp",
            "--fsdp_config.sharding_strategy",
            "HYBRID_SHARD",
            "--save_steps",
            1,
            "--max_restarts",
            1,
        ],
    )
    procs = [two_hosts.popen(host, argv, env=cli_env(cache_dir), cwd=REPO) for host, argv in enumerate(argvs)]
    killed: list[int] = []
    try:
        while latest_checkpoint(out) is None:
            assert all(p.poll() is None for p in procs), "the run ended before its first checkpoint"
            time.sleep(0.005)
        killed = torchrun_workers(two_hosts, 1)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
    finally:
        # a worker blocked in a collective with a dead peer may take torchrun's 30 s from SIGTERM to SIGKILL
        results = two_hosts.wait(procs, timeout=480)
    assert len(killed) == 2, killed
    assert_succeeded(results)
    logs = results[0][1] + results[1][1]  # global rank 0 (which prints) is on either host
    assert "fsdp2 HYBRID_SHARD, world size 4, mesh (replicate 2 x shard 2)" in logs
    assert "c10d rendezvous at hostA:29500, 2 processes per node, from flags" in results[0][1]
    # one restart, after the kill and before the end: the steps after that checkpoint were trained again
    resumed = re.findall(r"restart 1 of the worker group: resuming automatically from \S+/step-(\d+)", logs)
    assert len(resumed) == 1 and 1 <= int(resumed[0]) < 4, logs[-3000:]
    difference = assert_same_training(one_host, out, "hybrid shard 2x2, node lost and restarted")
    print(
        f"HYBRID_SHARD 2 hosts x 2, host B's workers killed after step {int(resumed[0])}'s checkpoint, all "
        f"resumed: max relative weight difference to one host {difference:.2e}"
    )


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
    step_env = {
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "hostA,hostB",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
    }
    tasks = []
    for node in (0, 1):
        variables = {**step_env, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)}
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in variables.items())
        tasks.append(f'env {assignments} {shlex.join(two_hosts.command(node, []))} "${{argv[@]}}" & pids+=($!)')
    write_executable(
        bin_dir / "srun",
        "\n".join(
            [
                "#!/bin/bash",
                "# stand-in srun: drop srun's own options, start the command once on each test host",
                "while [[ $# -gt 0 && $1 == -* ]]; do shift; done",
                'argv=("$@"); pids=()',
                *tasks,
                'status=0; for pid in "${pids[@]}"; do wait "$pid" || status=$?; done; exit $status',
                "",
            ]
        ),
    )


def stand_in_scontrol(bin_dir: Path, record: Path) -> None:
    """``scontrol`` standing in for SLURM's: records ``scontrol requeue ID`` (what the recipe calls); anything
    else fails (``scontrol show hostnames``: shardtune then reads the host list itself)."""
    write_executable(
        bin_dir / "scontrol",
        "\n".join(
            [
                "#!/bin/bash",
                f'if [ "$1" = requeue ]; then echo "$*" >> {shlex.quote(str(record))}; exit 0; fi',
                "exit 1",
                "",
            ]
        ),
    )


def launchers(two_hosts, host: int) -> list[int]:
    """The ``shardtune sft`` launchers (not torchrun's workers) running on host ``host``."""
    found = []
    for pid in set(two_hosts.pids(host)) - set(torchrun_workers(two_hosts, host)):
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"shardtune" in argv and b"sft" in argv:
            found.append(pid)
    return found


def wait_for_first_step(runs: Path, proc: subprocess.Popen) -> Path:
    """The run folder under ``runs`` once it has logged an optimizer step (training is under way)."""
    while True:
        for metrics in runs.glob("*/metrics.jsonl"):
            if logged_steps(metrics.parent) >= 1:
                return metrics.parent
        assert proc.poll() is None, "the job ended before its first step"
        time.sleep(0.05)


def logged_steps(out: Path) -> int:
    try:
        return len(step_rows(out))
    except (OSError, ValueError):
        return 0


def submit_slurm_recipe_and_stop_it(
    two_hosts, args: list[str], env: dict[str, str], root: Path
) -> tuple[int, str, str]:
    """``sbatch recipes/multinode.slurm ARGS`` on a real SLURM cluster on the two hosts (slurmctld + one slurmd
    per host) when slurm-wlm is installed, SIGUSR1 to the job's tasks after its first step as SLURM sends it
    before a time limit: the recipe requeues the job and SLURM starts it again, which resumes. Without slurm-wlm,
    the script is run by bash as sbatch would on the first node, with sbatch's variables, a stand-in srun and a
    stand-in scontrol that records the requeue; SIGUSR1 goes to both launchers, and the script is run again as
    SLURM would run the requeued job. Returns (exit status of the last run, all output, job id)."""
    runs = Path(env["SHARED"]) / "runs"
    missing = missing_programs()
    if not missing:
        cluster = SlurmCluster(two_hosts, root / "slurm")
        (root / "slurm").mkdir()
        try:
            cluster.start()
            # the recipe is written for 8 GPUs and 32 CPUs per node; these hosts have 2 and 2
            proc = cluster.submit(
                ["--gpus-per-node=2", "--cpus-per-task=1", "recipes/multinode.slurm", *args], env=env, cwd=REPO
            )
            job_id = wait_for_first_step(runs, proc).name.rsplit("-", 1)[1]
            cluster.signal(job_id, "USR1")
            code, output = cluster.finish(proc, timeout=600)
        finally:
            cluster.stop()
        print("SLURM recipe run by a real SLURM (slurmctld + 2 slurmd), requeued by itself")
        return code, output, job_id
    print(f"SLURM recipe run with the stand-in srun and scontrol ({', '.join(missing)} not installed)")
    bin_dir = Path(env["PATH"].split(":")[0])
    stand_in_srun(two_hosts, bin_dir)
    stand_in_scontrol(bin_dir, root / "scontrol.log")
    job_id = "4242"
    batch = {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "shardtune",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "hostA,hostB",
        "SLURM_NODEID": "0",
        "SLURM_GPUS_ON_NODE": "2",
    }
    proc = subprocess.Popen(
        ["bash", "recipes/multinode.slurm", *args],
        env={**env, **batch},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_first_step(runs, proc)
    for host in (0, 1):  # SLURM signals every task of the step
        for pid in launchers(two_hosts, host):
            os.kill(pid, signal.SIGUSR1)
    first, _ = proc.communicate(timeout=480)
    assert proc.returncode == EXIT_PREEMPTED, first[-3000:]
    assert (root / "scontrol.log").read_text() == f"requeue {job_id}\n"
    again = subprocess.run(
        ["bash", "recipes/multinode.slurm", *args],
        env={**env, **batch, "SLURM_RESTART_COUNT": "1"},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=480,
    )
    return again.returncode, first + again.stdout, job_id


def test_slurm_recipe_runs_as_it_is_with_deepspeed_zero3_and_requeues_itself_when_stopped(
    two_hosts, cache_dir, one_host, tiny_model, tmp_path
):
    """recipes/multinode.slurm submitted unmodified; no torchrun flags: the topology comes from SLURM. SIGUSR1
    mid-run (a time limit or a preemption): checkpoint, exit 75, the recipe's requeue, the requeued job resumes
    (--resume auto) and ends like the uninterrupted run."""
    bin_dir = bin_dir_with_shardtune(tmp_path / "bin")
    env = {
        **cli_env(cache_dir),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SHARED": str(tmp_path / "shared"),
        "STRATEGY": "deepspeed",
        "GLOO_SOCKET_IFNAME": INTERFACE,
    }
    code, output, job_id = submit_slurm_recipe_and_stop_it(
        two_hosts, ["--model_name", str(tiny_model), *map(str, TRAIN_ARGS[2:])], env, tmp_path
    )
    assert code == 0, output[-6000:]
    assert "c10d rendezvous at hostA:29500, 2 processes per node, from SLURM (SLURM_NNODES=2" in output, output[-3000:]
    assert "processes per node from SLURM_GPUS_ON_NODE" in output
    assert "ZeRO-3" in output, output[-3000:]
    out = tmp_path / "shared" / "runs" / f"shardtune-{job_id}"
    stopped = re.search(
        rf"stopped by SIGUSR1 after step (\d+): checkpoint {re.escape(str(out))}/checkpoints/"
        r"(step-\d+) written",
        output,
    )
    assert stopped and 1 <= int(stopped[1]) < 4, output[-6000:]  # stopped before the end: steps were left
    assert f"requeueing job {job_id}" in output
    assert f"resumed from {out / 'checkpoints' / stopped[2]}" in output, output[-3000:]
    assert (tmp_path / "shared" / "cache").is_dir()  # SHARDTUNE_CACHE on the shared path
    difference = assert_same_training(one_host, out, "slurm recipe zero3 2x2, stopped and requeued")
    print(
        f"SLURM recipe (ZeRO-3, 2 hosts x 2) stopped by SIGUSR1 after step {stopped[1]}, requeued, resumed: max "
        f"relative weight difference to one host {difference:.2e}"
    )


# TRL's distributed-training guide's job script, for 2 nodes x 1 process (these hosts have 2 CPUs and 2 "GPUs")
TRL_JOB_SCRIPT = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --gpus-per-node=2
#SBATCH --job-name=trl_multi

MAIN_NODE=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
srun torchrun --nnodes 2 --nproc_per_node 1 --node_rank $SLURM_NODEID --rdzv_backend c10d --rdzv_endpoint $MAIN_NODE:29500 {train}
"""  # noqa: E501 (the job script as TRL writes it)


def run_job_script(two_hosts, script: Path, env: dict[str, str], root: Path) -> tuple[int, str]:
    """``sbatch --wait SCRIPT`` on a real SLURM cluster on the two hosts when slurm-wlm is installed; without it,
    SCRIPT run by bash as sbatch would on the first node, with a stand-in srun and an scontrol that answers
    ``scontrol show hostnames LIST``. Returns (the job's exit status, its output)."""
    missing = missing_programs()
    if not missing:
        (root / "slurm").mkdir()
        cluster = SlurmCluster(two_hosts, root / "slurm")
        try:
            cluster.start()
            print("TRL's job script run by a real SLURM (slurmctld + 2 slurmd)")
            return cluster.finish(cluster.submit([str(script)], env=env, cwd=root), timeout=480)
        finally:
            cluster.stop()
    print(f"TRL's job script run with the stand-in srun and scontrol ({', '.join(missing)} not installed)")
    bin_dir = Path(env["PATH"].split(":")[0])
    stand_in_srun(two_hosts, bin_dir)
    write_executable(bin_dir / "scontrol", '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && tr , "\\n" <<< "$3"\n')
    batch = {
        "SLURM_JOB_ID": "4243",
        "SLURM_JOB_NAME": "trl_multi",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "hostA,hostB",
        "SLURM_NODEID": "0",
        "SLURM_GPUS_ON_NODE": "2",
    }
    job = subprocess.run(
        ["bash", str(script)],
        env={**env, **batch},
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=480,
    )
    return job.returncode, job.stdout


def script_result(output: str) -> dict:
    """The ``RESULT {json}`` line examples/sft_chat_lora.py's rank 0 prints."""
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, output[-6000:]
    return json.loads(lines[0].removeprefix("RESULT "))


def test_a_trl_script_under_trls_slurm_job_script_trains_like_one_process(two_hosts, cache_dir, tiny_model, tmp_path):
    """A TRL user's train.py (examples/sft_chat_lora.py) under TRL's guide's ``srun torchrun ... --rdzv_backend
    c10d --rdzv_endpoint $MAIN_NODE:29500 train.py`` job script: 2 nodes x 1 process x batch 1 x accumulation 2
    has the per-step losses and eval loss of one plain ``python train.py`` process with batch 4."""
    train = REPO / "examples" / "sft_chat_lora.py"
    reference = subprocess.Popen(  # meanwhile, on this machine: it waits on imports while the job does
        [sys.executable, str(train), str(tiny_model), "one", "4", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(cache_dir),
        cwd=tmp_path,
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_executable(
        bin_dir / "torchrun", f'#!/bin/bash\nexec {shlex.quote(sys.executable)} -m torch.distributed.run "$@"\n'
    )
    out = tmp_path / "shared" / "trl_multi"
    script = tmp_path / "trl_multi.slurm"
    script.write_text(TRL_JOB_SCRIPT.format(train=shlex.join(map(str, [train, tiny_model, out, 1, 2]))))
    env = {**cli_env(cache_dir), "PATH": f"{bin_dir}:{os.environ['PATH']}", "GLOO_SOCKET_IFNAME": INTERFACE}
    try:
        code, output = run_job_script(two_hosts, script, env, tmp_path)
        one_out, one_err = reference.communicate(timeout=300)
    finally:
        reference.kill()  # when the job failed to run (a no-op once it ended)
    assert reference.returncode == 0, one_err[-5000:]
    assert code == 0, output[-6000:]
    one, job = script_result(one_out), script_result(output)

    def losses(result: dict) -> list[float]:
        return [row["loss"] for row in result["history"] if "loss" in row]

    assert len(losses(one)) == 5 and job["global_step"] == 5
    assert all(abs(a - b) <= 1e-5 for a, b in zip(losses(one), losses(job), strict=True)), (losses(one), losses(job))
    assert abs(job["eval"]["eval_loss"] - one["eval"]["eval_loss"]) <= 1e-5
    assert (out.parent / "trl_multi-saved" / "adapter_config.json").is_file()


def test_a_node_with_another_config_stops_every_node_naming_the_field(sft_on_two_hosts, tiny_model, tmp_path):
    results = sft_on_two_hosts(
        1,
        ["--model_name", tiny_model, "--output_dir", tmp_path / "out", *TRAIN_ARGS],
        args_per_host=[[], ["--lr", "0.002"]],
        timeout=180,
    )
    expected = "preflight: the nodes differ in --lr: "
    for code, _out, err in results:
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
    results = sft_on_two_hosts(
        1,
        ["--model_name", tiny_model, "--output_dir", local / "out", *TRAIN_ARGS],
        node_local_dirs=[[], [local]],
        timeout=180,
    )
    for code, _out, err in results:
        assert code != 0
        lines = [line for line in err.splitlines() if "is not shared" in line]
        assert len(lines) == 1, err[-3000:]
        assert f"--output_dir {local / 'out'} is not shared: hostB cannot see" in lines[0], lines[0]
        assert "file system every node mounts at the same path" in lines[0]
    assert not (local / "out" / "metrics.jsonl").exists()
