"""TRL 1.16's public data utilities (``from trl import apply_chat_template, ...``) under shardtune's name, with TRL's
arguments and results, so that a script's preprocessing runs unchanged when ``trl`` becomes ``shardtune``.

They work on one example (a dict, as ``datasets.Dataset.map`` hands it) or on a whole dataset, and answer the
questions TRL's trainers ask of a row: is it a conversation (``role`` / ``content`` messages, or ShareGPT's ``from``
/ ``value``), where does an implicit prompt end, what text does the chat template make of each part. shardtune's
own loaders (shardtune.data.trl_formats, .preference, .prompts) ask the same questions through these functions.

Where TRL's answer is an accident we give a stable one and say so: ``is_conversational`` looks at the first of
TRL's keys the example has (TRL looks at whichever its set yields first, which changes with the hash seed) and
calls an empty list no conversation (TRL raises IndexError); ``extract_prompt`` never steps back past the first
item (TRL's space rule there wraps to the last character). Bad input raises one ConfigError naming the fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardtune.config.schema import ConfigError

# the keys TRL's conversational check reads, in the order we read them
CONVERSATION_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")
# the key sets TRL's apply_chat_template takes: language modelling, prompt-only, prompt-completion, preference
# (explicit and implicit prompt), unpaired preference
TEMPLATED_KEYS = ("prompt", "chosen", "rejected", "completion", "messages", "label")
LAYOUTS = (
    {"messages"},
    {"prompt"},
    {"prompt", "completion"},
    {"prompt", "chosen", "rejected"},
    {"chosen", "rejected"},
    {"prompt", "completion", "label"},
)
COMPLETION_KEYS = ("chosen", "rejected", "completion")
CHATML_KEYS = ("prompt", "completion", "chosen", "rejected", "messages", "conversations")


def is_message_list(value: Any, keys: tuple[str, ...] = ("role",)) -> bool:
    """A list of messages: a non-empty list whose first item is a mapping with ``keys`` (TRL reads the first only)."""
    return (
        isinstance(value, list) and bool(value) and isinstance(value[0], Mapping) and all(k in value[0] for k in keys)
    )


def is_conversational(example: Mapping[str, Any]) -> bool:
    """True when the example's first TRL key (prompt, chosen, rejected, completion, messages) holds messages."""
    key = next((k for k in CONVERSATION_KEYS if k in example), None)
    return key is not None and is_message_list(example[key])


def is_conversational_from_value(example: Mapping[str, Any]) -> bool:
    """True when ``conversations`` holds ShareGPT messages (``from`` / ``value``; TRL prefers role / content)."""
    return is_message_list(example.get("conversations"), ("from", "value"))


def prompt_is_implicit(example: Mapping[str, Any]) -> bool:
    """A preference example's prompt is inside chosen and rejected: no ``prompt``, or one whose kind (text or
    messages) differs from chosen's (some datasets add a text prompt to conversations that hold it already)."""
    if "prompt" not in example:
        return True
    return is_message_list(example["prompt"]) != is_message_list(example.get("chosen"))


