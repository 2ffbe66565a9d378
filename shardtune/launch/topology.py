"""How many nodes, which one this is, how many processes per node, where to meet: resolved once, before launch.

Sources, first match wins for the nodes (flags always win over the environment):

1. torchrun's flags given to ``shardtune sft`` (``--nnodes``, ``--rdzv_endpoint``, ``--standalone`` ...);
2. torchrun's own environment ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``
   (what Kubeflow's TrainJob and PyTorchJob set in every pod): a static rendezvous at the master;
3. SLURM inside an ``srun`` step with one task per node (``SLURM_NNODES``, ``SLURM_NODEID``, the node list):
   a c10d rendezvous on the first node of the step, its id the job id;
4. SkyPilot (``SKYPILOT_NUM_NODES``, ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS``): c10d on the first IP;
5. nothing: one node, ``--standalone`` (a free local port per run, so concurrent jobs never collide).

For the c10d cases the node that hosts the rendezvous store is named explicitly (``--rdzv_conf is_host=``):
torchrun would otherwise guess it by matching the endpoint against the hostname, which hangs or fails when
the hostname resolves to loopback or is shared. Processes per node: ``--nproc_per_node``, else
``PET_NPROC_PER_NODE`` / ``SLURM_GPUS_ON_NODE`` / ``SKYPILOT_NUM_GPUS_PER_NODE``, else one per visible GPU.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from shardtune.config.schema import ConfigError

# torchrun flags that place this node among the others; given any of them, the environment's nodes are ignored
NODE_FLAGS = (
    "nnodes",
    "node_rank",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "master_addr",
    "master_port",
    "standalone",
)
# processes per node when --nproc_per_node is not given: torchrun's, SLURM's and SkyPilot's word for it
NPROC_VARIABLES = ("PET_NPROC_PER_NODE", "SLURM_GPUS_ON_NODE", "SKYPILOT_NUM_GPUS_PER_NODE")
DEFAULT_RDZV_PORT = "29500"  # torchrun's default master port; MASTER_PORT in the environment overrides it


@dataclass(frozen=True)
class Topology:
    """What torchrun is told: ``nproc_per_node`` processes on each of ``num_nodes`` nodes, and from where."""

    num_nodes: int
    nproc_per_node: int
    source: str  # where the nodes came from, for the start log ("flags", "SLURM (SLURM_NNODES=2, ...)")
    node_args: dict[str, str | None] = field(default_factory=dict)  # torchrun's node flags (NODE_FLAGS)
    other_args: dict[str, str | None] = field(default_factory=dict)  # every other torchrun flag, unchanged

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.nproc_per_node

    def torchrun_argv(self) -> list[str]:
        args = {"nproc_per_node": str(self.nproc_per_node), **self.node_args, **self.other_args}
        return [f"--{name}" if value is None else f"--{name}={value}" for name, value in args.items()]

    def describe(self) -> str:
        """One line for the start log."""
        if self.num_nodes == 1 and "standalone" in self.node_args:
            where = "1 node (standalone)"
        else:
            endpoint = self.node_args.get("rdzv_endpoint") or "{}:{}".format(
                self.node_args.get("master_addr", "?"), self.node_args.get("master_port", DEFAULT_RDZV_PORT)
            )
            backend = self.node_args.get("rdzv_backend", "static")
            rank = self.node_args.get("node_rank")
            where = (
                f"{self.node_args.get('nnodes', self.num_nodes)} nodes"
                + (f", this is node {rank}" if rank is not None else "")
                + f", {backend} rendezvous at {endpoint}"
            )
        processes = "1 process" if self.nproc_per_node == 1 else f"{self.nproc_per_node} processes"
        return f"topology: {where}, {processes} per node, from {self.source}"


def resolve_topology(flags: Mapping[str, str | None], environ: Mapping[str, str], num_gpus: int) -> Topology:
    """The topology from torchrun's ``flags`` (as split from the command line) and the environment.

    A pure function of its arguments (``num_gpus``: the GPUs this node sees), so that every source is testable
    without a cluster.
    """
    node_args = {k: v for k, v in flags.items() if k in NODE_FLAGS}
    other_args = {k: v for k, v in flags.items() if k not in NODE_FLAGS and k != "nproc_per_node"}
    source = "flags"
    if not node_args:
        node_args, source = from_environment(environ) or ({}, "no multi-node flags or environment")
    num_nodes = resolve_nnodes(node_args.get("nnodes"))
    if num_nodes == 1 and not any(k in node_args for k in ("rdzv_endpoint", "master_addr")):
        # explicit --nnodes=1: torchrun would otherwise read PET_NNODES and wait for nodes that never come
        node_args = {"nnodes": "1", **node_args, "standalone": None}
    nproc_value = flags.get("nproc_per_node")
    if nproc_value is None:
        nproc_variable = next((name for name in NPROC_VARIABLES if name in environ), None)
        if nproc_variable:
            nproc_value = environ[nproc_variable]
            source += f"; processes per node from {nproc_variable}"
    return Topology(num_nodes, resolve_nproc(nproc_value, num_gpus), source, node_args, other_args)


def from_environment(environ: Mapping[str, str]) -> tuple[dict[str, str | None], str] | None:
    for reader in (from_torchrun_environment, from_slurm, from_skypilot):
        found = reader(environ)
        if found is not None:
            return found
    return None


def from_torchrun_environment(environ: Mapping[str, str]) -> tuple[dict[str, str | None], str] | None:
    """torchrun reads each flag also from ``PET_<FLAG>``; Kubeflow sets these in every pod."""
    node_args = {name: environ[f"PET_{name.upper()}"] for name in NODE_FLAGS if f"PET_{name.upper()}" in environ}
    node_args.pop("standalone", None)
    if not node_args:
        return None
    names = ", ".join(f"PET_{k.upper()}={v}" for k, v in node_args.items())
    return node_args, f"torchrun's environment ({names})"


def from_slurm(environ: Mapping[str, str]) -> tuple[dict[str, str | None], str] | None:
    """One ``srun`` task per node: the step's nodes meet at the first one, the job id names the rendezvous."""
    if "SLURM_JOB_ID" not in environ or "SLURM_NNODES" not in environ:
        return None
    in_step = "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ
    num_nodes = int(environ.get("SLURM_STEP_NUM_NODES", environ["SLURM_NNODES"]))
    if num_nodes == 1:
        return {}, "SLURM (1 node)"
    if not in_step:
        raise ConfigError(
            f"this SLURM job has {num_nodes} nodes but shardtune runs outside srun, on one of "
            "them: start it with `srun --ntasks-per-node=1 shardtune sft ...` (one launcher per "
            "node), or pass --standalone to train on this node alone"
        )
    num_tasks = int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", num_nodes)))
    if num_tasks != num_nodes:
        raise ConfigError(
            f"srun started {num_tasks} tasks on {num_nodes} nodes: shardtune sft starts the "
            "processes of a node itself, so run one task per node (srun --ntasks-per-node=1)"
        )
    node_list = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ["SLURM_NODELIST"]
    first_node = expand_hostlist(node_list)[0]
    node_rank = environ["SLURM_NODEID"]
    node_args = c10d_args(num_nodes, node_rank, first_node, environ, rdzv_id=environ["SLURM_JOB_ID"])
    names = ", ".join(
        f"{k}={environ[k]}"
        for k in ("SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_GPUS_ON_NODE")
        if k in environ
    )
    return node_args, f"SLURM ({names})"


