"""TRL's dataset formats -> ``{input_ids, labels}``, as TRL's SFTTrainer (trl 1.16) prepares them.

The format is recognised from the columns (and the first row), in TRL's order:

=================================  ===========================================  ==================================
format                             columns                                      labelled (loss) tokens
=================================  ===========================================  ==================================
tokenized                          ``input_ids`` (+ ``completion_mask``,        every token; ``labels`` as given;
                                   ``assistant_masks``, ``labels``)             masks as below
ShareGPT                           ``conversations`` of ``{from, value}``       as messages (from -> role)
prompt-completion                  ``prompt``, ``completion`` (strings)         the completion + eos
conversational prompt-completion   ``prompt``, ``completion`` (message lists)   the completion's tokens
conversational                     ``messages`` (``{role, content}`` lists)     every token
language modelling                 ``--dataset_text_field`` (``text``)          every token + eos
=================================  ===========================================  ==================================

Strings get the tokenizer's eos appended unless they end with it (text; the completion); conversations are
rendered by the tokenizer's chat template, which places eos itself. A ``tools`` column (a list, or its JSON
string) and a ``chat_template_kwargs`` column go to the template. Prompt-completion labels start where the
tokenised prompt and prompt + completion diverge. ``--completion_only_loss`` (auto: on for prompt-completion
rows) keeps only the completion; ``--assistant_only_loss`` keeps only the template's ``{% generation %}`` spans.
Rows longer than ``max_length`` are cut (keep_start / keep_end) and counted; a row left without a labelled token
is skipped. ShareGPT speakers ``human`` / ``gpt`` become ``user`` / ``assistant`` (TRL keeps them as roles, which
chat templates do not know); every other name is kept.

Bad rows (a missing or mistyped column, an unknown role, an empty assistant turn, a row the template rejects) are
counted by kind and skipped, or with --strict_data raise on the first one (RowFilter).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardtune.config.schema import ConfigError
from shardtune.data.files import Row
from shardtune.data.formatting import IGNORE_INDEX, _as_ids, _check_token_ids
from shardtune.data.report import DataReport, RowFilter
from shardtune.data.trl_utils import is_conversational_from_value, is_message_list

TOKENIZED, SHAREGPT, PROMPT_COMPLETION, CHAT_PROMPT_COMPLETION, MESSAGES, TEXT = (
    "tokenized",
    "ShareGPT conversations",
    "prompt-completion",
    "conversational prompt-completion",
    "conversational",
    "language modelling",
)
CONVERSATIONAL = (SHAREGPT, CHAT_PROMPT_COMPLETION, MESSAGES)
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}
MASK_COLUMNS = ("completion_mask", "assistant_masks", "labels")


@dataclass(frozen=True)
class RowFormat:
    """The format recognised for a dataset and the columns it was recognised from."""

    kind: str
    columns: tuple[str, ...]

    @property
    def conversational(self) -> bool:
        return self.kind in CONVERSATIONAL

    def describe(self) -> str:
        return f"{self.kind} rows (columns {', '.join(self.columns)})"


@dataclass(frozen=True)
class LossOptions:
    text_field: str = "text"
    completion_only_loss: str = "auto"  # auto | true | false
    assistant_only_loss: bool = False
    max_length: int = 1024
    truncation_mode: str = "keep_start"  # keep_start | keep_end


def recognise(columns: list[str], first: Mapping, text_field: str) -> RowFormat:
    """The format of rows with these columns (``first`` tells strings from message lists), as TRL decides it."""
    if "input_ids" in columns:
        return RowFormat(TOKENIZED, ("input_ids", *(c for c in MASK_COLUMNS if c in columns)))
    if "conversations" in columns and is_conversational_from_value(first):
        return RowFormat(SHAREGPT, ("conversations",))
    if "prompt" in columns and "completion" in columns:
        kind = CHAT_PROMPT_COMPLETION if is_message_list(first.get("prompt")) else PROMPT_COMPLETION
        return RowFormat(kind, ("prompt", "completion"))
    if "messages" in columns:
        return RowFormat(MESSAGES, ("messages",))
    if text_field in columns:
        return RowFormat(TEXT, (text_field,))
    raise ConfigError(
        f"no known format in the columns {', '.join(columns) or '(none)'}: expected {text_field!r} "
        "(or set --dataset_text_field), prompt + completion, messages, conversations or input_ids "
        "(see docs/data-formats.md)"
    )


def with_extras(fmt: RowFormat, columns: list[str]) -> RowFormat:
    """The description also names the columns handed to the template (tools, chat_template_kwargs)."""
    extras = tuple(c for c in ("tools", "chat_template_kwargs") if c in columns and fmt.kind != TOKENIZED)
    return RowFormat(fmt.kind, fmt.columns + extras)


def completion_only(options: LossOptions, fmt: RowFormat, columns: list[str]) -> bool:
    """TRL's rule: auto means on when the rows have prompt and completion columns."""
    if options.completion_only_loss != "auto":
        return options.completion_only_loss == "true"
    return "prompt" in columns and "completion" in columns


