"""TRL 1.16's reward functions (``trl.rewards``) under shardtune's name: ``from shardtune.rewards import
accuracy_reward`` in a script, or ``--reward_funcs accuracy_reward`` on the command line. Each is called as GRPO
calls a reward (``completions=..., completion_ids=..., <columns>..., **kwargs``) and returns one value per completion
(None where it cannot judge), TRL's values for the same input. The accuracy rewards need math_verify
(``pip install 'shardtune[rewards]'``).
"""

from shardtune.rewards.accuracy_rewards import accuracy_reward, get_cosine_scaled_reward, reasoning_accuracy_reward
from shardtune.rewards.format_rewards import think_format_reward
from shardtune.rewards.other_rewards import get_repetition_penalty_reward, get_soft_overlong_punishment

__all__ = [
    "accuracy_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "reasoning_accuracy_reward",
    "think_format_reward",
]