def from_skypilot(environ: Mapping[str, str]) -> tuple[dict[str, str | None], str] | None:
    """SkyPilot runs the task's ``run`` on every node with the nodes' IPs, first = rank 0."""
    if "SKYPILOT_NODE_IPS" not in environ or "SKYPILOT_NODE_RANK" not in environ:
        return None
    ips = environ["SKYPILOT_NODE_IPS"].split()
    num_nodes = int(environ.get("SKYPILOT_NUM_NODES", len(ips)))
    if num_nodes == 1:
        return {}, "SkyPilot (1 node)"
    node_rank = environ["SKYPILOT_NODE_RANK"]
    node_args = c10d_args(num_nodes, node_rank, ips[0], environ, rdzv_id=environ.get("SKYPILOT_TASK_ID", "shardtune"))
    return node_args, (
        f"SkyPilot (SKYPILOT_NUM_NODES={num_nodes}, SKYPILOT_NODE_RANK={node_rank}, first of "
        f"SKYPILOT_NODE_IPS {ips[0]})"
    )


def c10d_args(
    num_nodes: int, node_rank: str, first_node: str, environ: Mapping[str, str], rdzv_id: str
) -> dict[str, str | None]:
    """c10d rendezvous on ``first_node``; node rank 0 is that node and hosts the store."""
    if not 0 <= int(node_rank) < num_nodes:
        raise ConfigError(f"node rank {node_rank} is outside 0..{num_nodes - 1}")
    port = environ.get("MASTER_PORT", DEFAULT_RDZV_PORT)
    return {
        "nnodes": str(num_nodes),
        "node_rank": node_rank,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": f"{first_node}:{port}",
        "rdzv_id": rdzv_id,
        "rdzv_conf": f"is_host={int(int(node_rank) == 0)}",
    }


