"""TRL's unpaired preference format -> tokenised rows, as TRL 1.16's KTOTrainer prepares them (shardtune kto).

=======================================  =========================================  ==============================
format                                   columns                                    a row
=======================================  =========================================  ==============================
unpaired preference                      ``prompt``, ``completion``, ``label``      as given (label: desirable)
conversational unpaired preference       the same as message lists                  as given (chat template)
(implicit-prompt) preference             ``chosen``, ``rejected`` (+ ``prompt``)    two rows: chosen (label true),
                                                                                    rejected (label false)
=======================================  =========================================  ==============================

Paired data is unpaired as TRL's ``unpair_preference_dataset`` does under ``Dataset.map(batched=True)``: each block of
1,000 pairs becomes its 1,000 chosen rows then its 1,000 rejected rows (:class:`UnpairedRows`); a split without a
``prompt`` column has its prompt extracted first (the pair's shared prefix). A row is ``{prompt_ids, completion_ids,
label}``: text completions get the tokenizer's eos (unless they end with it); conversations are rendered by the chat
template (the prompt with the generation prompt). The completion starts where the tokenised prompt and prompt +
completion first diverge. A row whose prompt alone fills ``max_length`` is dropped (TRL's filter); :func:`collate_rows`
cuts each sequence to ``max_length`` (from the right, TRL's collator) and right-pads the micro-batch, with
``completion_mask`` marking the completion tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardtune.config.schema import ConfigError
from shardtune.data.emptiness import empty_split, nothing_usable
from shardtune.data.files import Row
from shardtune.data.report import DataError, DataReport, RowFilter
from shardtune.data.tokenising import Preparation
from shardtune.data.trl_formats import _BadRow, _messages, _render, _string, _template_kwargs, common_prefix_length
from shardtune.data.trl_utils import extract_prompt, is_message_list

ROW_FIELDS = ("prompt_ids", "completion_ids")
UNPAIR_BLOCK = 1000  # datasets' map batch size: TRL unpairs a block of pairs at a time
UNPAIRED, CHAT_UNPAIRED = "unpaired preference", "conversational unpaired preference"


@dataclass(frozen=True)
class RowForm:
    """How a split's rows read: pairs to unpair (``paired``; with ``implicit``: no prompt column), conversational."""

    paired: bool
    implicit: bool
    conversational: bool

    @property
    def name(self) -> str:
        kind = "conversational " if self.conversational else ""
        if self.paired:
            return f"{'implicit-prompt ' if self.implicit else ''}{kind}preference (unpaired as TRL does)"
        return f"{kind}unpaired preference"


def row_form(columns: list[str], first: Any) -> RowForm:
    """The form of rows with these columns (and this first row)."""
    first = first if isinstance(first, Mapping) else {}
    if "chosen" in columns and "rejected" in columns:
        return RowForm(True, "prompt" not in columns, is_message_list(first.get("chosen")))
    if {"prompt", "completion", "label"} <= set(columns):
        return RowForm(False, False, is_message_list(first.get("completion")))
    raise ConfigError(
        f"no unpaired preference format in the columns {', '.join(columns) or '(none)'}: expected prompt, completion "
        "and label (TRL's unpaired preference), or chosen and rejected (and prompt) pairs, unpaired as TRL does "
        "(see docs/kto.md)"
    )


class UnpairedRows(Sequence):
    """Pairs read as unpaired rows in TRL's order: block after block of UNPAIR_BLOCK pairs, each block's chosen rows
    then its rejected rows; item i is ``(origin, the pair's row number, (record, label))``."""

    def __init__(self, pairs: Sequence[Row]) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return 2 * len(self.pairs)

    def source(self, index: int) -> tuple[int, bool]:
        """(the pair's index, whether the chosen completion) of unpaired row ``index``."""
        block = index // (2 * UNPAIR_BLOCK)
        start = block * UNPAIR_BLOCK
        size = min(UNPAIR_BLOCK, len(self.pairs) - start)
        offset = index - 2 * start
        return (start + offset, True) if offset < size else (start + offset - size, False)

    def __getitem__(self, index):
        if isinstance(index, slice):
            wanted = [self.source(i) for i in range(*index.indices(len(self)))]
            if not wanted:
                return []
            low, high = min(p for p, _ in wanted), max(p for p, _ in wanted)
            read = self.pairs[low : high + 1]
            return [(read[p - low][0], read[p - low][1], (read[p - low][2], chosen)) for p, chosen in wanted]
        return self[range(len(self))[index] : range(len(self))[index] + 1][0]


