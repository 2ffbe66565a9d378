"""The shared-prompt layout of a micro-batch, built on the host with the batch: rows that share a prompt become one
row [prompt | completion 1 | completion 2 | ...] (GRPO's completions of one prompt, DPO's chosen and rejected of
one pair). How the model computes on it, and when it can: shardtune.model.shared_prompt."""

from __future__ import annotations

import torch

SHARED_IDS = "shared_input_ids"  # (groups, width): one row per prompt, its completions after it
SHARED_SEGMENTS = "shared_segments"  # (groups, width): 0 the prompt, k the k-th completion, -1 padding
SHARED_POSITIONS = "shared_position_ids"  # (groups, width): each token's position in its own padded row
SHARED_INDEX = "shared_index"  # (scored tokens,): where each scored token's predicting state sits, flattened


def shared_layout(prompts: list[list[int]], completions: list[list[int]], completion_mask: torch.Tensor, pad_id: int):
    """The shared-prompt keys of a micro-batch collated as ``completion_mask`` (rows, width) says (1 where a
    completion token carries a loss), or {} when no two rows share a prompt. The index lists the scored tokens in
    the padded layout's order (row by row), so the results scatter back to (rows, width) with its mask."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    if len(groups) == len(prompts):
        return {}
    inputs = [c[:-1] for c in completions]  # a completion's last token predicts nothing scored: not an input
    width = max(len(p) + sum(len(inputs[i]) for i in rows) for p, rows in groups.items())
    ids = torch.full((len(groups), width), pad_id, dtype=torch.long)
    segments = torch.full((len(groups), width), -1, dtype=torch.long)
    positions = torch.zeros((len(groups), width), dtype=torch.long)
    where: dict[int, tuple[int, int, int]] = {}  # row -> (group, the prompt's length, its completion's start)
    for g, (prompt, rows) in enumerate(groups.items()):
        n = len(prompt)
        ids[g, :n], segments[g, :n], positions[g, :n] = torch.tensor(prompt, dtype=torch.long), 0, torch.arange(n)
        at = n
        for k, i in enumerate(rows, start=1):
            c = inputs[i]
            ids[g, at : at + len(c)] = torch.tensor(c, dtype=torch.long)
            segments[g, at : at + len(c)] = k
            positions[g, at : at + len(c)] = torch.arange(n, n + len(c))
            where[i] = (g, n, at)
            at += len(c)
    index = []
    for i in range(len(prompts)):
        g, n, start = where[i]
        for j in (completion_mask[i, 1:].nonzero().flatten() + 1 - n).tolist():  # completion token j is scored
            index.append(g * width + (n - 1 if j == 0 else start + j - 1))
    return {
        SHARED_IDS: ids,
        SHARED_SEGMENTS: segments,
        SHARED_POSITIONS: positions,
        SHARED_INDEX: torch.tensor(index, dtype=torch.long),
    }


def rows_layout(batch: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """:func:`shared_layout` of right-padded rows [prompt | completion | pad] (``input_ids``, ``attention_mask``,
    ``completion_mask``: 1 on completion tokens), each row's prompt the tokens before its first completion token:
    the keys, or {} when no two rows share a prompt."""
    prompts, completions = [], []
    for ids, attention, completion in zip(
        batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["completion_mask"].tolist()
    ):
        length = sum(attention)
        start = next((t for t in range(length) if completion[t]), length)
        if any(completion[t] == 0 for t in range(start, length)):  # a completion with a hole: not this layout
            return {}
        prompts.append(ids[:start])
        completions.append(ids[start:length])
    return shared_layout(prompts, completions, batch["completion_mask"], pad_id)
