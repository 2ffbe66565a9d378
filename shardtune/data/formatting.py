"""Prompt templates, tokenisation and label masking.

Every text example becomes ``[bos] + tokens(prompt) + tokens(response) + [eos]`` with labels -100 on bos and
the prompt, so the loss covers the response and eos only (llama-cookbook's samsum format). Prompt and response
are tokenised separately, in one batched call each, with ``add_special_tokens=False``; bos / eos ids are added
explicitly (a tokenizer without a bos token gets none). Examples longer than ``context_length`` are skipped
(reason ``too_long``), never truncated: a truncated summary would teach the model to stop mid-sentence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardtune.config.schema import ConfigError
from shardtune.data.files import Row
from shardtune.data.report import RowFilter

IGNORE_INDEX = -100  # a label that carries no loss (the value torch's cross_entropy ignores by default)

SAMSUM_PROMPT = "Summarize this dialog:\n{dialog}\n---\nSummary:\n"
ALPACA_PROMPT = (
    "Below is a task, together with input that gives it context. Write a response that carries "
    "out the task.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
GRAMMAR_PROMPT = "Correct this to standard English: {input}\n---\nCorrected: "  # llama-cookbook's grammar_dataset
ALPACA_PROMPT_NO_INPUT = (
    "Below is a task. Write a response that carries out the task.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


@dataclass
class TextPair:
    origin: str
    row: int
    prompt: str
    response: str


def _text_field(
    record: Mapping, name: str, origin: str, row: int, filt: RowFilter, optional: bool = False
) -> str | None:
    """The string field ``name`` of ``record``, or None after counting the row as bad."""
    value = record.get(name)
    if value is None:
        if optional:
            return ""
        filt.skip("missing_field", origin, row, f"field {name!r} is missing")
        return None
    if not isinstance(value, str):
        filt.skip("not_a_string", origin, row, f"field {name!r} is a {type(value).__name__}, not a string")
        return None
    if not optional and not value.strip():
        filt.skip(f"empty_{name}", origin, row, f"field {name!r} is empty")
        return None
    return value


def _fields(row: Row, names: tuple[str, ...], optional: tuple[str, ...], filt: RowFilter) -> dict[str, str] | None:
    origin, row_no, record = row
    if not isinstance(record, Mapping):
        filt.skip("not_an_object", origin, row_no, f"a {type(record).__name__}, not an object with fields")
        return None
    values = {}
    for name in names + optional:
        value = _text_field(record, name, origin, row_no, filt, optional=name in optional)
        if value is None:
            return None
        values[name] = value
    return values


def samsum_pairs(rows: list[Row], filt: RowFilter) -> list[TextPair]:
    pairs = []
    for row in rows:
        values = _fields(row, ("dialogue", "summary"), (), filt)
        if values is not None:
            pairs.append(TextPair(row[0], row[1], SAMSUM_PROMPT.format(dialog=values["dialogue"]), values["summary"]))
    return pairs


def alpaca_pairs(rows: list[Row], filt: RowFilter) -> list[TextPair]:
    pairs = []
    for row in rows:
        values = _fields(row, ("instruction", "output"), ("input",), filt)
        if values is None:
            continue
        if values["input"].strip():
            prompt = ALPACA_PROMPT.format(instruction=values["instruction"], input=values["input"])
        else:
            prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=values["instruction"])
        pairs.append(TextPair(row[0], row[1], prompt, values["output"]))
    return pairs


def grammar_pairs(rows: list[Row], filt: RowFilter) -> list[TextPair]:
    pairs = []
    for row in rows:
        values = _fields(row, ("input", "target"), (), filt)
        if values is not None:
            pairs.append(TextPair(row[0], row[1], GRAMMAR_PROMPT.format(input=values["input"]), values["target"]))
    return pairs


def special_ids(tokenizer: Any) -> tuple[list[int], int]:
    """([bos] or [] when the tokenizer has none, eos)."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no eos token: "
            "set tokenizer.eos_token (the model must learn where a response ends)"
        )
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    return bos, tokenizer.eos_token_id


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def template_length(tokenizer: Any, template: str) -> int:
    """Tokens an example always has with ``template``: the template with empty fields, plus bos and eos."""
    bos, _ = special_ids(tokenizer)
    empty = template.format(dialog="", instruction="", input="")
    return len(bos) + len(_encode(tokenizer, [empty])[0]) + 1


