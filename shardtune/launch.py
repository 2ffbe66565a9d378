"""Turn ``shardtune sft ...`` into a torch.distributed.run launch; never re-implements rendezvous.

torchrun's own flags (``--nproc_per_node``, ``--nnodes``, ``--rdzv_endpoint`` ...) are split from the training
flags and passed to torch.distributed.run unchanged. Inside a torchrun worker nothing is launched.
"""

from __future__ import annotations

import os
import sys

from shardtune.config import ConfigError
from shardtune.distributed import local_gpu_count
from shardtune.preemption import EXIT_PREEMPTED, TORCHRUN_SIGNALS, stop_signals_forwarded, workers_stopped

# torchrun flags that take a value, and those that do not; both spellings (_ and -) are accepted.
TORCHRUN_VALUE_FLAGS = (
    "nproc_per_node", "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
    "master_addr", "master_port", "max_restarts", "monitor_interval", "start_method", "role", "log_dir",
    "redirects", "tee", "local_addr", "signals_to_handle",
)
TORCHRUN_SWITCHES = ("standalone",)
MULTI_NODE_FLAGS = ("nnodes", "rdzv_endpoint", "master_addr", "rdzv_backend", "rdzv_id")


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


def resolve_nproc(value: str | None) -> int:
    """One process per visible GPU by default; 1 on a machine without GPUs."""
    num_gpus = local_gpu_count()
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
        raise ConfigError(f"--nproc_per_node {nproc} exceeds the {num_gpus} visible GPUs: pass at most {num_gpus} "
                          "(one process per GPU)")
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


def torchrun_argv(launch: dict[str, str | None], nproc: int) -> list[str]:
    args = [f"--nproc_per_node={nproc}"]
    single_node = not any(k in launch for k in MULTI_NODE_FLAGS)
    if single_node and "standalone" not in launch:
        args.append("--standalone")  # a free local port per run, so concurrent jobs never collide
    if "signals_to_handle" not in launch:
        args.append(f"--signals_to_handle={TORCHRUN_SIGNALS}")  # SIGTERM / SIGUSR1: see shardtune/preemption.py
    for name, value in launch.items():
        if name == "nproc_per_node":
            continue
        args.append(f"--{name}" if value is None else f"--{name}={value}")
    return args


# torchrun's default --rdzv_conf join_timeout
DEFAULT_JOIN_TIMEOUT_S = 600


def rendezvous_timeout_message(args, error: BaseException) -> str:
    """One line for a rendezvous that timed out: how many nodes joined, where, and what to check."""
    conf = dict(item.split("=", 1) for item in (args.rdzv_conf or "").split(",") if "=" in item)
    wanted = args.nnodes.split(":")[0]
    joined = nodes_joined(error)
    count = f"{joined} of {wanted}" if joined is not None else f"fewer than {wanted}"
    return (f"rendezvous at {args.rdzv_endpoint or 'localhost'} (--rdzv_id {args.rdzv_id}): {count} nodes joined "
            f"within {conf.get('join_timeout', DEFAULT_JOIN_TIMEOUT_S)} s (--rdzv_conf join_timeout=SECONDS): start "
            "the same command on every node with the same --nnodes and --rdzv_id, and check that the endpoint's "
            "host name resolves to its address on every node (not 127.0.1.1) and that its port is open (firewall)")


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


def launch(torchrun_args: list[str], module: str, module_args: list[str], nproc: int, what: str = "training") -> int:
    """Run ``torchrun <torchrun_args> -m <module> <module_args>`` in this process; return an exit status."""
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args([*torchrun_args, "-m", module, *module_args])
    if "OMP_NUM_THREADS" not in os.environ:
        # share the cores between the local processes (torchrun would set 1 and warn about it)
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, nproc)))
    with stop_signals_forwarded() as control_dir:
        status = run_torchrun(args, what)
        stopped = workers_stopped(control_dir)
    if stopped and status == 0:
        print(f"shardtune: {stopped}", file=sys.stderr)
        return EXIT_PREEMPTED
    return status


def run_torchrun(args, what: str) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import run

    try:
        run(args)
    except RendezvousTimeoutError as e:
        print(f"shardtune: error: {rendezvous_timeout_message(args, e)}", file=sys.stderr)
        return 1
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"shardtune: {what} failed: rank {rank} exited with code {failure.exitcode} "
              "(its error is printed above)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shardtune: interrupted", file=sys.stderr)
        return 130
    except SignalException as e:
        print(f"shardtune: workers terminated by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0
