"""Data without a row, said as such in one line that names what the user gave and the fix ("--dataset_name
data/empty.jsonl is empty (no rows): ..."), instead of what ``datasets`` makes of it (a StopIteration from its format
inference, "Instruction 'train' corresponds to no data", a failed generation of a Parquet file), and a split that every
row was skipped from, with the counts.

Local files are looked at before ``datasets`` reads them, without reading them whole: JSON lines / JSON up to their
first characters, CSV up to its second line, Parquet by its metadata, Arrow up to its first record batch with a row.
"""

from __future__ import annotations

from pathlib import Path

from shardtune.data.report import DataError, DataReport

EMPTY = "is empty (no rows)"
_READ_BYTES = 1 << 16


def holds_no_rows(path: Path) -> bool:
    """True when the local data file has no row: blank (or ``[]``) JSON / JSON lines, CSV with a header at most,
    Parquet or Arrow of 0 rows. False when it has one, or when that cannot be told (``datasets`` then says what it
    finds)."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows == 0
        if suffix == ".arrow":
            return _arrow_rows_absent(path)
        if suffix in (".json", ".jsonl"):
            return _first_characters(path, 2) in ("", "[]")
        if suffix == ".csv":
            return _non_blank_lines(path, 2) < 2
    except (OSError, ValueError):  # unreadable, or not Parquet (pyarrow's ArrowInvalid): datasets says what it is
        return False
    return False


def _arrow_rows_absent(path: Path) -> bool:
    """An Arrow IPC stream (what ``datasets`` writes and reads) or file without a row, memory-mapped."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            return not any(batch.num_rows for batch in pa.ipc.open_stream(source))
        except pa.ArrowInvalid:  # not a stream: the random-access file format
            source.seek(0)
            reader = pa.ipc.open_file(source)
            return not any(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def _first_characters(path: Path, count: int) -> str:
    """The first ``count`` characters of the file that are not blank ("" for a blank file)."""
    found = ""
    with open(path, "rb") as fh:
        while len(found) < count and (chunk := fh.read(_READ_BYTES)):
            found += "".join(chunk.decode("utf-8", errors="replace").split())[: count - len(found)]
    return found


def _non_blank_lines(path: Path, count: int) -> int:
    """How many of the file's first ``count`` lines that are not blank it has."""
    seen = 0
    with open(path, "rb") as fh:
        for line in fh:
            seen += bool(line.strip())
            if seen == count:
                break
    return seen


def split_files(path: Path) -> dict[str, list[Path]]:
    """The data files of each split of a local ``--dataset_name`` as ``datasets`` reads it: a file is the train
    split; a folder's splits come from its files' names. {} when ``datasets`` cannot tell (its load says why)."""
    if path.is_file():
        return {"train": [path]}
    import datasets

    try:
        data_files = datasets.load_dataset_builder(str(path)).config.data_files or {}
    except Exception:  # no data files, unknown formats: datasets' own error, when it loads the folder, says which
        return {}
    return {str(split): [Path(f) for f in files] for split, files in data_files.items()}


def refuse_empty_files(name: str) -> None:
    """DataError when the local ``--dataset_name`` ``name`` (a file, or a folder's split) holds no row. A folder's
    split of empty files fails ``datasets`` whether the run reads that split or not, so every split is checked."""
    path = Path(name).expanduser()
    if path.is_file():
        if holds_no_rows(path):
            raise empty_file(name)
        return
    for split, files in split_files(path).items():
        if files and all(holds_no_rows(f) for f in files):
            listed = ", ".join(f.name for f in files)
            raise DataError(
                f"--dataset_name {name}: its {split} split ({listed}) {EMPTY}: add rows to it, or remove "
                f"{'it' if len(files) == 1 else 'them'}"
                + (f" (the run then has no {split} split)" if split != "train" else "")
            )


def empty_file(name: str) -> DataError:
    """The data file ``--dataset_name name`` without a row."""
    return DataError(f"--dataset_name {name} {EMPTY}: add rows to it, or pass a file that has some")


def empty_split(source: str, flag: str) -> DataError:
    """A loaded (or streamed) split ``source`` without a row; ``flag``: what names another split."""
    return DataError(f"{source} {EMPTY}: add rows to it, or pass another split as {flag}")


def nothing_usable(report: DataReport, what: str, fix: str) -> str:
    """The line for a split that gave no ``what`` (train example, test pair, prompt): it is empty, or every one of
    its rows was skipped, with the counts by reason and ``fix``."""
    if not report.num_rows:
        return f"{report.source} {EMPTY}: add rows to it, or pass other data"
    reasons = ", ".join(f"{reason} {count}" for reason, count in report.skipped.items()) or "none kept"
    return f"{report.source}: no usable {what}: all {report.num_rows} rows were skipped ({reasons}): {fix}"