def _unpaired_record(record: Any, form: RowForm) -> tuple[Any, Any, bool, Mapping]:
    """(prompt, completion, label, the record for the template's keywords) of one row."""
    if form.paired:
        pair, chosen = record
        if not isinstance(pair, Mapping):
            raise _BadRow("not_an_object", f"a {type(pair).__name__}, not an object with fields")
        read = _messages if form.conversational else _string
        completions = {name: read(pair, name) for name in ("chosen", "rejected")}
        prompt = None if form.implicit else read(pair, "prompt")
        if form.implicit:
            parts = extract_prompt(completions)
            prompt, completions = parts["prompt"], {"chosen": parts["chosen"], "rejected": parts["rejected"]}
        return prompt, completions["chosen" if chosen else "rejected"], chosen, pair
    if not isinstance(record, Mapping):
        raise _BadRow("not_an_object", f"a {type(record).__name__}, not an object with fields")
    label = record.get("label")
    if not isinstance(label, (bool, np.bool_)):
        raise _BadRow("label_not_boolean", f"field 'label' is {label!r}, not true or false")
    read = _messages if form.conversational else _string
    return read(record, "prompt"), read(record, "completion"), bool(label), record


def tokenize_row(record: Any, form: RowForm, tokenizer: Any) -> dict:
    """One row as TRL's KTOTrainer tokenises it: ``{prompt_ids, completion_ids, label}``."""
    prompt, completion, label, source = _unpaired_record(record, form)
    if form.conversational:
        kwargs = _template_kwargs(source)
        prompt_ids = _render(tokenizer, prompt, kwargs, add_generation_prompt=True)["input_ids"]
        full = _render(tokenizer, prompt + completion, kwargs)["input_ids"]
    else:
        eos = tokenizer.eos_token
        completion = completion if completion.endswith(eos) else completion + eos
        prompt_ids = tokenizer(text=prompt)["input_ids"]
        full = tokenizer(text=prompt + completion)["input_ids"]
    prompt_len = common_prefix_length(prompt_ids, full)
    return {"prompt_ids": prompt_ids[:prompt_len], "completion_ids": full[prompt_len:], "label": label}


def prepare_rows(
    rows: list[Row], tokenizer: Any, max_length: int, filt: RowFilter, report: DataReport, form: RowForm
) -> list[dict]:
    """Tokenised rows (bad rows counted, or raised, through ``filt``); ``report.num_truncated`` counts the rows longer
    than ``max_length`` (cut when collated)."""
    out = []
    for origin, row_no, record in rows:
        try:
            row = tokenize_row(record, form, tokenizer)
        except _BadRow as bad:
            filt.skip(bad.reason, origin, row_no, str(bad))
            continue
        prompt_len = len(row["prompt_ids"])
        if prompt_len >= max_length:
            filt.skip(
                "prompt_fills_max_length",
                origin,
                row_no,
                f"the prompt alone has {prompt_len} tokens, --max_length is {max_length}",
                "raise --max_length, or shorten the prompt",
            )
            continue
        if not row["completion_ids"]:
            filt.skip("empty_completion", origin, row_no, "the completion has no token")
            continue
        if prompt_len + len(row["completion_ids"]) > max_length:
            report.num_truncated += 1
        out.append(row)
    return out


@dataclass
class RowChunk:
    """One chunk's rows as flat arrays (each token field back to back, int32, with its lengths; the labels, int8)
    and what its rows' filter counted (shardtune.data.tokenising's Chunk for unpaired rows)."""

    num_rows: int
    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    labels: np.ndarray
    skipped: dict[str, int] = field(default_factory=dict)
    num_truncated: int = 0

    @property
    def num_examples(self) -> int:
        return len(self.labels)

    def examples(self) -> list[dict]:
        split = {}
        for name in ROW_FIELDS:
            ends = np.cumsum(self.lengths[name]).tolist()
            flat = self.tokens[name].tolist()
            split[name] = [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]
        return [
            {"prompt_ids": p, "completion_ids": c, "label": bool(label)}
            for p, c, label in zip(split["prompt_ids"], split["completion_ids"], self.labels.tolist())
        ]