def check_options(options: LossOptions, fmt: RowFormat) -> None:
    if options.assistant_only_loss and not fmt.conversational:
        raise ConfigError(
            f"--assistant_only_loss true needs conversational rows (messages, conversations, or "
            f"prompt / completion message lists), but these are {fmt.describe()}: drop the flag"
        )


class _BadRow(Exception):
    def __init__(self, reason: str, problem: str) -> None:
        super().__init__(problem)
        self.reason = reason


def prepare_rows(
    rows: list[Row],
    fmt: RowFormat,
    columns: list[str],
    tokenizer: Any,
    options: LossOptions,
    filt: RowFilter,
    report: DataReport,
) -> list[dict]:
    """Tokenised ``{input_ids, labels}`` examples of ``rows``; bad rows counted (or raised) through ``filt``."""
    check_options(options, fmt)
    mask_completion = completion_only(options, fmt, columns)
    examples = []
    for origin, row_no, record in rows:
        try:
            if not isinstance(record, Mapping):
                raise _BadRow("not_an_object", f"a {type(record).__name__}, not an object with fields")
            if fmt.kind == TOKENIZED:
                input_ids, labels = _tokenized(record, mask_completion)
            else:
                input_ids, labels = _tokenize_row(record, fmt, tokenizer, options, mask_completion)
        except _BadRow as bad:
            filt.skip(bad.reason, origin, row_no, str(bad))
            continue
        if len(input_ids) > options.max_length:
            cut = (
                slice(None, options.max_length)
                if options.truncation_mode == "keep_start"
                else slice(-options.max_length, None)
            )
            input_ids, labels = input_ids[cut], labels[cut]
            report.num_truncated += 1
        example = _check_token_ids(input_ids, labels, origin, row_no, len(tokenizer), filt)
        if example is not None:
            examples.append(example)
    return examples


def _labels(input_ids: list[int], masks: list[list[int]]) -> list[int]:
    return [token if all(bits) else IGNORE_INDEX for token, *bits in zip(input_ids, *masks)]


def _ids(record: Mapping, name: str) -> list[int]:
    ids = _as_ids(record.get(name))
    if ids is None:
        raise _BadRow(
            "not_token_ids" if name in record else "missing_field",
            f"field {name!r} is not a 1-D sequence of integers" if name in record else f"field {name!r} is missing",
        )
    return ids


def _tokenized(record: Mapping, mask_completion: bool) -> tuple[list[int], list[int]]:
    input_ids = _ids(record, "input_ids")
    if record.get("labels") is not None:
        return input_ids, _ids(record, "labels")
    names = (["completion_mask"] if mask_completion else []) + ["assistant_masks"]
    masks = [_ids(record, name) for name in names if record.get(name) is not None]
    if any(len(mask) != len(input_ids) for mask in masks):
        raise _BadRow("length_mismatch", f"a mask's length differs from the {len(input_ids)} input_ids")
    return input_ids, _labels(input_ids, masks)


def _string(record: Mapping, name: str) -> str:
    value = record.get(name)
    if value is None:
        raise _BadRow("missing_field", f"field {name!r} is missing")
    if not isinstance(value, str):
        raise _BadRow("not_a_string", f"field {name!r} is a {type(value).__name__}, not a string")
    return value


