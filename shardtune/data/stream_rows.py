"""Rows of a split read as a stream (--dataset_streaming), each with the position that resumes the stream at it.

A position is a small JSON-able dict. For local files it says where a row starts: the file (its index among the
split's files, in ``datasets``' order) and the byte offset of the row (JSON lines, CSV) or its index (Parquet: the
row group is found from the file's metadata; a JSON array file), and the row's number in its file. Resuming opens
the file there: the rows before it are not read again. Hub datasets (and Arrow files) stream through ``datasets``'
IterableDataset, whose own ``state_dict`` is the position (``datasets`` may read the current shard's earlier rows
again to get there). A script's ``datasets.IterableDataset`` (the Python face) is registered in this process under
:data:`IN_PROCESS_NAME` and streamed the same way.
"""

from __future__ import annotations

import copy
import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardtune.config.schema import TrainConfig
from shardtune.data.emptiness import EMPTY, empty_split, refuse_empty_files
from shardtune.data.files import Row
from shardtune.data.report import DataError

LOCAL_READERS = (".jsonl", ".json", ".csv", ".parquet")
START: dict = {"file": 0, "offset": 0, "row": 0}
IN_PROCESS_NAME = "<the script's IterableDataset>"  # --dataset_name of the datasets a script streams (shardtune.api)
_IN_PROCESS: dict[str, Any] = {}  # split name -> the script's dataset object


def register_in_process(splits: dict[str, Any]) -> str:
    """The script's datasets by split (a ``datasets.IterableDataset``, or a Dataset / list for evaluation), streamed
    by the worker this process runs; returns their --dataset_name. Every rank's script registers its own."""
    _IN_PROCESS.clear()
    _IN_PROCESS.update(splits)
    return IN_PROCESS_NAME


def _dataset_path(cfg: TrainConfig) -> Path:
    return Path(cfg.data.trl_dataset.dataset_name).expanduser()


def split_files(cfg: TrainConfig, split_name: str) -> list[Path] | None:
    """The local files of ``split_name`` in ``datasets``' order (a single file is the train split), [] when the
    data has no such split, or None when the rows come through ``datasets`` (a hub id, Arrow files)."""
    if cfg.data.trl_dataset.dataset_name == IN_PROCESS_NAME:
        return None
    path = _dataset_path(cfg)
    if path.is_file():
        files = [path] if split_name == cfg.data.trl_dataset.dataset_train_split else []
    elif path.is_dir():
        import datasets

        try:
            data_files = datasets.load_dataset_builder(str(path)).config.data_files or {}
        except Exception as e:  # no data files, unknown formats: one line with the fix
            raise DataError(
                f"--dataset_name {cfg.data.trl_dataset.dataset_name}: its files could not be listed "
                f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]}): pass a folder of JSON lines, CSV or "
                "Parquet files"
            ) from e
        files = [Path(f) for f in data_files.get(split_name, [])]
    else:
        return None
    if any(f.suffix.lower() not in LOCAL_READERS for f in files):
        return None
    return files


def has_split(cfg: TrainConfig, split_name: str) -> bool:
    files = split_files(cfg, split_name)
    if files is not None:
        return bool(files)
    tc = cfg.data.trl_dataset
    if tc.dataset_name == IN_PROCESS_NAME:
        return split_name in _IN_PROCESS
    import datasets

    return split_name in datasets.get_dataset_split_names(tc.dataset_name, tc.dataset_config or None)


