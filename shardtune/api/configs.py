"""``SFTConfig`` / ``DPOConfig`` / ``GRPOConfig``: TRL's field names with TRL's defaults, as canonical settings.

A config holds the fields a script gave, by TRL's names (every name of TRL 1.16's SFTConfig / DPOConfig /
GRPOConfig / ModelConfig / ScriptArguments and transformers' TrainingArguments is known: shardtune.config.dialects.trl),
and is turned into the canonical config by the command line's builder (one set of meanings): a field shardtune cannot
honour is refused in one line when the config is made, never accepted and ignored. A TRL ``SFTConfig`` /
``DPOConfig`` / ``GRPOConfig`` / ``TrainingArguments`` object is read the same way: the fields it sets differently from
its class's defaults.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

from shardtune.config.flags import build_config
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.config.spellings import resolve

# transformers' TrainingArguments default: where a script that names no output_dir writes
DEFAULT_OUTPUT_DIR = "trainer_output"


class TrlConfig:
    """The fields a script gave (TRL's names); the rest take TRL's defaults."""

    objective: ClassVar[str] = "sft"

    def __init__(self, output_dir: str | None = None, **fields: Any) -> None:
        given = {"output_dir": output_dir, **fields} if output_dir is not None else dict(fields)
        for name in given:
            resolve(name)  # an unknown name: one line with the closest known one
        object.__setattr__(self, "_given", given)
        self.canonical()  # a refused field or value: now, where the script builds its config

    @property
    def given(self) -> dict[str, Any]:
        return dict(self._given)

    def canonical(self, more: list[tuple[str, Any]] = ()) -> TrainConfig:
        """The canonical config of these fields and ``more`` (the trainer's: model, data, adapter), TRL's defaults
        for the rest."""
        given = {"output_dir": DEFAULT_OUTPUT_DIR, **self._given}
        pairs = [("defaults", "trl"), *((k, v) for k, v in given.items() if v is not None), *more]
        return build_config(pairs, None, (), [], self.objective)

    def __getattr__(self, name: str) -> Any:
        given = self.__dict__.get("_given", {})
        if name in given:
            return given[name]
        if name == "output_dir":
            return DEFAULT_OUTPUT_DIR
        raise AttributeError(
            f"{type(self).__name__}.{name}: not given (shardtune keeps the fields a script gives; the rest are TRL's "
            "defaults, as the run's config.yaml shows)"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        given = {**self._given, name: value}
        resolve(name)
        previous = self._given
        object.__setattr__(self, "_given", given)
        try:
            self.canonical()
        except ConfigError:
            object.__setattr__(self, "_given", previous)
            raise

    def to_dict(self) -> dict[str, Any]:
        return {"output_dir": DEFAULT_OUTPUT_DIR, **self._given}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


class SFTConfig(TrlConfig):
    """TRL's ``SFTConfig`` (and ModelConfig's / ScriptArguments' names) for :class:`shardtune.SFTTrainer`."""

    objective = "sft"


class DPOConfig(TrlConfig):
    """TRL's ``DPOConfig`` for :class:`shardtune.DPOTrainer`."""

    objective = "dpo"


class GRPOConfig(TrlConfig):
    """TRL's ``GRPOConfig`` for :class:`shardtune.GRPOTrainer`."""

    objective = "grpo"


def _plain(value: Any) -> Any:
    """A TRL object's field value as a config value: enums by their value."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def fields_of(args: Any) -> dict[str, Any]:
    """The fields a TRL / transformers arguments object sets differently from its class's defaults (its
    ``__post_init__`` applied to both alike), by name."""
    if isinstance(args, TrlConfig):
        return args.given
    if not dataclasses.is_dataclass(args):
        raise ConfigError(
            f"args {type(args).__name__}: pass shardtune's SFTConfig / DPOConfig / GRPOConfig, or TRL's SFTConfig / "
            "DPOConfig / GRPOConfig / transformers' TrainingArguments"
        )
    keep = {k: getattr(args, k) for k in ("output_dir", "use_cpu", "bf16", "fp16") if hasattr(args, k)}
    try:
        default = type(args)(**keep)
    except Exception:  # noqa: BLE001 - a class that needs more to construct: compare with the fields' own defaults
        default = None
    given: dict[str, Any] = {"output_dir": getattr(args, "output_dir", None) or DEFAULT_OUTPUT_DIR}
    for f in dataclasses.fields(args):
        if not f.init or f.name.startswith("_"):
            continue
        value = getattr(args, f.name)
        if default is not None:
            base = getattr(default, f.name)
        elif f.default is not dataclasses.MISSING:
            base = f.default
        elif f.default_factory is not dataclasses.MISSING:
            base = f.default_factory()
        else:
            base = dataclasses.MISSING
        if _plain(value) != _plain(base):
            given[f.name] = _plain(value)
        elif f.name in keep and value is not None and value != f.default:  # kept alike in the default instance
            given[f.name] = value
    return _without_derived_generation(args, given)


def _without_derived_generation(args: Any, given: dict[str, Any]) -> dict[str, Any]:
    """TRL's GRPOConfig fills in steps_per_generation / generation_batch_size from the batch and the world size when
    the script leaves them out: such values are not the script's (shardtune derives the same from its own 0s)."""
    if "generation_batch_size" not in given and "steps_per_generation" not in given:
        return given
    steps = getattr(args, "steps_per_generation", None)
    per_step = getattr(args, "per_device_train_batch_size", 0) * getattr(args, "world_size", 1)
    if steps and given.get("generation_batch_size") == per_step * steps:
        given.pop("generation_batch_size")
    if steps and steps == getattr(args, "gradient_accumulation_steps", None):
        given.pop("steps_per_generation", None)
    return given


def config_class(objective: str) -> type[TrlConfig]:
    return {"sft": SFTConfig, "dpo": DPOConfig, "grpo": GRPOConfig}[objective]
