"""``--accelerate_config FILE``: an Accelerate config file, as TRL's guide launches with, read as shardtune settings.

    launch_flags, train_settings = read_accelerate(path)

The file's launcher keys (num_processes, num_machines, machine_rank, main_process_ip / port) become torchrun
flags, its training keys (distributed_type, mixed_precision, fsdp_config.*, deepspeed_config.*) canonical settings
applied before the recipe's and the command line's, so what those say wins. Keys that only describe Accelerate's
own environment, or that FSDP2 / DeepSpeed here decide by themselves (prefetching, use_orig_params, ...), are
accepted as they are. Anything else is refused in one line naming the key, so no setting is silently dropped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

import yaml

from shardtune.config.dialects import Pairs
from shardtune.config.dialects.trl import PROFILES
from shardtune.config.fields import flatten_dict
from shardtune.config.schema import ConfigError

FLAG = "accelerate_config"

# Keys whose value does not change a shardtune run: Accelerate's environment, and FSDP / DeepSpeed knobs that
# shardtune's FSDP2 wrapping or DeepSpeed setup decides itself (the value is accepted whatever it is).
NO_EFFECT_KEYS = frozenset(
    {
        "compute_environment",
        "main_training_function",
        "same_network",
        "tpu_env",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "tpu_name",
        "tpu_zone",
        "commands",
        "command_file",
        "enable_cpu_affinity",
        "fsdp_config.fsdp_version",
        "fsdp_config.fsdp_use_orig_params",
        "fsdp_config.fsdp_sync_module_states",
        "fsdp_config.fsdp_forward_prefetch",
        "fsdp_config.fsdp_backward_prefetch",
        "deepspeed_config.deepspeed_multinode_launcher",
        "deepspeed_config.zero3_init_flag",
        "deepspeed_config.zero3_save_16bit_model",
        # how Accelerate's context / sequence parallelism is implemented; shardtune's ring and Ulysses compute the same
        "deepspeed_config.seq_parallel_communication_data_type",
        "parallelism_config.parallelism_config_cp_comm_strategy",
        "parallelism_config.parallelism_config_cp_handler",
        "parallelism_config.parallelism_config_cp_seq_length_is_variable",
        "parallelism_config.parallelism_config_cp_attn_implementation",
        "parallelism_config.parallelism_config_sp_seq_length",
        "parallelism_config.parallelism_config_sp_handler",
        "parallelism_config.parallelism_config_sp_seq_length_is_variable",
        "parallelism_config.parallelism_config_sp_attn_implementation",
    }
)
# Keys accepted only with the value that means what shardtune does anyway.
EXPECTED_VALUES: dict[str, tuple[Any, ...]] = {
    "debug": (False,),
    "use_cpu": (False,),
    "downcast_bf16": ("no", False),
    "gpu_ids": ("all", None),
    "rdzv_backend": ("static", "c10d"),
    "fsdp_config.fsdp_auto_wrap_policy": ("TRANSFORMER_BASED_WRAP",),
    "dynamo_config.dynamo_backend": ("NO", "no"),
}
DISTRIBUTED_TYPES = {
    "NO": [],
    "MULTI_GPU": [],
    "MULTI_CPU": [],
    "FSDP": [("parallel.strategy", "fsdp")],
    "DEEPSPEED": [("parallel.strategy", "deepspeed")],
}
MIXED_PRECISION = {
    "no": [("train.precision", "fp32")],
    "bf16": [("train.precision", "auto")],
    "fp16": [("train.precision", "fp16")],
}
SHARDING_STRATEGIES = {
    "1": "FULL_SHARD",
    "2": "SHARD_GRAD_OP",
    "3": "NO_SHARD",
    "4": "HYBRID_SHARD",
    "5": "HYBRID_SHARD",
}
OFFLOAD_DEVICES = {"none": False, "cpu": True}


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _choice(table: dict[str, Pairs]) -> Callable[[Any], Pairs | None]:
    return lambda value: table.get(_text(value))


def _same(key: str) -> Callable[[Any], Pairs]:
    return lambda value: [(key, value)]


def _sharding(value: Any) -> Pairs | None:
    name = SHARDING_STRATEGIES.get(_text(value), _text(value).upper())
    return [("parallel.sharding_strategy", name)] if name in SHARDING_STRATEGIES.values() else None


def _reshard_after_forward(value: Any) -> Pairs | None:
    """FSDP2 files say true / false; FSDP1 files name a sharding strategy in the same key."""
    if isinstance(value, bool) or _text(value) in ("true", "false"):
        return [("parallel.sharding_strategy", "FULL_SHARD" if _text(value) == "true" else "SHARD_GRAD_OP")]
    return _sharding(value)


def _offload(key: str) -> Callable[[Any], Pairs | None]:
    return lambda value: [(key, OFFLOAD_DEVICES[_text(value)])] if _text(value) in OFFLOAD_DEVICES else None


def _clipping(value: Any) -> Pairs:
    return [("optim.max_grad_norm", float(value) or None)]


# file key -> canonical settings (None: a value shardtune cannot take)
TRAIN_KEYS: dict[str, Callable[[Any], Pairs | None]] = {
    "distributed_type": _choice(DISTRIBUTED_TYPES),
    "mixed_precision": _choice(MIXED_PRECISION),
    "fsdp_config.fsdp_activation_checkpointing": _same("parallel.activation_checkpointing"),
    "fsdp_config.fsdp_offload_params": _same("parallel.cpu_offload"),
    "fsdp_config.fsdp_cpu_ram_efficient_loading": _same("parallel.low_cpu_fsdp"),
    "fsdp_config.fsdp_sharding_strategy": _sharding,
    "fsdp_config.fsdp_reshard_after_forward": _reshard_after_forward,
    "fsdp_config.fsdp_state_dict_type": _same("checkpoint.checkpoint_type"),
    "deepspeed_config.zero_stage": _same("parallel.zero_stage"),
    "deepspeed_config.offload_optimizer_device": _offload("parallel.offload_optimizer"),
    "deepspeed_config.offload_param_device": _offload("parallel.offload_param"),
    "deepspeed_config.gradient_accumulation_steps": _same("train.gradient_accumulation_steps"),
    "deepspeed_config.gradient_clipping": _clipping,
    "deepspeed_config.deepspeed_config_file": _same("parallel.deepspeed_config_file"),
}
LAUNCH_KEYS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port")
PARALLELISM = "parallelism_config.parallelism_config_"
# TRL's packaged profiles (`trl sft --accelerate_config zero2`): shardtune ships files of the same names and meaning.
PROFILES_DIR = Path(__file__).resolve().parent / "accelerate_profiles"


def profile_path(path: str) -> str:
    """A file, or the packaged profile of that name."""
    if not Path(path).expanduser().is_file() and path in PROFILES:
        return str(PROFILES_DIR / f"{path}.yaml")
    return path


def read_accelerate_config(path: str) -> dict[str, Any]:
    """The file's keys, nested sections flattened to dotted names (fsdp_config.fsdp_offload_params)."""
    file = Path(profile_path(path)).expanduser()
    if not file.is_file():
        raise ConfigError(
            f"--{FLAG} {path}: no such file: pass an Accelerate config file (accelerate config "
            f"writes one; TRL's are in examples/accelerate_configs/) or a profile: {', '.join(PROFILES)}"
        )
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--{FLAG} {path}: not valid YAML ({str(e).splitlines()[0]}): fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--{FLAG} {path}: the top level must be a mapping of Accelerate keys")
    return flatten_dict(data)