def tokenise_row_chunk(tokenise: Any, strict: bool, rows: list[Row]) -> RowChunk:
    report = DataReport(source="")
    tokenised = tokenise(rows, filt=RowFilter(report, strict))
    n = len(tokenised)
    lengths = {name: np.fromiter((len(r[name]) for r in tokenised), dtype=np.int64, count=n) for name in ROW_FIELDS}
    tokens = {
        name: np.fromiter(
            chain.from_iterable(r[name] for r in tokenised), dtype=np.int32, count=int(lengths[name].sum())
        )
        for name in ROW_FIELDS
    }
    labels = np.fromiter((r["label"] for r in tokenised), dtype=np.int8, count=n)
    return RowChunk(len(rows), tokens, lengths, labels, report.skipped, report.num_truncated)


def _chunk_rows(rows: list[Row], filt: RowFilter, **options: Any) -> list[dict]:
    return prepare_rows(rows, filt=filt, report=filt.report, **options)


def row_preparation(cfg: Any, tokenizer: Any, split: str) -> Preparation:
    """What tokenising ``split``'s unpaired rows takes, chunk by chunk (shardtune.data.tokenising, --dataset_num_proc):
    --dataset_name in TRL's unpaired preference format or its preference formats (unpaired as TRL does), or the
    embedded dialogues as pairs (--dataset synthetic_dialogues); the split's form read from its first row."""
    from shardtune.data.chat import check_chat_template
    from shardtune.data.mixture import mixture_rows
    from shardtune.data.preference import synthetic_pair_rows
    from shardtune.data.trl_loading import _dataset_rows

    if cfg.data.dataset == "trl_dataset":
        source, rows, columns = (mixture_rows if cfg.data.trl_dataset.dataset_mixture else _dataset_rows)(cfg, split)
    elif cfg.data.dataset == "synthetic_dialogues":
        source, rows, columns = synthetic_pair_rows(cfg, split)
    else:
        raise ConfigError(
            f"shardtune kto reads unpaired preference rows: --dataset_name (TRL's unpaired preference or preference "
            f"formats) or --dataset synthetic_dialogues, not --dataset {cfg.data.dataset}"
        )
    if not rows:
        raise empty_split(source, "--dataset_train_split" if split == "train" else "--dataset_test_split")
    form = row_form(columns, rows[0][2])
    if form.conversational:
        check_chat_template(cfg, tokenizer, f"{source} ({form.name} rows)")
    if form.paired:
        rows = UnpairedRows(rows)
    report = DataReport(source=f"{source}: {form.name} rows", num_rows=len(rows))
    tokenise = functools.partial(_chunk_rows, tokenizer=tokenizer, max_length=cfg.data.context_length, form=form)
    return Preparation(report, rows, tokenise, cfg.data.strict, pack=tokenise_row_chunk)


def no_usable_row(report: DataReport, split: str) -> str:
    return nothing_usable(report, f"{split} row", "fix the data (see the skip reasons) or raise --max_length")


def load_rows(cfg: Any, tokenizer: Any, split: str) -> tuple[list[dict], DataReport]:
    """Tokenised unpaired rows of ``split`` ("train" or "validation"), in this process (what the cache holds)."""
    preparation = row_preparation(cfg, tokenizer, split)
    rows = preparation.examples()
    if not rows:
        raise DataError(no_usable_row(preparation.report, split))
    return rows, preparation.report


# -- the rows as they lie in the cache ---------------------------------------------------------------------------------

# the files of an entry: each token field's tokens (int32) and offsets (int64), and the labels (int8)
ROW_STORE_ARRAYS = {
    **{f"{name}{part}": dtype for name in ROW_FIELDS for part, dtype in (("", np.int32), ("_offsets", np.int64))},
    "label": np.int8,
}


def add_row_chunk(arrays: dict, chunk: RowChunk) -> None:
    """Append a chunk to an entry's growing arrays (shardtune.data.cache)."""
    for name in ROW_FIELDS:
        arrays[f"{name}_offsets"].append(arrays[name].length + np.cumsum(chunk.lengths[name]))
        arrays[name].append(chunk.tokens[name])
    arrays["label"].append(chunk.labels)


