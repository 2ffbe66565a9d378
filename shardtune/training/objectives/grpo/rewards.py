"""GRPO's reward functions: what ``--reward_funcs`` names (a function in a Python file, an importable function, a
sequence-classification reward model) or a script hands GRPOTrainer (callables, models), called as TRL calls them:
``func(prompts=..., completions=..., completion_ids=..., **extra columns, trainer_state=...)`` returning one float
(or None) per completion; a model scores prompt + completion (its chat template for conversations), its first logit.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from shardtune.config.schema import ConfigError

# a script's reward functions (the Python face: GRPOTrainer(reward_funcs=[...])), registered before the run
_IN_PROCESS: list[Any] = []
IN_PROCESS_PREFIX = "<the script's reward function "


def register_in_process(funcs: list[Any]) -> list[str]:
    """The script's callables / models, kept in this process; returns the names they take in --reward_funcs."""
    _IN_PROCESS[:] = list(funcs)
    return [f"{IN_PROCESS_PREFIX}{i}: {reward_name(f)}>" for i, f in enumerate(funcs)]


def reward_name(func: Any) -> str:
    """TRL's name of a reward function (its metrics' ``rewards/<name>/mean``)."""
    if isinstance(func, torch.nn.Module):
        return str(getattr(getattr(func, "config", None), "_name_or_path", type(func).__name__)).split("/")[-1]
    return getattr(func, "__name__", type(func).__name__)


@dataclass
class Reward:
    name: str
    func: Callable[..., Any] | None = None  # a Python function
    model: torch.nn.Module | None = None  # a sequence-classification model
    tokenizer: Any = None


def _from_file(spec: str) -> Callable[..., Any]:
    from shardtune.data.sources import load_custom_function

    try:
        return load_custom_function(spec)
    except ConfigError as e:
        raise ConfigError(str(e).replace("--custom_dataset.file", "--reward_funcs")) from None


# ``trl grpo --reward_funcs NAME``: the names TRL's script knows (shardtune.rewards, TRL's functions;
# get_soft_overlong_punishment with the script's values)
TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment")


def _trl_reward(name: str) -> Callable[..., Any]:
    import shardtune.rewards
    from shardtune.rewards.accuracy_rewards import require_math_verify

    if name in ("accuracy_reward", "reasoning_accuracy_reward"):
        try:  # known before launch, not at the first scored step
            require_math_verify()
        except ImportError as e:
            raise ConfigError(f"--reward_funcs {name}: {e}") from None
    func = getattr(shardtune.rewards, name)
    if name == "get_soft_overlong_punishment":
        func = func(max_completion_len=1280, soft_punish_cache=256)
    return func


def importable(spec: str) -> Callable[..., Any] | None:
    module_name, _, name = spec.rpartition(".")
    if not module_name or not name.isidentifier():
        return None
    if os.getcwd() not in sys.path:  # as TRL's script: a module of the working directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    func = getattr(module, name, None)
    return func if callable(func) else None


def resolve(spec: str, load_models: bool, device: torch.device | None = None) -> Reward:
    """One --reward_funcs entry; ``load_models`` False only checks a model is there (before launch)."""
    if spec.startswith(IN_PROCESS_PREFIX):
        index = int(spec[len(IN_PROCESS_PREFIX) :].split(":")[0])
        if index >= len(_IN_PROCESS):
            raise ConfigError(f"--reward_funcs {spec}: a script's reward function, not registered in this process")
        func = _IN_PROCESS[index]
        if isinstance(func, torch.nn.Module):
            raise ConfigError(
                f"reward_funcs: {reward_name(func)} is a model object: pass its directory (a string), so that every "
                "process loads it on its own device"
            )
        return Reward(reward_name(func), func=func)
    if spec in TRL_REWARDS:
        func = _trl_reward(spec)
        return Reward(reward_name(func), func=func)
    path, sep, function = spec.rpartition(":")
    if sep and path.endswith(".py"):
        func = _from_file(spec)
        return Reward(function, func=func)
    func = importable(spec)
    if func is not None:
        return Reward(reward_name(func), func=func)
    from shardtune.model.scoring import check_scoring_model, is_adapter, load_scoring_model

    if not (Path(spec).expanduser() / "config.json").is_file() and not is_adapter(spec) and "/" not in spec:
        raise ConfigError(
            f"--reward_funcs {spec}: not a path.py:function, an importable package.module.function or a reward "
            "model (a local directory with config.json or a SEQ_CLS adapter, or a hub id): pass one of those"
        )
    check_scoring_model(spec, "reward_funcs")  # a model directory or hub id, or a reward model's adapter
    if not load_models:
        return Reward(spec.rstrip("/").split("/")[-1])
    model, tokenizer = load_scoring_model(spec, device)
    return Reward(spec.rstrip("/").split("/")[-1], model=model, tokenizer=tokenizer)


def load_rewards(specs: list[str], load_models: bool = True, device: torch.device | None = None) -> list[Reward]:
    if not specs:
        raise ConfigError(
            "the run needs reward functions (shardtune grpo / rloo): pass --reward_funcs path.py:function (or an "
            "importable package.module.function, or a reward model's directory)"
        )
    return [resolve(spec, load_models, device) for spec in specs]


@torch.no_grad()
def score(
    rewards: list[Reward],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    extras: dict[str, list[Any]],
    state: Any,
    device: torch.device,
) -> torch.Tensor:
    """(completions, reward functions) float64; NaN where a function returned None."""
    out = torch.full((len(prompts), len(rewards)), math.nan, dtype=torch.float64)
    for j, reward in enumerate(rewards):
        if reward.model is not None:
            if isinstance(prompts[0], list):
                texts = [
                    reward.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)
                ]
            else:
                texts = [p + c for p, c in zip(prompts, completions)]
            inputs = reward.tokenizer(
                text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
            )
            logits = reward.model(**{k: v.to(device) for k, v in inputs.items()}).logits[:, 0]
            out[:, j] = logits.double().cpu()
            continue
        values = reward.func(
            prompts=prompts, completions=completions, completion_ids=completion_ids, **extras, trainer_state=state
        )
        values = list(values)
        if len(values) != len(prompts):
            raise ConfigError(
                f"the reward function {reward.name!r} returned {len(values)} rewards for {len(prompts)} completions: "
                "return one per completion (None where it does not apply)"
            )
        for i, value in enumerate(values):
            if value is not None:
                out[i, j] = float(value)
    return out
