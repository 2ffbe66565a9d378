"""Value helpers of the TRL dialect's tables (trl.py, trl_trainer.py, trl_sharding.py): booleans and mappings as a
command line, a YAML file or a dumped TRL config writes them, and the two kinds of accepted-as-is names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardtune.config.dialects import Pairs, Spelling, canonical, is_empty, same, text
from shardtune.config.schema import ConfigError

# the state keys of trl_trainer.py's and trl_sharding.py's names, settled by trl_trainer.finish
STATE = "trainer:"


def _given(value: Any) -> Any:
    return True if value is None else value  # a translation's None is a bare flag: a switch turned on


def _bool(name: str, value: Any) -> bool:
    given = canonical(_given(value))
    if not isinstance(given, bool):
        raise ConfigError(f"--{name} {value!r} is not a boolean: use true or false")
    return given


def _shown(value: Any) -> str:
    return text(value) if not isinstance(value, (list, dict)) else json.dumps(value)


def only(name: str, accepted: tuple[Any, ...], meaning: str, why: str) -> Spelling:
    """A name accepted with the values (or none) that mean what shardtune does (``meaning``); any other is refused as
    ``--name value: why`` (``why`` ends with the fix)."""

    def to(value: Any) -> Pairs:
        given = _given(value)
        if is_empty(given) or any(same(given, a) for a in accepted):
            return []
        raise ConfigError(f"--{name} {_shown(given)}: {why}")

    return Spelling("-", meaning, to)


def no_effect(meaning: str) -> Spelling:
    """A name that changes nothing here, whatever its value (``meaning`` says what shardtune does)."""
    return Spelling("-", meaning, lambda value: [])


def _mapping(name: str, value: Any, example: str) -> dict[str, Any]:
    """A mapping: a YAML mapping, a JSON object, or a JSON file's path (empty: no keys)."""
    if is_empty(value):
        return {}
    if isinstance(value, str):
        path = Path(value).expanduser()
        try:
            value = json.loads(path.read_text(encoding="utf-8") if path.suffix == ".json" else value)
        except OSError as e:
            raise ConfigError(f"--{name} {value}: cannot read it ({e.strerror}): pass an existing JSON file") from None
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict):
        raise ConfigError(f"--{name} {value!r} is not a mapping: pass a JSON file or a mapping such as '{example}'")
    return value


def gpus_visible() -> bool:
    from shardtune.runtime.distributed import local_gpu_count

    return local_gpu_count() > 0
