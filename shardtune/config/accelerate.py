"""``--accelerate_config FILE``: an Accelerate config file, as TRL's guide launches with, read as shardtune flags.

    launch_flags, train_flags, rest = expand_accelerate_config(argv)

The file's launcher keys (num_processes, num_machines, machine_rank, main_process_ip / port) become torchrun
flags, its training keys (distributed_type, mixed_precision, fsdp_config.*, deepspeed_config.*) shardtune flags
placed before the command line's, so a flag typed on the command line wins. Keys that only describe Accelerate's
own environment, or that FSDP2 / DeepSpeed here decide by themselves (prefetching, use_orig_params, ...), are
accepted as they are. Anything else is refused in one line naming the key, so no setting is silently dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import yaml

from shardtune.config.schema import ConfigError
from shardtune.config.flags import flatten_dict

FLAG = "accelerate_config"

# Keys whose value does not change a shardtune run: Accelerate's environment, and FSDP / DeepSpeed knobs that
# shardtune's FSDP2 wrapping or DeepSpeed setup decides itself (the value is accepted whatever it is).
NO_EFFECT_KEYS = frozenset({
    "compute_environment", "main_training_function", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
    "tpu_name", "tpu_zone", "commands", "command_file", "enable_cpu_affinity",
    "fsdp_config.fsdp_version", "fsdp_config.fsdp_use_orig_params", "fsdp_config.fsdp_sync_module_states",
    "fsdp_config.fsdp_forward_prefetch", "fsdp_config.fsdp_backward_prefetch",
    "deepspeed_config.deepspeed_multinode_launcher", "deepspeed_config.zero3_init_flag",
    "deepspeed_config.zero3_save_16bit_model",
})
# Keys accepted only with the value that means what shardtune does anyway.
EXPECTED_VALUES: dict[str, tuple[Any, ...]] = {
    "debug": (False,), "use_cpu": (False,), "downcast_bf16": ("no", False), "gpu_ids": ("all", None),
    "rdzv_backend": ("static", "c10d"), "fsdp_config.fsdp_auto_wrap_policy": ("TRANSFORMER_BASED_WRAP",),
    "dynamo_config.dynamo_backend": ("NO", "no"),
}
DISTRIBUTED_TYPES = {"NO": [], "MULTI_GPU": [], "MULTI_CPU": [], "FSDP": ["--enable_fsdp", "true"],
                     "DEEPSPEED": ["--enable_deepspeed", "true"]}
MIXED_PRECISION = {"no": ["--mixed_precision", "false"], "bf16": ["--mixed_precision", "true"],
                   "fp16": ["--use_fp16", "true"]}
SHARDING_STRATEGIES = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                       "5": "HYBRID_SHARD"}
OFFLOAD_DEVICES = {"none": "false", "cpu": "true"}


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _choice(table: dict[str, list[str]]) -> Callable[[Any], list[str] | None]:
    return lambda value: table.get(_text(value))


def _same(flag: str) -> Callable[[Any], list[str]]:
    return lambda value: [flag, _text(value)]


def _sharding(value: Any) -> list[str] | None:
    name = SHARDING_STRATEGIES.get(_text(value), _text(value).upper())
    return ["--fsdp_config.sharding_strategy", name] if name in SHARDING_STRATEGIES.values() else None


def _reshard_after_forward(value: Any) -> list[str] | None:
    """FSDP2 files say true / false; FSDP1 files name a sharding strategy in the same key."""
    if isinstance(value, bool) or _text(value) in ("true", "false"):
        return ["--fsdp_config.sharding_strategy", "FULL_SHARD" if _text(value) == "true" else "SHARD_GRAD_OP"]
    return _sharding(value)


def _offload(flag: str) -> Callable[[Any], list[str] | None]:
    return lambda value: [flag, OFFLOAD_DEVICES[_text(value)]] if _text(value) in OFFLOAD_DEVICES else None


def _clipping(value: Any) -> list[str]:
    return ["--gradient_clipping", "true", "--gradient_clipping_threshold", _text(value)]


# file key -> shardtune training flags (None: a value shardtune cannot take)
TRAIN_KEYS: dict[str, Callable[[Any], list[str] | None]] = {
    "distributed_type": _choice(DISTRIBUTED_TYPES),
    "mixed_precision": _choice(MIXED_PRECISION),
    "fsdp_config.fsdp_activation_checkpointing": _same("--fsdp_config.fsdp_activation_checkpointing"),
    "fsdp_config.fsdp_offload_params": _same("--fsdp_config.fsdp_cpu_offload"),
    "fsdp_config.fsdp_cpu_ram_efficient_loading": _same("--low_cpu_fsdp"),
    "fsdp_config.fsdp_sharding_strategy": _sharding,
    "fsdp_config.fsdp_reshard_after_forward": _reshard_after_forward,
    "fsdp_config.fsdp_state_dict_type": _same("--fsdp_config.checkpoint_type"),
    "deepspeed_config.zero_stage": _same("--deepspeed_config.zero_stage"),
    "deepspeed_config.offload_optimizer_device": _offload("--deepspeed_config.offload_optimizer"),
    "deepspeed_config.offload_param_device": _offload("--deepspeed_config.offload_param"),
    "deepspeed_config.gradient_accumulation_steps": _same("--gradient_accumulation_steps"),
    "deepspeed_config.gradient_clipping": _clipping,
    "deepspeed_config.deepspeed_config_file": _same("--deepspeed_config.config_file"),
}
LAUNCH_KEYS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port")


def read_accelerate_config(path: str) -> dict[str, Any]:
    """The file's keys, nested sections flattened to dotted names (fsdp_config.fsdp_offload_params)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"--{FLAG} {path}: no such file: pass an Accelerate config file (accelerate config "
                          "writes one; TRL's are in examples/accelerate_configs/)")
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--{FLAG} {path}: not valid YAML ({str(e).splitlines()[0]}): fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--{FLAG} {path}: the top level must be a mapping of Accelerate keys")
    return flatten_dict(data)


