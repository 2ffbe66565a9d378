"""A model's tool calls in the format its chat template writes them: read from what the model generated, and the tool
results written back as the template renders a tool message (GRPO / RLOO with tools).

The format comes from the tokenizer itself:

- a tokenizer with a ``response_template`` (transformers' declarative response parser: the model declares how its
  replies are structured) is parsed by ``tokenizer.parse_response``, as TRL 1.16 parses;
- otherwise the format is read off the chat template by rendering an assistant turn that calls a tool with marked
  names (:func:`tool_call_format`): the text around the marked call's JSON is the call's markup (``<tool_call>`` ...
  ``</tool_call>``, or none), the JSON's shape says where the name and arguments are (``{"name", "arguments"}``,
  ``{"name", "parameters"}``, ``{"type": "function", "function": {...}}``, one object per call or a list of them).
  Templates that write calls as something other than JSON (XML-style arguments) need a ``response_template``.

A completion that opens a call it does not finish (no JSON, or no closing markup) is plain text, as TRL's fallback
reads it: its content the decoded text without special tokens, no tool calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardtune.config.schema import ConfigError

# marks a rendered call's parts carry (unlikely in any template's own text)
NAME, ARGUMENT, VALUE, CONTENT = "tool_name_5b0e", "tool_argument_c7a1", "tool_value_2f9d", "reply_text_83e4"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCallFormat:
    """How the chat template writes an assistant turn's tool calls (from :func:`tool_call_format`)."""

    open: str  # the markup before a call's JSON ("" when the JSON stands alone), whitespace stripped
    close: str  # the markup after it ("" when none)
    end: str  # what ends the assistant's turn after its text (its eos, "<|im_end|>" ...), whitespace stripped
    listed: bool  # the calls are the items of one JSON list (else one JSON object per call)
    name_path: tuple[str, ...]  # where a call object holds the tool's name
    arguments_path: tuple[str, ...]  # where it holds the arguments (an object, or a JSON string of one)


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _call(arguments_as_json: bool) -> dict[str, Any]:
    arguments: Any = json.dumps({ARGUMENT: VALUE}) if arguments_as_json else {ARGUMENT: VALUE}
    return {"type": "function", "function": {"name": NAME, "arguments": arguments}}


