"""Settings into a TrainConfig, from an Accelerate file, a YAML recipe and the command line, each flag in any
dialect (shardtune.config.spellings), typed by its canonical field; config.yaml written and read back.

Precedence: the command line > the recipe (--config) > the Accelerate file. Where the recipe and the Accelerate
file set one setting to different values, a line naming both is added to ``notes`` (the recipe's value is kept).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Iterable

import yaml

from shardtune.config import defaults
from shardtune.config.argv import split_argv
from shardtune.config.dialects import cookbook, placeholder, text, trl, trl_trainer
from shardtune.config.dialects.accelerate import LAUNCH_KEYS, launch_flags
from shardtune.config.fields import (
    flat_fields,
    flatten_dict,
    get_value,
    is_list,
    is_setting,
    optional,
    set_value,
    typed,
)
from shardtune.config.objectives import registration
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.config.spellings import normalise, resolve, spellings

# Keys of a recipe that are not settings: read before launch by the command (recipe_launch_settings): TRL's CLI
# passes these on to accelerate launch.
RECIPE_LAUNCH_KEYS = ("env", "accelerate_config", *LAUNCH_KEYS)


class Builder:
    """A config being built: flags applied in order of precedence (a later one wins), then the dialects' rules."""

    def __init__(self) -> None:
        self.cfg = TrainConfig()
        self.state: dict[str, Any] = {}  # the dialects' own keys ("cookbook:use_peft"), settled by finish
        self.spelled: dict[str, str] = {}  # canonical key -> the flag name that set it, as given
        self.names: list[str] = []  # the names a user typed (command line, recipe): they imply whose defaults
        self.defaults_applied = False  # a config being changed (with_settings) has its defaults already

    def apply(self, name: str, raw: Any, bare_is_true: bool = True) -> dict[str, Any]:
        """Set one flag (``raw`` None: a bare flag, or a recipe key left empty, which means the default); returns
        {canonical key: the value it now has}."""
        name = normalise(name)
        spelling = resolve(name, self.cfg.objective)
        if placeholder(name, raw):
            return {}  # a dumped TRL config's "<HUB_TOKEN>": the value was not written
        if spelling.refuse:
            if spelling.asks_nothing("true" if raw is None and bare_is_true else raw):
                return {}  # the refused thing is not asked for (its tool's default, or empty): no change
            raise ConfigError(f"--{name}: {spelling.refuse}")
        if raw in ([], {}) and not bare_is_true and spelling.plain and not is_list(flat_fields()[spelling.target].type):
            raw = None  # a file's empty list (TRL's debug: []) for a single value: unset
        if raw is None and not bare_is_true:
            if not spelling.plain:
                return {}  # a translated key left empty: its default
            self.spelled.pop(spelling.target, None)
            value = flat_fields()[spelling.target].default
            set_value(self.cfg, spelling.target, value)
            return {spelling.target: value}
        if raw is None and spelling.plain and optional(flat_fields()[spelling.target].type)[0] is not bool:
            raise ConfigError(f"--{name} needs a value")
        changed: dict[str, Any] = {}
        if spelling.to is None:
            pairs = [(spelling.target, "true" if raw is None else raw)]  # a bare switch is true
        else:
            pairs = spelling.to(raw)  # a translation's None is None (no clipping), not a bare flag
        for key, value in pairs:
            if ":" in key:  # a dialect's rule flag, settled by its finish: messages name the flag as given
                self.state[key] = value
                if spelling.target in flat_fields() and not (
                    isinstance(value, bool) and spelling.target in self.spelled
                ):
                    self.spelled[spelling.target] = name  # a switch does not hide the flag that gave the value
                continue
            value = typed(name, flat_fields()[key].type, value)
            if key == "objective":
                registration(value)  # known, or a plug-in's module:attribute, imported and registered now
            set_value(self.cfg, key, value)
            self.spelled[key] = name
            changed[key] = value
        return changed

    def apply_all(
        self, pairs: Iterable[tuple[str, Any]], bare_is_true: bool = True, typed_by_user: bool = False
    ) -> dict[str, Any]:
        changed: dict[str, Any] = {}
        for name, value in pairs:
            changed.update(self.apply(name, value, bare_is_true))
            if typed_by_user:
                self.names.append(normalise(name))
        return changed

    def apply_defaults(self, infer: bool) -> None:
        """The defaults of the settings not given: ``--defaults``, else (``infer``: a command line) the names used,
        else the objective's home (shardtune.config.defaults)."""
        cfg, reason = self.cfg, ""
        profile = cfg.run.defaults
        if profile and profile not in defaults.PROFILES:
            raise ConfigError(f"--defaults {profile}: choose trl or cookbook (or leave it out: the names decide)")
        if profile and "run.defaults" in self.spelled:
            reason = f"--{self.spelled['run.defaults']} {profile}"
        elif infer:
            profile, names = defaults.implied(self.names)
            if profile:
                whose = {"trl": "TRL's", "cookbook": "llama-cookbook's"}[profile]
                reason = ", ".join(f"--{n}" for n in names[:3]) + f" {'is' if len(names) == 1 else 'are'} {whose}"
            else:
                profile = registration(cfg.objective).home
                reason = f"shardtune {cfg.objective}'s when the names do not say"
        cfg.run.defaults = profile or "cookbook"
        for key, value in defaults.profile_defaults(cfg.run.defaults, cfg.objective).items():
            if key not in self.spelled:
                set_value(cfg, key, copy.deepcopy(value))
        cfg.provenance.defaults_reason = reason

    def finish(self, infer: bool = False) -> TrainConfig:
        cfg = self.cfg
        if not self.defaults_applied:
            self.apply_defaults(infer)
        cookbook.finish(cfg, self.state, self.spelled)
        trl.finish(cfg, self.state, self.spelled)
        trl_trainer.finish(cfg, self.state, self.spelled)
        tc = cfg.data.trl_dataset
        if (tc.dataset_name or tc.dataset_mixture) and "data.dataset" not in self.spelled:
            cfg.data.dataset = "trl_dataset"  # TRL's --dataset_name (or datasets: mixture) alone names the data
        if cfg.checkpoint.dist_checkpoint_root_folder and "output.dir" not in self.spelled:
            cfg.output.dir = cookbook_run_dir(cfg)
        cfg.provenance.spelled = dict(self.spelled)  # how the user named each setting: what messages repeat
        if not registration(cfg.objective).packs:
            settle_padding(cfg)
        return cfg