def launch_flags(path: str, keys: dict[str, Any], flag: str = FLAG) -> dict[str, str]:
    """torchrun flags: Accelerate's num_processes counts the processes of ALL machines (``flag``: the file's)."""
    machines = int(keys.get("num_machines", 1) or 1)
    flags: dict[str, str] = {}
    if keys.get("distributed_type") == "NO":  # as Accelerate: one process, whatever num_processes says
        flags["nproc_per_node"] = "1"
    elif "num_processes" in keys:
        total = int(keys["num_processes"])
        if total % machines:
            raise ConfigError(
                f"--{flag} {path}: num_processes {total} is not a multiple of num_machines {machines}: "
                "fix the file (Accelerate counts the processes of all machines)"
            )
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


def _size(path: str, keys: dict[str, Any], name: str) -> int:
    value = keys.get(PARALLELISM + name, 1)
    if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
        raise ConfigError(f"--{FLAG} {path}: parallelism_config_{name} {value!r} must be a whole number >= 1")
    return int(value)


def parallelism_settings(path: str, keys: dict[str, Any]) -> Pairs:
    """Accelerate's parallelism_config on shardtune's mesh: cp (torch backend) is ring attention (--cp_size); sp, and
    cp with the deepspeed backend (ALST), are Ulysses (--sp_size); dp_replicate > 1 under FSDP is HYBRID_SHARD."""
    if not any(k.startswith(PARALLELISM) for k in keys):
        return []
    tp, cp, sp = (_size(path, keys, n) for n in ("tp_size", "cp_size", "sp_size"))
    replicate, shard = _size(path, keys, "dp_replicate_size"), _size(path, keys, "dp_shard_size")
    if tp > 1:
        raise ConfigError(
            f"--{FLAG} {path}: parallelism_config_tp_size {tp}: tensor parallelism is not built: use "
            "FSDP (distributed_type: FSDP) to fit the model, and set tp_size to 1"
        )
    backends = {
        "cp_backend": keys.get(PARALLELISM + "cp_backend", "torch"),
        "sp_backend": keys.get(PARALLELISM + "sp_backend", "deepspeed"),
    }
    if backends["cp_backend"] not in ("torch", "deepspeed") or backends["sp_backend"] != "deepspeed":
        raise ConfigError(
            f"--{FLAG} {path}: parallelism_config cp_backend {backends['cp_backend']!r} / sp_backend "
            f"{backends['sp_backend']!r}: shardtune has torch's (ring) context parallelism and "
            "DeepSpeed's (Ulysses) sequence parallelism"
        )
    if backends["cp_backend"] == "deepspeed":  # ALST: Ulysses under the name cp
        cp, sp = 1, sp * cp
    distributed = keys.get("distributed_type", "NO")
    if replicate > 1 and distributed == "DEEPSPEED":
        raise ConfigError(
            f"--{FLAG} {path}: parallelism_config_dp_replicate_size {replicate}: ZeRO partitions over "
            "all processes (no replica groups): set it to 1, or use distributed_type: FSDP (HSDP)"
        )
    if shard > 1 and distributed not in ("FSDP", "DEEPSPEED"):
        raise ConfigError(
            f"--{FLAG} {path}: parallelism_config_dp_shard_size {shard} needs distributed_type FSDP or "
            f"DEEPSPEED (not {distributed}): set one, or dp_shard_size 1"
        )
    total = replicate * shard * cp * sp
    if "num_processes" in keys and int(keys["num_processes"]) != total and distributed != "NO":
        raise ConfigError(
            f"--{FLAG} {path}: parallelism_config dp_replicate {replicate} x dp_shard {shard} x cp {cp} "
            f"x sp {sp} = {total}, but num_processes is {keys['num_processes']}: make them agree"
        )
    pairs: Pairs = [
        (f"parallel.{name}", size)
        for name, size in (("context_parallel_size", cp), ("sequence_parallel_size", sp))
        if size > 1
    ]
    if replicate > 1 and distributed == "FSDP":
        pairs += [("parallel.sharding_strategy", "HYBRID_SHARD"), ("parallel.replica_group_size", replicate)]
    return pairs