class RowStream:
    """The rows of one split, from a position on: ``rows(position)`` yields (row, position of that row)."""

    def __init__(self, cfg: TrainConfig, split_name: str):
        tc = cfg.data.trl_dataset
        self.name, self.config, self.split = tc.dataset_name, tc.dataset_config, split_name
        self.files = split_files(cfg, split_name)
        if self.files == []:
            raise DataError(f"--dataset_name {self.name} has no split {split_name!r}: pass --dataset_train_split")

    def describe(self) -> str:
        return f"{self.name} split {self.split} (streamed)"

    def rows(self, position: dict | None = None) -> Iterator[tuple[Row, dict]]:
        position = dict(position or START)
        if self.files is None:
            yield from self._hub_rows(position)
            return
        for index in range(position["file"], len(self.files)):
            path = self.files[index]
            start = (position["offset"], position["row"]) if index == position["file"] else (0, 0)
            for record, offset, row in _file_rows(path, *start):
                yield (str(path), row + 1, record), {"file": index, "offset": offset, "row": row}

    def _iterable(self) -> Any:
        import datasets

        if self.name == IN_PROCESS_NAME:
            if self.split not in _IN_PROCESS:
                raise DataError(f"the script's datasets have no {self.split!r} split: pass it to the trainer")
            stream = _IN_PROCESS[self.split]
            return copy.deepcopy(stream) if isinstance(stream, datasets.IterableDataset) else stream
        try:
            return datasets.load_dataset(self.name, name=self.config or None, split=self.split, streaming=True)
        except Exception as e:  # network, authentication, missing dataset
            raise DataError(
                f"--dataset_name {self.name}: could not be streamed ({type(e).__name__}: "
                f"{(str(e).splitlines() or [''])[0]}): pass a local data file or folder, or a reachable hub id"
            ) from e

    def _hub_rows(self, position: dict) -> Iterator[tuple[Row, dict]]:
        stream = self._iterable()
        if not hasattr(stream, "state_dict"):  # a script's evaluation Dataset or list: read whole
            for row, record in enumerate(stream):
                yield (self.describe(), row + 1, record), {"row": row}
            return
        if position.get("state") is not None:
            stream.load_state_dict(position["state"])
        row = position.get("row", 0)
        state = stream.state_dict()
        for record in stream:
            yield (self.describe(), row + 1, record), {"state": state, "row": row}
            row += 1
            state = stream.state_dict()

    def first(self) -> tuple[list[str], list[Row]]:
        """The columns and the first row (what the format is recognised from)."""
        for row, _ in self.rows():
            return list(row[2]) if isinstance(row[2], dict) else [], [row]
        if self.name == IN_PROCESS_NAME:  # the script's dataset: named by the trainer's argument
            argument = "train_dataset" if self.split == "train" else "eval_dataset"
            raise DataError(f"{argument} (an IterableDataset) {EMPTY}: pass a dataset that yields rows")
        if Path(self.name).expanduser().exists():  # a local file or split: said as when it is loaded whole
            refuse_empty_files(self.name)
        flag = "--dataset_train_split" if self.split == "train" else "--dataset_test_split"
        raise empty_split(f"--dataset_name {self.name} split {self.split!r} (streamed)", flag)


def _file_rows(path: Path, offset: int, row: int) -> Iterator[tuple[Any, int, int]]:
    """(record, its position, its 0-based row) of ``path`` from ``offset`` (bytes or rows: see the module)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_rows(path, offset)
    elif suffix == ".csv":
        yield from _csv_rows(path, offset, row)
    elif suffix == ".json" and _is_json_array(path):
        records = json.loads(path.read_text(encoding="utf-8"))
        for index in range(offset, len(records)):
            yield records[index], index, index
    else:
        yield from _json_lines(path, offset, row)


def _is_json_array(path: Path) -> bool:
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"[")


def _json_lines(path: Path, offset: int, row: int) -> Iterator[tuple[Any, int, int]]:
    with open(path, "rb") as fh:
        fh.seek(offset)
        while True:
            start = fh.tell()
            line = fh.readline()
            if not line:
                return
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:  # kept as a row that is not an object: the formats' checks skip it or name it
                record = f"not JSON: {line[:60]!r}"
            yield record, start, row
            row += 1


def _csv_rows(path: Path, offset: int, row: int) -> Iterator[tuple[Any, int, int]]:
    """A record may span lines (a quoted field with newlines): lines are joined until their quotes balance."""
    with open(path, "rb") as fh:
        header = next(csv.reader([_csv_record(fh).decode("utf-8")]), None)
        if header is None:
            return
        if offset:
            fh.seek(offset)
        while True:
            start = fh.tell()
            record = _csv_record(fh)
            if not record:
                return
            if not record.strip():
                continue
            values = next(csv.reader(io.StringIO(record.decode("utf-8"))))
            yield dict(zip(header, values)), start, row
            row += 1


def _csv_record(fh) -> bytes:
    record = fh.readline()
    while record.count(b'"') % 2:
        more = fh.readline()
        if not more:
            break
        record += more
    return record


def _parquet_rows(path: Path, offset: int) -> Iterator[tuple[Any, int, int]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    first = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if first + rows > offset:
            records = parquet.read_row_group(group).to_pylist()
            for index in range(max(offset - first, 0), rows):
                yield records[index], first + index, first + index
        first += rows
