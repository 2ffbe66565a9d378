"""Reward functions for the GRPO demo on the demo preset (no download), called as TRL calls them.

    shardtune grpo --config recipes/grpo-demo.yaml          # from the repository root
    # the same spelled out, on a demo model of your own (shardtune init-model --preset demo ./demo):
    shardtune grpo --model_name_or_path ./demo --dataset_name examples/data/grpo_prompts.jsonl \
        --reward_funcs examples/grpo_rewards.py:single_characters --num_generations 4 \
        --per_device_train_batch_size 8 --max_completion_length 16 --max_steps 40 --learning_rate 3e-3 \
        --logging_steps 1 --save_strategy no --output_dir runs/grpo-demo

Each function takes TRL's keywords (``completions``: the texts, ``completion_ids``: their token ids, the prompt
rows' other columns, ``trainer_state`` ...) and returns one float per completion. TRL's ``GRPOTrainer`` takes them
as they are (``reward_funcs=[single_characters]``): ``python -m bench.grpo`` runs both on this file.
"""

from __future__ import annotations

# The demo and tiny presets' tokenizer: ids 0-3 are <unk>, <s>, </s>, <pad>; ids 4-99 are the single printable
# characters (punctuation, digits, letters); the merges of two or more characters come after.
FIRST_CHARACTER_ID, END_OF_CHARACTERS_ID = 4, 100


def single_characters(completions, completion_ids, **kwargs) -> list[float]:
    """The share of a completion's tokens that are single characters (ids 4-99 of the demo preset's tokenizer).

    A randomly initialised model samples them about 96 / 1024 = 9% of the time; every completion has some, so a
    group's rewards differ and the signal is dense: GRPO raises the mean from ~0.09 to ~0.86 in 40 steps at lr 3e-3
    (recipes/grpo-demo.yaml; docs/benchmarks.md#grpo-shardtune-grpo-vs-trls-grpotrainer). An empty completion
    scores 0; the end-of-sequence token counts as not a character.
    """
    return [
        sum(FIRST_CHARACTER_ID <= token < END_OF_CHARACTERS_ID for token in ids) / len(ids) if ids else 0.0
        for ids in completion_ids
    ]


def digits(completions, **kwargs) -> list[float]:
    """The share of a completion's characters that are digits (any tokenizer; standard, text completions).

    Sparse for a randomly initialised model (a few digit tokens in its vocabulary): a reward for a model that
    already writes text. Conversational completions (lists of messages) are scored on their last message.
    """

    def text(completion) -> str:
        return completion[-1]["content"] if isinstance(completion, list) else completion

    return [sum(ch.isdigit() for ch in text(c)) / len(text(c)) if text(c) else 0.0 for c in completions]
