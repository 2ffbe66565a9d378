"""A dataset mixture (``--dataset_mixture``, TRL's ``datasets:``): the rows of several datasets in one run, by weight.

Each entry is one split of one dataset, loaded with ``datasets.load_dataset`` as TRL's ``get_dataset`` loads it
(``path``, ``name``, ``data_dir``, ``data_files``, ``split``, then ``columns`` kept); a local file is its folder's
data file. How many rows each source gives (:func:`composition`):

- no weight and no fraction on any entry: every row of every source once, in the order given (TRL's concatenation);
- TRL's ``fraction`` (on every entry): its share of the largest mixture that repeats no row, the first rows of each
  source, in the order given (what TRL 1.16 does);
- shardtune's ``weight`` (an entry without one weighs 1): the mixture has as many rows N as the sources together,
  and source i gives round(w_i / sum(w) x N) rows: its rows in an order seeded by --seed, the whole order again
  (newly seeded) as often as it needs more rows than it has (upsampling), the first ones of that order when it
  needs fewer; the rows of all sources are then shuffled together, seeded (:func:`draw`).

The same seed and data give the same mixture in every process. All sources must have the same columns (TRL
concatenates them). A mixture has no evaluation split (TRL's has one only with its ``test_split_size``, which is not
built): training runs without evaluation, and a command that asks for evaluation is refused.
"""

from __future__ import annotations

import functools
import glob
import json
from pathlib import Path
from typing import Any

import numpy as np

from shardtune.config.mixture import MIXTURE_KEY, mixture_entries
from shardtune.config.schema import ConfigError, TrainConfig, TrlDatasetConfig
from shardtune.data.emptiness import EMPTY, holds_no_rows
from shardtune.data.files import READERS, Row
from shardtune.data.report import DataError

NOT_FOR_A_MIXTURE = {"dataset_config": "name", "dataset_train_split": "split"}  # flag -> the entry key instead


def mixture_label(cfg: TrainConfig) -> str:
    """How the user named the mixture: ``datasets:`` (a TRL recipe) or ``--dataset_mixture``."""
    name = cfg.provenance.spelled.get(MIXTURE_KEY, "dataset_mixture")
    return "datasets:" if name == "datasets" else f"--{name}"


def check_mixture(cfg: TrainConfig) -> None:
    """Before launch: the entries are well formed, name data that exists, and no flag is set that a mixture ignores."""
    tc, label = cfg.data.trl_dataset, mixture_label(cfg)
    entries = mixture_entries(label, tc.dataset_mixture)
    if tc.dataset_name:
        raise ConfigError(f"{label} and --dataset_name {tc.dataset_name} both name the data: drop one of them")
    if cfg.data.streaming:
        raise ConfigError(
            f"--dataset_streaming true streams one --dataset_name; {label} draws from whole datasets: drop "
            "--dataset_streaming"
        )
    for flag, key in NOT_FOR_A_MIXTURE.items():
        if getattr(tc, flag) != getattr(TrlDatasetConfig(), flag):
            raise ConfigError(
                f"--{flag} {getattr(tc, flag)} has no effect with {label}: give each entry its {key}, or drop the flag"
            )
    for i, entry in enumerate(entries, start=1):
        path = Path(entry["path"]).expanduser()
        where = f"{label} entry {i} ({entry['path']})"
        if not path.exists() and (entry["path"].startswith(("/", ".", "~")) or path.suffix.lower() in READERS):
            raise DataError(f"{where}: no such file or folder: fix the path")
        given = [key for key in ("name", "data_dir", "data_files") if entry[key] is not None]
        if path.is_file() and given:
            raise ConfigError(f"{where} is a file: {given[0]} applies to folders and hub datasets: drop it")


def without_evaluation(cfg: TrainConfig, asked: list[str], say: bool) -> None:
    """A mixture has no evaluation split: the run trains without evaluation (``say``: tell it), unless a flag of
    ``asked`` asked for evaluation: then that is refused."""
    label = mixture_label(cfg)
    if asked:
        raise DataError(
            f"--{asked[0]} asks for evaluation, but {label} (a dataset mixture) has no evaluation split (TRL's "
            f"test_split_size is not built): drop --{asked[0]}"
        )
    cfg.eval.enabled = False
    if say:
        print(
            f"shardtune: {label} (a dataset mixture) has no evaluation split: training without evaluation", flush=True
        )


def mixture_rows(cfg: TrainConfig, split: str) -> tuple[str, list[Row], list[str]]:
    """What ``_dataset_rows`` (trl_loading) gives for one dataset: the source described (each entry's rows in the
    source and in the mixture), the rows as (origin, row number in its source, record), the column names."""
    label = mixture_label(cfg)
    if split != "train":
        raise DataError(
            f"{label}: a dataset mixture has no evaluation split (TRL's test_split_size is not built): evaluate "
            "with --dataset_name on a test set, or drop the evaluation flags"
        )
    entries = mixture_entries(label, cfg.data.trl_dataset.dataset_mixture)
    loaded = [_records(label, i, entry) for i, entry in enumerate(entries, start=1)]
    names = [_name(entry) for entry in entries]
    _check_same_columns(label, names, [columns for _, columns in loaded])
    sizes = [len(records) for records, _ in loaded]
    counts = composition(sizes, entries)
    weighted = any(entry["weight"] is not None for entry in entries)
    origins = [
        entry["path"] if Path(entry["path"]).expanduser().is_file() else name for entry, name in zip(entries, names)
    ]
    rows = [(origins[s], j + 1, loaded[s][0][j]) for s, j in draw(sizes, counts, cfg.train.seed if weighted else None)]
    how = (
        f"by weight, seed {cfg.train.seed}"
        if weighted
        else "by TRL's fraction"
        if entries[0]["fraction"]
        else "all rows"
    )
    return f"mixture of {len(entries)} datasets ({how}): {describe(names, sizes, counts)}", rows, loaded[0][1]


