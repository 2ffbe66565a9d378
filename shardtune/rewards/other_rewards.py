"""Rewards on the completion's tokens (TRL 1.16's trl.rewards.other_rewards): they read ``completion_ids`` only.
Each is a callable object rather than a closure, so that it pickles (a process pool may carry it); its ``__name__``
is TRL's, which names the reward's metrics (``rewards/<name>/mean``).
"""

from __future__ import annotations

from typing import Any, Callable


class _RepetitionPenalty:
    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float) -> None:
        self.ngram_size, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return [self._penalty(list(ids)) for ids in completion_ids]

    def _penalty(self, ids: list[int]) -> float:
        num_ngrams = len(ids) - self.ngram_size + 1
        if num_ngrams < 1:
            return 0.0
        ngrams = {tuple(ids[i : i + self.ngram_size]) for i in range(num_ngrams)}
        repeated = 1 - len(ngrams) / num_ngrams
        return repeated * self.max_penalty if repeated else 0.0


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> Callable[..., list[float]]:
    """A penalty for repeated token n-grams (Demystifying Long Chain-of-Thought Reasoning, appendix C.2), against
    degenerate repetitive text: ``max_penalty`` times the share of the completion's n-grams that repeat an earlier
    one; 0.0 for a completion without repeats or shorter than ``ngram_size``."""
    if ngram_size < 1:
        raise ValueError(f"ngram_size {ngram_size}: an n-gram has at least one token, pass 1 or more")
    if max_penalty > 0:
        raise ValueError(f"max_penalty {max_penalty} is positive: a penalty is 0 or negative, pass e.g. -1.0")
    return _RepetitionPenalty(ngram_size, max_penalty)


class _SoftOverlongPunishment:
    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int) -> None:
        self.max_completion_len, self.soft_punish_cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return [self._punishment(len(ids)) for ids in completion_ids]

    def _punishment(self, length: int) -> float:
        free = self.max_completion_len - self.soft_punish_cache  # the longest completion not punished
        if length <= free:
            return 0.0
        if length <= self.max_completion_len:
            return (free - length) / self.soft_punish_cache
        return -1.0


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable[..., list[float]]:
    """DAPO's soft overlong punishment (eq. 13): 0 up to ``max_completion_len - soft_punish_cache`` tokens, then
    falling linearly to -1 at ``max_completion_len``, and -1 beyond; it punishes long completions and rewards no
    short one."""
    return _SoftOverlongPunishment(max_completion_len, soft_punish_cache)
