"""Rewards for the shape of a completion (TRL 1.16's trl.rewards.format_rewards)."""

from __future__ import annotations

from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _thinks_first(text: str) -> bool:
    """The text opens with ``<think>``, closes it later, and opens no second one."""
    if not text.startswith(THINK_OPEN):
        return False
    rest = text[len(THINK_OPEN) :]
    return THINK_OPEN not in rest and THINK_CLOSE in rest


def think_format_reward(completions: list[list[dict[str, str]]], **kwargs: Any) -> list[float]:
    """1.0 where the completion starts with its reasoning in one ``<think>...</think>`` block, else 0.0."""
    return [1.0 if _thinks_first(completion[0]["content"]) else 0.0 for completion in completions]
