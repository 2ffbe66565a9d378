"""Turn ``shardtune sft ...`` into a torch.distributed.run launch; never re-implements rendezvous.

torchrun's own flags (``--nproc_per_node``, ``--nnodes``, ``--rdzv_endpoint`` ...) are split from the training
flags; with the cluster's environment (SLURM, Kubeflow, SkyPilot) they resolve to a Topology
(shardtune.launch.topology), which is what torch.distributed.run is given. Inside a torchrun worker nothing is launched.
"""

from __future__ import annotations

import os
import socket
import sys

from shardtune.config.argv import TORCHRUN_SWITCHES, TORCHRUN_VALUE_FLAGS
from shardtune.config.help import help_text
from shardtune.launch.topology import Topology, resolve_topology


def sft_help_text(command: str = "sft") -> str:
    """``shardtune sft --help`` (or ``dpo``), answered without importing torch: the training flags and the torchrun
    flags."""
    return "\n".join(
        [
            help_text(command),
            "",
            "torchrun flags, passed to torch.distributed.run unchanged (see torchrun --help):",
            "  " + " ".join(f"--{name} VALUE" for name in TORCHRUN_VALUE_FLAGS),
            "  " + " ".join(f"--{name}" for name in TORCHRUN_SWITCHES),
            "  --nproc_per_node defaults to one process per visible GPU (1 without GPUs). A run of one process on one",
            "  node with no other torchrun flag runs in place, without torchrun (same code, rank 0 of 1).",
        ]
    )


def resolve_here(flags: dict[str, str | None]) -> Topology:
    """This node's topology: torchrun's flags, else what the cluster's environment says (shardtune.launch.topology)."""
    from shardtune.runtime.distributed import local_gpu_count

    return resolve_topology(flags, os.environ, local_gpu_count())


def runs_in_place(launch_args: dict[str, str | None], topology: Topology) -> bool:
    """One process on one node, and nothing asked of torchrun (restarts, rendezvous, log files): the launcher
    itself becomes the worker, instead of starting a new interpreter that imports and checks everything again."""
    return topology.world_size == 1 and set(launch_args) <= {"nproc_per_node", "standalone"}


def in_place_worker_env() -> dict[str, str]:
    """The variables torchrun gives a lone worker: rank 0 of 1, and a free local port for the process group."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "GROUP_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME") or "lo",
    }


# torchrun's default --rdzv_conf join_timeout
DEFAULT_JOIN_TIMEOUT_S = 600


def rendezvous_timeout_message(args, error: BaseException) -> str:
    """One line for a rendezvous that timed out: how many nodes joined, where, and what to check."""
    conf = dict(item.split("=", 1) for item in (args.rdzv_conf or "").split(",") if "=" in item)
    wanted = args.nnodes.split(":")[0]
    joined = nodes_joined(error)
    count = f"{joined} of {wanted}" if joined is not None else f"fewer than {wanted}"
    return (
        f"rendezvous at {args.rdzv_endpoint or 'localhost'} (--rdzv_id {args.rdzv_id}): {count} nodes joined "
        f"within {conf.get('join_timeout', DEFAULT_JOIN_TIMEOUT_S)} s (--rdzv_conf join_timeout=SECONDS): start "
        "the same command on every node with the same --nnodes and --rdzv_id, and check that the endpoint's "
        "host name resolves to its address on every node (not 127.0.1.1) and that its port is open (firewall)"
    )


def nodes_joined(error: BaseException) -> int | None:
    """Nodes in the round that timed out, read from torch's rendezvous state in the traceback (torch's error does
    not say): the participants left plus this node, which removes itself before raising. None when that state is
    not found (another rendezvous backend or torch version)."""
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        state = getattr(owner, "_state", None)
        if hasattr(state, "participants"):
            return len(set(state.participants) | {getattr(owner, "_node", None)})
        tb = tb.tb_next
    return None


def launch(topology: Topology, module: str, module_args: list[str], what: str = "training") -> int:
    """Run ``torchrun <topology's flags> -m <module> <module_args>`` in this process (``module`` a path ending in
    .py: that script, as ``torchrun train.py``); return an exit status."""
    from torch.distributed.run import get_args_parser

    from shardtune.runtime.preemption import TORCHRUN_SIGNALS, stop_signals_forwarded, workers_stopped

    print(topology.describe(), flush=True)
    torchrun_args = topology.torchrun_argv()
    if "signals_to_handle" not in topology.other_args:
        torchrun_args.append(
            f"--signals_to_handle={TORCHRUN_SIGNALS}"
        )  # SIGTERM / SIGUSR1: shardtune/runtime/preemption.py
    target = [module] if module.endswith(".py") else ["-m", module]
    args = get_args_parser().parse_args([*torchrun_args, *target, *module_args])
    if topology.num_nodes == 1 and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # one node: gloo's connections between the workers stay on loopback
    if "OMP_NUM_THREADS" not in os.environ:
        # share the cores between the local processes (torchrun would set 1 and warn about it)
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // topology.nproc_per_node))
    with stop_signals_forwarded() as control_dir:
        status = run_torchrun(args, what)
        stopped = workers_stopped(control_dir)
    if stopped and status == 0:
        print(f"shardtune: {stopped[1]}", file=sys.stderr)
        return stopped[0]
    return status


def run_torchrun(args, what: str) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import run

    from shardtune.launch.rendezvous import count_attempts_across_nodes

    count_attempts_across_nodes(args)  # every node's workers agree on which start of the group they are
    try:
        run(args)
    except RendezvousTimeoutError as e:
        print(f"shardtune: error: {rendezvous_timeout_message(args, e)}", file=sys.stderr)
        return 1
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if os.path.isfile(
            failure.error_file
        ):  # one line recorded by the worker (shardtune.training.engine.worker.record_worker_error)
            print(f"shardtune: error: {failure.message}", file=sys.stderr)
        else:
            print(
                f"shardtune: {what} failed: rank {rank} exited with code {failure.exitcode} "
                "(its error is printed above)",
                file=sys.stderr,
            )
        return 1
    except KeyboardInterrupt:
        print("shardtune: interrupted", file=sys.stderr)
        return 130
    except SignalException as e:
        print(f"shardtune: workers terminated by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0
