"""Turn ``shardtune sft ...`` into a torch.distributed.run launch; never re-implements rendezvous.

torchrun's own flags (``--nproc_per_node``, ``--nnodes``, ``--rdzv_endpoint`` ...) are split from the training
flags; with the cluster's environment (SLURM, Kubeflow, SkyPilot) they resolve to a Topology
(shardtune.topology), which is what torch.distributed.run is given. Inside a torchrun worker nothing is launched.
"""

from __future__ import annotations

import os
import sys

from shardtune.config import ConfigError
from shardtune.distributed import local_gpu_count
from shardtune.topology import Topology, resolve_topology

# torchrun flags that take a value, and those that do not; both spellings (_ and -) are accepted.
TORCHRUN_VALUE_FLAGS = (
    "nproc_per_node", "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
    "master_addr", "master_port", "max_restarts", "monitor_interval", "start_method", "role", "log_dir",
    "redirects", "tee", "local_addr",
)
TORCHRUN_SWITCHES = ("standalone",)


def split_launcher_args(argv: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """Separate torchrun flags from training flags."""
    launch: dict[str, str | None] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        name = name.replace("-", "_")
        if name in TORCHRUN_VALUE_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"--{name} needs a value")
                value = argv[i + 1]
                i += 1
            launch[name] = value
        elif name in TORCHRUN_SWITCHES:
            launch[name] = None
        else:
            rest.append(arg)
        i += 1
    return launch, rest


def resolve_here(flags: dict[str, str | None]) -> Topology:
    """This node's topology: torchrun's flags, else what the cluster's environment says (shardtune.topology)."""
    return resolve_topology(flags, os.environ, local_gpu_count())


def launch(topology: Topology, module: str, module_args: list[str]) -> int:
    """Run ``torchrun <topology's flags> -m <module> <module_args>`` in this process; return an exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    print(topology.describe(), flush=True)
    args = get_args_parser().parse_args([*topology.torchrun_argv(), "-m", module, *module_args])
    if "OMP_NUM_THREADS" not in os.environ:
        # share the cores between the local processes (torchrun would set 1 and warn about it)
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // topology.nproc_per_node))
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"shardtune: training failed: rank {rank} exited with code {failure.exitcode} "
              "(its error is printed above)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shardtune: interrupted", file=sys.stderr)
        return 130
    return 0