def composition(sizes: list[int], entries: list[dict[str, Any]]) -> list[int]:
    """The rows each source gives to the mixture (see the module's docstring)."""
    if entries[0]["fraction"] is not None:  # TRL's: shares of the largest mixture that repeats no row
        shares = _shares([entry["fraction"] for entry in entries])
        total = min(size / share for size, share in zip(sizes, shares))
        return [round(share * total) for share in shares]
    if all(entry["weight"] is None for entry in entries):
        return list(sizes)
    shares = _shares([1.0 if entry["weight"] is None else entry["weight"] for entry in entries])
    return [round(share * sum(sizes)) for share in shares]


def draw(sizes: list[int], counts: list[int], seed: int | None) -> list[tuple[int, int]]:
    """(source, row index) of each mixture row: with ``seed``, each source's rows in seeded orders (repeated as
    needed), all shuffled together; without, the first ``counts`` rows of each source, in order."""
    if seed is None:
        return [(s, j) for s, count in enumerate(counts) for j in range(count)]
    rng = np.random.default_rng(seed)
    picks: list[tuple[int, int]] = []
    for s, (size, count) in enumerate(zip(sizes, counts)):
        passes = [rng.permutation(size) for _ in range(-(-count // size))]
        picks += [(s, int(j)) for j in (np.concatenate(passes)[:count] if passes else [])]
    return [picks[k] for k in rng.permutation(len(picks))]


def describe(names: list[str], sizes: list[int], counts: list[int]) -> str:
    """``a.jsonl 700 of 1000 rows, b.jsonl 300 rows (upsampled from 100)``."""
    parts = []
    for name, size, count in zip(names, sizes, counts):
        if count > size:
            parts.append(f"{name} {count} rows (upsampled from {size})")
        else:
            parts.append(f"{name} {count} rows" if count == size else f"{name} {count} of {size} rows")
    return ", ".join(parts)


def local_paths(cfg: TrainConfig) -> list[Path]:
    """The local files and folders a mixture reads (what the tokenised-data cache hashes)."""
    found: list[Path] = []
    for entry in mixture_entries(mixture_label(cfg), cfg.data.trl_dataset.dataset_mixture):
        base = Path(entry["path"]).expanduser()
        found.append(base)
        files = entry["data_files"]
        named = files.values() if isinstance(files, dict) else [files] if files is not None else []
        for item in named:
            for pattern in [item] if isinstance(item, str) else item:
                found += [Path(p) for p in sorted(glob.glob(str(Path(pattern).expanduser())))]
        if entry["data_dir"]:
            found.append(Path(entry["data_dir"]).expanduser())
    return [path for path in found if path.exists()]


def _shares(values: list[float]) -> list[float]:
    return [value / sum(values) for value in values]


def _name(entry: dict[str, Any]) -> str:
    config = f" ({entry['name']})" if entry["name"] else ""
    split = f" split {entry['split']}" if entry["split"] != "train" else ""
    return f"{entry['path']}{config}{split}"


def _check_same_columns(label: str, names: list[str], columns: list[list[str]]) -> None:
    for name, other in zip(names[1:], columns[1:]):
        if sorted(other) != sorted(columns[0]):
            raise DataError(
                f"{label}: {names[0]} has columns {', '.join(columns[0])} but {name} has {', '.join(other)}: the "
                "sources of a mixture need one row format (TRL concatenates them): keep common ones with columns:, "
                "or convert one"
            )


def _records(label: str, i: int, entry: dict[str, Any]) -> tuple[list[dict], list[str]]:
    path = Path(entry["path"]).expanduser()
    if path.is_file() and holds_no_rows(path):  # said before datasets fails on it in its own words
        raise DataError(f"{label} entry {i} ({_name(entry)}) {EMPTY}: add rows to it, or drop the entry")
    dataset = load_entry(entry)
    if not len(dataset):
        raise DataError(f"{label} entry {i} ({_name(entry)}) {EMPTY}: add rows to it, or drop the entry")
    return dataset.to_list(), list(dataset.column_names)


def load_entry(entry: dict[str, Any]) -> Any:
    """One entry's split (an entry as :func:`shardtune.config.mixture.mixture_entries` gives it) as a
    ``datasets.Dataset``, its columns kept; loaded once per process."""
    return _load(json.dumps(entry, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _load(entry_json: str) -> Any:
    import datasets

    entry = json.loads(entry_json)
    path = Path(entry["path"]).expanduser()
    try:
        if path.is_file():  # datasets reads a file as its folder's data file (the train split)
            dataset = datasets.load_dataset(str(path.resolve().parent), data_files=path.name, split=entry["split"])
        else:
            dataset = datasets.load_dataset(
                str(path) if path.is_dir() else entry["path"],
                name=entry["name"],
                data_dir=entry["data_dir"],
                data_files=entry["data_files"],
                split=entry["split"],
            )
        return dataset.select_columns(entry["columns"]) if entry["columns"] is not None else dataset
    except Exception as e:  # network, missing split or column, unreadable files: one line with the fix
        where = "local data" if path.exists() else "the Hugging Face hub (offline? HF_DATASETS_OFFLINE set?)"
        reason = (str(e).strip().splitlines() or [""])[0]
        raise DataError(
            f"dataset mixture entry {_name(entry)}: could not be loaded from {where} ({type(e).__name__}: "
            f"{reason}): fix the entry (a local JSON / JSONL / CSV / Parquet file or folder, or a reachable hub id)"
        ) from e