class RowStore(Sequence):
    """A split's tokenised unpaired rows memory-mapped from the cache (as shardtune.data.pair_store's pairs): item
    ``i`` is a :class:`RowView`; what the run adds to a row (its ``index``, precomputed ``ref_logps``) kept here."""

    def __init__(self, entry: Path):
        self.tokens = {name: np.load(entry / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in ROW_FIELDS}
        self.offsets = {name: np.load(entry / f"{name}_offsets.npy", allow_pickle=False) for name in ROW_FIELDS}
        self.labels = np.load(entry / "label.npy", allow_pickle=False)
        for name in ROW_FIELDS:
            offsets = self.offsets[name]
            if offsets.ndim != 1 or len(offsets) != len(self.labels) + 1 or offsets[-1] != len(self.tokens[name]):
                raise ValueError(f"{entry}: {name} offsets do not match its {len(self.labels)} rows")
        self.added: dict[str, list] = {}

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return RowView(self, range(len(self))[index])

    def field(self, name: str, index: int) -> list[int]:
        offsets = self.offsets[name]
        return self.tokens[name][offsets[index] : offsets[index + 1]].tolist()

    def field_length(self, name: str, index: int) -> int:
        return int(self.offsets[name][index + 1] - self.offsets[name][index])

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))


class RowView(Mapping):
    """Row ``index`` of a RowStore: equal to a dict of the same fields (and of what the run set on it)."""

    __slots__ = ("_store", "_index")

    def __init__(self, store: RowStore, index: int):
        self._store, self._index = store, index

    @property
    def length(self) -> int:
        return sum(self._store.field_length(name, self._index) for name in ROW_FIELDS)

    def __getitem__(self, key: str) -> Any:
        if key in ROW_FIELDS:
            return self._store.field(key, self._index)
        if key == "label":
            return bool(self._store.labels[self._index])
        value = self._store.added.get(key, ())
        if not value or value[self._index] is None:
            raise KeyError(key)
        return value[self._index]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in (*ROW_FIELDS, "label"):
            raise TypeError(f"a cached row's {key} is read-only")
        self._store.added.setdefault(key, [None] * len(self._store))[self._index] = value

    def __iter__(self):
        added = [k for k, values in self._store.added.items() if values[self._index] is not None]
        return iter((*ROW_FIELDS, "label", *added))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    def __repr__(self) -> str:
        return repr(dict(self.items()))


# -- batches -----------------------------------------------------------------------------------------------------------


def row_sequence(prompt: list[int], completion: list[int], max_length: int | None) -> tuple[list[int], list[int]]:
    """(ids, completion mask) of prompt + completion, cut to ``max_length`` from the right (TRL's collator)."""
    ids, mask = list(prompt) + list(completion), [0] * len(prompt) + [1] * len(completion)
    return (ids, mask) if max_length is None else (ids[:max_length], mask[:max_length])


def pad_sequences(sequences: list[tuple[list[int], list[int]]], pad_id: int, prefix: str = "") -> dict:
    """Right-padded ``input_ids``, ``attention_mask``, ``completion_mask`` (keys with ``prefix``)."""
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    completion = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, (ids, mask) in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[i, : len(ids)] = 1
        completion[i, : len(ids)] = torch.tensor(mask, dtype=torch.long)
    return {
        f"{prefix}input_ids": input_ids,
        f"{prefix}attention_mask": attention,
        f"{prefix}completion_mask": completion,
    }


def collate_rows(
    rows: list[Mapping], pad_id: int, max_length: int | None, kl_completions: list[list[int]] | None = None
) -> dict[str, torch.Tensor]:
    """A micro-batch of unpaired rows as TRL's ``DataCollatorForUnpairedPreference``: ``input_ids``,
    ``attention_mask``, ``completion_mask`` (right-padded), ``label`` (bool); with ``kl_completions`` (each row's
    mismatched completion) the KL rows, each prompt with that completion, under the ``KL_`` prefix; and the rows'
    precomputed reference log-probabilities (``ref_logps``, and ``ref_KL_logps`` with the KL rows) when they carry
    them (``ref_logps``: (policy row, KL row) per row)."""
    batch = pad_sequences([row_sequence(r["prompt_ids"], r["completion_ids"], max_length) for r in rows], pad_id)
    if kl_completions is not None:
        kl = [row_sequence(r["prompt_ids"], c, max_length) for r, c in zip(rows, kl_completions)]
        batch.update(pad_sequences(kl, pad_id, "KL_"))
    batch["label"] = torch.tensor([bool(r["label"]) for r in rows], dtype=torch.bool)
    if rows and all("ref_logps" in r for r in rows):
        ref = torch.tensor([r["ref_logps"] for r in rows], dtype=torch.float32)
        batch["ref_logps"] = ref[:, 0]
        if kl_completions is not None:
            batch["ref_KL_logps"] = ref[:, 1]
    return batch