def expand_hostlist(node_list: str) -> list[str]:
    """SLURM's compressed host list (``gpu[01-03,07],login1``) as names: ``scontrol show hostnames`` when
    available, else our own reading of the bracket forms."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", node_list], capture_output=True, text=True, timeout=30, check=True
            ).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass
    return parse_hostlist(node_list)


def parse_hostlist(node_list: str) -> list[str]:
    """``a[1-2]-ib,b`` -> ``a1-ib, a2-ib, b``; ranges keep their zero padding (``[08-10]`` -> 08, 09, 10)."""
    names: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", node_list):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [literal + suffix for suffix in expand_ranges(ranges)] if ranges else [literal]
            expanded = [head + choice for head in expanded for choice in choices]
        names.extend(expanded)
    if not names or not all(names):
        raise ConfigError(f"cannot read the SLURM node list {node_list!r}")
    return names


def expand_ranges(ranges: str) -> list[str]:
    """``01-03,07`` -> ``01, 02, 03, 07``."""
    out = []
    for part in ranges.split(","):
        start, _, end = part.partition("-")
        if not start.isdigit() or (end and not end.isdigit()):
            raise ConfigError(f"cannot read the SLURM node range [{ranges}]")
        out.extend(f"{i:0{len(start)}d}" for i in range(int(start), int(end or start) + 1))
    return out


def resolve_nproc(value: str | None, num_gpus: int) -> int:
    """One process per visible GPU by default; 1 on a machine without GPUs."""
    if value is None or value in ("auto", "gpu"):
        return num_gpus or 1
    if value == "cpu":
        return 1
    try:
        nproc = int(value)
    except ValueError:
        raise ConfigError(f"--nproc_per_node {value!r} is not a number: pass e.g. --nproc_per_node 8") from None
    if nproc <= 0:
        raise ConfigError(f"--nproc_per_node {nproc} must be positive")
    if num_gpus and nproc > num_gpus:
        raise ConfigError(
            f"--nproc_per_node {nproc} exceeds the {num_gpus} visible GPUs: pass at most {num_gpus} "
            "(one process per GPU)"
        )
    return nproc


def resolve_nnodes(value: str | None) -> int:
    """torchrun accepts a fixed count or an elastic range MIN:MAX; the world size is planned for MAX."""
    if value is None:
        return 1
    try:
        nnodes = int(value.split(":")[-1])
    except ValueError:
        raise ConfigError(f"--nnodes {value!r} is not a number or MIN:MAX range") from None
    if nnodes <= 0:
        raise ConfigError(f"--nnodes {value} must be positive")
    return nnodes
