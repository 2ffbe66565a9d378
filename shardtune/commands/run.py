"""``shardtune run [launcher flags] train.py [script arguments]``: a user's Python script (``from shardtune import
SFTTrainer, SFTConfig``, TRL's shape) under shardtune's launcher: the topology from torchrun's flags or the cluster's
environment (SLURM, PET_* variables), the start log, and stop signals forwarded so that a preempted run checkpoints
and exits 75, as ``shardtune sft`` does. The script's own arguments follow it untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardtune.config.argv import ACCELERATE_LAUNCHER_NAMES, TORCHRUN_SWITCHES, TORCHRUN_VALUE_FLAGS
from shardtune.config.schema import ConfigError
from shardtune.launch.torchrun import launch, resolve_here
from shardtune.runtime.distributed import is_torchrun_worker
from shardtune.runtime.errors import fail

USAGE = (
    "usage: shardtune run [--nproc_per_node N] [--nnodes M --node_rank R --rdzv_backend c10d --rdzv_endpoint HOST:PORT"
    " ...] train.py [its arguments]\n\nRuns a Python script that trains with shardtune's SFTTrainer / DPOTrainer "
    "(docs/python-api.md) on every process torchrun's flags (or the cluster's environment) describe."
)


def split(argv: list[str]) -> tuple[dict[str, str | None], str, list[str]]:
    """(torchrun's flags, the script, its arguments): the launcher's flags come before the script."""
    launcher: dict[str, str | None] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        name, eq, value = argv[i][2:].partition("=")
        name = ACCELERATE_LAUNCHER_NAMES.get(name.replace("-", "_"), name.replace("-", "_"))
        i += 1
        if name in TORCHRUN_SWITCHES:
            launcher[name] = None
            continue
        if name not in TORCHRUN_VALUE_FLAGS:
            raise ConfigError(
                f"--{name} is not a launcher flag: shardtune run takes torchrun's flags before the script, and the "
                "script's own arguments after it (shardtune run --nproc_per_node 2 train.py --its_flag 1)"
            )
        if not eq:
            if i >= len(argv):
                raise ConfigError(f"--{name} needs a value")
            value, i = argv[i], i + 1
        launcher[name] = value
    if i >= len(argv):
        raise ConfigError("no script given: shardtune run [launcher flags] train.py [its arguments]")
    script = argv[i]
    if not script.endswith(".py") or not Path(script).is_file():
        raise ConfigError(f"{script}: no such Python script: pass the path of the training script (a .py file)")
    return launcher, script, argv[i + 1 :]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    try:
        if is_torchrun_worker():
            raise ConfigError(
                "shardtune run starts torchrun itself: run it outside torchrun (or run the script under torchrun)"
            )
        launcher, script, script_args = split(argv)
        topology = resolve_here(launcher)
    except ConfigError as e:
        fail(str(e), False)
        return 2
    return launch(topology, script, script_args, what="the script")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