def _messages(record: Mapping, name: str, keys: tuple[str, str] = ("role", "content")) -> list[dict]:
    """The message list of column ``name``: known roles, string contents, no empty assistant turn."""
    value = record.get(name)
    if value is None:
        raise _BadRow("missing_field", f"field {name!r} is missing")
    if not isinstance(value, list) or not value or not all(isinstance(m, Mapping) for m in value):
        raise _BadRow("not_messages", f"field {name!r} is not a non-empty list of {{{keys[0]}, {keys[1]}}} objects")
    messages = []
    for number, message in enumerate(value, start=1):
        message = dict(message)
        if keys != ("role", "content"):  # ShareGPT: from / value
            role = message.pop(keys[0], None)
            message = {"role": SHAREGPT_ROLES.get(role, role), "content": message.pop(keys[1], None), **message}
        role, content = message.get("role"), message.get("content")
        if role not in KNOWN_ROLES:
            raise _BadRow(
                "unknown_role", f"message {number} of {name!r} has the role {role!r} (known: {', '.join(KNOWN_ROLES)})"
            )
        if content is not None and not isinstance(content, str):
            raise _BadRow("not_a_string", f"message {number} of {name!r}: content is a {type(content).__name__}")
        if role == "assistant" and not (content or "").strip() and not message.get("tool_calls"):
            raise _BadRow("empty_assistant_turn", f"message {number} of {name!r} is an empty assistant turn")
        messages.append(message)
    return messages


def _template_kwargs(record: Mapping) -> dict:
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise _BadRow("bad_tools", f"field 'tools' is not valid JSON ({e.msg})") from None
    return {"tools": tools, **(record.get("chat_template_kwargs") or {})}


def _render(tokenizer: Any, messages: list[dict], kwargs: dict, **options: Any) -> dict:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs, **options)
    except (TemplateError, TypeError, ValueError, KeyError) as e:
        raise _BadRow("template_error", f"the chat template rejects the row ({type(e).__name__}: {e})") from None


def _tokenize_row(
    record: Mapping, fmt: RowFormat, tokenizer: Any, options: LossOptions, mask_completion: bool
) -> tuple[list[int], list[int]]:
    eos = tokenizer.eos_token
    assistant_mask = {"return_assistant_tokens_mask": options.assistant_only_loss}
    if fmt.kind == TEXT:
        text = _string(record, options.text_field)
        input_ids = tokenizer(text=text if text.endswith(eos) else text + eos)["input_ids"]
        return input_ids, list(input_ids)
    if fmt.kind == PROMPT_COMPLETION:
        prompt, completion = _string(record, "prompt"), _string(record, "completion")
        completion = completion if completion.endswith(eos) else completion + eos
        prompt_ids = tokenizer(text=prompt)["input_ids"]
        input_ids = tokenizer(text=prompt + completion)["input_ids"]
        return input_ids, _completion_labels(prompt_ids, input_ids, [], mask_completion)
    kwargs = _template_kwargs(record)
    if fmt.kind == CHAT_PROMPT_COMPLETION:
        prompt, completion = _messages(record, "prompt"), _messages(record, "completion")
        prompt_ids = _render(tokenizer, prompt, kwargs, add_generation_prompt=True)["input_ids"]
        rendered = _render(tokenizer, prompt + completion, kwargs, **assistant_mask)
        masks = _assistant_masks(rendered, options)
        return rendered["input_ids"], _completion_labels(prompt_ids, rendered["input_ids"], masks, mask_completion)
    messages = (
        _messages(record, "conversations", ("from", "value")) if fmt.kind == SHAREGPT else _messages(record, "messages")
    )
    rendered = _render(tokenizer, messages, kwargs, **assistant_mask)
    return rendered["input_ids"], _labels(rendered["input_ids"], _assistant_masks(rendered, options))


def _assistant_masks(rendered: Mapping, options: LossOptions) -> list[list[int]]:
    if not options.assistant_only_loss:
        return []
    mask = list(rendered["assistant_masks"])
    if 1 not in mask:
        raise _BadRow(
            "no_assistant_tokens",
            "the chat template marks no assistant token in this row (no assistant "
            "turn, or no {% generation %} span around it)",
        )
    return [mask]


def _completion_labels(
    prompt_ids: list[int], input_ids: list[int], masks: list[list[int]], mask_completion: bool
) -> list[int]:
    """The completion starts where the tokenised prompt and prompt + completion first differ."""
    prompt_len = common_prefix_length(prompt_ids, input_ids)
    if mask_completion:
        masks = [[0] * prompt_len + [1] * (len(input_ids) - prompt_len), *masks]
    return _labels(input_ids, masks)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
