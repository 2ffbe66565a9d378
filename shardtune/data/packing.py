"""Packing: which examples share a block of at most ``context_length`` tokens. Every strategy lives here, used by the
engine (shardtune.data.batching.build_units, shardtune.data.streaming) and by :func:`pack_dataset` (TRL's public
function, on `datasets` data), so that the two cannot drift apart.

- ``greedy`` (llama-cookbook's recipe; the cookbook names' default): whole examples in an order seeded by
  ``train.seed``, each added to the open block until the next does not fit, which then opens a new block.
- ``bfd`` (TRL's default): best-fit decreasing. Examples are taken longest first (equal lengths in data order); each
  goes into the open block with the least free space that still holds it (of equal ones, the first to have that
  space), else into a new block. Rows longer than ``context_length`` are cut (TRL keeps their start).
- ``bfd_split``: ``bfd`` over the pieces of rows longer than ``context_length``, cut into ``context_length`` tokens
  from the row's start (the last piece shorter) instead of truncated; each piece is a sequence of its own.
- ``wrapped``: the rows are concatenated and cut into blocks of exactly ``context_length`` tokens. A block is one
  sequence: the examples in it attend to the ones before them, and an example cut by a block's end continues in the
  next block without seeing its beginning. Labels travel with their tokens (a prompt's -100 stays -100); a block's
  first token is never predicted (nothing precedes it in its row).

In ``greedy``, ``bfd`` and ``bfd_split`` no example attends to another (padding-free rows with per-example
boundaries). TRL packs with ``datasets.Dataset.map(batched=True)``, whose batches hold :data:`MAP_BATCH_ROWS` rows:
every batch is packed on its own (``wrapped``: the last block of each batch is shorter). The engine packs its
examples in data order by the same batches, so its blocks are TRL's (TRL with ``dataset_num_proc`` unset; with N
processes TRL packs N contiguous shards apart). The blocks depend on the data alone (and the seed, for ``greedy``),
never on the number of processes.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shardtune.config.schema import ConfigError, TrainConfig

# datasets.Dataset.map's default batch size: TRL's pack_dataset packs each batch of this many rows on its own
MAP_BATCH_ROWS = 1000
TRL_STRATEGIES = ("bfd", "bfd_split", "wrapped")  # pack_dataset's (TRL 1.16's)
WHOLE_ROW_STRATEGIES = ("bfd_split", "wrapped")  # keep rows longer than context_length whole: they split them

Example = Mapping[str, Any]
Unit = list[Example]


# -- the algorithms, on lengths ---------------------------------------------------------------------------------------


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices into ``lengths`` (each in (0, capacity]), in the order they were opened, each bin's indices in
    the order they went in: longest first (a stable sort: equal lengths in index order), each into the bin with the
    least free space that holds it (bins with the same free space: the first to have had it), else a new bin."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[int] = []  # the distinct free spaces of open bins, ascending
    holders: dict[int, deque[int]] = {}  # free space -> the bins that have it, first come first
    for index in order:
        length = int(lengths[index])
        assert 0 < length <= capacity, f"length {length} outside (0, {capacity}]"
        at = bisect_left(free, length)
        if at < len(free):
            space = free[at]
            chosen = holders[space].popleft()
            if not holders[space]:
                del holders[space], free[at]
        else:
            space, chosen = capacity, len(bins)
            bins.append([])
        bins[chosen].append(index)
        left = space - length
        if left > 0:
            if left not in holders:
                holders[left] = deque()
                insort(free, left)
            holders[left].append(chosen)
    return bins


def row_pieces(length: int, capacity: int) -> list[tuple[int, int]]:
    """(start, end) of the pieces ``bfd_split`` cuts a row into: ``capacity`` tokens each from its start, the last
    one shorter."""
    return [(start, min(start + capacity, length)) for start in range(0, length, capacity)]


def wrapped_spans(total: int, capacity: int) -> list[tuple[int, int]]:
    """(start, end) of the blocks ``wrapped`` cuts ``total`` concatenated tokens into; the last one shorter."""
    return [(start, min(start + capacity, total)) for start in range(0, total, capacity)]


def map_batches(num_rows: int, rows: int = MAP_BATCH_ROWS) -> Iterator[range]:
    """The batches of rows TRL packs apart (datasets.Dataset.map's batches)."""
    for start in range(0, num_rows, rows):
        yield range(start, min(start + rows, num_rows))


# -- the engine's units -----------------------------------------------------------------------------------------------


class TokenSlice(Mapping):
    """Tokens ``[start, end)`` of flat ``input_ids`` / ``labels`` arrays (a wrapped block, a piece of a split row): an
    example as a cached one (shardtune.data.cache.ExampleView) is, its lists read when asked, ``length`` without."""

    __slots__ = ("_input_ids", "_labels", "_start", "_end")

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, start: int, end: int):
        self._input_ids, self._labels, self._start, self._end = input_ids, labels, start, end

    @property
    def length(self) -> int:
        return self._end - self._start

    def __getitem__(self, key: str) -> list[int]:
        if key == "input_ids":
            return self._input_ids[self._start : self._end].tolist()
        if key == "labels":
            return self._labels[self._start : self._end].tolist()
        raise KeyError(key)

    def __iter__(self):
        return iter(("input_ids", "labels"))

    def __len__(self) -> int:
        return 2

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    def __repr__(self) -> str:
        return repr(dict(self.items()))