def settle_padding(cfg: TrainConfig) -> None:
    """An objective that never packs pads its rows per micro-batch: packing a user asked for (a flag or recipe key
    that set it) is refused; the cookbook's default packing, which nobody asked for, becomes padding."""
    if cfg.data.batching == "packing" and "data.batching" in cfg.provenance.spelled:
        raise ConfigError(
            f"{spelling_of(cfg, 'data.batching')} asks for packing, but shardtune {cfg.objective} never packs: its "
            "rows are padded per micro-batch; drop the flag"
        )
    cfg.data.batching = "padding"


def build_config(
    training: Iterable[tuple[str, Any]],
    recipe: str | None = None,
    accelerate: Iterable[tuple[str, Any]] = (),
    notes: list[str] | None = None,
    objective: str | None = None,
) -> TrainConfig:
    """The config of: canonical settings from an Accelerate file, a recipe file, then the command line's flags (the
    defaults of what none of them gives: whose the names imply, shardtune.config.defaults); ``objective``: the
    verb's, which an --objective or the recipe's objective must not contradict."""
    builder = Builder()
    training = list(training)
    given = [value for name, value in training if normalise(name) == "objective"]
    for value in given if objective else ():
        if value is None or text(value) == objective:  # None: a bare --objective, which needs a value
            continue
        if objective and registration(objective).hosts_plugins and ":" in text(value):  # a plug-in
            objective = text(value)
            continue
        raise ConfigError(
            f"--objective {text(value)}: this is shardtune {objective}; run shardtune {text(value)}, or drop the flag"
        )
    if objective or given:  # first: what the recipe's names mean may depend on it (--loss_type)
        builder.apply("objective", objective or given[-1])
    from_accelerate = builder.apply_all(accelerate)
    if recipe:
        pairs = recipe_settings(recipe, builder.cfg.objective)
        theirs = [text(value) for name, value in pairs if normalise(name) == "objective" and value is not None]
        if objective and theirs and theirs[-1] != objective:
            raise ConfigError(
                f"--config {recipe} says objective: {theirs[-1]}, but this is shardtune {objective}: run shardtune "
                f"{theirs[-1]} --config {recipe}, or change the recipe's objective"
            )
        alone = Builder()  # the recipe's settings as it resolves them alone (its dialects' rules settled)
        alone.apply("objective", builder.cfg.objective)
        alone.apply_all(pairs, bare_is_true=False, typed_by_user=True)
        said = alone.finish(infer=True)
        for key, theirs in from_accelerate.items():
            if key in said.provenance.spelled and get_value(said, key) != theirs and notes is not None:
                notes.append(
                    f"{key}: the recipe {recipe} says {get_value(said, key)!r} ({said.provenance.spelled[key]}), the "
                    f"Accelerate file says {theirs!r}: using the recipe's (command line > recipe > Accelerate file)"
                )
        builder.apply_all(pairs, bare_is_true=False, typed_by_user=True)
    builder.apply_all(training, typed_by_user=True)
    return builder.finish(infer=True)


