"""The tools a GRPO / RLOO model may call while it generates (TRL 1.16's ``tools=[...]``): what ``--tools`` names (a
function in a Python file, an importable function) or a script hands the trainer (callables), and one call run as
TRL runs it: ``tool(**arguments)``, its result (``str()`` of it; a list of content parts as it is) as a tool message;
a tool that raises, an unknown name or a call that is no function call become ``{"error": ...}`` in the conversation
(a failed call), never a crash. The chat template renders the tools into the prompts (their signatures and
docstrings, as transformers' ``get_json_schema`` reads them) and the calls the model writes
(shardtune.data.tool_calls).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardtune.config.schema import ConfigError
from shardtune.data.tool_calls import ToolCallFormat, parse_completion, tool_call_format, tool_result_ids
from shardtune.data.trl_utils import supports_tool_calling

# a script's tools (the Python face: GRPOTrainer(tools=[...])), registered before the run
_IN_PROCESS: list[Callable[..., Any]] = []
IN_PROCESS_PREFIX = "<the script's tool "


def register_in_process(funcs: list[Callable[..., Any]]) -> list[str]:
    """The script's tools, kept in this process; returns the names they take in --tools."""
    for func in funcs:
        if not callable(func):
            raise ConfigError(f"tools: {func!r} is not callable: pass Python functions")
    _IN_PROCESS[:] = list(funcs)
    return [f"{IN_PROCESS_PREFIX}{i}: {getattr(f, '__name__', type(f).__name__)}>" for i, f in enumerate(funcs)]


def resolve(spec: str) -> Callable[..., Any]:
    """One --tools entry: path.py:function, package.module.function, or a script's registered callable."""
    from shardtune.data.sources import load_custom_function
    from shardtune.training.objectives.grpo.rewards import importable

    if spec.startswith(IN_PROCESS_PREFIX):
        index = int(spec[len(IN_PROCESS_PREFIX) :].split(":")[0])
        if index >= len(_IN_PROCESS):
            raise ConfigError(f"--tools {spec}: a script's tool, not registered in this process")
        return _IN_PROCESS[index]
    path, sep, _ = spec.rpartition(":")
    if sep and path.endswith(".py"):
        try:
            return load_custom_function(spec)
        except ConfigError as e:
            raise ConfigError(str(e).replace("--custom_dataset.file", "--tools")) from None
    func = importable(spec)
    if func is None:
        raise ConfigError(f"--tools {spec}: not a path.py:function or an importable package.module.function")
    return func


def load_tools(specs: list[str]) -> list[Callable[..., Any]]:
    tools = [resolve(spec) for spec in specs]
    names = [getattr(t, "__name__", "") for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--tools: two tools are named {twice[0]!r}: the model calls a tool by its name; rename one")
    return tools


@dataclass
class Toolbox:
    """What a sampling with tools needs: the tools by name, how the template writes calls, the limits."""

    tools: list[Callable[..., Any]]
    tokenizer: Any
    fmt: ToolCallFormat | None  # None: the tokenizer's response_template parses
    max_iterations: int  # tool-calling turns per completion at most
    max_completion_length: int
    max_length: int  # the model's context (max_position_embeddings)

    @property
    def by_name(self) -> dict[str, Callable[..., Any]]:
        return {getattr(t, "__name__", ""): t for t in self.tools}

    def parse(self, ids: list[int], prefix: list[int]) -> dict[str, Any]:
        return parse_completion(self.tokenizer, self.fmt, ids, prefix, self.tools)

    def result_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return tool_result_ids(self.tokenizer, messages)

    def run(self, call: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """(the tool message of one call, whether the call failed)."""
        if call.get("type") != "function":
            name = call.get("name", "unknown")
            error = {"error": f"Unsupported tool call type: {call.get('type')}"}
            return {"role": "tool", "name": name, "content": str(error)}, True
        function = call["function"]
        name = function["name"]
        try:
            tool = self.by_name.get(name)
            if tool is None:
                raise ValueError(f"Tool {name} not found.")
            result = tool(**function["arguments"])
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
            failed = False
        except Exception as e:  # noqa: BLE001 - the model's call of the user's tool: an error message, as TRL's
            result, failed = {"error": str(e)}, True
        content = result if isinstance(result, list) else str(result)
        return {"role": "tool", "name": name, "content": content}, failed


async def _awaited(result: Any) -> Any:
    return await result


def toolbox(cfg, tokenizer, tools: list[Callable[..., Any]], max_length: int) -> Toolbox | None:
    """The run's toolbox (None without tools); its format checked (one ConfigError line) before any sampling."""
    if not tools:
        return None
    check_tokenizer(tokenizer)
    fmt = None if getattr(tokenizer, "response_template", None) is not None else tool_call_format(tokenizer)
    g = cfg.grpo
    return Toolbox(
        tools, tokenizer, fmt, g.max_tool_calling_iterations or sys.maxsize, g.max_completion_length, max_length
    )


def check_tokenizer(tokenizer: Any) -> None:
    """The chat template renders a whole tool exchange, and a tool message's tokens continue the call's (or the run
    would fail at its first call)."""
    if not supports_tool_calling(tokenizer):
        raise ConfigError(
            "tools: the chat template does not render a tool-calling conversation (user -> assistant with "
            "tool_calls -> tool), as TRL requires: use a template that does (--chat_template_path)"
        )
    if getattr(tokenizer, "response_template", None) is None:
        tool_call_format(tokenizer)
    tool_result_ids(tokenizer, [{"role": "tool", "name": "check", "content": "1"}])