def train_settings(path: str, keys: dict[str, Any]) -> Pairs:
    settings: Pairs = []
    for key, value in keys.items():
        if key in LAUNCH_KEYS or key in NO_EFFECT_KEYS:
            continue
        if key.startswith(PARALLELISM) and key.removeprefix(PARALLELISM) in (
            "tp_size",
            "cp_size",
            "sp_size",
            "dp_replicate_size",
            "dp_shard_size",
            "cp_backend",
            "sp_backend",
        ):
            continue  # parallelism_settings
        if key in EXPECTED_VALUES:
            if value not in EXPECTED_VALUES[key]:
                raise ConfigError(
                    f"--{FLAG} {path}: {key} {value!r} cannot be mapped onto shardtune (it runs with "
                    f"{EXPECTED_VALUES[key][0]!r}): remove the key or set that value"
                )
            continue
        mapped = TRAIN_KEYS[key](value) if key in TRAIN_KEYS else None
        if mapped is None:
            raise ConfigError(
                f"--{FLAG} {path}: {key} {value!r} cannot be mapped onto a shardtune setting: remove it "
                "from the file (see shardtune sft --help for what shardtune offers)"
            )
        settings += mapped
    return settings + parallelism_settings(path, keys)  # after fsdp_config's strategy: HSDP wins over it


