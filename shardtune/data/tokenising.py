"""Tokenising a split in chunks, in ``data.num_proc`` worker processes (TRL's --dataset_num_proc).

A split's rows are cut into contiguous chunks of ``CHUNK_ROWS`` rows, whatever the number of processes; each chunk
is tokenised by the same function into flat int32 arrays (its examples' ``input_ids`` and ``labels`` back to back,
and their lengths) and its bad-row counts. The chunks come back in row order, so the tokenised split, its data
report and the cache files written from them are the same bytes with one process or many (tested). At most two
chunks per worker are in flight, so tokenising a corpus holds a few chunks of tokens, never the corpus as lists.

With one process (or one chunk) no pool is started. Workers are forked on Linux (they inherit the tokenizer; a
chunk's rows travel to them pickled) and spawned elsewhere; each tokenises with one thread (the pool is the
parallelism). The process that tokenises shows the rows done and rows/s on stderr when it is a terminal, and says
once when it is done: ``tokenised N train rows in T s (R rows/s, W workers)``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, TextIO

import numpy as np

from shardtune.data.files import Row
from shardtune.data.report import DataReport, RowFilter

CHUNK_ROWS = 1024  # rows per chunk: fixed, so that the chunks (and the report's order) never depend on num_proc
CHUNKS_IN_FLIGHT_PER_WORKER = 2  # one being tokenised, one waiting: the parent writes while the workers work

# A chunk's tokeniser: (its rows, filt=a RowFilter) -> {input_ids, labels} examples, bad rows counted (or raised)
# through the filter into its report.
Tokenise = Callable[..., list[dict]]


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: what a job scheduler gave it), not the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def num_processes(num_proc: int | None) -> int:
    """``data.num_proc``: None is every CPU available."""
    return num_proc or available_cpus()


@dataclass
class Chunk:
    """One chunk's examples as flat arrays, and what its rows' filter counted."""

    num_rows: int
    input_ids: np.ndarray  # int32, the examples back to back
    labels: np.ndarray  # int32, aligned with input_ids
    lengths: np.ndarray  # int64, one per example
    skipped: dict[str, int] = field(default_factory=dict)
    num_truncated: int = 0

    @property
    def num_examples(self) -> int:
        return len(self.lengths)

    def examples(self) -> list[dict]:
        ends = np.cumsum(self.lengths).tolist()
        ids, labels = self.input_ids.tolist(), self.labels.tolist()
        return [{"input_ids": ids[a:b], "labels": labels[a:b]} for a, b in zip([0, *ends[:-1]], ends)]


def tokenise_chunk(tokenise: Tokenise, strict: bool, rows: list[Row]) -> Chunk:
    report = DataReport(source="")
    examples = tokenise(rows, filt=RowFilter(report, strict))
    lengths = np.fromiter((len(e["input_ids"]) for e in examples), dtype=np.int64, count=len(examples))
    total = int(lengths.sum())
    return Chunk(
        num_rows=len(rows),
        input_ids=np.fromiter(chain.from_iterable(e["input_ids"] for e in examples), dtype=np.int32, count=total),
        labels=np.fromiter(chain.from_iterable(e["labels"] for e in examples), dtype=np.int32, count=total),
        lengths=lengths,
        skipped=report.skipped,
        num_truncated=report.num_truncated,
    )


# (tokenise, strict, a chunk's rows) -> the chunk as flat arrays (Chunk, or what a pack function of the same shape
# makes: num_rows, num_examples, skipped, num_truncated); picklable: module-level
Pack = Callable[[Tokenise, bool, list[Row]], Any]


@dataclass
class Preparation:
    """What tokenising a split takes: its rows, its data report so far (source, rows read), and the function that
    tokenises a chunk of rows (picklable: a module-level function, or a partial of one, with its tokenizer); ``pack``
    turns a chunk's tokenised examples into arrays (SFT's examples: tokenise_chunk; DPO's pairs: their own)."""

    report: DataReport
    rows: Sequence[Row]
    tokenise: Tokenise
    strict: bool
    pack: Pack = tokenise_chunk

    def chunks(self, num_proc: int = 1, progress: Progress | None = None) -> Iterator[Chunk]:
        """The tokenised chunks in row order, each added to the report (and to ``progress``) as it is yielded."""
        bounds = [(a, min(a + CHUNK_ROWS, len(self.rows))) for a in range(0, len(self.rows), CHUNK_ROWS)]
        workers = max(1, min(num_proc, len(bounds)))
        if progress is not None:
            progress.start(len(self.rows), workers)
        chunks = (
            (self.pack(self.tokenise, self.strict, self.rows[a:b]) for a, b in bounds)
            if workers == 1
            else _pooled(self, bounds, workers)
        )
        with contextlib.closing(chunks):  # a pool's workers end when the caller stops reading, error or not
            for chunk in chunks:
                self._count(chunk)
                if progress is not None:
                    progress.advance(chunk.num_rows)
                yield chunk

    def examples(self) -> list[dict]:
        """Every example as lists, tokenised in this process (load_examples: what is not read from the cache); the
        chunks' ``examples()`` (DPO's: their pairs)."""
        return [example for chunk in self.chunks() for example in chunk.examples()]

    def _count(self, chunk: Chunk) -> None:
        for reason, count in chunk.skipped.items():
            self.report.skipped[reason] = self.report.skipped.get(reason, 0) + count
        self.report.num_truncated += chunk.num_truncated
        self.report.num_examples += chunk.num_examples


