"""The front door: a command line split once, into what each part of shardtune reads.

    args = split_argv(argv)
    args.launcher     # torchrun's flags (Accelerate's --num_processes N is --nproc_per_node N)
    args.hardware     # the plan's hardware: --gpu, --gpu_memory, --host_memory, --gpus_per_node (and plan's own)
    args.accelerate   # --accelerate_config FILE|PROFILE
    args.recipe       # --config FILE (a YAML recipe, a `trl sft --config` file)
    args.training     # every other flag, as (name as typed, value), in order: the config's (shardtune.config.flags)

A value follows its flag (``--name value``, ``--name=value``); a flag followed by another flag, or last, is bare
(``--packing``: true); ``--no_X`` is ``--X false`` for every switch X, of any dialect (``--no_gradient_checkpointing``,
``--no_fsdp_config.pure_bf16``, ``--no_eval.on_start``); a list setting takes the values after it one by one
(``--loss_type sigmoid sft``), as TRL's parser does. Nothing else of shardtune scans argv.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardtune.config.schema import ConfigError
from shardtune.config.spellings import negated, normalise, takes_a_list

# torchrun flags that take a value, and those that do not; both spellings (_ and -) are accepted.
TORCHRUN_VALUE_FLAGS = (
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "master_addr",
    "master_port",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "role",
    "log_dir",
    "redirects",
    "tee",
    "local_addr",
    "signals_to_handle",
)
TORCHRUN_SWITCHES = ("standalone",)
# Accelerate's name of a torchrun flag
ACCELERATE_LAUNCHER_NAMES = {"num_processes": "nproc_per_node"}
# the hardware a plan describes (shardtune plan, shardtune sft --dry_run), and the images it assumes per row
HARDWARE_FLAGS = ("gpu", "gpu_memory", "host_memory", "gpus_per_node", "images_per_example", "image_tokens")
FILE_FLAGS = {"config": "recipe", "accelerate_config": "accelerate"}


@dataclass
class Arguments:
    launcher: dict[str, str | None] = field(default_factory=dict)
    hardware: dict[str, str] = field(default_factory=dict)
    accelerate: str | None = None
    recipe: str | None = None
    training: list[tuple[str, Any]] = field(default_factory=list)

    def training_argv(self) -> list[str]:
        """The training flags as a command line again (what a recommended command repeats)."""
        out: list[str] = []
        for name, value in self.training:
            out += [f"--{name}"] + ([] if value is None else [str(value)])
        return out


def split_argv(argv: list[str], hardware: tuple[str, ...] = HARDWARE_FLAGS) -> Arguments:
    """``argv`` (the words after the command) split into its groups; ``hardware``: the names of the hardware
    group (``shardtune plan`` adds its own)."""
    args = Arguments()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: flags look like --name value")
        name, eq, value = arg[2:].partition("=")
        name = normalise(name)
        name = ACCELERATE_LAUNCHER_NAMES.get(name, name)
        has_value = bool(eq) or (i + 1 < len(argv) and not argv[i + 1].startswith("--"))
        if not eq and has_value:
            i += 1
            value = argv[i]
        i += 1
        if name in TORCHRUN_SWITCHES:
            if has_value and value.lower() not in ("true", "1"):
                raise ConfigError(f"--{name} is a switch: drop {value!r}")
            args.launcher[name] = None
        elif name in TORCHRUN_VALUE_FLAGS or name in hardware or name in FILE_FLAGS:
            if not has_value:
                raise ConfigError(
                    f"--{name} needs a value" + (": --config recipes/demo.yaml" if name == "config" else "")
                )
            if name in TORCHRUN_VALUE_FLAGS:
                args.launcher[name] = value
            elif name in hardware:
                args.hardware[name] = value
            else:
                setattr(args, FILE_FLAGS[name], value)
        elif (switch := negated(name)) is not None:
            if has_value:
                raise ConfigError(f"--{name} takes no value: drop {value!r}, or pass --{switch} {value}")
            args.training.append((switch, "false"))
        else:
            if has_value and not eq and takes_a_list(name):
                while i < len(argv) and not argv[i].startswith("--"):
                    value = f"{value},{argv[i]}"  # the comma-separated form of the same list
                    i += 1
            args.training.append((name, value if has_value else None))
    return args


def as_flags(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Settings (canonical names, or a dialect's state keys ``dialect:flag``) as (flag name, value) pairs a command
    line can repeat."""
    out = []
    for key, value in pairs:
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        out.append(
            (
                key.partition(":")[2] or key,
                "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value),
            )
        )
    return out