def parse_args(
    argv: list[str], accelerate: Iterable[tuple[str, Any]] = (), notes: list[str] | None = None
) -> TrainConfig:
    """A config from training flags as a command line gives them (``--config FILE`` among them), over the settings
    of an Accelerate file (shardtune.config.dialects.accelerate.read_accelerate)."""
    args = split_argv(argv)
    if args.launcher:
        raise ConfigError(
            f"--{next(iter(args.launcher))} is a launcher flag: give it to shardtune sft (or torchrun), not here"
        )
    return build_config(args.training, args.recipe, accelerate, notes)


def config_from(settings: dict[str, Any] | None = None, **more: Any) -> TrainConfig:
    """A config from settings named as flags (any dialect or canonical name; dotted names in ``settings``), with
    typed values: what code builds a config with (the bench, the tests)."""
    builder = Builder()
    builder.apply_all({**(settings or {}), **more}.items())
    return builder.finish()


def with_settings(cfg: TrainConfig, settings: dict[str, Any] | None = None, **more: Any) -> TrainConfig:
    """A copy of ``cfg`` with more settings applied, named as in config_from; ``cfg`` is unchanged."""
    builder = Builder()
    builder.cfg = copy.deepcopy(cfg)
    builder.spelled = dict(cfg.provenance.spelled)
    builder.defaults_applied = True
    builder.apply_all({**(settings or {}), **more}.items())
    return builder.finish()


def cookbook_run_dir(cfg: TrainConfig) -> str:
    """llama-cookbook's run folder, <dist_checkpoint_root_folder>/<dist_checkpoint_folder>-<model_name>: the run's
    directory when those are given and --output_dir is not (the lesson's commands, run one after another)."""
    return str(
        Path(cfg.checkpoint.dist_checkpoint_root_folder) / f"{cfg.checkpoint.dist_checkpoint_folder}-{cfg.model.name}"
    )


# -- recipes -------------------------------------------------------------------------------------------------------


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
    return data


