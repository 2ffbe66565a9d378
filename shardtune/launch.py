"""Turn ``shardtune sft ...`` into a torch.distributed.run launch; never re-implements rendezvous.

torchrun's own flags (``--nproc_per_node``, ``--nnodes``, ``--rdzv_endpoint`` ...) are split from the training
flags and passed to torch.distributed.run unchanged. Inside a torchrun worker nothing is launched.
"""

from __future__ import annotations

import os
import socket
import sys

from shardtune.config import ConfigError, help_text

# torchrun flags that take a value, and those that do not; both spellings (_ and -) are accepted.
TORCHRUN_VALUE_FLAGS = (
    "nproc_per_node", "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
    "master_addr", "master_port", "max_restarts", "monitor_interval", "start_method", "role", "log_dir",
    "redirects", "tee", "local_addr",
)
TORCHRUN_SWITCHES = ("standalone",)
MULTI_NODE_FLAGS = ("nnodes", "rdzv_endpoint", "master_addr", "rdzv_backend", "rdzv_id")


def sft_help_text() -> str:
    """``shardtune sft --help``, answered without importing torch: the training flags and the torchrun flags."""
    return "\n".join([
        help_text(), "",
        "torchrun flags, passed to torch.distributed.run unchanged (see torchrun --help):",
        "  " + " ".join(f"--{name} VALUE" for name in TORCHRUN_VALUE_FLAGS),
        "  " + " ".join(f"--{name}" for name in TORCHRUN_SWITCHES),
        "  --nproc_per_node defaults to one process per visible GPU (1 without GPUs). A run of one process on one",
        "  node with no other torchrun flag runs in place, without torchrun (same code, rank 0 of 1)."])


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
    from shardtune.distributed import local_gpu_count

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
    for name, value in launch.items():
        if name == "nproc_per_node":
            continue
        args.append(f"--{name}" if value is None else f"--{name}={value}")
    return args


def runs_in_place(launch_args: dict[str, str | None], nproc: int) -> bool:
    """One process on one node, and nothing asked of torchrun (restarts, rendezvous, log files): the launcher
    itself becomes the worker, instead of starting a new interpreter that imports and checks everything again."""
    return nproc == 1 and set(launch_args) <= {"nproc_per_node", "standalone"}


def in_place_worker_env() -> dict[str, str]:
    """The variables torchrun gives a lone worker: rank 0 of 1, and a free local port for the process group."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def launch(torchrun_args: list[str], module: str, module_args: list[str], nproc: int) -> int:
    """Run ``torchrun <torchrun_args> -m <module> <module_args>`` in this process; return an exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args([*torchrun_args, "-m", module, *module_args])
    if "OMP_NUM_THREADS" not in os.environ:
        # share the cores between the local processes (torchrun would set 1 and warn about it)
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, nproc)))
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if os.path.isfile(failure.error_file):  # one line recorded by the worker (shardtune.sft.record_worker_error)
            print(f"shardtune: error: {failure.message}", file=sys.stderr)
        else:
            print(f"shardtune: training failed: rank {rank} exited with code {failure.exitcode} "
                  "(its error is printed above)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shardtune: interrupted", file=sys.stderr)
        return 130
    return 0
