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

# Other spellings accepted as aliases of ours (TRL's names, with their meaning: shardtune/config/trl.py).
ALIASES = {
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
        if typ == list[float]:
            return [_parse_value(key, float, p) for p in text.split(",") if p.strip()]
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
    if typ == list[float]:
        if isinstance(raw, list):
            return [_parse_value(key, float, x) for x in raw]
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return [float(raw)]
        raise ConfigError(f"{key}: {raw!r} is not a list of numbers: pass a YAML list or a comma-separated string")
    return raw


def _takes_a_list(name: str) -> bool:
    """Whether flag ``name`` is a list setting, whose values may follow it one by one (``--loss_type sigmoid sft``,
    as TRL's parser takes them)."""
    try:
        typ = flat_fields()[resolve_key(name)][0]
    except (ConfigError, KeyError):
        return False
    return typ in (list[str], list[float])


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
    from shardtune.config.trl import TRL_FLAGS

    candidates = list(known) + list(ALIASES) + list(TRL_FLAGS)
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    hint = f"did you mean --{close[0]}?" if close else "see shardtune sft --help"
    raise ConfigError(f"unknown flag --{key}: {hint}")


# Nested configs whose fields may also be given without their prefix (llama-cookbook spells --pure_bf16).
SHORT_SPELLING_OWNERS: list[str] = ["fsdp_config", "trl_dataset", "dpo"]


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


def _flag_pairs(argv: list[str]) -> tuple[list[tuple[str, Any]], str | None]:
    """``--key value`` / ``--key=value`` / bare ``--flag`` (value None) pairs, and the path of ``--config``."""
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
                while _takes_a_list(name) and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    value = f"{value},{argv[i + 1]}"  # the comma-separated form of the same list
                    i += 1
        i += 1
        if name == "config":
            if value is None:
                raise ConfigError("--config needs a path: --config recipes/demo.yaml")
            config_path = value
            continue
        pairs.append((name, value))
    return pairs, config_path


# Keys of a recipe that are not settings: read before launch by the command (config.trl.recipe_launch_settings).
RECIPE_LAUNCH_KEYS = ("env", "accelerate_config")


def _apply(cfg: TrainConfig, name: str, value: Any, given: dict[str, Any], bare_is_true: bool) -> dict[str, Any]:
    """Set one flag (maybe a TRL name that sets several of ours); returns {our key: the value it now has}."""
    from shardtune.config.trl import TRL_FLAGS, translate

    if value is None and not bare_is_true and name.replace("-", "_") in TRL_FLAGS:
        return {}  # a recipe key left empty means the default (TRL's translations take no empty value)
    if name.replace("-", "_") in TRL_FLAGS:
        given[name.replace("-", "_")] = value
    changed = {}
    for key, raw in translate(name, value):
        key = resolve_key(key)
        if raw is None and bare_is_true:
            if flat_fields()[key][0] is not bool:
                raise ConfigError(f"--{name} needs a value")
            raw = "true"
        set_value(cfg, key, raw)
        changed[key] = get_value(cfg, key)
    return changed


def get_value(cfg: TrainConfig, key: str) -> Any:
    target: Any = cfg
    for part in key.split("."):
        target = getattr(target, part)
    return target


def _recipe_pairs(path: str) -> list[tuple[str, Any]]:
    """The recipe's settings; every unknown key is named at once, in one line."""
    pairs = [(k, v) for k, v in load_yaml(path).items() if k.split(".")[0] not in RECIPE_LAUNCH_KEYS]
    unknown = []
    for name, value in pairs:
        try:
            from shardtune.config.trl import translate

            for key, _ in translate(name, value):
                resolve_key(key)
        except ConfigError as e:
            if str(e).startswith("unknown flag"):
                unknown.append(str(e).removeprefix("unknown flag --").replace(": did you mean", " (did you mean")
                               .replace("?", "?)").replace(": see shardtune sft --help", ""))
    if unknown:
        raise ConfigError(f"--config {path}: unknown keys: {'; '.join(unknown)}: fix or remove them (shardtune sft "
                          "--help lists the names, docs/flags.md TRL's)")
    return pairs


def recipe_path(argv: list[str]) -> str | None:
    """The path of --config in argv (None: none)."""
    path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    return path or next((a.partition("=")[2] for a in argv if a.startswith("--config=")), None)


def recipe_launch_settings(argv: list[str]) -> tuple[dict[str, str], str | None]:
    """A ``trl sft --config`` recipe's ``env:`` (variables to export before launch) and ``accelerate_config:`` (a file
    or a packaged profile name), read before anything else."""
    path = recipe_path(argv)
    if path is None:
        return {}, None
    flat = load_yaml(path)
    env = {k.removeprefix("env."): "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
           for k, v in flat.items() if k.startswith("env.")}
    accelerate = flat.get("accelerate_config")
    if accelerate is not None and not isinstance(accelerate, str):
        raise ConfigError(f"--config {path}: accelerate_config must be a file path or a profile name")
    return env, accelerate


def parse_args(argv: list[str], accelerate_argv: list[str] = (), notes: list[str] | None = None) -> TrainConfig:
    """Parse ``--config FILE`` plus ``--key value`` / ``--key=value`` / bare ``--flag`` (true) overrides.

    Precedence: the command line > the recipe (--config) > ``accelerate_argv`` (an Accelerate file's settings,
    shardtune.config.accelerate). Where the recipe and the Accelerate file set one setting to different values, a
    line naming both is appended to ``notes`` (the recipe's value is kept)."""
    from shardtune.config.trl import finish

    pairs, config_path = _flag_pairs(argv)
    cfg = TrainConfig()
    given: dict[str, Any] = {}
    from_accelerate: dict[str, Any] = {}
    for name, value in _flag_pairs(list(accelerate_argv))[0]:
        from_accelerate.update(_apply(cfg, name, value, given, bare_is_true=True))
    set_keys = set(from_accelerate)
    if config_path:
        for name, value in _recipe_pairs(config_path):
            for key, now in _apply(cfg, name, value, given, bare_is_true=False).items():
                set_keys.add(key)
                if key in from_accelerate and from_accelerate[key] != now and notes is not None:
                    notes.append(f"{key}: the recipe {config_path} says {now!r} ({name}), the Accelerate file says "
                                 f"{from_accelerate[key]!r}: using the recipe's (command line > recipe > Accelerate "
                                 "file)")
    for name, value in pairs:
        set_keys.update(_apply(cfg, name, value, given, bare_is_true=True))
    finish(cfg, given)
    select_hybrid_sharding(cfg)
    if cfg.trl_dataset.dataset_name and cfg.dataset == field_default(flat_fields()["dataset"][1]):
        cfg.dataset = "trl_dataset"  # TRL's --dataset_name alone names the data
    if cfg.dist_checkpoint_root_folder and "output_dir" not in set_keys:
        cfg.output_dir = cookbook_run_dir(cfg)
    return cfg


def cookbook_run_dir(cfg: TrainConfig) -> str:
    """llama-cookbook's run folder, <dist_checkpoint_root_folder>/<dist_checkpoint_folder>-<model_name>: the run's
    directory when those are given and --output_dir is not (the lesson's commands, run one after another)."""
    return str(Path(cfg.dist_checkpoint_root_folder) / f"{cfg.dist_checkpoint_folder}-{cfg.model_name}")


def select_hybrid_sharding(cfg: TrainConfig) -> None:
    """llama-cookbook's --hsdp means hybrid sharding (with --sharding_group_size / --replica_group_size): it selects
    HYBRID_SHARD over the default FULL_SHARD; with SHARD_GRAD_OP or NO_SHARD it is refused by the FSDP check."""
    if cfg.fsdp_config.hsdp and cfg.fsdp_config.sharding_strategy == "FULL_SHARD":
        cfg.fsdp_config.sharding_strategy = "HYBRID_SHARD"


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: TrainConfig) -> str:
    """config.yaml's text; a secret (--hub_token) is written empty."""
    data = to_dict(cfg)
    for key, (_, f) in flat_fields().items():
        if f.metadata.get("secret"):
            *owners, name = key.split(".")
            section = data
            for owner in owners:
                section = section[owner]
            section[name] = field_default(f)
    return yaml.safe_dump(data, sort_keys=False)