def launch_flags(path: str, keys: dict[str, Any]) -> dict[str, str]:
    """torchrun flags: Accelerate's num_processes counts the processes of ALL machines."""
    machines = int(keys.get("num_machines", 1) or 1)
    flags: dict[str, str] = {}
    if "num_processes" in keys:
        total = int(keys["num_processes"])
        if total % machines:
            raise ConfigError(f"--{FLAG} {path}: num_processes {total} is not a multiple of num_machines {machines}: "
                              "fix the file (Accelerate counts the processes of all machines)")
        flags["nproc_per_node"] = str(total // machines)
    if machines > 1:
        flags["nnodes"] = str(machines)
        flags["node_rank"] = _text(keys.get("machine_rank", 0))
        address = f"{keys.get('main_process_ip', '127.0.0.1')}:{keys.get('main_process_port', 29500)}"
        if keys.get("rdzv_backend") == "c10d":
            flags.update(rdzv_backend="c10d", rdzv_endpoint=address)
        else:
            flags.update(master_addr=address.rsplit(":", 1)[0], master_port=address.rsplit(":", 1)[1])
    return flags


def train_flags(path: str, keys: dict[str, Any]) -> list[str]:
    flags: list[str] = []
    for key, value in keys.items():
        if key in LAUNCH_KEYS or key in NO_EFFECT_KEYS:
            continue
        if key in EXPECTED_VALUES:
            if value not in EXPECTED_VALUES[key]:
                raise ConfigError(f"--{FLAG} {path}: {key} {value!r} cannot be mapped onto shardtune (it runs with "
                                  f"{EXPECTED_VALUES[key][0]!r}): remove the key or set that value")
            continue
        mapped = TRAIN_KEYS[key](value) if key in TRAIN_KEYS else None
        if mapped is None:
            raise ConfigError(f"--{FLAG} {path}: {key} {value!r} cannot be mapped onto a shardtune flag: remove it "
                              "from the file (see shardtune sft --help for what shardtune offers)")
        flags += mapped
    return flags


def expand_accelerate_config(argv: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """(launcher flags from the file, training flags from the file, argv without --accelerate_config FILE)."""
    rest: list[str] = []
    path = None
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in (f"--{FLAG}", "--accelerate-config"):
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"--{FLAG} needs a path: --{FLAG} fsdp2.yaml")
                value = argv[i + 1]
                i += 1
            path = value
        else:
            rest.append(argv[i])
        i += 1
    if path is None:
        return {}, [], rest
    keys = read_accelerate_config(path)
    return launch_flags(path, keys), train_flags(path, keys), rest
