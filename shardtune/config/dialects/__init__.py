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

from dataclasses import dataclass
from typing import Any, Callable

# A translation's settings: (canonical dotted key, typed value), or (a dialect's state key "dialect:name", value)
# for a flag whose meaning its dialect's finish rule settles with others.
Pairs = list[tuple[str, Any]]


@dataclass(frozen=True)
class Spelling:
    target: str  # the canonical setting(s) it sets, as the docs show them
    meaning: str = ""  # what it does here (docs/flags.md)
    to: Callable[[Any], Pairs] | None = None  # value -> settings; None: the value of ``target`` as it is
    refuse: str = ""  # non-empty: refused, with this reason and fix

    @property
    def plain(self) -> bool:
        """A plain rename: the value is typed by the canonical field."""
        return self.to is None and not self.refuse


def refused(why: str) -> Spelling:
    """A name refused in one line: ``--name: why`` (``why`` ends with the fix)."""
    return Spelling("-", refuse=why)


def text(value: Any) -> str:
    """A flag's value as text (a bare flag, None, is true)."""
    return "true" if value is None else str(value).lower() if isinstance(value, bool) else str(value).strip()