def read_accelerate(path: str | None) -> tuple[dict[str, str], Pairs]:
    """(launcher flags from the file, canonical settings from the file); none without a file."""
    if path is None:
        return {}, []
    keys = read_accelerate_config(path)
    return launch_flags(path, keys), train_settings(path, keys)


# Accelerate's switches for its own rank-0 loading (the lesson's QLoRA command sets them). With both set,
# transformers' from_pretrained leaves the weights of every process but local rank 0 unloaded, expecting
# Accelerate's FSDP to broadcast them; shardtune loads (or, with --low_cpu_fsdp, broadcasts) weights itself.
ACCELERATE_LOADING_VARIABLES = ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING")


def clear_accelerate_loading_variables() -> None:
    """Remove Accelerate's loading switches from this process (and so from the workers it launches), saying so."""
    found = [name for name in ACCELERATE_LOADING_VARIABLES if name in os.environ]
    for name in found:
        del os.environ[name]
    if found and os.environ.get("RANK", "0") == "0":
        print(
            f"shardtune: ignoring {' and '.join(found)} (Accelerate's loading switches): every rank loads the "
            "model, or only rank 0 with --low_cpu_fsdp",
            file=sys.stderr,
        )


# What ``accelerate launch --config_file FILE script.py`` tells the script's processes: its file's keys as
# environment variables (accelerate/utils/launch.py) -> the file's keys, read as a file is.
ENVIRONMENT_KEYS = {
    "ACCELERATE_MIXED_PRECISION": "mixed_precision",
    "FSDP_SHARDING_STRATEGY": "fsdp_config.fsdp_sharding_strategy",
    "FSDP_RESHARD_AFTER_FORWARD": "fsdp_config.fsdp_reshard_after_forward",
    "FSDP_OFFLOAD_PARAMS": "fsdp_config.fsdp_offload_params",
    "FSDP_STATE_DICT_TYPE": "fsdp_config.fsdp_state_dict_type",
    "FSDP_ACTIVATION_CHECKPOINTING": "fsdp_config.fsdp_activation_checkpointing",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "fsdp_config.fsdp_cpu_ram_efficient_loading",
    "FSDP_AUTO_WRAP_POLICY": "fsdp_config.fsdp_auto_wrap_policy",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "deepspeed_config.zero_stage",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "deepspeed_config.offload_optimizer_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "deepspeed_config.offload_param_device",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "deepspeed_config.gradient_accumulation_steps",
    "ACCELERATE_GRADIENT_CLIPPING": "deepspeed_config.gradient_clipping",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": "deepspeed_config.deepspeed_config_file",
}
ENVIRONMENT_SWITCHES = (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED"))


def environment_settings(env: dict[str, str]) -> Pairs:
    """The canonical settings ``accelerate launch`` passed this process in its environment (none outside it): the
    strategy, its options and the precision, as its config file would give them."""
    keys: dict[str, Any] = {}
    for variable, distributed in ENVIRONMENT_SWITCHES:
        if env.get(variable, "").lower() == "true":
            keys["distributed_type"] = distributed
    for variable, key in ENVIRONMENT_KEYS.items():
        value = env.get(variable)
        if value is None or value == "" or (key.startswith("fsdp_config") and keys.get("distributed_type") != "FSDP"):
            continue
        if key == "mixed_precision" and value == "no":
            continue  # accelerate's default when its file says nothing: the script's config decides (TRL's: bf16)
        if key.startswith("deepspeed_config") and keys.get("distributed_type") != "DEEPSPEED":
            continue
        if value.lower() in ("true", "false"):
            keys[key] = value.lower() == "true"
        elif key.endswith(("zero_stage", "gradient_accumulation_steps")) and value.isdigit():
            keys[key] = int(value)
        else:
            keys[key] = value
    if not keys:
        return []
    return train_settings("(accelerate launch's environment)", keys)
