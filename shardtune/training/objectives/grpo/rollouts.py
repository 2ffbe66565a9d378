"""A batch's completions as GRPO / RLOO sample them, and with tools the turns of each (TRL 1.16's tool-calling loop):
the model's reply parsed for tool calls, the tools run, their results appended as the chat template renders tool
messages, the reply resumed after them, until no call is left or ``max_tool_calling_iterations`` turns are done.

The whole completion is one token sequence, prompt + reply + results + reply ... (concatenated ids, never
re-tokenised), at most max_completion_length long: results that would pass it (or the model's context) are dropped and
the completion ends there; a resumed reply is cut to what is left. The results' tokens are the environment's, not the
model's: their mask is 0 and they carry no loss, nor count in completions/*_length.

Every turn is collective and keyed, so the same completions come out on any layout: each rank resumes its own rows
(a rank with none runs a stand-in row), all ranks run the same number of turns (the number of rows still calling,
all-reduced), and turn t of a completion draws from a generator seeded by its own key and t (:func:`turn_seed`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardtune.runtime.distributed import all_reduce_sum

Turn = Callable[[list[list[int]], list[int], list[int]], list[list[int]]]  # (prompts, seeds, budgets) -> replies


@dataclass
class Rollouts:
    """Sampled completions: their ids; with tools, which of their tokens are the model's (1) or a tool result's (0),
    each completion's messages (assistant and tool turns, as TRL hands reward functions), its calls and failures."""

    ids: list[list[int]]
    masks: list[list[int]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    calls: list[int] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.calls = self.calls or [0] * len(self.ids)
        self.failures = self.failures or [0] * len(self.ids)


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a completion's turn ``turn`` (> 0) after tool results, from the seed of its first."""
    return hash((seed, turn)) & (2**63 - 1)


def roll_out(
    box, rows: list[dict], first: list[list[int]], seeds: list[int], turn: Turn, device: torch.device
) -> Rollouts:
    """The completions of ``rows`` whose first replies are ``first``, with ``box``'s tools (tools.Toolbox) run turn
    by turn; ``turn`` samples replies of prompts (collective). Collective: every rank calls it alike."""
    prompts = [row["prompt_ids"] for row in rows]
    out = Rollouts([list(ids) for ids in first], [[1] * len(ids) for ids in first], [], [], [])
    out.messages = [[box.parse(ids, prompt)] for ids, prompt in zip(first, prompts)]
    calling = [i for i, messages in enumerate(out.messages) if messages[-1].get("tool_calls")]
    done = 0
    while done < box.max_iterations:
        if all_reduce_sum(torch.tensor([float(len(calling))], dtype=torch.float64), device)[0] == 0:
            break
        resumed = [i for i in calling if _add_results(box, out, i, prompts[i])]
        extended = [prompts[i] + out.ids[i] for i in resumed]
        budgets = [box.max_completion_length - len(out.ids[i]) for i in resumed]
        replies = turn(extended, [turn_seed(seeds[i], done + 1) for i in resumed], budgets)
        calling = []
        for i, prompt, reply in zip(resumed, extended, replies):
            out.ids[i] += reply
            out.masks[i] += [1] * len(reply)  # type: ignore[index]
            if reply:
                message = box.parse(reply, prompt)
                out.messages[i].append(message)
                if message.get("tool_calls"):
                    calling.append(i)
        done += 1
    return out


def _add_results(box, out: Rollouts, i: int, prompt: list[int]) -> bool:
    """Run completion i's calls and append their results; False (nothing appended, the completion ends) when they
    would pass max_completion_length or the model's context."""
    results = []
    for call in out.messages[i][-1]["tool_calls"]:  # type: ignore[index]
        message, failed = box.run(call)
        out.calls[i] += 1
        out.failures[i] += int(failed)
        results.append(message)
    suffix = box.result_ids(results)
    if len(out.ids[i]) + len(suffix) > box.max_completion_length or len(prompt) + len(out.ids[i]) + len(suffix) >= (
        box.max_length
    ):
        return False
    out.messages[i] += results  # type: ignore[index]
    out.ids[i] += suffix
    out.masks[i] += [0] * len(suffix)  # type: ignore[index]
    return True