def tokenize_pairs(pairs: list[TextPair], tokenizer: Any, context_length: int, filt: RowFilter) -> list[dict]:
    bos, eos = special_ids(tokenizer)
    prompts = _encode(tokenizer, [p.prompt for p in pairs])
    responses = _encode(tokenizer, [p.response for p in pairs])
    examples = []
    for pair, prompt, response in zip(pairs, prompts, responses):
        input_ids = bos + prompt + response + [eos]
        if _too_long(len(input_ids), context_length, pair.origin, pair.row, filt):
            continue
        labels = [IGNORE_INDEX] * (len(bos) + len(prompt)) + response + [eos]
        examples.append({"input_ids": input_ids, "labels": labels})
    return examples


def text_examples(
    rows: list[Row],
    filt: RowFilter,
    *,
    to_pairs: Callable[[list[Row], RowFilter], list[TextPair]],
    tokenizer: Any,
    context_length: int,
) -> list[dict]:
    """The examples of rows of a prompt / response dataset (``to_pairs``: samsum_pairs, alpaca_pairs ...)."""
    return tokenize_pairs(to_pairs(rows, filt), tokenizer, context_length, filt)


def _too_long(num_tokens: int, context_length: int, origin: str, row: int, filt: RowFilter) -> bool:
    if num_tokens <= context_length:
        return False
    filt.skip(
        "too_long",
        origin,
        row,
        f"{num_tokens} tokens > --context_length {context_length}",
        "raise --context_length, or drop --strict_data to skip such rows",
    )
    return True


def token_examples(rows: list[Any], origin: str, vocab_size: int, context_length: int, filt: RowFilter) -> list[dict]:
    """Validate ready-made ``{input_ids, labels}`` rows (lists or 1-D tensors; other fields are ignored)."""
    examples = []
    for row_no, record in enumerate(rows, start=1):
        example = _token_example(record, origin, row_no, vocab_size, filt)
        if example is not None and not _too_long(len(example["input_ids"]), context_length, origin, row_no, filt):
            examples.append(example)
    return examples


def _as_ids(value: Any) -> list[int] | None:
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    if tensor.dim() != 1 or tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        return None
    return tensor.tolist()


def _token_example(record: Any, origin: str, row: int, vocab_size: int, filt: RowFilter) -> dict | None:
    if not isinstance(record, Mapping):
        filt.skip("not_an_object", origin, row, f"a {type(record).__name__}, not a dict with input_ids and labels")
        return None
    ids = {}
    for name in ("input_ids", "labels"):
        if record.get(name) is None:
            filt.skip("missing_field", origin, row, f"field {name!r} is missing")
            return None
        ids[name] = _as_ids(record[name])
        if ids[name] is None:
            filt.skip("not_token_ids", origin, row, f"field {name!r} is not a 1-D sequence of integers")
            return None
    return _check_token_ids(ids["input_ids"], ids["labels"], origin, row, vocab_size, filt)


def _check_token_ids(
    input_ids: list[int], labels: list[int], origin: str, row: int, vocab_size: int, filt: RowFilter
) -> dict | None:
    if not input_ids:
        filt.skip("empty", origin, row, "input_ids is empty")
    elif len(labels) != len(input_ids):
        filt.skip("length_mismatch", origin, row, f"{len(input_ids)} input_ids but {len(labels)} labels")
    elif min(input_ids) < 0 or max(input_ids) >= vocab_size:
        filt.skip("bad_token_id", origin, row, f"input_ids outside the tokenizer's range [0, {vocab_size})")
    elif any(label != IGNORE_INDEX and not 0 <= label < vocab_size for label in labels):
        filt.skip("bad_label", origin, row, f"labels must be {IGNORE_INDEX} or in [0, {vocab_size})")
    elif all(label == IGNORE_INDEX for label in labels):
        filt.skip("no_labels", origin, row, f"every label is {IGNORE_INDEX}: the row teaches nothing")
    else:
        return {"input_ids": input_ids, "labels": labels}
    return None