def from_dict(data: dict[str, Any]) -> TrainConfig:
    cfg = TrainConfig()
    for key, value in flatten_dict(data).items():
        set_value(cfg, key, value)
    return cfg


def field_default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def help_text(command: str = "sft") -> str:
    from shardtune.config.trl import TRL_FLAGS, trl_names_of

    lines = [f"usage: shardtune {command} [--config recipe.yaml] [--accelerate_config accelerate.yaml|PROFILE] [--flag value "
             "...] [torchrun flags]", "",
             "precedence: command line > recipe (--config; TRL's `trl sft --config` YAML too) > Accelerate file; a "
             "setting the recipe and the Accelerate file give different values is named in one line", "",
             "training flags:"]
    for key, (typ, f) in flat_fields().items():
        default = field_default(f)
        tname = getattr(typ, "__name__", str(typ))
        owner, _, name = key.rpartition(".")
        trl = trl_names_of(key) or ([name] if owner == "trl_dataset" else [])  # TRL's names, as TRL users type them
        lines.append(f"  --{key} {tname.upper()}  (default: {default!r})"
                     + (f"  (TRL: {', '.join('--' + n for n in trl)})" if trl else ""))
        lines.append(f"      {f.metadata.get('help', '')}")
    lines.append("")
    lines.append("aliases: " + ", ".join(f"--{a} = --{c}" for a, c in ALIASES.items()))
    refused = [n for n, flag in TRL_FLAGS.items() if flag.refuse]
    lines.append("TRL flags refused (with the fix, in one line): " + ", ".join(f"--{n}" for n in refused)
                 + " (docs/flags.md: the whole table)")
    if command == "dpo":
        lines.append("dpo: the training flags of sft, on preference pairs (prompt / chosen / rejected, TRL's formats), "
                     "with --beta, --loss_type, --loss_weights, --label_smoothing, --f_divergence_type, "
                     "--f_alpha_divergence_coef and --discopop_tau (docs/dpo.md)")
    return "\n".join(lines)
