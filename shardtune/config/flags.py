"""Flags and YAML recipes into a TrainConfig: dotted flags for nested configs (``--samsum_dataset.data_path X``),
TRL / Hugging Face spellings as aliases, typo suggestions, and the generated ``--help``.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from shardtune.config.schema import ConfigError, TrainConfig

# TRL / HF Trainer spellings accepted as aliases of ours.
ALIASES = {
    "per_device_train_batch_size": "batch_size_training",
    "per_device_eval_batch_size": "val_batch_size",
    "learning_rate": "lr",
    "num_train_epochs": "num_epochs",
    "max_steps": "max_train_step",
    "max_grad_norm": "gradient_clipping_threshold",
    "max_seq_length": "context_length",
    "max_length": "context_length",
    "sp_size": "sequence_parallel_size",
    "cp_size": "context_parallel_size",
    "fsdp_config.use_fp16": "use_fp16",
    "fsdp_config.mixed_precision": "mixed_precision",
    "fsdp_config.optimizer": "optimizer",
    "enable_activation_checkpointing": "fsdp_config.fsdp_activation_checkpointing",
}


# ---------------------------------------------------------------------------------------------------------------
# Flat view of the (nested) dataclass tree: "samsum_dataset.data_path" -> (owner type, field)


def flat_fields(cls: type = TrainConfig, prefix: str = "") -> dict[str, tuple[type, dataclasses.Field]]:
    out: dict[str, tuple[type, dataclasses.Field]] = {}
    hints = get_type_hints(cls)
    for f in fields(cls):
        typ = hints[f.name]
        if is_dataclass(typ):
            out.update(flat_fields(typ, prefix + f.name + "."))
        else:
            out[prefix + f.name] = (typ, f)
    return out


def _parse_value(key: str, typ: type, raw: Any) -> Any:
    if isinstance(raw, str):
        text = raw.strip()
        if typ is bool:
            low = text.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ConfigError(f"--{key} {raw!r} is not a boolean: use true or false")
        if typ is int:
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"--{key} {raw!r} is not an integer: pass a whole number") from None
        if typ is float:
            try:
                return float(text)
            except ValueError:
                raise ConfigError(f"--{key} {raw!r} is not a number: pass e.g. 1e-4") from None
        if typ == list[str]:
            return [p.strip() for p in text.split(",") if p.strip()]
        return raw
    # values from YAML keep their type, checked here
    if typ is bool and not isinstance(raw, bool):
        raise ConfigError(f"{key}: {raw!r} is not a boolean: use true or false")
    if typ is int and (isinstance(raw, bool) or not isinstance(raw, int)):
        raise ConfigError(f"{key}: {raw!r} is not an integer: pass a whole number")
    if typ is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(f"{key}: {raw!r} is not a number: pass e.g. 1e-4")
        return float(raw)
    if typ is str and not isinstance(raw, str):
        return str(raw)
    if typ == list[str]:
        if isinstance(raw, list):
            return [str(x) for x in raw]
        raise ConfigError(f"{key}: {raw!r} is not a list: pass a YAML list or a comma-separated string")
    return raw


def resolve_key(key: str) -> str:
    """Map a flag name (maybe an alias or a short spelling of a nested field) to its canonical dotted name."""
    known = flat_fields()
    key = key.replace("-", "_") if "." not in key else key
    if key in known:
        return key
    if key in ALIASES:
        return ALIASES[key]
    # short spellings of nested fields, as llama-cookbook accepts them (--pure_bf16 -> fsdp_config.pure_bf16)
    for owner in SHORT_SPELLING_OWNERS:
        if f"{owner}.{key}" in known:
            return f"{owner}.{key}"
    candidates = list(known) + list(ALIASES)
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    hint = f"did you mean --{close[0]}?" if close else "see shardtune sft --help"
    raise ConfigError(f"unknown flag --{key}: {hint}")


# Nested configs whose fields may also be given without their prefix (llama-cookbook spells --pure_bf16).
SHORT_SPELLING_OWNERS: list[str] = ["fsdp_config", "trl_dataset"]


def set_value(cfg: TrainConfig, key: str, raw: Any) -> None:
    """Set a flat key from a flag or YAML value; None (YAML's empty value, ``data_path:``) means the default."""
    key = resolve_key(key)
    typ, f = flat_fields()[key]
    value = field_default(f) if raw is None else _parse_value(key, typ, raw)
    if "spellings" in f.metadata:  # another accepted spelling of a choice (int4 -> 4bit)
        value = f.metadata["spellings"].get(value, value)
    *owners, name = key.split(".")
    target: Any = cfg
    for owner in owners:
        target = getattr(target, owner)
    setattr(target, name, value)


def flatten_dict(data: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested config mappings as dotted flag names."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(flatten_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file: pass the path of a YAML recipe (see recipes/)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]}): fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping of flag names to values")
    return flatten_dict(data)


def parse_args(argv: list[str]) -> TrainConfig:
    """Parse ``--config FILE`` plus ``--key value`` / ``--key=value`` / bare ``--flag`` (true) overrides."""
    pairs: list[tuple[str, Any]] = []
    i = 0
    config_path = None
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: flags look like --name value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("--"):
                value = None
            else:
                value = nxt
                i += 1
        i += 1
        if name == "config":
            if value is None:
                raise ConfigError("--config needs a path: --config recipes/demo.yaml")
            config_path = value
            continue
        pairs.append((name, value))
    cfg = TrainConfig()
    if config_path:
        for key, value in load_yaml(config_path).items():
            set_value(cfg, key, value)
    for name, value in pairs:
        key = resolve_key(name)
        typ, _ = flat_fields()[key]
        if value is None:
            if typ is not bool:
                raise ConfigError(f"--{name} needs a value")
            value = "true"
        set_value(cfg, key, value)
    select_hybrid_sharding(cfg)
    if cfg.trl_dataset.dataset_name and cfg.dataset == field_default(flat_fields()["dataset"][1]):
        cfg.dataset = "trl_dataset"  # TRL's --dataset_name alone names the data
    return cfg


def select_hybrid_sharding(cfg: TrainConfig) -> None:
    """llama-cookbook's --hsdp means hybrid sharding (with --sharding_group_size / --replica_group_size): it selects
    HYBRID_SHARD over the default FULL_SHARD; with SHARD_GRAD_OP or NO_SHARD it is refused by the FSDP check."""
    if cfg.fsdp_config.hsdp and cfg.fsdp_config.sharding_strategy == "FULL_SHARD":
        cfg.fsdp_config.sharding_strategy = "HYBRID_SHARD"


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def from_dict(data: dict[str, Any]) -> TrainConfig:
    cfg = TrainConfig()
    for key, value in flatten_dict(data).items():
        set_value(cfg, key, value)
    return cfg


def field_default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def help_text() -> str:
    lines = ["usage: shardtune sft [--config recipe.yaml] [--accelerate_config accelerate.yaml] [--flag value ...] "
             "[torchrun flags]", "", "training flags:"]
    for key, (typ, f) in flat_fields().items():
        default = field_default(f)
        tname = getattr(typ, "__name__", str(typ))
        owner, _, name = key.rpartition(".")
        short = f" (or --{name})" if owner == "trl_dataset" else ""  # TRL's names, as TRL users type them
        lines.append(f"  --{key} {tname.upper()}  (default: {default!r}){short}")
        lines.append(f"      {f.metadata.get('help', '')}")
    lines.append("")
    lines.append("aliases: " + ", ".join(f"--{a} = --{c}" for a, c in ALIASES.items()))
    return "\n".join(lines)
