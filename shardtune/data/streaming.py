"""Streaming (--dataset_streaming, TRL's name): rows are read, tokenised and batched as the steps need them.

Nothing is tokenised before launch but the first row (its format); the first step waits for its own rows only.
The rule that makes a run the same on any layout is the non-streaming one (shardtune.data.batching), with the
stream's order in place of the epoch's permutation:

1. The rows, in the stream's order, become examples (TRL's formats: shardtune.data.trl_formats), the examples
   become units: one example each (padding), or blocks (packing; TRL packs a streamed dataset too): greedy fills
   blocks of whole examples in stream order until the next one does not fit; TRL's strategies (bfd, bfd_split,
   wrapped) pack each 1,000 examples of the stream as TRL's pack_dataset does (shardtune.data.packing).
2. Optimizer step s trains on units [s x G, (s + 1) x G) of that sequence (G: the effective batch); with padding
   sorted by length, as rule 3; cut into micro-batches as rule 4. Units depend on the data, context_length and the
   packing choice only, so 1 x 4, 2 x 2 and 1 process with accumulation 4 train on the same global batches.
3. When the stream ends, a last partial global batch is dropped and the stream starts again (the next pass).

Every rank reads and tokenises the rows of every global batch (what accelerate's IterableDatasetShard does) and
keeps its own micro-batches: the ranks' shares are disjoint, and each knows where the next step's rows start. That
position (shardtune.data.stream_rows, plus the pass and the examples seen) travels with each step into the
checkpoint, and resuming opens the stream there: the rows before it are not read again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from shardtune.config.objectives import registration
from shardtune.config.schema import ConfigError, TrainConfig, effective_batch_size
from shardtune.data.batching import RowTransform, collate, unit_length
from shardtune.data.chat import check_chat_template
from shardtune.data.packing import MAP_BATCH_ROWS, batch_blocks
from shardtune.data.report import DataReport, RowFilter
from shardtune.data.stream_rows import START, RowStream
from shardtune.data.trl_formats import prepare_rows
from shardtune.data.trl_loading import loss_options, recognise_rows

FIRST_POSITION: dict = {"pass": 0, "rows": START, "examples": 0}  # + "units": the units of the rows' batch done


def check_streaming(cfg: TrainConfig) -> None:
    """Before launch: what streaming needs (TRL's rule: --max_steps, as the stream's length is unknown)."""
    if not cfg.data.streaming:
        return
    if cfg.data.dataset != "trl_dataset":
        raise ConfigError(
            f"--dataset_streaming true streams --dataset_name data; --dataset {cfg.data.dataset} is generated or read "
            "whole: pass --dataset_name, or drop --dataset_streaming"
        )
    if not registration(cfg.objective).streams:
        raise ConfigError(
            f"--dataset_streaming true: streamed data trains shardtune sft; shardtune {cfg.objective}'s data is "
            "prepared before launch: drop --dataset_streaming"
        )
    if cfg.train.max_steps <= 0:
        raise ConfigError(
            "--dataset_streaming true needs --max_steps (a stream's length is unknown, so epochs cannot be "
            "counted; TRL requires it too): pass --max_steps N"
        )


class StreamSource:
    """What every rank holds of a streamed training split: the stream and its recognised format; no row."""

    def __init__(self, cfg: TrainConfig, tokenizer: Any):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.stream = RowStream(cfg, cfg.data.trl_dataset.dataset_train_split)
        columns, first = self.stream.first()
        self.columns = columns
        self.fmt = recognise_rows(cfg, columns, first)
        if self.fmt.conversational:
            check_chat_template(cfg, tokenizer, f"{self.stream.describe()} ({self.fmt.describe()})")
        self.options = loss_options(cfg)

    def describe(self) -> str:
        return f"{self.stream.describe()}: {self.fmt.describe()}"

    def examples(self, position: dict, report: DataReport) -> Iterator[tuple[dict, dict]]:
        """(example, the position of its row) from ``position`` (a stream position) to the stream's end."""
        filt = RowFilter(report, self.cfg.data.strict)
        for row, where in self.stream.rows(position):
            report.num_rows += 1
            for example in prepare_rows([row], self.fmt, self.columns, self.tokenizer, self.options, filt, report):
                report.num_examples += 1
                yield example, where

    def units(self, position: dict, report: DataReport, done: int = 0) -> Iterator[tuple[list[dict], dict, int]]:
        """(unit, the stream position it is made from, the units made from there before it) from ``position``, less
        the first ``done`` units made there: one example each with padding, blocks of at most context_length tokens
        with packing (greedy: from the position of its first row; TRL's strategies: of its batch's first row)."""
        if self.cfg.data.batching == "padding":
            for example, where in self.examples(position, report):
                yield [example], where, 0
            return
        if self.cfg.data.packing_strategy != "greedy":
            yield from self._batch_units(position, report, done)
            return
        limit, block, used, start = self.cfg.data.context_length, [], 0, None
        for example, where in self.examples(position, report):
            length = len(example["input_ids"])
            if block and used + length > limit:
                yield block, start, 0
                block, used = [], 0
            if not block:
                start = where
            block.append(example)
            used += length
        if block:
            yield block, start, 0

    def _batch_units(self, position: dict, report: DataReport, done: int) -> Iterator[tuple[list[dict], dict, int]]:
        """TRL's strategies: the blocks of each MAP_BATCH_ROWS examples, the first ``done`` of the first batch left
        out (a resumed run reads that batch's rows again and skips the blocks already trained on)."""
        batch, start = [], position
        strategy, limit = self.cfg.data.packing_strategy, self.cfg.data.context_length
        for example, where in self.examples(position, report):
            if not batch:
                start = where
            batch.append(example)
            if len(batch) == MAP_BATCH_ROWS:
                units = batch_blocks(batch, range(len(batch)), strategy, limit)
                yield from ((unit, start, k) for k, unit in enumerate(units) if k >= done)
                batch, done = [], 0
        if batch:
            units = batch_blocks(batch, range(len(batch)), strategy, limit)
            yield from ((unit, start, k) for k, unit in enumerate(units) if k >= done)


