"""llama-cookbook's custom dataset files for a vision-language model (its multi-modal recipe, e.g. ocrvqa):
``get_custom_dataset(dataset_config, processor, split)`` returns the rows, and ``get_data_collator(processor)``, where
the file defines it, a callable that turns a list of rows into a batch (input_ids, attention_mask, labels, pixels and
the family's other keys) through the processor. The cookbook passes the processor, not the tokenizer, to both.

A file without a collator must return rows in one of TRL's vision formats (shardtune.data.vision), which shardtune's
own collator batches. A file with one: every row is batched alone by it before launch, so a row it fails on is refused
naming the file and the row, a batch key the model would not take is refused, and each row gets its length (what
batching sorts a global batch by) and its labelled tokens (a row with none is skipped and counted). During training
the collator makes every micro-batch from the rows the sampler chose, and the loss is normalised by the step's
labelled tokens over all ranks as for every other row (shardtune.model.loss).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.report import DataError, RowFilter
from shardtune.data.sources import load_custom_file
from shardtune.data.vision import MODEL_INPUT_KEYS, VisionExample, VisionRows

# what the loss passes to the model's forward from a batch (shardtune.model.loss.model_inputs), and the labels it reads
PASSED_KEYS = ("input_ids", "attention_mask", "position_ids", *MODEL_INPUT_KEYS)
CUSTOM = "custom"


class NumberedRows:
    """The function's rows as (origin, row number from 1, row) triples, read lazily (a ``datasets.Dataset`` decodes its
    images when a row is read)."""

    def __init__(self, rows: Any, origin: str) -> None:
        self.rows, self.origin = rows, origin

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[str, int, Any]:
        return self.origin, index + 1, self.rows[index]


class CollatedRows:
    """A split whose rows the file's own collator batches: the rows, the collator, and where they come from."""

    kind = CUSTOM

    def __init__(self, rows: NumberedRows, collator: Callable[[list], Any], file: str) -> None:
        self.rows, self.collator, self.file = rows, collator, file

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> tuple[str, int, Any]:
        return self.rows[index]


def custom_vision_rows(cfg: TrainConfig, processor: Any, split: str) -> tuple[str, VisionRows | CollatedRows]:
    """(source, rows) of ``split`` ("train" or "validation": --custom_dataset.train_split / .test_split is what the
    function is given): batched by the file's collator where it defines one, else read as TRL's vision formats."""
    cc = cfg.data.custom_dataset
    custom_split = cc.train_split if split == "train" else cc.test_split
    source = f"custom_dataset: {cc.file} split {custom_split}"
    function, collator_factory = load_custom_file(cc.file)
    try:
        rows = function(cc, processor, custom_split)
        if not (hasattr(rows, "__len__") and hasattr(rows, "__getitem__")):
            rows = list(rows)
        collator = collator_factory(processor) if collator_factory is not None else None
    except Exception as e:  # user code
        raise DataError(
            f"{source}: the dataset file failed ({type(e).__name__}: {e}): fix {cc.file} (get_custom_dataset(config, "
            "processor, split) returns rows; get_data_collator(processor) a callable batching a list of them)"
        ) from e
    if not len(rows):
        raise DataError(f"{source}: the function returned no rows: fix {cc.file} or --custom_dataset.{split}_split")
    numbered = NumberedRows(rows, source)
    if collator is not None:
        if not callable(collator):
            raise ConfigError(f"{cc.file}: get_data_collator returned a {type(collator).__name__}, not a callable")
        return source, CollatedRows(numbered, collator, cc.file)
    columns = rows.column_names if hasattr(rows, "column_names") else list(_first_row(rows, source, cc.file))
    try:
        return source, VisionRows(numbered, columns, None, cfg.data.trl_dataset.dataset_text_field)
    except DataError as e:
        raise DataError(f"{source}: {e} (or define get_data_collator(processor) in {cc.file})") from None


