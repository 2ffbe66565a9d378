"""Other tools' spellings of the settings, translated at the edge into the canonical config
(shardtune.config.schema): llama-cookbook's flags and shardtune's flat names of earlier releases (cookbook.py),
TRL's names with TRL's meaning (trl.py), Accelerate's config files (accelerate.py), DeepSpeed's JSON files
(deepspeed.py).

A dialect is a table of :class:`Spelling` (a name as a user types it, the canonical setting it sets, and how its
value translates, or why it is refused) and, where one of its flags means something only together with another, a
``finish`` rule that resolves them once every flag is read. Nothing in a table is accepted and ignored: a name is
translated, accepted as meaning what shardtune does anyway (said in its table), or refused in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from shardtune.config.fields import FALSE, TRUE

# A translation's settings: (canonical dotted key, typed value), or (a dialect's state key "dialect:name", value)
# for a flag whose meaning its dialect's finish rule settles with others.
Pairs = list[tuple[str, Any]]


@dataclass(frozen=True)
class Spelling:
    target: str  # the canonical setting(s) it sets, as the docs show them
    meaning: str = ""  # what it does here (docs/flags.md)
    to: Callable[[Any], Pairs] | None = None  # value -> settings; None: the value of ``target`` as it is
    refuse: str = ""  # non-empty: refused, with this reason and fix
    accepts: tuple[Any, ...] = ()  # refused: the values that ask for nothing (its tool's default), taken as no change

    @property
    def plain(self) -> bool:
        """A plain rename: the value is typed by the canonical field."""
        return self.to is None and not self.refuse

    def asks_nothing(self, value: Any) -> bool:
        """Whether a refused name's value asks for nothing: empty (None, "", [], {}: unset) or one of ``accepts``. A
        dumped config (TRL's ``to_dict()``) holds every name with its default, which must load."""
        return is_empty(value) or any(same(value, accepted) for accepted in self.accepts)


def refused(why: str, *accepts: Any) -> Spelling:
    """A name refused in one line: ``--name: why`` (``why`` ends with the fix); given an empty value or one of
    ``accepts`` (its tool's default: what asks for nothing) it is accepted as no change."""
    return Spelling("-", refuse=why, accepts=accepts)


def text(value: Any) -> str:
    """A flag's value as text (a bare flag, None, is true)."""
    return "true" if value is None else str(value).lower() if isinstance(value, bool) else str(value).strip()


def canonical(value: Any) -> Any:
    """A value as written by a command line, a YAML file or a dumped config, compared by meaning: an enum as its value
    (``IntervalStrategy.STEPS`` and "steps" alike), booleans as True / False ("yes", 1), numbers as floats, empty
    (None, "", "none", [], {}) as None."""
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, str):
        given = value.strip()
        enum_text = re.fullmatch(r"[A-Z][A-Za-z]*\.([A-Z][A-Z0-9_]*)", given)  # str() of an enum member
        lowered = (enum_text.group(1) if enum_text else given).lower()
        if lowered in ("", "none", "null"):
            return None
        if lowered in TRUE or lowered in FALSE:
            return lowered in TRUE
        try:
            return float(lowered)
        except ValueError:
            return lowered
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value] or None
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()} or None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def is_empty(value: Any) -> bool:
    return canonical(value) is None


def same(value: Any, other: Any) -> bool:
    """Whether two values mean the same (:func:`canonical`)."""
    return canonical(value) == canonical(other)


def placeholder(name: str, value: Any) -> bool:
    """transformers' ``TrainingArguments.to_dict()`` (what a dumped SFTConfig / DPOConfig holds) writes every field
    whose name ends in ``_token`` as ``<NAME>``, hiding its value: such a value says nothing."""
    return name.endswith("_token") and value == f"<{name.upper()}>"
