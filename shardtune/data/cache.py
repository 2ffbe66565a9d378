"""Tokenise once: the launcher (or the first worker) writes the tokenised examples, every rank reads them.

This also moves data errors before any process group: the launcher loads the data as part of its checks,
so a bad row under --strict_data is one line from the launcher, not a failed worker.

An entry lives in ``<cache>/tokenized/<key>/`` where the key hashes everything the examples depend on: the
dataset settings, the data files' contents, context_length, the seed (it picks held-out rows), strict_data, the
tokenizer (with its chat template) and, for TRL's formats, the loss options (--assistant_only_loss,
--completion_only_loss, --truncation_mode ...). It holds flat int32 ``input_ids`` / ``labels`` arrays plus example
offsets as .npy files (read without unpickling) and the data report as JSON, written chunk by chunk as
``data.num_proc`` processes tokenise the rows (shardtune.data.tokenising: the same bytes for any number of
processes, which is why it is not in the key). shardtune dpo's preference pairs have entries of their own
(``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``, each with its offsets), and with --precompute_ref_log_probs the
reference's log-probabilities of the pairs are kept beside them, one ``reference-<key>.npy`` per reference model (the
key: its weights' files, dtype and kernels; see shardtune/training/objectives/dpo/objective.py). Entries are written to
a temporary
folder and renamed, under a file lock, so concurrent processes never see half an entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardtune.config.schema import TrainConfig
from shardtune.data.packing import whole_rows
from shardtune.data.pair_store import MARGIN, PAIR_FIELDS, PairStore
from shardtune.data.preference import no_usable_pair, pair_preparation
from shardtune.data.report import DataError, DataReport
from shardtune.data.sources import check_usable, load_examples, prepare_examples
from shardtune.data.tokenising import Preparation, Progress, num_processes
from shardtune.data.trl_loading import uses_trl_formats
from shardtune.runtime.files import fsync_dir, fsync_tree, write_bytes_atomic

FORMAT_VERSION = 1
HASH_CHUNK_BYTES = 1 << 20


def _hash_file(path: Path, digest: "hashlib._Hash") -> None:
    digest.update(str(path.resolve()).encode())
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK_BYTES):
            digest.update(chunk)


def _hash_path(path: Path, digest: "hashlib._Hash") -> None:
    """Contents of a data file, or of every file below a data folder."""
    path = path.expanduser()
    if path.is_file():
        _hash_file(path, digest)
    elif path.is_dir():
        for child in sorted(p for p in path.rglob("*") if p.is_file()):
            _hash_file(child, digest)


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    template = (
        tokenizer.chat_template
        if isinstance(tokenizer.chat_template, str)
        else json.dumps(tokenizer.chat_template, sort_keys=True)
    )
    return hashlib.sha256((text + json.dumps(specials) + template).encode()).hexdigest()


def cache_key(cfg: TrainConfig, tokenizer: Any, split: str, pairs: bool = False, whole: bool = False) -> str:
    """``pairs``: shardtune dpo's preference pairs (another layout; the truncation mode applies to every dataset);
    ``whole``: such pairs as a reward model reads them (none cut, their margins kept)."""
    dataset_config = dataclasses.asdict(cfg.data.selected)
    digest = hashlib.sha256(
        json.dumps(
            {
                "format": FORMAT_VERSION,
                "dataset": cfg.data.dataset,
                "dataset_config": dataset_config,
                "split": split,
                "context_length": cfg.data.context_length,
                "seed": cfg.train.seed,
                "strict_data": cfg.data.strict,
                "tokenizer": _tokenizer_fingerprint(tokenizer),
                "trl_formats": dataclasses.asdict(cfg.data.trl_dataset) if pairs or uses_trl_formats(cfg) else None,
                **({"pairs": 1} if pairs else {}),
                **({"whole_pairs": 1} if whole else {}),
                **({"whole_rows": 1} if whole_rows(cfg) and not pairs else {}),  # not cut to context_length
            },
            sort_keys=True,
        ).encode()
    )
    if dataset_config.get("data_path"):
        _hash_path(Path(dataset_config["data_path"]), digest)
    if cfg.data.dataset == "trl_dataset" and cfg.data.trl_dataset.dataset_mixture:
        from shardtune.data.mixture import local_paths

        for path in local_paths(cfg):  # every entry's local files and folders (a hub id: its name only)
            _hash_path(path, digest)
    elif (
        cfg.data.dataset == "trl_dataset"
    ):  # a local file or folder (a hub id hashes its name only, as samsum's hub data)
        _hash_path(Path(cfg.data.trl_dataset.dataset_name), digest)
    if cfg.data.dataset == "grammar_dataset":  # its split names are the paths of its files
        for path in (cfg.data.grammar_dataset.train_split, cfg.data.grammar_dataset.test_split):
            _hash_path(Path(path), digest)
    return digest.hexdigest()[:32]


def _publish(tmp: Path, entry: Path) -> None:
    fsync_tree(tmp)
    os.replace(tmp, entry)
    fsync_dir(entry.parent)


def _staging(entry: Path) -> Path:
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


STORE_ARRAYS = {"input_ids": np.int32, "labels": np.int32, "offsets": np.int64}  # a TokenStore's files


class _GrowingArray:
    """A 1-D .npy file written as its parts arrive: the bytes np.save writes for the whole array (numpy's header keeps
    room for any length, so it is written again at the end with the final one)."""

    def __init__(self, path: Path, dtype: type) -> None:
        self.file, self.dtype, self.length = open(path, "wb"), np.dtype(dtype), 0
        self.data_start = self._header()

    def _header(self) -> int:
        self.file.seek(0)
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.length,)}
        np.lib.format.write_array_header_1_0(self.file, header)
        return self.file.tell()

    def append(self, values: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.length += len(values)

    def close(self) -> None:
        data_start = self._header()
        assert data_start == self.data_start, "the .npy header changed size"
        self.file.close()


def _write_chunked(entry: Path, preparation: Preparation, num_proc: int, split: str, files: dict, add, check) -> None:
    """Tokenise ``preparation``'s rows in ``num_proc`` processes into the entry's ``files`` (name -> dtype; an offsets
    file starts at 0), each chunk handed to ``add`` with the growing arrays as it comes; ``check`` the report, then
    publish the entry. On any failure nothing is left behind."""
    tmp, progress = _staging(entry), Progress(f"{split} rows")
    arrays = {name: _GrowingArray(tmp / f"{name}.npy", dtype) for name, dtype in files.items()}
    try:
        for name, array in arrays.items():
            if name.endswith("offsets"):
                array.append(np.zeros(1, dtype=np.int64))
        for chunk in preparation.chunks(num_proc, progress):
            add(arrays, chunk)
        for array in arrays.values():
            array.close()
        check(preparation.report)
        (tmp / "report.json").write_text(json.dumps(dataclasses.asdict(preparation.report)))
    except BaseException:
        progress.abandon()
        for array in arrays.values():
            array.file.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, entry)
    progress.finish()


def _add_examples(arrays: dict, chunk) -> None:
    arrays["offsets"].append(arrays["input_ids"].length + np.cumsum(chunk.lengths))
    arrays["input_ids"].append(chunk.input_ids)
    arrays["labels"].append(chunk.labels)


def _write_examples(entry: Path, preparation: Preparation, num_proc: int, split: str) -> None:
    """Tokenise ``preparation``'s rows in ``num_proc`` processes, chunk by chunk into a TokenStore's arrays."""
    _write_chunked(
        entry, preparation, num_proc, split, STORE_ARRAYS, _add_examples, lambda report: check_usable(report, split)
    )


class TokenStore(Sequence):
    """A tokenised split as it lies in the cache: flat ``input_ids`` / ``labels`` arrays (int32) and the examples'
    ``offsets``, memory-mapped. Every process of a run maps the same files, so the corpus is in the page cache once
    per machine, not once per process as lists of ints (~72 bytes a token); the store holds only the offsets. Item
    ``i`` is a view of example ``i`` (its arrays are slices of the maps, read when a batch is collated)."""

    def __init__(self, entry: Path):
        self.input_ids = np.load(entry / "input_ids.npy", mmap_mode="r", allow_pickle=False)
        self.labels = np.load(entry / "labels.npy", mmap_mode="r", allow_pickle=False)
        self.offsets = np.load(entry / "offsets.npy", allow_pickle=False)
        if self.offsets.ndim != 1 or self.offsets[-1] != len(self.input_ids) or len(self.labels) != len(self.input_ids):
            raise ValueError(f"{entry}: offsets end at {self.offsets[-1]}, arrays hold {len(self.input_ids)} tokens")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} of {len(self)}")
        return ExampleView(self, int(self.offsets[index]), int(self.offsets[index + 1]))

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))


class ExampleView(Mapping):
    """One example of a TokenStore: ``input_ids`` and ``labels`` read from the maps as lists when asked for (nothing
    is kept), ``length`` without reading them. Equal to a dict of the same lists."""

    __slots__ = ("_store", "_start", "_end")

    def __init__(self, store: TokenStore, start: int, end: int):
        self._store, self._start, self._end = store, start, end

    @property
    def length(self) -> int:
        return self._end - self._start

    def __getitem__(self, key: str) -> list[int]:
        if key == "input_ids":
            return self._store.input_ids[self._start : self._end].tolist()
        if key == "labels":
            return self._store.labels[self._start : self._end].tolist()
        raise KeyError(key)

    def __iter__(self):
        return iter(("input_ids", "labels"))

    def __len__(self) -> int:
        return 2

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    def __repr__(self) -> str:
        return repr(dict(self.items()))


def _read(entry: Path) -> tuple[TokenStore, DataReport]:
    report = DataReport(**json.loads((entry / "report.json").read_text()))
    return TokenStore(entry), report


PAIR_STORE_ARRAYS = {
    f"{name}{part}": dtype for name in PAIR_FIELDS for part, dtype in (("", np.int32), ("_offsets", np.int64))
}


def _add_pairs(arrays: dict, chunk) -> None:
    for name in PAIR_FIELDS:
        arrays[f"{name}_offsets"].append(arrays[name].length + np.cumsum(chunk.lengths[name]))
        arrays[name].append(chunk.tokens[name])
    if MARGIN in arrays:  # whole pairs: one margin each (a chunk whose rows were all skipped has none)
        arrays[MARGIN].append(chunk.margins if chunk.margins is not None else np.zeros(0))


def _check_pairs(report: DataReport, split: str) -> None:
    if not report.num_examples:
        raise DataError(no_usable_pair(report, split))


def _write_pairs(entry: Path, preparation: Preparation, num_proc: int, split: str, whole: bool = False) -> None:
    """Tokenise ``preparation``'s pairs in ``num_proc`` processes, chunk by chunk into a PairStore's arrays (each
    field's tokens and offsets, and whole pairs' margins: shardtune.data.pair_store)."""
    files = {**PAIR_STORE_ARRAYS, **({MARGIN: np.float64} if whole else {})}
    _write_chunked(entry, preparation, num_proc, split, files, _add_pairs, lambda report: _check_pairs(report, split))


def _read_pairs(entry: Path) -> tuple[PairStore, DataReport]:
    return PairStore(entry), DataReport(**json.loads((entry / "report.json").read_text()))


class DamagedEntry(Exception):
    """A cache entry that cannot be read (an emptied or cut file, what a power cut or a full disk leaves)."""


def _read_checked(entry: Path, read=_read) -> tuple[list[dict], DataReport]:
    try:
        return read(entry)
    except (OSError, EOFError, ValueError, TypeError, KeyError) as e:
        raise DamagedEntry(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}") from None


def _through_cache(entry: Path, write, read) -> tuple[list[dict], DataReport]:
    """``read`` the entry when it is whole; else, under the folder's file lock, ``write`` it (one process does; the
    others wait and read it)."""
    if entry.is_dir():
        with contextlib.suppress(DamagedEntry):
            return _read_checked(entry, read)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f".{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if entry.is_dir():
            try:
                return _read_checked(entry, read)
            except DamagedEntry as e:  # under the lock: one process removes it and tokenises again
                print(
                    f"shardtune: note: the tokenised-data cache entry {entry} is damaged ({e}): removed, "
                    "tokenising again",
                    file=sys.stderr,
                    flush=True,
                )
                shutil.rmtree(entry, ignore_errors=True)
        write(entry)
    return read(entry)  # what every other process reads (the same views of the same files)


def load_examples_cached(cfg: TrainConfig, tokenizer: Any, split: str, root: Path) -> tuple[list[dict], DataReport]:
    """``load_examples`` through the on-disk cache under ``root`` (same result, tokenised once).

    Custom datasets are not cached: their function may read anything, so no key could tell when they change.
    """
    if cfg.data.dataset == "custom_dataset":
        return load_examples(cfg, tokenizer, split)
    return _through_cache(
        root / "tokenized" / cache_key(cfg, tokenizer, split),
        lambda entry: _write_examples(
            entry, prepare_examples(cfg, tokenizer, split), num_processes(cfg.data.num_proc), split
        ),
        _read,
    )


def pairs_entry(cfg: TrainConfig, tokenizer: Any, split: str, root: Path, whole: bool = False) -> Path:
    """The cache folder of ``split``'s tokenised preference pairs (their key: the data's, plus the pair options)."""
    return root / "tokenized" / cache_key(cfg, tokenizer, split, pairs=True, whole=whole)


def load_pairs_cached(
    cfg: TrainConfig, tokenizer: Any, split: str, root: Path, whole: bool = False
) -> tuple[list[dict], DataReport]:
    """``load_pairs`` (shardtune dpo's tokenised preference pairs; ``whole``: as a reward model reads them) through the
    on-disk cache under ``root``."""
    return _through_cache(
        pairs_entry(cfg, tokenizer, split, root, whole),
        lambda entry: _write_pairs(
            entry, pair_preparation(cfg, tokenizer, split, whole), num_processes(cfg.data.num_proc), split, whole
        ),
        _read_pairs,
    )


def read_reference_log_probs(path: Path, num_pairs: int) -> np.ndarray | None:
    """A pair split's cached reference (chosen, rejected) log-probabilities (--precompute_ref_log_probs): float64
    of shape (pairs, 2), or None when absent or not whole (a cut or emptied file is computed again)."""
    try:
        values = np.load(path, allow_pickle=False)
    except (OSError, EOFError, ValueError):
        return None
    if values.dtype != np.float64 or values.shape != (num_pairs, 2) or not np.isfinite(values).all():
        return None
    return values


def write_reference_log_probs(path: Path, values: np.ndarray) -> None:
    """Into the pairs' entry folder, atomically (readers see all or nothing)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(values, dtype=np.float64))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, buffer.getvalue())