def _length(example: Example) -> int:
    length = getattr(example, "length", None)
    return length if length is not None else len(example["input_ids"])


def _row_lengths(examples: Sequence[Example], rows: range) -> np.ndarray:
    offsets = getattr(examples, "offsets", None)  # a TokenStore's: no token read
    if offsets is not None:
        return np.diff(np.asarray(offsets[rows.start : rows.stop + 1], dtype=np.int64))
    return np.fromiter((_length(examples[i]) for i in rows), dtype=np.int64, count=len(rows))


def _flat(examples: Sequence[Example], rows: range) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``rows``' tokens back to back (input_ids, labels) and where each row starts in them (len(rows) + 1 offsets): a
    TokenStore's own memory-mapped arrays (nothing copied), else the lists concatenated."""
    offsets = getattr(examples, "offsets", None)
    if offsets is not None and hasattr(examples, "input_ids"):
        return examples.input_ids, examples.labels, np.asarray(offsets[rows.start : rows.stop + 1], dtype=np.int64)
    chosen = [examples[i] for i in rows]
    starts = np.zeros(len(chosen) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([_length(e) for e in chosen])
    if not chosen:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, starts
    input_ids = np.concatenate([np.asarray(e["input_ids"], dtype=np.int64) for e in chosen])
    labels = np.concatenate([np.asarray(e["labels"], dtype=np.int64) for e in chosen])
    return input_ids, labels, starts


def greedy_blocks(examples: Sequence[Example], context_length: int, seed: int) -> list[Unit]:
    """Greedy packing in an order seeded by ``seed`` alone (the same blocks every epoch and world size).

    Whole examples fill the current block until the next one does not fit; then a new block opens. An example is never
    split across blocks (the loader has already skipped or cut those longer than context_length).
    """
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    blocks: list[Unit] = []
    block: Unit = []
    used = 0
    for index in order:
        example = examples[index]
        length = _length(example)
        assert length <= context_length, "the loader skips or cuts examples longer than context_length"
        if block and used + length > context_length:
            blocks.append(block)
            block, used = [], 0
        block.append(example)
        used += length
    if block:
        blocks.append(block)
    return blocks


def batch_blocks(examples: Sequence[Example], rows: range, strategy: str, context_length: int) -> list[Unit]:
    """The blocks TRL's ``strategy`` makes of one batch of rows (``examples[rows]``, in data order)."""
    lengths = _row_lengths(examples, rows)
    if strategy == "bfd":
        if len(lengths) and lengths.max() > context_length:
            raise ValueError(f"an example of {lengths.max()} tokens > context_length {context_length}: cut it first")
        bins = best_fit_decreasing(lengths.tolist(), context_length)
        return [[examples[rows[i]] for i in chosen] for chosen in bins]
    input_ids, labels, starts = _flat(examples, rows)
    if strategy == "wrapped":
        first = int(starts[0])
        return [
            [TokenSlice(input_ids, labels, first + a, first + b)]
            for a, b in wrapped_spans(int(starts[-1] - first), context_length)
        ]
    if strategy == "bfd_split":
        pieces = [
            examples[row] if b - a == length else TokenSlice(input_ids, labels, int(start) + a, int(start) + b)
            for row, start, length in zip(rows, starts, lengths.tolist())
            for a, b in row_pieces(length, context_length)
        ]
        bins = best_fit_decreasing([_length(piece) for piece in pieces], context_length)
        return [[pieces[i] for i in chosen] for chosen in bins]
    raise ValueError(f"packing strategy {strategy!r} is not one of {TRL_STRATEGIES}")


def pack_examples(examples: Sequence[Example], strategy: str, context_length: int, seed: int) -> list[Unit]:
    """The blocks of ``examples`` (in data order) under ``strategy``; TRL's strategies batch by batch of
    :data:`MAP_BATCH_ROWS` rows, as TRL's pack_dataset does."""
    if strategy == "greedy":
        return greedy_blocks(examples, context_length, seed)
    return [
        block for rows in map_batches(len(examples)) for block in batch_blocks(examples, rows, strategy, context_length)
    ]


def whole_rows(cfg: TrainConfig) -> bool:
    """Whether the loader keeps rows longer than context_length whole (bfd_split and wrapped split them, as TRL does:
    it cuts no row before packing) instead of cutting (TRL's formats) or skipping them (the cookbook's datasets)."""
    return cfg.data.batching == "packing" and cfg.data.packing_strategy in WHOLE_ROW_STRATEGIES


def row_limit(cfg: TrainConfig) -> int:
    """The longest example the loader keeps as it is: context_length, or no limit when packing splits rows."""
    return np.iinfo(np.int64).max if whole_rows(cfg) else cfg.data.context_length


def eval_examples(examples: Sequence[Example], cfg: TrainConfig) -> Sequence[Example]:
    """What evaluation computes, each alone: the examples, or with whole rows the sequences packing makes of them
    (wrapped: its blocks; bfd_split: the pieces of each row, in row order), as TRL evaluates packed data (its
    eval_packing follows packing). An example alone has the loss it has in a bfd / greedy block."""
    if not whole_rows(cfg):
        return examples
    limit, out = cfg.data.context_length, []
    for rows in map_batches(len(examples)):
        if cfg.data.packing_strategy == "wrapped":
            out += [unit[0] for unit in batch_blocks(examples, rows, "wrapped", limit)]
            continue
        input_ids, labels, starts = _flat(examples, rows)
        for row, start, end in zip(rows, starts.tolist(), starts[1:].tolist()):
            pieces = row_pieces(end - start, limit)
            if len(pieces) == 1:
                out.append(examples[row])
            else:
                out += [TokenSlice(input_ids, labels, start + a, start + b) for a, b in pieces]
    return out


def check_packing(cfg: TrainConfig) -> None:
    """A packing strategy named where nothing is packed is refused (TRL's default, bfd, which a dumped TRL config
    holds, asks for nothing)."""
    spelled = cfg.provenance.spelled
    if cfg.data.batching == "packing" or "data.packing_strategy" not in spelled or cfg.data.packing_strategy == "bfd":
        return
    raise ConfigError(
        f"--{spelled['data.packing_strategy']} {cfg.data.packing_strategy} has no effect without packing: add "
        "--packing true (--batching_strategy packing), or drop the flag"
    )


# -- TRL's pack_dataset, on `datasets` data ---------------------------------------------------------------------------


def pack_dataset(dataset: Any, seq_length: int, strategy: str = "bfd", map_kwargs: dict[str, Any] | None = None) -> Any:
    """TRL 1.16's ``trl.pack_dataset``: the rows of ``dataset`` (a ``datasets`` Dataset or DatasetDict of list columns
    of equal lengths row by row, e.g. ``input_ids`` and ``labels``) packed into rows of at most ``seq_length`` tokens
    by ``strategy`` (bfd, bfd_split or wrapped; see the module's docstring), with the same rows and columns as TRL's:
    bfd and bfd_split add ``seq_lengths`` (each packed row's sequences, for position ids that restart per sequence).
    ``map_kwargs`` go to ``dataset.map`` (``batch_size``: the rows packed together, 1,000 by default; ``num_proc``).
    The engine packs with the same functions (:func:`pack_examples`), so a training run's blocks are these rows."""
    if strategy not in TRL_STRATEGIES:
        raise ValueError(f"packing strategy {strategy!r} is not one of {', '.join(TRL_STRATEGIES)}")
    form = _format_of(dataset)
    packed = dataset.with_format("arrow").map(
        _pack_table, batched=True, fn_kwargs={"seq_length": seq_length, "strategy": strategy}, **(map_kwargs or {})
    )
    if strategy != "wrapped" and "columns" in form:
        form["columns"] = [*form["columns"], "seq_lengths"]
    return packed.with_format(**form)


def _format_of(dataset: Any) -> dict[str, Any]:
    """The output format to give back (type, columns, its keyword arguments), as ``with_format`` takes it."""
    first = dataset[next(iter(dataset))] if isinstance(dataset, dict) else dataset
    if hasattr(first, "format"):  # a Dataset
        form = dict(first.format)
    else:  # an IterableDataset
        formatting = getattr(first, "_formatting", None)
        form = {"type": formatting.format_type if formatting is not None else None}
    form.update(form.pop("format_kwargs", {}) or {})
    return form


def _list_columns(table: Any) -> list[Any]:
    """The table's columns as single arrays, checked: every column a list column whose rows have the same lengths as
    the first's (the tokens and what is aligned with them)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = [column.combine_chunks() for column in table.columns]
    for name, column in zip(table.column_names, columns):
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise TypeError(
                f"packing needs list columns (token ids and what aligns with them); {name} is {column.type}"
            )
        if not pc.equal(pc.list_value_length(column), pc.list_value_length(columns[0])).to_numpy(False).all():
            raise ValueError(
                f"column {name}'s rows are not as long as {table.column_names[0]}'s: they cannot be packed"
            )
    return columns


def _relisted(column: Any, offsets: np.ndarray, values: Any) -> Any:
    """A list column of the same list type over ``values``, its rows cut at ``offsets``."""
    return type(column).from_arrays(offsets.astype(column.offsets.type.to_pandas_dtype()), values)


def _pack_table(table: Any, seq_length: int, strategy: str) -> Any:
    """One map batch (an Arrow table) packed: the same columns, one row per block (+ seq_lengths but for wrapped)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = _list_columns(table)
    if strategy == "wrapped":
        total = len(columns[0].flatten())
        offsets = np.array([start for start, _ in wrapped_spans(total, seq_length)] + [total], dtype=np.int64)
        return pa.Table.from_arrays([_relisted(c, offsets, c.flatten()) for c in columns], names=table.column_names)
    lengths = pc.list_value_length(columns[0]).to_numpy(False)
    if not lengths.all():  # empty rows hold nothing to pack
        columns = [c.filter(pa.array(lengths > 0)) for c in columns]
    if strategy == "bfd":
        columns = [pc.list_slice(c, 0, seq_length) for c in columns]
    else:  # bfd_split: every row cut into pieces of seq_length tokens, each a row of its own
        ends = np.cumsum(pc.list_value_length(columns[0]).to_numpy(False), dtype=np.int64)
        starts = ends - pc.list_value_length(columns[0]).to_numpy(False)
        cuts = [s + a for s, e in zip(starts.tolist(), ends.tolist()) for a, _ in row_pieces(e - s, seq_length)]
        offsets = np.array([*cuts, int(ends[-1]) if len(ends) else 0], dtype=np.int64)
        columns = [_relisted(c, offsets, c.flatten()) for c in columns]
    lengths = pc.list_value_length(columns[0])
    bins = best_fit_decreasing(lengths.to_numpy(False).tolist(), seq_length)
    order = pa.array([i for chosen in bins for i in chosen], type=pa.int64())
    taken = [c.take(order) for c in columns]
    sizes = np.asarray(lengths.take(order).to_numpy(False), dtype=np.int64)
    per_bin = np.cumsum([0, *(len(chosen) for chosen in bins)], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])[per_bin]
    packed = [_relisted(c, offsets, t.flatten()) for c, t in zip(columns, taken)]
    seq_lengths = pa.ListArray.from_arrays(per_bin.astype(np.int32), lengths.take(order))
    return pa.Table.from_arrays([*packed, seq_lengths], names=[*table.column_names, "seq_lengths"])
