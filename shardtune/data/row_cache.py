"""shardtune kto's tokenised unpaired rows (shardtune.data.unpaired) through the tokenised-data cache
(shardtune.data.cache): written once, chunk by chunk, by the launcher or the first worker; memory-mapped by every rank.
Their entry's key is the preference pairs' key of the same data (the data, the tokenizer, the TRL format options)
marked ``-unpaired``; with --precompute_ref_log_probs the reference's log-probabilities are kept beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardtune.config.schema import TrainConfig
from shardtune.data.cache import _through_cache, _write_chunked, cache_key
from shardtune.data.report import DataError, DataReport
from shardtune.data.tokenising import num_processes
from shardtune.data.unpaired import ROW_STORE_ARRAYS, RowStore, add_row_chunk, no_usable_row, row_preparation


def rows_entry(cfg: TrainConfig, tokenizer: Any, split: str, root: Path) -> Path:
    """The cache folder of ``split``'s tokenised unpaired rows."""
    return root / "tokenized" / f"{cache_key(cfg, tokenizer, split, pairs=True)}-unpaired"


def _read_rows(entry: Path) -> tuple[RowStore, DataReport]:
    return RowStore(entry), DataReport(**json.loads((entry / "report.json").read_text()))


def load_rows_cached(cfg: TrainConfig, tokenizer: Any, split: str, root: Path) -> tuple[list[dict], DataReport]:
    """``load_rows`` (shardtune.data.unpaired) through the on-disk cache under ``root``."""

    def check(report: DataReport) -> None:
        if not report.num_examples:
            raise DataError(no_usable_row(report, split))

    def write(entry: Path) -> None:
        preparation = row_preparation(cfg, tokenizer, split)
        processes = num_processes(cfg.data.num_proc)
        _write_chunked(entry, preparation, processes, split, ROW_STORE_ARRAYS, add_row_chunk, check)

    return _through_cache(rows_entry(cfg, tokenizer, split, root), write, _read_rows)
