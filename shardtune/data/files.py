"""Reading row files (JSON, JSON Lines, CSV, Parquet) and choosing the train / validation files.

Rows are read with the standard library (json, csv) and pyarrow.parquet. Each row keeps where it came
from (file and 1-based row number: the list index for JSON, the line for JSON Lines, the data record for
CSV, the table row for Parquet) so that a bad row can be named.

A folder holds its splits as files, picked by name (case-insensitive, files with other extensions ignored):
train files contain the train split name ("train"); validation files contain the test split name
("validation"), or else "val", then "dev", then "test" (the first of these that matches any file wins, so a
folder with validation.jsonl and test.jsonl evaluates on validation.jsonl). Several files for one split (e.g.
parquet shards) are read in name order and concatenated. A single file is the train split. Without a
validation file, ``validation_fraction`` of the train rows is held out, chosen by a permutation seeded with
the training seed.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from shardtune.data.report import DataError

# (origin, 1-based row number, record)
Row = tuple[str, int, Any]

VALIDATION_KEYWORDS = ("val", "dev", "test")


def _read_text(path: Path, encoding: str = "utf-8") -> str:
    try:
        return path.read_text(encoding=encoding)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}): save the file as UTF-8") from None


def _read_jsonl_text(path: Path, text: str) -> list[Row]:
    rows: list[Row] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((str(path), line_no, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {line_no}: not valid JSON ({e.msg}): fix or remove that line") from None
    return rows


def _read_jsonl(path: Path, columns: tuple[str, ...]) -> list[Row]:
    return _read_jsonl_text(path, _read_text(path))


def _read_json(path: Path, columns: tuple[str, ...]) -> list[Row]:
    """A list of objects, or JSON Lines saved as .json (as Hugging Face's json loader accepts both)."""
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if _first_line_is_json(text):
            return _read_jsonl_text(path, text)
        raise DataError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}): fix the file, or save it as "
            "a list of objects or as JSON Lines (one object per line)"
        ) from None
    if isinstance(data, dict):
        return [(str(path), 1, data)]
    if not isinstance(data, list):
        raise DataError(f"{path}: the top level is a {type(data).__name__}: save the rows as a list of objects")
    return [(str(path), i, record) for i, record in enumerate(data, start=1)]


def _first_line_is_json(text: str) -> bool:
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        return False
    try:
        json.loads(lines[0])
    except json.JSONDecodeError:
        return False
    return True


def _missing_columns_error(path: Path, missing: list[str], found: list[str]) -> DataError:
    return DataError(
        f"{path}: no column {', '.join(repr(c) for c in missing)} (found: {', '.join(found) or 'none'}): "
        "rename the columns or pass a file that has them"
    )


def _read_csv(path: Path, columns: tuple[str, ...]) -> list[Row]:
    text = _read_text(path, encoding="utf-8-sig")
    try:
        reader = csv.DictReader(text.splitlines(keepends=True))
        found = list(reader.fieldnames or [])
        missing = [c for c in columns if c not in found]
        if missing:
            raise _missing_columns_error(path, missing, found)
        return [(str(path), i, record) for i, record in enumerate(reader, start=1)]
    except csv.Error as e:
        raise DataError(f"{path}: not valid CSV ({e}): fix the file") from None


def _read_parquet(path: Path, columns: tuple[str, ...]) -> list[Row]:
    import pyarrow as pa  # here: a run without Parquet files does not pay for importing it
    import pyarrow.parquet as pq

    try:
        found = pq.read_schema(path).names
        missing = [c for c in columns if c not in found]
        if missing:
            raise _missing_columns_error(path, missing, found)
        records = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e}): fix or re-export the file") from None
    return [(str(path), i, record) for i, record in enumerate(records, start=1)]


READERS: dict[str, Callable[[Path, tuple[str, ...]], list[Row]]] = {
    ".json": _read_json,
    ".jsonl": _read_jsonl,
    ".csv": _read_csv,
    ".parquet": _read_parquet,
}


def read_rows(paths: list[Path], columns: tuple[str, ...]) -> list[Row]:
    """All rows of ``paths`` in order; a CSV or Parquet file must have every column in ``columns``."""
    rows: list[Row] = []
    for path in paths:
        rows.extend(READERS[path.suffix.lower()](path, columns))
    return rows


@dataclass
class DataFiles:
    """The files of one dataset: train files and (maybe no) validation files."""

    train: list[Path]
    validation: list[Path]


def locate(flag: str, data_path: str, train_name: str, test_name: str, allow_folder: bool = True) -> DataFiles:
    """Resolve ``--<flag> data_path`` to its files (see the module docstring for the naming rule)."""
    path = Path(data_path).expanduser()
    known = ", ".join(READERS)
    if path.is_file():
        if path.suffix.lower() not in READERS:
            raise DataError(f"--{flag} {data_path}: unknown format {path.suffix!r}: pass a {known} file")
        return DataFiles(train=[path], validation=[])
    if path.is_dir() and allow_folder:
        return _split_folder(flag, path, train_name, test_name)
    what = "file or folder" if allow_folder else "file"
    raise DataError(f"--{flag} {data_path}: no such {what}: pass the path of a {known} {what}")


def _split_folder(flag: str, folder: Path, train_name: str, test_name: str) -> DataFiles:
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in READERS)
    train = [p for p in files if train_name.lower() in p.stem.lower()]
    if not train:
        raise DataError(
            f"--{flag} {folder}: no train file (a {', '.join(READERS)} file whose name contains "
            f"{train_name!r}; found: {', '.join(p.name for p in files) or 'none'}): add one"
        )
    rest = [p for p in files if p not in train]
    for keyword in dict.fromkeys((test_name.lower(), *VALIDATION_KEYWORDS)):
        validation = [p for p in rest if keyword in p.stem.lower()]
        if validation:
            return DataFiles(train=train, validation=validation)
    return DataFiles(train=train, validation=[])


def hold_out(rows: list[Row], fraction: float, seed: int, split: str) -> list[Row]:
    """The ``split`` side of a deterministic hold-out of ``fraction`` of ``rows`` (file order kept)."""
    num_validation = max(1, round(len(rows) * fraction))
    if num_validation >= len(rows):
        origin = rows[0][0] if rows else "the data"
        raise DataError(
            f"{origin}: {len(rows)} rows are too few to hold out a validation fraction of {fraction}: "
            "add rows or a validation file"
        )
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen = set(order[:num_validation])
    keep_validation = split == "validation"
    return [row for i, row in enumerate(rows) if (i in chosen) == keep_validation]
