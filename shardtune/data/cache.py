"""Tokenise once: the launcher (or the first worker) writes the tokenised examples, every rank reads them.

This also moves data errors before any process group: the launcher loads the data as part of its checks,
so a bad row under --strict_data is one line from the launcher, not a failed worker.

An entry lives in ``<cache>/tokenized/<key>/`` where the key hashes everything the examples depend on: the
dataset settings, the data files' contents, context_length, the seed (it picks held-out rows), strict_data, the
tokenizer (with its chat template) and, for TRL's formats, the loss options (--assistant_only_loss,
--completion_only_loss, --truncation_mode ...). It holds flat int32 ``input_ids`` / ``labels`` arrays plus example
offsets as .npy files (read without unpickling) and the data report as JSON. Entries are written to a temporary
folder and renamed, under a file lock, so concurrent processes never see half an entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

from shardtune.config.schema import TrainConfig
from shardtune.data.report import DataReport
from shardtune.data.sources import load_examples
from shardtune.data.trl_loading import uses_trl_formats
from shardtune.runtime.files import fsync_dir, fsync_tree

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
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(
        tokenizer.chat_template, sort_keys=True)
    return hashlib.sha256((text + json.dumps(specials) + template).encode()).hexdigest()


def cache_key(cfg: TrainConfig, tokenizer: Any, split: str) -> str:
    dataset_config = dataclasses.asdict(cfg.dataset_config)
    digest = hashlib.sha256(json.dumps({
        "format": FORMAT_VERSION, "dataset": cfg.dataset, "dataset_config": dataset_config, "split": split,
        "context_length": cfg.context_length, "seed": cfg.seed, "strict_data": cfg.strict_data,
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "trl_formats": dataclasses.asdict(cfg.trl_dataset) if uses_trl_formats(cfg) else None,
    }, sort_keys=True).encode())
    if dataset_config.get("data_path"):
        _hash_path(Path(dataset_config["data_path"]), digest)
    if cfg.dataset == "trl_dataset":  # a local file or folder (a hub id hashes its name only, as samsum's hub data)
        _hash_path(Path(cfg.trl_dataset.dataset_name), digest)
    if cfg.dataset == "grammar_dataset":  # its split names are the paths of its files
        for path in (cfg.grammar_dataset.train_split, cfg.grammar_dataset.test_split):
            _hash_path(Path(path), digest)
    return digest.hexdigest()[:32]


def _write(entry: Path, examples: list[dict], report: DataReport) -> None:
    lengths = np.array([len(e["input_ids"]) for e in examples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.save(tmp / "input_ids.npy", np.fromiter((t for e in examples for t in e["input_ids"]), dtype=np.int32,
                                                count=int(offsets[-1])))
    np.save(tmp / "labels.npy", np.fromiter((t for e in examples for t in e["labels"]), dtype=np.int32,
                                             count=int(offsets[-1])))
    np.save(tmp / "offsets.npy", offsets)
    (tmp / "report.json").write_text(json.dumps(dataclasses.asdict(report)))
    fsync_tree(tmp)
    os.replace(tmp, entry)
    fsync_dir(entry.parent)


def _read(entry: Path) -> tuple[list[dict], DataReport]:
    input_ids = np.load(entry / "input_ids.npy", allow_pickle=False).tolist()
    labels = np.load(entry / "labels.npy", allow_pickle=False).tolist()
    offsets = np.load(entry / "offsets.npy", allow_pickle=False).tolist()
    examples = [{"input_ids": input_ids[a:b], "labels": labels[a:b]} for a, b in zip(offsets[:-1], offsets[1:])]
    report = DataReport(**json.loads((entry / "report.json").read_text()))
    return examples, report


class DamagedEntry(Exception):
    """A cache entry that cannot be read (an emptied or cut file, what a power cut or a full disk leaves)."""


def _read_checked(entry: Path) -> tuple[list[dict], DataReport]:
    try:
        return _read(entry)
    except (OSError, EOFError, ValueError, TypeError, KeyError) as e:
        raise DamagedEntry(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}") from None


def load_examples_cached(cfg: TrainConfig, tokenizer: Any, split: str, root: Path) -> tuple[list[dict], DataReport]:
    """``load_examples`` through the on-disk cache under ``root`` (same result, tokenised once).

    Custom datasets are not cached: their function may read anything, so no key could tell when they change.
    """
    if cfg.dataset == "custom_dataset":
        return load_examples(cfg, tokenizer, split)
    entry = root / "tokenized" / cache_key(cfg, tokenizer, split)
    if entry.is_dir():
        with contextlib.suppress(DamagedEntry):
            return _read_checked(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f".{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if entry.is_dir():
            try:
                return _read_checked(entry)
            except DamagedEntry as e:  # under the lock: one process removes it and tokenises again
                print(f"shardtune: note: the tokenised-data cache entry {entry} is damaged ({e}): removed, "
                      "tokenising again", file=sys.stderr, flush=True)
                shutil.rmtree(entry, ignore_errors=True)
        examples, report = load_examples(cfg, tokenizer, split)
        _write(entry, examples, report)
    return examples, report