def _path_to(value: Any, wanted: Callable[[Any], bool], path: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """The keys leading from ``value`` (nested dicts) to the first item ``wanted`` accepts."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if wanted(item):
                return (*path, key)
            found = _path_to(item, wanted, (*path, key))
            if found is not None:
                return found
    return None


def _is_arguments(item: Any) -> bool:
    if isinstance(item, str):
        try:
            item = json.loads(item)
        except ValueError:
            return False
    return isinstance(item, Mapping) and item.get(ARGUMENT) == VALUE


def _first_json(text: str, holds: Callable[[Any], bool]) -> tuple[int, int, Any] | None:
    """(start, end, value) of the first JSON value in ``text`` that ``holds`` accepts."""
    for start, char in enumerate(text):
        if char not in "{[":
            continue
        try:
            value, end = _DECODER.raw_decode(text, start)
        except ValueError:
            continue
        if holds(value):
            return start, end, value
    return None


def _assistant_turns(tokenizer: Any) -> tuple[str, str]:
    """(a plain reply's turn, a reply that calls a tool), as rendered after the generation prompt."""
    user = [{"role": "user", "content": "hi"}]
    base = _render(tokenizer, user, generation_prompt=True)
    plain = _render(tokenizer, [*user, {"role": "assistant", "content": CONTENT}])
    for as_json in (False, True):
        try:
            calling = _render(tokenizer, [*user, {"role": "assistant", "content": "", "tool_calls": [_call(as_json)]}])
        except TypeError:  # a template that takes arguments as a JSON string only
            continue
        if plain.startswith(base) and calling.startswith(base):
            return plain[len(base) :], calling[len(base) :]
    raise ConfigError(
        "tools: the chat template's assistant turn does not continue its generation prompt (rendered alone and in a "
        "conversation they differ): use a chat template whose turns extend the prompt, as training templates do"
    )


def tool_call_format(tokenizer: Any) -> ToolCallFormat:
    """The chat template's tool-call format, read off a rendered call (one ConfigError line when it has none that
    shardtune reads: no tool calls rendered, or not as JSON)."""
    plain, calling = _assistant_turns(tokenizer)
    preamble, _, after = plain.partition(CONTENT)  # what the template writes before a reply's text, and after it
    end = after.strip()
    calling = calling.removeprefix(preamble)
    found = _first_json(calling, lambda v: NAME in json.dumps(v) and VALUE in json.dumps(v))
    if found is None:
        raise ConfigError(
            "tools: the chat template does not write a tool call's name and arguments as JSON: give the tokenizer a "
            "response_template (transformers' response parser) or use a template that writes calls as JSON"
        )
    start, stop, value = found
    listed = isinstance(value, list)
    call = value[0] if listed and value else value
    name_path = _path_to(call, lambda item: item == NAME)
    arguments_path = _path_to(call, _is_arguments)
    if not isinstance(call, Mapping) or name_path is None or arguments_path is None:
        raise ConfigError("tools: the chat template's tool call holds no name and arguments shardtune can read")
    close = calling[stop:].strip()
    close = close[: -len(end)].strip() if end and close.endswith(end) else close
    return ToolCallFormat(calling[:start].strip(), close, end, listed, name_path, arguments_path)


def _at(value: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def _as_call(item: Any, fmt: ToolCallFormat) -> dict[str, Any] | None:
    """A call object as TRL's message holds it ({"type": "function", "function": {"name", "arguments"}}), or None."""
    name, arguments = _at(item, fmt.name_path), _at(item, fmt.arguments_path)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not isinstance(arguments, Mapping):
        return None
    return {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}


def _calls_at(text: str, at: int, fmt: ToolCallFormat) -> tuple[list[dict], int] | None:
    """The calls of the JSON value at ``at`` (after whitespace) and where its closing markup ends; None: none."""
    while at < len(text) and text[at].isspace():
        at += 1
    try:
        value, at = _DECODER.raw_decode(text, at)
    except ValueError:
        return None
    items = value if fmt.listed and isinstance(value, list) else [value]
    calls = [_as_call(item, fmt) for item in items]
    if not calls or any(c is None for c in calls) or (fmt.listed and not isinstance(value, list)):
        return None
    rest = text[at:]
    if fmt.close:
        if not rest.lstrip().startswith(fmt.close):
            return None
        at += len(rest) - len(rest.lstrip()) + len(fmt.close)
    return [c for c in calls if c is not None], at


def parse_turn(text: str, fmt: ToolCallFormat) -> dict[str, Any] | None:
    """The assistant message of one generated turn's text (special tokens kept): its content and its tool calls;
    None when a call is opened and not finished (the caller reads the turn as plain text)."""
    if fmt.end and fmt.end in text:
        text = text[: text.index(fmt.end)]
    calls: list[dict] = []
    kept: list[str] = []
    at = 0
    while True:
        if fmt.open:
            start = text.find(fmt.open, at)
            begin = start + len(fmt.open)
        else:
            found = _first_json(text[at:], lambda v: isinstance(v, (list, dict)))
            start = -1 if found is None else at + found[0]
            begin = start
        if start < 0:
            kept.append(text[at:])
            break
        parsed = _calls_at(text, begin, fmt)
        if parsed is None:
            if fmt.open:
                return None
            kept.append(text[at : start + 1])  # a JSON value that is no call: text
            at = start + 1
            continue
        kept.append(text[at:start])
        calls += parsed[0]
        at = parsed[1]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(kept).strip()}
    if calls:
        message["tool_calls"] = calls
    return message


def parse_completion(
    tokenizer: Any, fmt: ToolCallFormat | None, ids: list[int], prefix: list[int], tools: list[Callable]
) -> dict[str, Any]:
    """The assistant message of a generated turn's token ids (``prefix``: the ids before it), by the tokenizer's
    response_template when it has one (``fmt`` None), else by ``fmt``; a malformed call: plain text."""
    parsed = None
    if fmt is None:
        try:
            parsed = tokenizer.parse_response(ids, prefix=prefix, tools=tools)
            if isinstance(parsed.get("content"), str):
                parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
            parsed["content"] = parsed.get("content") or ""
        except (ValueError, TypeError, AttributeError):
            parsed = None
    else:
        parsed = parse_turn(tokenizer.decode(ids, skip_special_tokens=False), fmt)
    if parsed is None:
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return parsed


def tool_result_ids(tokenizer: Any, tool_messages: list[dict[str, Any]]) -> list[int]:
    """The tokens that follow an assistant turn which called tools (ended by its eos): the tool messages as the
    template renders them, then the next assistant turn's opening (its generation prompt)."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    before = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prefix = tokenizer.apply_chat_template(before, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(
        before + tool_messages, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    prefix, full = list(prefix), list(full)
    ends = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if ends:  # the model's turn stops at its eos: what the template writes after it belongs to the results
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ConfigError(
            "tools: the chat template's tokens of a tool message do not continue those of the call before it: use a "
            "template that renders a conversation as the concatenation of its turns"
        )
    return full[len(prefix) :]
