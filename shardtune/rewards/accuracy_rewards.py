"""Rewards for mathematical answers checked by math_verify (TRL 1.16's trl.rewards.accuracy_rewards): the answer of a
completion against the row's ``solution`` column; None where the solution itself cannot be parsed (nothing to check
against: TRL skips the completion), so it counts in no advantage.

math_verify is an optional dependency (``pip install 'shardtune[rewards]'``): imported when a reward is first
called, so importing this module never needs it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_REASONING_DELIMITERS = ("</think>",)
# math_verify's timeouts use signal.alarm, which only the main thread may set: elsewhere they are off (as in TRL)
PARSING_TIMEOUT_S, VERIFY_TIMEOUT_S = 10, 5
NOT_PARSED, NOT_CHECKED, INCOMPLETE = "[unparseable]", "[skipped]", "[incomplete reasoning]"


def require_math_verify() -> Any:
    """math_verify, or one ImportError that says how to install it."""
    try:
        import math_verify
    except ImportError:
        raise ImportError(
            "the accuracy rewards check answers with math_verify, which is not installed: "
            "pip install 'shardtune[rewards]'"
        ) from None
    return math_verify


@dataclass
class _Checked:
    """One completion's verdict and what the completions table shows of it (TRL's extra columns)."""

    reward: float | None
    gold: str
    answer: str


class _Checker:
    """Parses solutions and answers as TRL's accuracy rewards do: the solution with math_verify's defaults, the
    answer as LaTeX only (a \\boxed{} first, units normalised, no match without an anchor), its first match."""

    def __init__(self) -> None:
        self.mv = require_math_verify()
        from latex2sympy2_extended import NormalizationConfig  # math_verify's own dependency

        main = threading.current_thread() is threading.main_thread()
        self.parsing_timeout = PARSING_TIMEOUT_S if main else None
        self.verify_timeout = VERIFY_TIMEOUT_S if main else None
        if not main:  # math_verify warns at every call that its timeout is off
            for name in ("math_verify.parser", "math_verify.grader"):
                logging.getLogger(name).setLevel(logging.ERROR)
        self.answer_config = [
            self.mv.LatexExtractionConfig(
                normalization_config=NormalizationConfig(units=True),
                boxed_match_priority=0,
                try_extract_without_anchor=False,
            )
        ]

    def check(self, answer_text: str, solution: str) -> _Checked:
        gold = self.mv.parse(solution, parsing_timeout=self.parsing_timeout)
        if not gold:
            return _Checked(None, NOT_PARSED, NOT_CHECKED)
        answer = self.mv.parse(
            answer_text,
            extraction_config=self.answer_config,
            extraction_mode="first_match",
            parsing_timeout=self.parsing_timeout,
        )
        right = self.mv.verify(gold, answer, timeout_seconds=self.verify_timeout)
        return _Checked(float(right), str(gold), str(answer) if answer else NOT_PARSED)


def _contents(completions: Sequence[Any]) -> list[str]:
    """The text of each completion: TRL's rewards take conversational completions (one assistant message each)."""
    return [completion[0]["content"] for completion in completions]


def _report(checked: list[_Checked], solution: Sequence[str], log_extra: Callable[[str, list], None] | None) -> list:
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", [c.gold for c in checked])
        log_extra("answer_parsed", [c.answer for c in checked])
    return [c.reward for c in checked]


def _paired(contents: list[str], solution: Sequence[str]) -> list[tuple[str, str]]:
    if len(contents) != len(solution):
        raise ValueError(f"{len(contents)} completions but {len(solution)} solutions: pass one solution per completion")
    return list(zip(contents, solution))


def accuracy_reward(
    completions: list[list[dict[str, str]]],
    solution: list[str],
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 where the completion's answer equals the solution mathematically, 0.0 where not (or where it has no
    LaTeX answer), None where the solution cannot be parsed."""
    checker = _Checker()
    checked = [checker.check(text, sol) for text, sol in _paired(_contents(completions), solution)]
    return _report(checked, solution, log_extra)


def reasoning_accuracy_reward(
    completions: list[list[dict[str, str]]],
    solution: list[str],
    reasoning_delimiters: list[str] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """:func:`accuracy_reward` of the text after the reasoning: after the last occurrence of the first delimiter
    (default ``</think>``) the completion has; 0.0 for a completion whose reasoning never ends (a partial answer
    inside the reasoning earns nothing)."""
    delimiters = DEFAULT_REASONING_DELIMITERS if reasoning_delimiters is None else reasoning_delimiters
    checker = _Checker()
    checked = []
    for text, sol in _paired(_contents(completions), solution):
        delimiter = next((d for d in delimiters if d in text), None)
        if delimiter is None:
            checked.append(_Checked(0.0, INCOMPLETE, INCOMPLETE))
        else:
            checked.append(checker.check(text.split(delimiter)[-1], sol))
    return _report(checked, solution, log_extra)


class _CosineScaledReward:
    """A callable object rather than a closure, so that it pickles (a process pool may carry it)."""

    __name__ = "cosine_scaled_reward"

    def __init__(self, max_len: int, wrong: tuple[float, float], correct: tuple[float, float]) -> None:
        self.max_len, self.wrong, self.correct = max_len, wrong, correct

    def __call__(
        self,
        completions: list[list[dict[str, str]]],
        solution: list[str],
        completion_ids: list[list[int]],
        **kwargs: Any,
    ) -> list[float | None]:
        verdicts = accuracy_reward(completions, solution)
        if len(verdicts) != len(completion_ids):
            raise ValueError(f"{len(verdicts)} completions but {len(completion_ids)} completion_ids: pass one each")
        return [self._scaled(v, len(ids)) for v, ids in zip(verdicts, completion_ids)]

    def _scaled(self, verdict: float | None, length: int) -> float | None:
        """From the short-length value (at length 0) to the long-length one (at max_len and beyond) on a half cosine:
        a right answer earns more when short, a wrong one loses more when short."""
        if verdict is None:
            return None
        long_value, short_value = self.correct if verdict else self.wrong[::-1]
        cosine = math.cos(min(length / self.max_len, 1.0) * math.pi)  # 1 at length 0, -1 at max_len and beyond
        return float(long_value + 0.5 * (short_value - long_value) * (1.0 + cosine))


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> Callable[..., list[float | None]]:
    """A reward that scales :func:`accuracy_reward` by the completion's length in tokens on a cosine (Demystifying
    Long Chain-of-Thought Reasoning, appendix C.1), to favour concise reasoning: a right answer earns from
    ``max_value_correct`` (length 0) down to ``min_value_correct`` (``max_len`` and longer), a wrong one from
    ``min_value_wrong`` (length 0) up to ``max_value_wrong``; None where the solution cannot be parsed."""
    return _CosineScaledReward(max_len, (min_value_wrong, max_value_wrong), (min_value_correct, max_value_correct))