def _merged_kwargs(*parts: Mapping[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in parts:
        clash = sorted(set(merged) & set(part))
        if clash:
            raise ConfigError(
                f"apply_chat_template: {', '.join(clash)} given twice (as an argument of shardtune's call and in "
                "template_kwargs or the row's chat_template_kwargs): pass each once"
            )
        merged.update(part)
    return merged


def _prompt_ending(prompt: Sequence[Mapping[str, Any]]) -> dict[str, bool]:
    """A prompt ending with the user (or a tool) gets the generation prompt; one ending with the assistant is
    continued, so the completion goes on the same turn."""
    role = prompt[-1]["role"]
    if role in ("user", "tool"):
        return {"add_generation_prompt": True, "continue_final_message": False}
    if role == "assistant":
        return {"add_generation_prompt": False, "continue_final_message": True}
    raise ConfigError(
        f"apply_chat_template: the prompt's last message has the role {role!r}: end it with a user, tool or "
        "assistant message"
    )


def apply_chat_template(
    example: dict[str, Any],
    processing_class: Any,
    tools: list[dict | Callable] | None = None,
    **template_kwargs: Any,
) -> dict[str, Any]:
    """The example's conversations rendered to text by the tokenizer's chat template, as TRL's trainers see them:
    ``messages`` becomes ``text``; ``prompt`` is rendered for generation, and each completion (chosen, rejected,
    completion) is what the whole conversation adds after the prompt, the prompt cut to the part every rendering
    shares (a template may render the prompt alone differently); ``label`` is kept. ``tools`` and
    ``template_kwargs`` (and the row's ``chat_template_kwargs``) go to the template."""
    keys = {k for k in TEMPLATED_KEYS if k in example}
    if keys not in LAYOUTS:
        raise ConfigError(
            f"apply_chat_template: the example's keys {sorted(keys)} are no TRL layout: give messages; prompt; "
            "prompt + completion; prompt + chosen + rejected; chosen + rejected; or prompt + completion + label"
        )
    options = _merged_kwargs({"tools": tools or None}, example.get("chat_template_kwargs") or {}, template_kwargs)

    def render(messages: list, **ending: bool) -> str:
        return processing_class.apply_chat_template(messages, tokenize=False, **_merged_kwargs(options, ending))

    out: dict[str, Any] = {}
    if "messages" in example:
        out["text"] = render(example["messages"])
    if "prompt" in example:
        prompt = example["prompt"]
        whole = {k: render(prompt + example[k]) for k in COMPLETION_KEYS if k in example}
        shared = os.path.commonprefix([render(prompt, **_prompt_ending(prompt)), *whole.values()])
        out["prompt"] = shared
        out.update({k: text[len(shared) :] for k, text in whole.items()})
    else:
        out.update({k: render(example[k]) for k in COMPLETION_KEYS if k in example})
    if "label" in example:
        out["label"] = example["label"]
    return out


def maybe_apply_chat_template(
    example: dict[str, Any],
    processing_class: Any,
    tools: list[dict | Callable] | None = None,
    **template_kwargs: Any,
) -> dict[str, Any]:
    """:func:`apply_chat_template` for a conversational example; any other example is returned as it is."""
    if is_conversational(example):
        return apply_chat_template(example, processing_class, tools, **template_kwargs)
    return example


def extract_prompt(example: dict[str, Sequence]) -> dict[str, Sequence]:
    """An implicit prompt made explicit: the longest prefix chosen and rejected share (of messages, or of
    characters without a space that ends it), taken off both; at least the last item stays with each completion."""
    chosen, rejected = example["chosen"], example["rejected"]
    shared = 0
    for shared in range(min(len(chosen), len(rejected))):
        if chosen[shared] != rejected[shared]:
            if shared > 0 and chosen[shared - 1] == " ":  # the space goes with the completions
                shared -= 1
            break
    return {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}


def maybe_extract_prompt(example: dict[str, Any]) -> dict[str, Any]:
    """:func:`extract_prompt` for a preference example whose prompt is implicit (:func:`prompt_is_implicit`); any
    other example is returned as it is. The result has only prompt, chosen and rejected, as TRL's."""
    if "chosen" not in example or "rejected" not in example or not prompt_is_implicit(example):
        return example
    return extract_prompt({"chosen": example["chosen"], "rejected": example["rejected"]})


def _unpair_batch(batch: dict[str, list]) -> dict[str, list]:
    """A batch of pairs as twice as many unpaired rows: every chosen (label True), then every rejected (False);
    the prompt and the other columns repeated alike."""
    n = len(batch["chosen"])
    out = {"completion": batch["chosen"] + batch["rejected"], "label": [True] * n + [False] * n}
    out.update({k: v + v for k, v in batch.items() if k not in ("chosen", "rejected")})
    return out


def _column_names(dataset: Any) -> list[str]:
    """A split's columns (the first split's for a dict of splits; a stream without a schema: its first row's)."""
    from datasets import DatasetDict, IterableDatasetDict

    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        dataset = next(iter(dataset.values()))
    return dataset.column_names or list(next(iter(dataset)).keys())


def unpair_preference_dataset(dataset: Any, **map_kwargs: Any) -> Any:
    """A preference dataset (chosen, rejected, an optional prompt) as an unpaired one (prompt, completion, label),
    for objectives that score completions one by one (TRL's KTO). ``map_kwargs`` go to ``dataset.map``."""
    columns = _column_names(dataset)
    taken = [c for c in ("completion", "label") if c in columns]
    if taken:
        raise ConfigError(
            f"unpair_preference_dataset: the dataset already has {' and '.join(taken)}, which the unpaired rows "
            "are made of: rename or remove that column first"
        )
    return dataset.map(_unpair_batch, batched=True, remove_columns=columns, **map_kwargs)


def maybe_unpair_preference_dataset(dataset: Any, num_proc: int | None = None, desc: str | None = None) -> Any:
    """:func:`unpair_preference_dataset` when the dataset has chosen and rejected columns; else it as it is."""
    columns = _column_names(dataset)
    if "chosen" in columns and "rejected" in columns:
        return unpair_preference_dataset(dataset, num_proc=num_proc, desc=desc)
    return dataset


def _chatml_message(message: Any) -> Any:
    if not isinstance(message, Mapping):
        return message
    out = {k: v for k, v in message.items() if k not in ("from", "value")}
    if "from" in message:
        out["role"] = message["from"]
    if "value" in message:
        out["content"] = message["value"]
    return out


def maybe_convert_to_chatml(example: dict[str, Any]) -> dict[str, Any]:
    """ShareGPT messages (``from`` / ``value``) in any of TRL's message columns as ChatML (``role`` / ``content``),
    and ``conversations`` renamed ``messages``. In place, as TRL does: under ``Dataset.map`` that is what drops the
    ``conversations`` column (a returned dict without it would be merged with the row that still has it)."""
    for key in CHATML_KEYS:
        if isinstance(example.get(key), list):
            example[key][:] = [_chatml_message(m) for m in example[key]]
    if "conversations" in example:
        example["messages"] = example.pop("conversations")
    return example


# a conversation whose every tool-calling part carries a mark that must survive the template
_TOOL_MARKS = ("tool_name_4c1e", "tool_argument_9d2a", "tool_value_7b3f", "tool_result_e58c")


def _tool_conversation(arguments_as_json: bool) -> list[dict[str, Any]]:
    name, key, value, result = _TOOL_MARKS
    arguments: Any = f'{{"{key}": "{value}"}}' if arguments_as_json else {key: value}
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": name, "content": result},
    ]


def supports_tool_calling(processing_class: Any) -> bool:
    """Whether the chat template renders a whole tool exchange (the call's name and arguments, the tool's answer):
    some templates drop tool_calls or tool messages without a word. Arguments are tried as a dict, then (templates
    that reject a dict) as a JSON string."""
    from jinja2 import TemplateError

    if getattr(processing_class, "chat_template", None) is None:
        return False
    for arguments_as_json in (False, True):
        try:
            text = processing_class.apply_chat_template(_tool_conversation(arguments_as_json), tokenize=False)
        except TemplateError:
            return False
        except TypeError:
            if arguments_as_json:
                raise
            continue
        return all(mark in text for mark in _TOOL_MARKS)
    return False
