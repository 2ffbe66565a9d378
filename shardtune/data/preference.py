"""TRL's preference formats -> tokenised pairs, as TRL's DPOTrainer (trl 1.16) prepares them.

=======================================  =========================================  ==============================
format                                   columns                                    prompt
=======================================  =========================================  ==============================
preference                               ``prompt``, ``chosen``, ``rejected`` text   as given
conversational preference                the same as message lists                   as given (chat template)
implicit-prompt preference               ``chosen``, ``rejected`` (text or lists)    their shared prefix
=======================================  =========================================  ==============================

A pair is ``{prompt_ids, chosen_ids, rejected_ids}``: text completions get the tokenizer's eos (unless they end
with it); conversations are rendered by the chat template (the prompt with the generation prompt). The completion
starts where the tokenised prompt and prompt + completion first diverge (for both completions: the shorter of the
two prefixes). With ``keep_start`` a pair whose prompt alone fills ``max_length`` is dropped (TRL's filter);
:func:`collate_pairs` cuts each sequence to ``max_length`` (keep_start / keep_end) and lays a batch out as TRL's
``DataCollatorForPreference``: the chosen rows first, then the rejected rows, right-padded, with
``completion_mask`` marking the completion tokens. TRL 1.16 has no ``max_prompt_length``: ``max_length`` alone
bounds a sequence.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from shardtune.config.schema import ConfigError
from shardtune.data.batching import EXAMPLE_IDS, EXAMPLE_LENGTHS
from shardtune.data.emptiness import empty_split, nothing_usable
from shardtune.data.files import Row
from shardtune.data.pair_store import MARGIN, PAIR_FIELDS
from shardtune.data.report import DataReport, RowFilter
from shardtune.data.shared_prompt import rows_layout
from shardtune.data.tokenising import Preparation
from shardtune.data.trl_formats import (
    _BadRow,
    _messages,
    _render,
    _string,
    _template_kwargs,
    common_prefix_length,
)
from shardtune.data.trl_utils import extract_prompt, is_message_list, prompt_is_implicit

PREFERENCE, CHAT_PREFERENCE = "preference", "conversational preference"


def recognise_preference(columns: list[str], first: Mapping) -> tuple[str, bool]:
    """(the format's name, whether the prompt is implicit) of rows with these columns."""
    if "chosen" not in columns or "rejected" not in columns:
        raise ConfigError(
            f"no preference format in the columns {', '.join(columns) or '(none)'}: expected chosen and "
            "rejected (and prompt, or a prompt shared as their prefix; see docs/dpo.md)"
        )
    conversational = is_message_list(first.get("chosen"))
    implicit = "prompt" not in columns or prompt_is_implicit(first)
    kind = CHAT_PREFERENCE if conversational else PREFERENCE
    return (f"implicit-prompt {kind}" if implicit else kind), implicit


def _tokenize_pair(record: Mapping, conversational: bool, implicit: bool, tokenizer: Any) -> dict:
    if conversational:
        chosen, rejected = _messages(record, "chosen"), _messages(record, "rejected")
        prompt = None if implicit else _messages(record, "prompt")
    else:
        chosen, rejected = _string(record, "chosen"), _string(record, "rejected")
        prompt = None if implicit else _string(record, "prompt")
    if implicit:
        parts = extract_prompt({"chosen": chosen, "rejected": rejected})
        prompt, chosen, rejected = parts["prompt"], parts["chosen"], parts["rejected"]
    if conversational:
        kwargs = _template_kwargs(record)
        prompt_ids = _render(tokenizer, prompt, kwargs, add_generation_prompt=True)["input_ids"]
        chosen_full = _render(tokenizer, prompt + chosen, kwargs)["input_ids"]
        rejected_full = _render(tokenizer, prompt + rejected, kwargs)["input_ids"]
    else:
        eos = tokenizer.eos_token
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        prompt_ids = tokenizer(text=prompt)["input_ids"]
        chosen_full = tokenizer(text=prompt + chosen)["input_ids"]
        rejected_full = tokenizer(text=prompt + rejected)["input_ids"]
    prompt_len = min(common_prefix_length(prompt_ids, chosen_full), common_prefix_length(prompt_ids, rejected_full))
    return {
        "prompt_ids": prompt_ids[:prompt_len],
        "chosen_ids": chosen_full[prompt_len:],
        "rejected_ids": rejected_full[prompt_len:],
    }


def prepare_pairs(
    rows: list[Row],
    columns: list[str],
    tokenizer: Any,
    max_length: int,
    truncation_mode: str,
    filt: RowFilter,
    report: DataReport,
    form: tuple[bool, bool] | None = None,
    whole: bool = False,
) -> list[dict]:
    """Tokenised pairs of ``rows`` (bad rows counted, or raised, through ``filt``); ``report.num_truncated``
    counts the pairs with a sequence longer than ``max_length`` (cut when collated). ``form``: (implicit prompt,
    conversational), the split's (its first row's; default: these rows' first). ``whole``: the pairs a scoring
    model reads (:func:`whole_pair`: no sequence is cut; a ``margin`` column is kept)."""
    implicit, conversational = form or split_form(columns, rows[0][2] if rows else {})
    pairs = []
    for origin, row_no, record in rows:
        try:
            if not isinstance(record, Mapping):
                raise _BadRow("not_an_object", f"a {type(record).__name__}, not an object with fields")
            pair = _tokenize_pair(record, conversational, implicit, tokenizer)
            if whole:  # TRL's margin column; without it the loss is the margin-0 one exactly
                pair[MARGIN] = _margin(record) if MARGIN in columns else 0.0
        except _BadRow as bad:
            filt.skip(bad.reason, origin, row_no, str(bad))
            continue
        if whole:
            if whole_pair(pair, max_length, filt, origin, row_no):
                pairs.append(pair)
            continue
        prompt_len = len(pair["prompt_ids"])
        if truncation_mode == "keep_start" and prompt_len >= max_length:
            filt.skip(
                "prompt_fills_max_length",
                origin,
                row_no,
                f"the prompt alone has {prompt_len} tokens, --max_length is {max_length}",
                "raise --max_length, or shorten the prompt",
            )
            continue
        if not pair["chosen_ids"] or not pair["rejected_ids"]:
            filt.skip("empty_completion", origin, row_no, "a completion has no token")
            continue
        if prompt_len + max(len(pair["chosen_ids"]), len(pair["rejected_ids"])) > max_length:
            report.num_truncated += 1
        pairs.append(pair)
    return pairs


def _margin(record: Mapping) -> float:
    value = record.get("margin")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _BadRow("margin_not_a_number", f"its margin is {value!r}, not a finite number")
    return float(value)


def whole_pair(pair: Mapping, max_length: int | None, filt: RowFilter, origin: str, row_no: int) -> bool:
    """Whether a scoring model (a reward model) reads the pair, as TRL's RewardTrainer prepares it: prompt + chosen
    and prompt + rejected are whole sequences, and a pair with one longer than ``max_length`` is dropped (counted
    under ``longer_than_max_length``), not cut (a cut sequence would be scored at another token)."""
    longest = len(pair["prompt_ids"]) + max(len(pair["chosen_ids"]), len(pair["rejected_ids"]))
    if max_length is not None and longest > max_length:
        filt.skip(
            "longer_than_max_length",
            origin,
            row_no,
            f"a sequence of the pair has {longest} tokens, --max_length is {max_length}",
            "raise --max_length, or shorten the row",
        )
        return False
    if not pair["chosen_ids"] or not pair["rejected_ids"]:
        filt.skip("empty_completion", origin, row_no, "a completion has no token")
        return False
    return True


def split_form(columns: list[str], first: Any) -> tuple[bool, bool]:
    """(implicit prompt, conversational) of a split, from its columns and first row."""
    _, implicit = recognise_preference(columns, first)
    return implicit, is_message_list(first.get("chosen") if isinstance(first, Mapping) else None)


@dataclass
class PairChunk:
    """One chunk's pairs as flat arrays (each field's tokens back to back, int32, and its lengths), and what its
    rows' filter counted (shardtune.data.tokenising's Chunk for pairs)."""

    num_rows: int
    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    skipped: dict[str, int] = field(default_factory=dict)
    num_truncated: int = 0
    margins: np.ndarray | None = None  # whole pairs' margins (float64), one per pair; None: pairs without

    @property
    def num_examples(self) -> int:
        return len(self.lengths[PAIR_FIELDS[0]])

    def examples(self) -> list[dict]:
        """The pairs as dicts of lists (and their margins)."""
        split = {}
        for name in PAIR_FIELDS:
            ends = np.cumsum(self.lengths[name]).tolist()
            flat = self.tokens[name].tolist()
            split[name] = [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]
        pairs = [dict(zip(PAIR_FIELDS, values)) for values in zip(*split.values())]
        for pair, margin in zip(pairs, self.margins.tolist() if self.margins is not None else ()):
            pair[MARGIN] = margin
        return pairs


def tokenise_pair_chunk(tokenise: Any, strict: bool, rows: list[Row]) -> PairChunk:
    report = DataReport(source="")
    pairs = tokenise(rows, filt=RowFilter(report, strict))
    lengths = {
        name: np.fromiter((len(p[name]) for p in pairs), dtype=np.int64, count=len(pairs)) for name in PAIR_FIELDS
    }
    tokens = {
        name: np.fromiter(chain.from_iterable(p[name] for p in pairs), dtype=np.int32, count=int(lengths[name].sum()))
        for name in PAIR_FIELDS
    }
    margins = np.array([p[MARGIN] for p in pairs], dtype=np.float64) if pairs and MARGIN in pairs[0] else None
    return PairChunk(len(rows), tokens, lengths, report.skipped, report.num_truncated, margins)


def _chunk_pairs(rows: list[Row], filt: RowFilter, **options: Any) -> list[dict]:
    return prepare_pairs(rows, filt=filt, report=filt.report, **options)


def pair_sequences(
    pair: Mapping, max_length: int | None, truncation_mode: str = "keep_start"
) -> tuple[list[int], list[int], list[int], list[int]]:
    """(chosen ids, chosen completion mask, rejected ids, rejected completion mask), each cut to max_length."""
    cut = (
        slice(None)
        if max_length is None
        else slice(None, max_length)
        if truncation_mode == "keep_start"
        else slice(-max_length, None)
    )
    prompt = list(pair["prompt_ids"])
    out = []
    for name in ("chosen_ids", "rejected_ids"):
        ids = prompt + list(pair[name])
        mask = [0] * len(prompt) + [1] * len(pair[name])
        out += [ids[cut], mask[cut]]
    return tuple(out)  # type: ignore[return-value]


def collate_pairs(
    pairs: list[Mapping], pad_id: int, max_length: int | None, truncation_mode: str = "keep_start"
) -> dict[str, torch.Tensor]:
    """A micro-batch of ``n`` pairs: rows 0..n-1 the chosen sequences, n..2n-1 the rejected, right-padded:
    ``input_ids``, ``attention_mask``, ``completion_mask`` (B = 2n, T = the longest); and ``ref_logps`` (n, 2) when
    the pairs carry their precomputed reference log-probabilities (--precompute_ref_log_probs)."""
    seqs = [pair_sequences(p, max_length, truncation_mode) for p in pairs]
    rows = [(s[0], s[1]) for s in seqs] + [(s[2], s[3]) for s in seqs]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    completion = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        completion[i, : len(ids)] = torch.tensor(mask)
    batch = {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}
    if pairs and all("ref_logps" in p for p in pairs):
        batch["ref_logps"] = torch.tensor([p["ref_logps"] for p in pairs], dtype=torch.float32)
    return batch


def collate_pairs_flat(
    pairs: list[Mapping], max_length: int | None, truncation_mode: str = "keep_start"
) -> dict[str, torch.Tensor]:
    """A padding-free micro-batch of ``n`` pairs: ONE row holding the chosen sequences then the rejected ones back to
    back, no pad token, positions restarting at each sequence and ``cu_seq_lens`` marking where each starts (the
    layout of shardtune.data.batching.collate_flat, which the varlen attention keeps within each sequence)."""
    seqs = [pair_sequences(p, max_length, truncation_mode) for p in pairs]
    rows = [(s[0], s[1]) for s in seqs] + [(s[2], s[3]) for s in seqs]
    lengths = [len(ids) for ids, _ in rows]
    input_ids = torch.tensor([token for ids, _ in rows for token in ids], dtype=torch.long)
    completion = torch.tensor([m for _, mask in rows for m in mask], dtype=torch.long)
    cu_seq_lens = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu_seq_lens[1:] = torch.tensor(lengths).cumsum(0)
    batch = {
        "input_ids": input_ids[None],
        "completion_mask": completion[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "cu_seq_lens": cu_seq_lens,
        "max_length": torch.tensor(max(lengths)),
        "completion_lengths": torch.tensor([sum(mask) for _, mask in rows], dtype=torch.long),
    }
    if pairs and all("ref_logps" in p for p in pairs):
        batch["ref_logps"] = torch.tensor([p["ref_logps"] for p in pairs], dtype=torch.float32)
    return batch


def synthetic_pair_rows(cfg: Any, split: str) -> tuple[str, list[Row], list[str]]:
    """The embedded dialogues as conversational preference rows: chosen is the dialogue's own summary, rejected
    the next dialogue's (the last one takes the first's)."""
    from shardtune.data.synthetic import generate_dialogues
    from shardtune.data.trl_loading import SYNTHETIC_SYSTEM_PROMPT

    sd = cfg.data.synthetic_dialogues
    num = sd.num_train if split == "train" else sd.num_validation
    source = f"synthetic_dialogues: {num} generated {split} dialogues as preference pairs (seed {sd.seed})"
    dialogues = generate_dialogues(num, sd.seed, split, chatter=sd.chatter)
    rows = [
        {
            "prompt": [
                {"role": "system", "content": SYNTHETIC_SYSTEM_PROMPT},
                {"role": "user", "content": d["dialogue"]},
            ],
            "chosen": [{"role": "assistant", "content": d["summary"]}],
            "rejected": [{"role": "assistant", "content": dialogues[(i + 1) % len(dialogues)]["summary"]}],
        }
        for i, d in enumerate(dialogues)
    ]
    return source, [(source, i, r) for i, r in enumerate(rows, start=1)], ["prompt", "chosen", "rejected"]


def load_pairs(cfg: Any, tokenizer: Any, split: str, whole: bool = False) -> tuple[list[dict], DataReport]:
    """Tokenised pairs of ``split`` ("train" or "validation"), in this process (what the cache holds, as lists);
    ``whole``: as a scoring model reads them (:func:`whole_pair`)."""
    from shardtune.data.report import DataError

    preparation = pair_preparation(cfg, tokenizer, split, whole)
    pairs = preparation.examples()
    if not pairs:
        raise DataError(no_usable_pair(preparation.report, split))
    return pairs, preparation.report


def no_usable_pair(report: DataReport, split: str) -> str:
    return nothing_usable(report, f"{split} pair", "fix the data (see the skip reasons) or raise --max_length")


def pair_preparation(cfg: Any, tokenizer: Any, split: str, whole: bool = False) -> Preparation:
    """What tokenising ``split``'s pairs takes, chunk by chunk (shardtune.data.tokenising, --dataset_num_proc):
    --dataset_name in TRL's preference formats, or the embedded dialogues as pairs (--dataset synthetic_dialogues);
    the split's form (implicit prompt, conversational) read from its first row, for every chunk. ``whole``: the
    pairs a scoring model reads (:func:`whole_pair`), with their margins."""
    from shardtune.data.chat import check_chat_template
    from shardtune.data.mixture import mixture_rows
    from shardtune.data.trl_loading import _dataset_rows

    if cfg.data.dataset == "trl_dataset":
        source, rows, columns = (mixture_rows if cfg.data.trl_dataset.dataset_mixture else _dataset_rows)(cfg, split)
    elif cfg.data.dataset == "synthetic_dialogues":
        source, rows, columns = synthetic_pair_rows(cfg, split)
    else:
        raise ConfigError(
            f"shardtune {cfg.objective} reads preference pairs: --dataset_name (TRL's preference formats) or "
            f"--dataset synthetic_dialogues, not --dataset {cfg.data.dataset}"
        )
    if not rows:
        raise empty_split(source, "--dataset_train_split" if split == "train" else "--dataset_test_split")
    kind, _ = recognise_preference(columns, rows[0][2])
    if kind.endswith(CHAT_PREFERENCE):
        check_chat_template(cfg, tokenizer, f"{source} ({kind} rows)")
    report = DataReport(source=f"{source}: {kind} rows", num_rows=len(rows))
    tokenise = functools.partial(
        _chunk_pairs,
        columns=columns,
        tokenizer=tokenizer,
        max_length=cfg.data.context_length,
        truncation_mode=cfg.data.trl_dataset.truncation_mode,
        form=split_form(columns, rows[0][2]),
        whole=whole,
    )
    return Preparation(report, rows, tokenise, cfg.data.strict, pack=tokenise_pair_chunk)


def collate_pair_units(units: list[list[Mapping]], cfg: Any, pad_id: int) -> dict[str, torch.Tensor]:
    """The training loader's collate for pairs (one pair per unit): :func:`collate_pairs` with the run's
    --max_length and truncation mode (with the shared-prompt layout of its rows, which the model computes on where it
    can: shardtune.model.shared_prompt), or :func:`collate_pairs_flat` with --padding_free. Pairs that carry their
    place in the training data (``index``) get LoRA dropout's per-token keys too (:func:`pair_example_ids`)."""
    pairs = [pair for unit in units for pair in unit]
    if (
        cfg.data.padding_free or cfg.parallel.sequence_parallel_size * cfg.parallel.context_parallel_size > 1
    ):  # split rows are flat
        batch = collate_pairs_flat(pairs, cfg.data.context_length, cfg.data.trl_dataset.truncation_mode)
    else:  # and the chosen and rejected rows of a prompt as one row (shardtune.model.shared_prompt)
        batch = collate_pairs(pairs, pad_id, cfg.data.context_length, cfg.data.trl_dataset.truncation_mode)
        batch.update(rows_layout(batch, pad_id))
    if pairs and all("index" in pair for pair in pairs):
        batch.update(pair_example_ids(batch, [pair["index"] for pair in pairs]))
    return batch


def pair_example_ids(batch: dict[str, torch.Tensor], indices: list[int]) -> dict[str, torch.Tensor]:
    """Per token, the keys of LoRA dropout masks that do not depend on the rank layout (shardtune.model.lora_dropout):
    the sequence's global id (pair ``i``'s chosen ``2 i``, its rejected ``2 i + 1``; -1 on padding), its length, and
    for padded rows the positions (what the model computes by default for right-padded rows)."""
    ids = [2 * i for i in indices] + [2 * i + 1 for i in indices]  # chosen rows first, then rejected
    if "cu_seq_lens" in batch:
        lengths = batch["cu_seq_lens"].diff().long()
        return {
            EXAMPLE_IDS: torch.repeat_interleave(torch.tensor(ids), lengths)[None],
            EXAMPLE_LENGTHS: torch.repeat_interleave(lengths, lengths)[None],
        }
    rows, width = batch["input_ids"].shape
    real = batch["attention_mask"].bool()
    lengths = real.sum(dim=1, keepdim=True).expand(rows, width)
    return {
        EXAMPLE_IDS: torch.where(real, torch.tensor(ids)[:, None], -1),
        EXAMPLE_LENGTHS: torch.where(real, lengths, 0),
        "position_ids": torch.arange(width).expand(rows, width).clone(),
    }
