"""TRL's reward functions in shardtune's namespace (shardtune.rewards): for the same completions, solutions and token
ids, exactly trl 1.16's values (the oracle, pinned in the dev extra), None included; the same names (which name the
reward metrics), picklable as TRL's; --reward_funcs NAME resolves to them without trl. Each comparison has a control
that shows it can fail. No launch.
"""

from __future__ import annotations

import pickle
import sys
import threading

import pytest
import trl.rewards as trl_rewards
from trl.trainer.utils import get_callable_name

import shardtune.rewards as ours
from shardtune.config.schema import ConfigError
from shardtune.training.objectives.grpo.rewards import TRL_REWARDS, resolve


def completion(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


THIRD = r"\frac{1}{3}"
# (completion, solution): right, wrong, unparsable answers, unparsable solutions, with and without reasoning
ANSWERS = [
    (r"My answer is \boxed{\frac{1}{3}}", THIRD),
    (r"My answer is \boxed{\frac{1}{2}}", THIRD),
    (r"So it is $\frac{2}{6}$.", THIRD),  # equal after simplification
    (r"\boxed{0.3333}", THIRD),
    ("one third", THIRD),  # no LaTeX answer
    (r"\boxed{}", THIRD),
    (r"The answer is \boxed{42}", "42"),
    (r"The answer is $42$ apples", "$42$"),
    (r"\boxed{x^2 + 2x + 1}", r"$(x+1)^2$"),
    (r"\boxed{10\text{ cm}}", r"$10$"),
    (r"\boxed{\{1, 2\}}", r"$\{2, 1\}$"),
    (r"\boxed{5}", "no maths in this solution"),  # the solution cannot be parsed: None
    (r"<think>5?</think> \boxed{5}", "no maths in this solution"),
    (r"<think>about 1/2</think> \boxed{\frac{1}{3}}", THIRD),
    (r"<think>\boxed{\frac{1}{3}} maybe</think> So \boxed{\frac{1}{2}}", THIRD),
    (r"<think>still thinking \boxed{\frac{1}{3}}", THIRD),
    (r"<think>a</think> b </think> \boxed{\frac{1}{3}}", THIRD),
    (r"Reasoning done. ANSWER: \boxed{7}", "$7$"),
    ("", THIRD),
]
COMPLETIONS = [completion(text) for text, _ in ANSWERS]
SOLUTIONS = [solution for _, solution in ANSWERS]


def test_accuracy_reward_is_trls():
    mine = ours.accuracy_reward(COMPLETIONS, SOLUTIONS)
    assert mine == trl_rewards.accuracy_reward(COMPLETIONS, SOLUTIONS)
    assert {1.0, 0.0, None} <= set(mine)  # control: right, wrong and unverifiable completions are all there
    wrong_solutions = [r"\frac{1}{2}" if s == THIRD else s for s in SOLUTIONS]
    assert ours.accuracy_reward(COMPLETIONS, wrong_solutions) != mine  # control: another input, other values


@pytest.mark.parametrize("delimiters", [None, ["</think>"], ["ANSWER:", "</think>"], ["<answer>"]])
def test_reasoning_accuracy_reward_is_trls(delimiters):
    mine = ours.reasoning_accuracy_reward(COMPLETIONS, SOLUTIONS, reasoning_delimiters=delimiters)
    assert mine == trl_rewards.reasoning_accuracy_reward(COMPLETIONS, SOLUTIONS, reasoning_delimiters=delimiters)
    if delimiters != ["<answer>"]:
        assert mine != ours.accuracy_reward(COMPLETIONS, SOLUTIONS)  # control: the reasoning is cut off
        assert {1.0, 0.0, None} <= set(mine)


def test_the_accuracy_rewards_log_trls_columns():
    for name in ("accuracy_reward", "reasoning_accuracy_reward"):
        mine, theirs = {}, {}
        getattr(ours, name)(COMPLETIONS, SOLUTIONS, log_extra=mine.__setitem__, trainer_state=None)
        getattr(trl_rewards, name)(COMPLETIONS, SOLUTIONS, log_extra=theirs.__setitem__, trainer_state=None)
        assert mine == theirs and set(mine) == {"solution", "gold_parsed", "answer_parsed"}, name


def test_off_the_main_thread_the_rewards_are_trls():
    """math_verify's timeouts need the main thread: elsewhere both run without them."""
    results = {}

    def score() -> None:
        results["ours"] = ours.accuracy_reward(COMPLETIONS[:6], SOLUTIONS[:6])
        results["trl"] = trl_rewards.accuracy_reward(COMPLETIONS[:6], SOLUTIONS[:6])

    thread = threading.Thread(target=score)
    thread.start()
    thread.join()
    assert results["ours"] == results["trl"] and len(results["ours"]) == 6


def test_a_solution_per_completion_is_required():
    with pytest.raises(ValueError, match="3 completions but 2 solutions"):
        ours.accuracy_reward(COMPLETIONS[:3], SOLUTIONS[:2])


def test_without_math_verify_the_accuracy_rewards_say_how_to_install_it(monkeypatch):
    for package in ("math_verify", "latex2sympy2_extended"):  # what an import meets when the package is absent
        monkeypatch.setitem(sys.modules, package, None)
    for reward in (ours.accuracy_reward, ours.reasoning_accuracy_reward, ours.get_cosine_scaled_reward(10)):
        with pytest.raises(ImportError, match=r"pip install 'shardtune\[rewards\]'"):
            reward(completions=COMPLETIONS[:1], solution=SOLUTIONS[:1], completion_ids=[[1]])
    with pytest.raises(ConfigError, match=r"--reward_funcs accuracy_reward: .*pip install 'shardtune\[rewards\]'"):
        resolve("accuracy_reward", load_models=False)
    assert ours.think_format_reward([completion("<think>a</think>")]) == [1.0]  # the others do not need it


THINK = [
    "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
    "<think>\nThis is my reasoning.\nThis is my answer.",
    "<think></think>",
    "<think>a</think><think>b</think>",
    "<think>a<think>b</think>",
    "Answer first <think>a</think>",
    " <think>a</think>",
    "\n<think>a</think>",
    "<think>a</think>\n\nline\n</think>",
    "<think>multi\nline\nthought</think>",
    "<THINK>a</THINK>",
    "<think>a</thinking>",
    "<think>",
    "",
]


def test_think_format_reward_is_trls():
    completions = [completion(text) for text in THINK]
    mine = ours.think_format_reward(completions, trainer_state=None)
    assert mine == trl_rewards.think_format_reward(completions, trainer_state=None)
    assert mine.count(1.0) == 4 and mine.count(0.0) == len(THINK) - 4  # control: both answers, where expected


def ids(length: int, period: int = 1_000_000) -> list[int]:
    return [i % period for i in range(length)]


LENGTHS = [0, 1, 2, 5, 50, 79, 80, 81, 90, 99, 100, 101, 150, 1000]


@pytest.mark.parametrize("max_len", [100, 7])
def test_cosine_scaled_reward_is_trls(max_len):
    completions = [COMPLETIONS[i % 3] for i in range(len(LENGTHS))] + [COMPLETIONS[11]]
    solutions = [THIRD] * len(LENGTHS) + [SOLUTIONS[11]]
    token_ids = [ids(n) for n in LENGTHS] + [ids(3)]
    for bounds in ({}, {"min_value_wrong": -2.0, "max_value_wrong": 0.0, "min_value_correct": 0.1}):
        mine = ours.get_cosine_scaled_reward(max_len, **bounds)(completions, solutions, token_ids, trainer_state=None)
        theirs = trl_rewards.get_cosine_scaled_reward(max_len, **bounds)(completions, solutions, token_ids)
        assert mine == theirs and mine[-1] is None
        assert len(set(mine)) > 5  # control: the values vary with length and verdict
    shorter = ours.get_cosine_scaled_reward(max_len)(completions, solutions, [ids(1)] * len(token_ids))
    assert shorter != mine  # control: another length, another value


@pytest.mark.parametrize("ngram_size", [1, 2, 3, 4])
def test_repetition_penalty_is_trls(ngram_size):
    token_ids = [[], [1], [1, 2], [1, 2, 3, 4], [5] * 5, ids(30, 4), ids(30, 7), [1, 2, 1, 2, 1, 3], ids(10)]
    for max_penalty in (-1.0, -0.3, 0.0):
        mine = ours.get_repetition_penalty_reward(ngram_size, max_penalty)(completion_ids=token_ids, prompts=None)
        assert mine == trl_rewards.get_repetition_penalty_reward(ngram_size, max_penalty)(completion_ids=token_ids)
        if max_penalty:
            assert len(set(mine)) > 2  # control: repetitive and varied completions score apart
    with pytest.raises(ValueError, match="max_penalty 0.5 is positive"):
        ours.get_repetition_penalty_reward(ngram_size, 0.5)
    with pytest.raises(ValueError, match="ngram_size 0"):
        ours.get_repetition_penalty_reward(0)


@pytest.mark.parametrize("max_len, cache", [(100, 20), (100, 0), (100, 100), (7, 3)])
def test_soft_overlong_punishment_is_trls(max_len, cache):
    token_ids = [ids(n) for n in LENGTHS]
    mine = ours.get_soft_overlong_punishment(max_len, cache)(completion_ids=token_ids, completions=None)
    assert mine == trl_rewards.get_soft_overlong_punishment(max_len, cache)(completion_ids=token_ids)
    assert min(mine) == -1.0 and max(mine) == 0.0  # control: short completions go free, long ones are punished
    assert ours.get_soft_overlong_punishment(max_len + 50, cache)(token_ids) != mine  # control: another limit


def test_names_are_trls_and_the_made_rewards_pickle():
    made = [
        (ours.get_cosine_scaled_reward(10), trl_rewards.get_cosine_scaled_reward(10)),
        (ours.get_repetition_penalty_reward(), trl_rewards.get_repetition_penalty_reward()),
        (ours.get_soft_overlong_punishment(10, 2), trl_rewards.get_soft_overlong_punishment(10, 2)),
    ]
    plain = [(getattr(ours, n), getattr(trl_rewards, n)) for n in ("accuracy_reward", "think_format_reward")]
    for mine, theirs in made + plain:
        assert get_callable_name(mine) == get_callable_name(theirs)
    inputs = {"completions": COMPLETIONS[:2], "solution": SOLUTIONS[:2], "completion_ids": [ids(12, 3), ids(3)]}
    for mine, _ in made:
        assert pickle.loads(pickle.dumps(mine))(**inputs) == mine(**inputs)
    assert set(ours.__all__) == set(trl_rewards._import_structure["accuracy_rewards"]) | {
        "think_format_reward",
        "get_repetition_penalty_reward",
        "get_soft_overlong_punishment",
    }


def test_reward_funcs_names_resolve_to_shardtunes_rewards_with_trl_grpos_values():
    """``--reward_funcs NAME`` as `trl grpo` takes it: shardtune's functions, the overlong one with the script's
    max_completion_len 1280 and soft_punish_cache 256, named as TRL names them."""
    rewards = {name: resolve(name, load_models=True) for name in TRL_REWARDS}
    assert rewards["accuracy_reward"].func is ours.accuracy_reward
    overlong = rewards["get_soft_overlong_punishment"]
    assert overlong.name == "soft_overlong_punishment_reward" and type(overlong.func).__module__.startswith("shardtune")
    lengths = [1024, 1025, 1280, 1281]
    assert overlong.func([ids(n) for n in lengths]) == [0.0, -1 / 256, -1.0, -1.0]
