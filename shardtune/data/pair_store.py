"""A split's tokenised preference pairs as they lie in the cache, memory-mapped by every rank (shardtune dpo).

Each of a pair's token fields (``prompt_ids``, ``chosen_ids``, ``rejected_ids``) is one flat int32 array, the pairs'
tokens back to back, with its offsets. Every process of a run maps the same files, so the pairs are in the page cache
once per machine, not once per process as lists of ints (~72 bytes a token, three sequences a pair); a process holds
the offsets. Item ``i`` is a :class:`PairView`: its fields read from the maps as lists when asked for, its length
without reading them, and what the run adds to a pair (its ``index``, precomputed ``ref_logps``) kept by the store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

PAIR_FIELDS = ("prompt_ids", "chosen_ids", "rejected_ids")
MARGIN = "margin"  # whole pairs' (a reward model's): TRL's margin column, one float64 per pair in margin.npy


class PairStore(Sequence):
    def __init__(self, entry: Path):
        self.tokens = {name: np.load(entry / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in PAIR_FIELDS}
        self.offsets = {name: np.load(entry / f"{name}_offsets.npy", allow_pickle=False) for name in PAIR_FIELDS}
        counts = {len(offsets) - 1 for offsets in self.offsets.values()}
        if len(counts) != 1:
            raise ValueError(f"{entry}: the pair fields hold different numbers of pairs ({sorted(counts)})")
        for name in PAIR_FIELDS:
            offsets = self.offsets[name]
            if offsets.ndim != 1 or offsets[-1] != len(self.tokens[name]):
                raise ValueError(
                    f"{entry}: {name} offsets end at {offsets[-1]}, its array holds {len(self.tokens[name])}"
                )
        self.count = counts.pop()
        margins = entry / f"{MARGIN}.npy"
        self.margins = np.load(margins, allow_pickle=False) if margins.is_file() else None
        if self.margins is not None and self.margins.shape != (self.count,):
            raise ValueError(f"{entry}: {len(self.margins)} margins for {self.count} pairs")
        self.added: dict[str, list] = {}  # keys the run sets on pairs -> one value per pair (None: not set)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(self.count)[index]  # negative indices, IndexError
        return PairView(self, index)

    def field(self, name: str, index: int) -> list[int]:
        offsets = self.offsets[name]
        return self.tokens[name][offsets[index] : offsets[index + 1]].tolist()

    def field_length(self, name: str, index: int) -> int:
        offsets = self.offsets[name]
        return int(offsets[index + 1] - offsets[index])

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))


class PairView(Mapping):
    """Pair ``index`` of a PairStore: equal to a dict of the same fields (and of what the run set on it)."""

    __slots__ = ("_store", "_index")

    def __init__(self, store: PairStore, index: int):
        self._store, self._index = store, index

    @property
    def length(self) -> int:
        """The tokens of its longer sequence: the prompt and the longer completion."""
        store, i = self._store, self._index
        return store.field_length("prompt_ids", i) + max(
            store.field_length("chosen_ids", i), store.field_length("rejected_ids", i)
        )

    def __getitem__(self, key: str) -> Any:
        if key in PAIR_FIELDS:
            return self._store.field(key, self._index)
        if key == MARGIN and self._store.margins is not None:
            return float(self._store.margins[self._index])
        value = self._store.added.get(key, ())
        if not value or value[self._index] is None:
            raise KeyError(key)
        return value[self._index]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in PAIR_FIELDS or key == MARGIN:
            raise TypeError(f"a cached pair's {key} is read-only")
        self._store.added.setdefault(key, [None] * len(self._store))[self._index] = value

    def __iter__(self):
        added = [k for k, values in self._store.added.items() if values[self._index] is not None]
        margin = (MARGIN,) if self._store.margins is not None else ()
        return iter((*PAIR_FIELDS, *margin, *added))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    def __repr__(self) -> str:
        return repr(dict(self.items()))
