"""The config's fields as a flat table (``"optim.lr"`` -> its type and metadata), values read and set by that dotted
name, and a value typed by its field (from a command line's text or a YAML file's value)."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any, NamedTuple, get_type_hints

from shardtune.config.schema import ConfigError, TrainConfig


class FieldInfo(NamedTuple):
    key: str  # dotted canonical name
    type: Any  # the annotation (int, float, str, bool, list[str], list[float], float | None, ...)
    field: dataclasses.Field

    @property
    def meta(self) -> typing.Mapping[str, Any]:
        return self.field.metadata

    @property
    def default(self) -> Any:
        return field_default(self.field)

    @property
    def affects(self) -> str:
        return self.meta.get("affects", "training")


@functools.cache
def flat_fields(cls: type = TrainConfig, prefix: str = "") -> dict[str, FieldInfo]:
    """Every leaf setting of ``cls``, by dotted name, in declaration order."""
    out: dict[str, FieldInfo] = {}
    hints = get_type_hints(cls)
    for f in fields(cls):
        if not is_setting(f):
            continue
        typ = hints[f.name]
        if isinstance(typ, type) and is_dataclass(typ):
            out.update(flat_fields(typ, prefix + f.name + "."))
        else:
            out[prefix + f.name] = FieldInfo(prefix + f.name, typ, f)
    return out


def is_setting(f: dataclasses.Field) -> bool:
    """Whether a config field is a setting (TrainConfig.provenance is not: how the settings were given)."""
    return f.metadata.get("setting", True)


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is dataclasses.MISSING:
        raise TypeError(f"the config field {f.name} has no default")
    return f.default_factory()


def get_value(cfg: Any, key: str) -> Any:
    target = cfg
    for part in key.split("."):
        target = getattr(target, part)
    return target


def set_value(cfg: Any, key: str, value: Any) -> None:
    *owners, name = key.split(".")
    target = cfg
    for owner in owners:
        target = getattr(target, owner)
    setattr(target, name, value)


def optional(typ: Any) -> tuple[Any, bool]:
    """(the type inside ``X | None``, whether None is allowed)."""
    if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union:
        inner = [a for a in typing.get_args(typ) if a is not type(None)]
        return inner[0], True
    return typ, False


def is_list(typ: Any) -> bool:
    return typing.get_origin(typ) is list


TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def typed(name: str, typ: Any, raw: Any) -> Any:
    """``raw`` as a value of ``typ``: text from a command line is parsed, a YAML value is checked. ``name`` is the flag
    as given, for the one-line error."""
    typ, nullable = optional(typ)
    if nullable and (raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "null", ""))):
        return None
    if is_list(typ):
        item = typing.get_args(typ)[0]
        if isinstance(raw, str):
            return [typed(name, item, part.strip()) for part in raw.split(",") if part.strip()]
        if isinstance(raw, (list, tuple)):
            return [typed(name, item, part) for part in raw]
        if item is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return [float(raw)]
        raise ConfigError(
            f"--{name} {raw!r} is not a list: pass values one after another, comma-separated, or a YAML list"
        )
    if isinstance(raw, str):
        text = raw.strip()
        if typ is bool:
            if text.lower() in TRUE:
                return True
            if text.lower() in FALSE:
                return False
            raise ConfigError(f"--{name} {raw!r} is not a boolean: use true or false")
        if typ is int:
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"--{name} {raw!r} is not an integer: pass a whole number") from None
        if typ is float:
            try:
                return float(text)
            except ValueError:
                raise ConfigError(f"--{name} {raw!r} is not a number: pass e.g. 1e-4") from None
        return raw
    if typ is bool and not isinstance(raw, bool):
        raise ConfigError(f"--{name} {raw!r} is not a boolean: use true or false")
    if typ is int and (isinstance(raw, bool) or not isinstance(raw, int)):
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        raise ConfigError(f"--{name} {raw!r} is not an integer: pass a whole number")
    if typ is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(f"--{name} {raw!r} is not a number: pass e.g. 1e-4")
        return float(raw)
    if typ is str:
        return str(raw).lower() if isinstance(raw, bool) else str(raw)
    return raw


def flatten_dict(data: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested config mappings as dotted names."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(flatten_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def settings_by(predicate) -> frozenset[str]:
    """The dotted names of the fields whose metadata satisfies ``predicate`` (a FieldInfo -> bool)."""
    return frozenset(key for key, info in flat_fields().items() if predicate(info))
