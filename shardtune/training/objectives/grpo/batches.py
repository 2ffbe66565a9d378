"""Which completions each GRPO step trains on, defined globally so that no layout changes them.

An optimizer step trains on C = per_device_train_batch_size x data-parallel processes x accumulation completions (TRL
counts GRPO's batch in completions), G = num_generations of each of C / G prompts. One generation samples the
completions of k optimizer steps (k = steps_per_generation / accumulation, or generation_batch_size / C; TRL's
default: 1) and is trained on num_iterations (mu) times: a ROUND is k x mu optimizer steps, its step w training on
slice w % k of the round's completions (TRL's buffer order).

Prompts are ordered per epoch by a permutation seeded by (seed, epoch); round r takes the next k x C / G of them.
Global completion c of a round is generation c % G of the round's prompt c // G; slice j holds completions
[j C, (j + 1) C), of which data-parallel rank d's micro-batch m holds [(m D + d) B, (m D + d + 1) B) -- the rule of
every shardtune loader (shardtune.data.batching.micro_batch_slice). The sampling of completion c is keyed by (seed,
epoch, round, the prompt's index in the dataset, c % G), never by the rank, so 1 x 4 x 1, 2 x 2 x 1 and 1 x 1 x 4
(processes x batch x accumulation) sample the same completions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardtune.config.schema import ConfigError, TrainConfig, effective_batch_size
from shardtune.data.batching import DataError


@dataclass(frozen=True)
class RoundPlan:
    completions_per_step: int  # C
    generations: int  # G
    steps_per_generation: int  # k, optimizer steps
    iterations: int  # mu
    batch: int  # B, per device
    dp_size: int  # D
    accumulation: int  # A

    @property
    def round_steps(self) -> int:
        return self.steps_per_generation * self.iterations

    @property
    def prompts_per_round(self) -> int:
        return self.steps_per_generation * self.completions_per_step // self.generations

    def rank_completions(self, dp_rank: int) -> list[list[int]]:
        """The round's global completion indices this rank holds: [slice j x micro-batch m] -> B indices, in the
        order slices, then micro-batches."""
        out = []
        for j in range(self.steps_per_generation):
            for m in range(self.accumulation):
                start = j * self.completions_per_step + (m * self.dp_size + dp_rank) * self.batch
                out.append(list(range(start, start + self.batch)))
        return out


def round_plan(cfg: TrainConfig, dp_size: int) -> RoundPlan:
    """The plan of ``cfg``'s rounds; an impossible combination raises one ConfigError line."""
    g = cfg.grpo
    c = effective_batch_size(cfg, dp_size)
    accumulation = cfg.train.gradient_accumulation_steps
    what = (
        f"per_device_train_batch_size {cfg.train.batch_size} x {dp_size} data-parallel processes x "
        f"gradient_accumulation_steps {accumulation} = {c} completions per step"
    )
    if c % g.num_generations:
        raise ConfigError(
            f"{what} is not a multiple of --num_generations {g.num_generations}: each prompt's completions are "
            "scored together in one step; change the batch or --num_generations"
        )
    k = 1
    if g.steps_per_generation:  # TRL's primary setting (a dumped GRPOConfig holds both: the batch size derived)
        if g.steps_per_generation % accumulation:
            raise ConfigError(
                f"--steps_per_generation {g.steps_per_generation} counts micro-batches per process, as TRL's: make it "
                f"a multiple of --gradient_accumulation_steps {accumulation} (one generation for whole optimizer "
                "steps)"
            )
        k = g.steps_per_generation // accumulation
    elif g.generation_batch_size:
        if g.generation_batch_size % c:
            raise ConfigError(
                f"--generation_batch_size {g.generation_batch_size} is not a multiple of the {what}: make it one"
            )
        k = g.generation_batch_size // c
    return RoundPlan(c, g.num_generations, k, g.num_iterations, cfg.train.batch_size, dp_size, accumulation)


def epoch_steps(cfg: TrainConfig, num_prompts: int, dp_size: int) -> int:
    """Optimizer steps of an epoch: whole rounds over the prompts (a last partial round is dropped, as the last
    partial batch of any shardtune epoch)."""
    plan = round_plan(cfg, dp_size)
    rounds = num_prompts // plan.prompts_per_round
    if rounds == 0:
        raise DataError(
            f"{num_prompts} prompts are fewer than one generation needs ({plan.prompts_per_round} prompts: "
            f"{plan.steps_per_generation} step(s) of {plan.completions_per_step} completions, "
            f"{plan.generations} per prompt): add prompts, or lower the batch / --steps_per_generation"
        )
    return rounds * plan.round_steps


def prompt_order(num_prompts: int, seed: int, epoch: int) -> list[int]:
    """The epoch's prompt order (the same on every rank and layout)."""
    return torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def sampling_seed(seed: int, epoch: int, round_index: int, prompt: int, generation: int) -> int:
    """The seed of one completion's sampling generator: keyed by what it is, never by the rank that samples it."""
    return hash((seed, epoch, round_index, prompt, generation)) & (2**63 - 1)  # int tuples hash alike everywhere