def _first_row(rows: Sequence, source: str, file: str) -> dict:
    first = rows[0]
    if not isinstance(first, dict):
        raise DataError(f"{source}: row 1 is a {type(first).__name__}, not a dict: fix {file}")
    return first


def check_collated_rows(
    rows: CollatedRows, forward_keys: frozenset[str] | None, context_length: int, filt: RowFilter
) -> list[VisionExample]:
    """Every row batched alone by the file's collator: a failure or a key the model would not take is refused (one
    line naming the file and the row); the rows kept with their lengths. ``forward_keys``: the keywords the model's
    forward takes (None: not known, not checked). A row longer than --context_length or with no labelled token is
    skipped and counted (--strict: refused), as the cookbook's custom text rows are."""
    kept = []
    for index in range(len(rows)):
        origin, number, _ = rows.row(index)
        batch = collate_rows(rows, [index], forward_keys)
        length = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].size(1)
        if length > context_length:
            filt.skip("too_long", origin, number, f"{length} tokens > --context_length {context_length}")
        elif not bool((batch["labels"][:, 1:] != -100).any()):
            filt.skip("no_labels", origin, number, "the collator's labels are all -100 (nothing to learn)")
        else:
            kept.append(VisionExample(index, length))
    filt.report.num_examples += len(kept)
    return kept


def collate_rows(rows: CollatedRows, indices: list[int], forward_keys: frozenset[str] | None) -> dict:
    """The collator's batch of rows ``indices``, checked: tensors only, input_ids and labels of one (rows, tokens)
    shape, and only keys the loss passes to the model and the model takes."""
    numbers = ", ".join(str(rows.row(i)[1]) for i in indices)
    where = f"{rows.row(indices[0])[0]} {'row' if len(indices) == 1 else 'rows'} {numbers}"
    try:
        batch = dict(rows.collator([rows.row(i)[2] for i in indices]))
    except Exception as e:  # user code: one line naming the file and the rows
        raise DataError(
            f"{where}: its data collator failed ({type(e).__name__}: {e}): fix the collator or the data"
        ) from e
    problem = _batch_problem(batch, forward_keys)
    if problem:
        raise DataError(f"{where}: the data collator's batch {problem}")
    return batch


def _batch_problem(batch: dict, forward_keys: frozenset[str] | None) -> str:
    for key in ("input_ids", "labels"):
        if not isinstance(batch.get(key), torch.Tensor) or batch[key].dim() != 2 or batch[key].is_floating_point():
            return f"has no {key} as a (rows, tokens) tensor of token ids: return it"
    if batch["labels"].shape != batch["input_ids"].shape:
        return f"has labels of shape {tuple(batch['labels'].shape)} beside input_ids {tuple(batch['input_ids'].shape)}"
    for key, value in batch.items():
        if key != "labels" and key not in PASSED_KEYS:
            return (
                f"has {key!r}, which shardtune does not pass to the model (it passes {', '.join(PASSED_KEYS)}): "
                "drop it from the batch"
            )
        if key != "labels" and forward_keys is not None and key not in forward_keys:
            return f"has {key!r}, which the model's forward does not take: drop it from the batch"
        if not isinstance(value, torch.Tensor):
            return f"has {key!r} as a {type(value).__name__}, not a tensor: return tensors (return_tensors='pt')"
    return ""


class CollatedBatches:
    """A micro-batch of rows through the file's collator (called with the units of a micro-batch, each a list of
    one VisionExample, as shardtune.data.vision.VisionCollator)."""

    def __init__(self, rows: CollatedRows, forward_keys: frozenset[str] | None) -> None:
        self.rows, self.forward_keys = rows, forward_keys

    def __call__(self, units: list, cfg: Any = None, pad_id: int = 0) -> dict[str, torch.Tensor]:
        return collate_rows(self.rows, [example.index for unit in units for example in unit], self.forward_keys)