def mapping_settings(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """A (nested) mapping's settings as (dotted name, value): sections (``optim:``, ``fsdp_config:``) are
    flattened; a mapping under any other key is that flag's value (TRL's ``lr_scheduler_kwargs:``)."""
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and is_section(name):
            out += mapping_settings(value, f"{name}.")
        else:
            out.append((name, value))
    return out


def is_section(name: str) -> bool:
    """Whether ``name`` groups settings: a canonical group, or a dialect's (``fsdp_config``, ``samsum_dataset``)."""
    prefix = normalise(name) + "."
    return any(key.startswith(prefix) for key in (*flat_fields(), *spellings()))


def recipe_settings(path: str, objective: str | None = None) -> list[tuple[str, Any]]:
    """The recipe's settings; every unknown key is named at once, in one line (a suggestion among ``objective``'s
    names)."""
    pairs = [(k, v) for k, v in mapping_settings(load_yaml(path)) if k.split(".")[0] not in RECIPE_LAUNCH_KEYS]
    unknown = []
    for name, _ in pairs:
        try:
            resolve(name, objective)
        except ConfigError as e:
            unknown.append(
                str(e)
                .removeprefix("unknown flag --")
                .replace(": did you mean", " (did you mean")
                .replace("?", "?)")
                .replace(": see shardtune sft --help", "")
            )
    if unknown:
        raise ConfigError(
            f"--config {path}: unknown keys: {'; '.join(unknown)}: fix or remove them (shardtune sft "
            "--help lists the names, docs/flags.md TRL's)"
        )
    return pairs


def recipe_launch_settings(recipe: str | None) -> tuple[dict[str, str], str | None, dict[str, str]]:
    """A ``trl sft --config`` recipe's ``env:`` (variables to export before launch), ``accelerate_config:`` (a file
    or a packaged profile name) and Accelerate's launcher keys (``num_processes: 2``, as clis.md writes it: the
    processes of all machines, with ``num_machines`` ...) as torchrun flags, read before anything else."""
    if recipe is None:
        return {}, None, {}
    flat = flatten_dict(load_yaml(recipe))
    env = {
        k.removeprefix("env."): "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
        for k, v in flat.items()
        if k.startswith("env.")
    }
    accelerate = flat.get("accelerate_config")
    if accelerate is not None and not isinstance(accelerate, str):
        raise ConfigError(f"--config {recipe}: accelerate_config must be a file path or a profile name")
    keys = {k: v for k, v in flat.items() if k in LAUNCH_KEYS and v is not None}
    for key, value in keys.items():
        if key in ("num_processes", "num_machines", "machine_rank") and not str(value).isdigit():
            raise ConfigError(f"--config {recipe}: {key} {value!r} is not a whole number: fix the recipe")
    return env, accelerate, launch_flags(recipe, keys, "config") if keys else {}


# -- config.yaml ---------------------------------------------------------------------------------------------------


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The settings of ``cfg``, grouped (its provenance is not a setting)."""
    data = dataclasses.asdict(cfg)
    for f in dataclasses.fields(cfg):
        if not is_setting(f):
            del data[f.name]
    return data


def to_yaml(cfg: TrainConfig) -> str:
    """config.yaml's text: the canonical config, grouped; a secret (the hub token) is written empty."""
    data = to_dict(cfg)
    for key, info in flat_fields().items():
        if info.meta.get("secret"):
            *owners, name = key.split(".")
            section = data
            for owner in owners:
                section = section[owner]
            section[name] = info.default
    return yaml.safe_dump(data, sort_keys=False)


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """A config.yaml read back: this version's grouped form, or an earlier release's flat names (a dialect)."""
    builder = Builder()
    builder.apply_all(mapping_settings(data), bare_is_true=False)
    return builder.finish()


def flat_settings(cfg: TrainConfig) -> dict[str, Any]:
    """Every canonical setting by dotted name."""
    return {key: get_value(cfg, key) for key in flat_fields()}


def spelling_of(cfg: TrainConfig, key: str) -> str:
    """``--name`` of the canonical ``key`` in a message: as the user typed it, else the name users know it by."""
    from shardtune.config.spellings import default_spelling

    return "--" + cfg.provenance.spelled.get(key, default_spelling(key))
