"""The topology resolver: torchrun's flags, torchrun's PET_* environment (Kubeflow), SLURM and SkyPilot."""

from __future__ import annotations

import pytest

from shardtune.config.argv import split_argv
from shardtune.config.schema import ConfigError
from shardtune.launch.topology import parse_hostlist, resolve_topology

KUBEFLOW = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "4",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "job-node-0-0",
    "PET_MASTER_PORT": "29400",
}
SLURM_STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_GPUS_ON_NODE": "8",
}
SKYPILOT = {
    "SKYPILOT_NODE_IPS": "10.1.0.5\n10.1.0.6\n",
    "SKYPILOT_NODE_RANK": "0",
    "SKYPILOT_NUM_NODES": "2",
    "SKYPILOT_NUM_GPUS_PER_NODE": "4",
}


def resolve(argv: list[str], environ: dict[str, str], num_gpus: int = 8):
    args = split_argv([*argv, "--lr", "1e-4"])
    assert args.training == [("lr", "1e-4")]
    return resolve_topology(args.launcher, environ, num_gpus)


def test_nothing_said_means_one_standalone_node_with_one_process_per_gpu():
    topology = resolve([], {})
    assert topology.torchrun_argv() == ["--nproc_per_node=8", "--nnodes=1", "--standalone"]
    assert topology.world_size == 8
    assert resolve([], {}, num_gpus=0).nproc_per_node == 1
    assert "1 node (standalone), 8 processes per node" in topology.describe()


def test_flags_pass_to_torchrun_unchanged():
    argv = [
        "--nnodes",
        "2",
        "--nproc_per_node",
        "2",
        "--node_rank",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "10.0.0.1:29500",
        "--max_restarts",
        "3",
    ]
    topology = resolve(argv, {})
    assert topology.torchrun_argv() == [
        "--nproc_per_node=2",
        "--nnodes=2",
        "--node_rank=1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.0.0.1:29500",
        "--max_restarts=3",
    ]
    assert (topology.num_nodes, topology.world_size) == (2, 4)
    assert topology.describe() == (
        "topology: 2 nodes, this is node 1, c10d rendezvous at 10.0.0.1:29500, 2 processes per node, from flags"
    )


def test_kubeflow_pod_with_only_pet_variables_joins_the_static_rendezvous():
    topology = resolve([], KUBEFLOW)
    assert topology.torchrun_argv() == [
        "--nproc_per_node=4",
        "--nnodes=2",
        "--node_rank=1",
        "--master_addr=job-node-0-0",
        "--master_port=29400",
    ]
    assert topology.world_size == 8
    assert "--standalone" not in topology.torchrun_argv()
    assert "from torchrun's environment (PET_NNODES=2" in topology.describe()


def test_slurm_step_with_one_task_per_node_meets_at_the_first_node():
    topology = resolve([], SLURM_STEP)
    assert topology.torchrun_argv() == [
        "--nproc_per_node=8",
        "--nnodes=2",
        "--node_rank=1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=gpu07:29500",
        "--rdzv_id=4242",
        "--rdzv_conf=is_host=0",
    ]
    assert "from SLURM (SLURM_NNODES=2, SLURM_NODEID=1" in topology.describe()
    first = resolve([], {**SLURM_STEP, "SLURM_NODEID": "0", "MASTER_PORT": "31000"})
    assert "--rdzv_conf=is_host=1" in first.torchrun_argv()
    assert "--rdzv_endpoint=gpu07:31000" in first.torchrun_argv()


def test_slurm_mistakes_are_one_line_with_the_fix():
    outside_srun = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_ID"}
    with pytest.raises(ConfigError, match=r"outside srun.*srun --ntasks-per-node=1 shardtune sft"):
        resolve([], outside_srun)
    with pytest.raises(ConfigError, match="srun started 16 tasks on 2 nodes"):
        resolve([], {**SLURM_STEP, "SLURM_NTASKS": "16"})
    assert resolve(["--standalone"], outside_srun).num_nodes == 1  # flags win: train on this node alone


def test_one_slurm_node_is_standalone_with_the_gpus_slurm_gave():
    topology = resolve([], {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "2"})
    assert topology.torchrun_argv() == ["--nproc_per_node=2", "--nnodes=1", "--standalone"]


def test_skypilot_nodes_meet_at_the_first_ip():
    topology = resolve([], SKYPILOT)
    assert topology.torchrun_argv() == [
        "--nproc_per_node=4",
        "--nnodes=2",
        "--node_rank=0",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.1.0.5:29500",
        "--rdzv_id=shardtune",
        "--rdzv_conf=is_host=1",
    ]


def test_flags_win_over_the_environment():
    standalone = resolve(["--standalone"], KUBEFLOW)
    assert standalone.torchrun_argv() == ["--nproc_per_node=4", "--nnodes=1", "--standalone"]  # not PET_NNODES=2
    assert "processes per node from PET_NPROC_PER_NODE" in standalone.describe()
    nproc = resolve(["--nproc_per_node", "2"], SLURM_STEP)
    assert nproc.world_size == 4 and "--rdzv_endpoint=gpu07:29500" in nproc.torchrun_argv()
    endpoint = resolve(["--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "hostA:29500"], SLURM_STEP)
    assert "--rdzv_id=4242" not in endpoint.torchrun_argv() and endpoint.describe().endswith(
        "from flags; processes per node from SLURM_GPUS_ON_NODE"
    )


@pytest.mark.parametrize(
    "node_list, names",
    [
        ("gpu01", ["gpu01"]),
        ("a,b", ["a", "b"]),
        ("gpu[08-10,12]", ["gpu08", "gpu09", "gpu10", "gpu12"]),
        ("n[1-2]-ib,login", ["n1-ib", "n2-ib", "login"]),
        ("r[1-2]n[3,5]", ["r1n3", "r1n5", "r2n3", "r2n5"]),
    ],
)
def test_slurm_host_lists_expand(node_list, names):
    assert parse_hostlist(node_list) == names


def test_unreadable_host_list_is_a_config_error():
    with pytest.raises(ConfigError, match="node range"):
        parse_hostlist("gpu[a-b]")
