"""GRPO's evaluation (TRL's GRPOTrainer in eval mode): completions of the test split's prompts sampled with the model
as it is, ``num_generations_eval`` per prompt, scored by the reward functions, their group advantages, and the
policy's loss on them (importance ratio 1), under TRL's metric names with its ``eval_`` prefix.

Every metric is over the whole split, all ranks together (TRL averages per-batch values, which change with the
batch and the number of processes), so an evaluation gives the same row on any layout. Completion c is generation
c % G of prompt c // G; chunks of ``per_device_eval_batch_size`` completions go to data-parallel rank chunk % D (a
rank short of chunks samples and runs one it does not count: a sharded model's forwards are collective). Every
evaluation draws the same random numbers (keyed by prompt and generation, not by step), so two evaluations differ
by the weights alone. ``--max_eval_step N`` evaluates the first prompts that N batches per rank hold, whole groups.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import torch
from torch import nn

from shardtune.runtime.distributed import all_reduce_sum
from shardtune.training.objectives.grpo.batches import sampling_seed
from shardtune.training.objectives.grpo.loss import REDUCTIONS, completion_targets, token_logps

EVAL_KEY = -1  # the epoch of the sampling key: evaluations draw apart from every training generation


@dataclasses.dataclass
class EvalChunk:
    completions: range  # global completion indices (a rank's uncounted stand-in: counted False)
    batch: dict
    counted: bool


def eval_chunks(num_prompts: int, generations: int, cfg, dp_rank: int, dp_size: int) -> tuple[list[range], int, int]:
    """(this rank's chunks of global completion indices, the number of batches every rank runs, the completions)."""
    size = cfg.eval.batch_size
    if cfg.eval.max_batches:
        num_prompts = min(num_prompts, max(1, cfg.eval.max_batches * size * dp_size // generations))
    total = num_prompts * generations
    chunks = [range(start, min(start + size, total)) for start in range(0, total, size)]
    return chunks[dp_rank::dp_size], math.ceil(len(chunks) / dp_size), total


@torch.no_grad()
def grpo_evaluate(objective, model: nn.Module, eval_rows: list[dict], step: int) -> dict[str, float]:
    """The evaluation row of :class:`shardtune.training.objectives.grpo.objective.GRPO` (collective)."""
    cfg, env, strategy = objective.cfg, objective.env, objective.strategy
    g = dataclasses.replace(cfg.grpo, num_generations=cfg.grpo.num_generations_eval or cfg.grpo.num_generations)
    generations, device = g.num_generations, env.device
    dims = strategy.dims
    mine, num_batches, total = eval_chunks(len(eval_rows), generations, cfg, dims.dp_rank(env.rank), dims.dp_size)
    chunks = [sampled_chunk(objective, model, eval_rows, mine, i, g, step) for i in range(num_batches)]
    shared = torch.zeros(total, chunks[0][1].size(1), dtype=torch.float64)
    for chunk, table in chunks:
        if chunk.counted:
            shared[list(chunk.completions)] = table
    shared = all_reduce_sum(shared, device).cpu()
    advantages, row = objective.generation_metrics(shared, g)
    summed = REDUCTIONS.count("sum")  # the stats that add up (the rest are the step's min / max)
    sums = torch.zeros(summed + 2, dtype=torch.float64, device=device)
    model.eval()
    try:
        for chunk, _ in chunks:
            batch = chunk.batch
            batch["advantages"] = advantages[list(chunk.completions)].float()
            with strategy.autocast():
                logps, entropies = token_logps(model, batch, device, g.temperature, True)
                _, stats = objective.terms(logps, entropies, batch, g)
            if chunk.counted:
                tokens = float((completion_targets(batch) != -100).sum())
                extra = torch.tensor([objective.normaliser(batch), tokens], dtype=torch.float64, device=device)
                sums += torch.cat([stats[:summed].to(device, torch.float64), extra])
    finally:
        model.train()
    sums = all_reduce_sum(sums, device).tolist()
    tokens = max(sums[-1], 1.0)
    row["loss"] = sums[0] / max(sums[-2], 1e-12)
    if g.beta != 0.0 and "kl" not in row:  # RLOO's kl is its generation's (a reward penalty): in the row already
        row["kl"] = sums[1] / tokens
    row["entropy"] = sums[2] / tokens
    return {f"eval_{key}": value for key, value in row.items()}


def sampled_chunk(objective, model: nn.Module, eval_rows: list[dict], mine: list[range], i: int, g, step: int):
    """(chunk i of this rank, sampled, scored and collated with its reference log-probabilities, its table)."""
    counted = i < len(mine)
    completions = mine[i] if counted else range(1)
    rows = [eval_rows[c // g.num_generations] for c in completions]
    seeds = [
        sampling_seed(objective.cfg.train.seed, EVAL_KEY, 0, row["index"], c % g.num_generations)
        for row, c in zip(rows, completions)
    ]
    sampled = objective.sample_rows(model, rows, seeds, g)
    state = SimpleNamespace(global_step=step, epoch=0)
    table = objective.score_rows(rows, sampled, state)[1]
    cut = table[:, len(objective.rewards) + 1].tolist()
    keep = [not (g.mask_truncated_completions and t) and len(x) > 0 for x, t in zip(sampled.ids, cut)]
    prompts = [r["prompt_ids"] for r in rows]
    index = list(completions)
    batch = objective.collate(prompts, sampled.ids, keep, torch.zeros(len(index)), index, sampled.masks)
    if g.beta > 0:
        objective.add_reference(batch)
    return EvalChunk(completions, batch, counted), torch.cat([table, objective.round_columns([[batch]])], dim=1)