# -- the pool --------------------------------------------------------------------------------------------------------

_worker_job: tuple[Pack, Tokenise, bool] | None = None  # set in each worker by the pool's initializer


def _install(pack: Pack, tokenise: Tokenise, strict: bool) -> None:
    global _worker_job
    _worker_job = (pack, tokenise, strict)


def _tokenise_in_worker(rows: list[Row]) -> Any:
    assert _worker_job is not None, "the pool's initializer installs the job"
    pack, tokenise, strict = _worker_job
    return pack(tokenise, strict, rows)


def _start_method() -> str:
    # fork shares the tokenizer without pickling it and starts in milliseconds; elsewhere (macOS, Windows) it is
    # unsafe or absent
    return "fork" if sys.platform == "linux" else "spawn"


@contextlib.contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    """Workers started meanwhile tokenise with one thread each (Hugging Face tokenizers would start a thread per CPU
    in every worker, and warn after a fork)."""
    given = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if given is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = given


def _pooled(prep: Preparation, bounds: list[tuple[int, int]], workers: int) -> Iterator[Chunk]:
    """The chunks tokenised by ``workers`` processes, in order, with at most a few per worker in flight."""
    context = multiprocessing.get_context(_start_method())
    with _single_threaded_tokenizers():
        pool = context.Pool(workers, initializer=_install, initargs=(prep.pack, prep.tokenise, prep.strict))
    with pool:  # leaving (at the end, on an error, or when the caller stops) terminates and joins the workers
        waiting = iter(bounds)
        in_flight: deque = deque()

        def submit() -> None:
            bound = next(waiting, None)
            if bound is not None:
                in_flight.append(pool.apply_async(_tokenise_in_worker, (prep.rows[bound[0] : bound[1]],)))

        for _ in range(CHUNKS_IN_FLIGHT_PER_WORKER * workers):
            submit()
        while in_flight:
            chunk = in_flight.popleft().get()  # a worker's error (a bad row under --strict_data) is raised here
            submit()
            yield chunk


# -- progress --------------------------------------------------------------------------------------------------------


class Progress:
    """Rows done and rows/s on ``stream`` while tokenising (redrawn in place, only on a terminal), then one line."""

    REDRAW_S = 0.2
    CLEAR_TO_END = "\x1b[K"

    def __init__(
        self, rows: str = "rows", stream: TextIO | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.rows = rows  # what is counted: "rows", "train rows" ...
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = self.done = self.workers = 0
        self.started = self.drawn = 0.0

    def start(self, total: int, workers: int) -> None:
        self.total, self.workers, self.done = total, workers, 0
        self.started = self.drawn = self.clock()

    def advance(self, rows: int) -> None:
        self.done += rows
        now = self.clock()
        if self.live and (now - self.drawn >= self.REDRAW_S or self.done == self.total):
            self.drawn = now
            done = f"{self.done:,} / {self.total:,} {self.rows} ({self.done / max(self.total, 1):.0%}"
            self._say(f"tokenising {done}, {self._speed(now)})", end="")

    def finish(self) -> None:
        now = self.clock()
        self._say(f"tokenised {self.done:,} {self.rows} in {now - self.started:.1f} s ({self._speed(now)})", end="\n")

    def abandon(self) -> None:
        """Tokenising failed (an error follows): the line drawn so far is cleared."""
        if self.live and self.done:
            self.stream.write("\r" + self.CLEAR_TO_END)
            self.stream.flush()

    def _speed(self, now: float) -> str:
        rate = self.done / max(now - self.started, 1e-9)
        return f"{rate:,.0f} rows/s, {self.workers} worker{'' if self.workers == 1 else 's'}"

    def _say(self, text: str, end: str) -> None:
        self.stream.write(f"\rshardtune: {text}{self.CLEAR_TO_END}{end}" if self.live else f"shardtune: {text}{end}")
        self.stream.flush()
