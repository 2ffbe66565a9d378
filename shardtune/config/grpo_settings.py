"""GRPO's own section of the canonical config (shardtune.config.schema): TRL 1.16's GRPOConfig names and defaults for
generation, rewards and the clipped policy loss (read by shardtune grpo; docs/grpo.md)."""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.config.setting import RUN, setting

GRPO_LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
# TRL 1.16's other GRPO losses, with what they are: refused in one line
GRPO_LOSS_TYPES_NOT_BUILT = {
    "cispo": "MiniMax-M1's clipped importance weights",
    "sapo": "Soft Adaptive Policy Optimization's gate",
    "luspo": "Length-Unbiased Sequence Policy Optimization",
    "vespo": "VESPO's Gamma weighting",
}
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass
class GrpoConfig:
    """TRL's GRPO settings, under TRL's names (read by shardtune grpo); see docs/grpo.md."""

    reward_funcs: list[str] = setting(
        [],
        "the reward functions: path.py:function (a Python file), package.module.function (importable), or a "
        "sequence-classification reward model (a local directory or hub id, its first logit the reward); "
        "several are summed with reward_weights. The Python API takes callables (GRPOTrainer(reward_funcs=...))",
    )
    reward_weights: list[float] = setting([], "one weight per reward function (default: 1 each)")
    num_generations: int = setting(
        8, "completions sampled per prompt (a group); the step's completions must be a multiple of it", at_least=2
    )
    max_completion_length: int = setting(512, "tokens generated per completion at most", at_least=1)
    temperature: float = setting(
        1.0, "sampling temperature (the loss's log-probabilities use it too, as TRL's)", above=0
    )
    top_p: float = setting(1.0, "nucleus sampling: the smallest set of tokens whose probability reaches top_p", above=0)
    top_k: int = setting(0, "sample among the top_k most likely tokens (0: all)", at_least=0)
    min_p: float = setting(
        0.0, "drop tokens less likely than min_p x the most likely token's probability (0: off, TRL's None)", at_least=0
    )
    repetition_penalty: float = setting(
        1.0,
        "the logits of tokens already in the row (its prompt and completion so far) divided by it (multiplied when "
        "negative), as transformers' RepetitionPenaltyLogitsProcessor; 1: off",
        above=0,
    )
    beta: float = setting(
        0.0,
        "the KL coefficient toward the reference (the starting weights; with PEFT the base, adapter off); "
        "0: no reference model is loaded. GRPO: beta x each token's k3 estimate in the loss; RLOO: beta x the "
        "completion's summed log-ratio to the reference subtracted from its reward (TRL's RLOO default: 0.05)",
        at_least=0,
    )
    epsilon: float = setting(0.2, "the clipping range of the importance ratio (lower side)", above=0)
    epsilon_high: float = setting(0.0, "the upper clipping range (0: epsilon, TRL's None)", at_least=0)
    delta: float = setting(
        0.0,
        "two-sided clipping (INTELLECT-2): the importance ratio capped at delta in the unclipped term (recommended "
        "> 1 + epsilon; 0: off, TRL's None)",
        at_least=0,
    )
    loss_type: str = setting(
        "dapo",
        "how token losses become the step's loss: dapo (over the step's completion tokens), grpo (per-sequence "
        "means, averaged), dr_grpo (over completions x max_completion_length), bnpo (TRL normalises per local "
        "batch; shardtune over the step's tokens, as dapo)",
        choices=GRPO_LOSS_TYPES,
    )
    scale_rewards: str = setting(
        "group",
        "advantages divided by the group's reward std (group), the batch's (batch) or not at all (none)",
        choices=SCALE_REWARDS,
    )
    multi_objective_aggregation: str = setting(
        "sum_then_normalize",
        "several reward functions: sum the weighted rewards, then normalise (sum_then_normalize), or normalise each "
        "in its group, sum, then normalise over the batch (normalize_then_sum, GDPO)",
        choices=AGGREGATIONS,
    )
    num_generations_eval: int = setting(
        0, "completions sampled per prompt of the test split when evaluating (0: num_generations)", at_least=0
    )
    num_iterations: int = setting(1, "optimisation passes over each generation batch (mu)", at_least=1)
    steps_per_generation: int = setting(
        0,
        "micro-batches per process one generation serves (TRL's unit; a multiple of gradient_accumulation_steps; "
        "0: gradient_accumulation_steps, one generation per optimizer step)",
        at_least=0,
    )
    generation_batch_size: int = setting(
        0,
        "completions one generation samples, all processes together (a multiple of the step's completions; "
        "0: from steps_per_generation)",
        at_least=0,
    )
    mask_truncated_completions: bool = setting(False, "completions cut at max_completion_length (no eos) carry no loss")
    importance_sampling_level: str = setting(
        "token",
        "the importance ratio per token (GRPO) or per sequence, the mean of its tokens' log-ratios (GSPO)",
        choices=IMPORTANCE_SAMPLING_LEVELS,
    )
    use_bias_correction_kl: bool = setting(True, "the KL term weighted by the importance ratio (as TRL 1.16)")
    ds3_gather_for_generation: bool = setting(
        True,
        "DeepSpeed ZeRO-3: gather the whole model on every process for sampling (fast; needs the whole model's "
        "memory), or false: layer by layer, as the training forward does (slower; for models one device cannot hold)",
    )
    tools: list[str] = setting(
        [],
        "Python functions the model may call while it generates: path.py:function or package.module.function (the "
        "Python API takes callables: GRPOTrainer(tools=[...])); the chat template renders their signatures into the "
        "prompts (conversational) and the calls, each result is appended as a tool message and the reply resumed; "
        "the results' tokens carry no loss (docs/grpo.md)",
    )
    max_tool_calling_iterations: int = setting(
        0, "tool-calling turns per completion at most (0: no limit, TRL's None)", at_least=0
    )
    log_completions: bool = setting(
        False, "each logging step's completions (prompt, completion, rewards) into completions.jsonl", **RUN
    )
    num_completions_to_print: int = setting(0, "completions of a logged step printed (0: none)", at_least=0, **RUN)