def streamed_examples(cfg: TrainConfig, tokenizer: Any) -> tuple[list[dict], DataReport]:
    """A streamed run's evaluation split (--dataset_test_split), read whole through the stream (an evaluation split
    is small; the train split is never loaded as a whole)."""
    stream = RowStream(cfg, cfg.data.trl_dataset.dataset_test_split)
    columns, first = stream.first()
    fmt = recognise_rows(cfg, columns, first)
    report = DataReport(source=f"{stream.describe()}: {fmt.describe()}")
    rows = [row for row, _ in stream.rows()]
    report.num_rows = len(rows)
    filt = RowFilter(report, cfg.data.strict)
    examples = prepare_rows(rows, fmt, columns, tokenizer, loss_options(cfg), filt, report)
    report.num_examples = len(examples)
    return examples, report


class StreamSteps:
    """Yields (this rank's micro-batches of a step, the data position after that step) from ``position``."""

    def __init__(
        self,
        source: StreamSource,
        dp_rank: int,
        dp_size: int,
        pad_id: int,
        position: dict,
        row_slice: RowTransform | None = None,
    ):
        self.source, self.cfg, self.dp_rank, self.dp_size, self.pad_id = source, source.cfg, dp_rank, dp_size, pad_id
        self.position, self.row_slice = dict(position), row_slice

    def __iter__(self) -> Iterator[tuple[list[dict], dict]]:
        size = effective_batch_size(self.cfg, self.dp_size)
        position = dict(self.position)
        while True:  # passes over the stream
            report = DataReport(source=self.source.describe())
            batch: list[list[dict]] = []
            first = examples = position["examples"]  # the global index of the batch's first example, of the next
            stepped = False
            for unit, where, done in self.source.units(position["rows"], report, position.get("units", 0)):
                if len(batch) == size:  # ``unit`` starts the next step: its row is where that step's data begins
                    position = {"pass": position["pass"], "rows": where, "examples": examples, "units": done}
                    yield self._micro_batches(batch, first), position
                    batch, first, stepped = [], examples, True
                batch.append(unit)
                examples += len(unit)
            if len(batch) == size:
                position = {"pass": position["pass"] + 1, "rows": START, "examples": examples}
                yield self._micro_batches(batch, first), position
                continue
            if not stepped and position["rows"] == START:  # a whole pass gives no step
                raise _too_small(self.cfg, self.dp_size, len(batch), self.source.describe())
            position = {"pass": position["pass"] + 1, "rows": START, "examples": first}  # the partial batch dropped

    def _micro_batches(self, units: list[list[dict]], first_example: int) -> list[dict]:
        """Rules 3 and 4 of shardtune.data.batching on the global batch ``units``, whose first example is the
        stream's ``first_example``-th (the LoRA dropout masks' example ids)."""
        cfg = self.cfg
        first_ids = [first_example]
        for unit in units[:-1]:
            first_ids.append(first_ids[-1] + len(unit))
        order = list(range(len(units)))
        if cfg.data.batching == "padding":  # rule 3: similar lengths together
            order.sort(key=lambda i: (unit_length(units[i]), i))
        micro_batches = []
        for micro_step in range(cfg.train.gradient_accumulation_steps):
            index = micro_step * self.dp_size + self.dp_rank
            chosen = order[index * cfg.train.batch_size : (index + 1) * cfg.train.batch_size]
            ids = [first_ids[i] + j for i in chosen for j in range(len(units[i]))]
            micro = collate([units[i] for i in chosen], cfg, self.pad_id, ids)
            micro_batches.append(micro if self.row_slice is None else self.row_slice(micro, self.pad_id))
        return micro_batches


def _too_small(cfg: TrainConfig, dp_size: int, units: int, source: str) -> ConfigError:
    what = "packed blocks" if cfg.data.batching == "packing" else "examples"
    return ConfigError(
        f"{source}: the whole stream holds {units} {what}, fewer than one effective batch "
        f"({effective_batch_size(cfg, dp_size)}: batch_size_training {cfg.train.batch_size} x {dp_size} data-parallel "
        f"processes x gradient_accumulation_steps {cfg.train.gradient_accumulation_steps}): add data or lower them"
    )


def stream_steps(
    source: StreamSource,
    dp_rank: int,
    dp_size: int,
    pad_id: int,
    position: dict | None,
    row_slice: RowTransform | None = None,
) -> Iterator[tuple[list[dict], dict]]:
    """Steps from ``position`` (None: the stream's start), read in the training process: a step's rows are a few
    milliseconds of tokenising, and a data error stays one line (--strict_data names the row)."""
    return iter(StreamSteps(source, dp_rank, dp_size, pad_id, position or FIRST_POSITION, row_slice))
