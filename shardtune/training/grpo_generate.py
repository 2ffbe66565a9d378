"""GRPO's completions, sampled with the model being trained (any strategy: FSDP gathers the parameters for the
generation, KV cache on), each with its own random generator (shardtune.training.grpo_batches.sampling_seed) so that
a completion does not depend on the rank that samples it or on the other rows of its batch.

The decode loop is ours, not ``generate``'s: the sampling draws from one generator per row (``generate`` draws from
the global one), and every rank runs the same number of forwards (a sharded model's forwards are collective), all
ranks stopping once every row of every rank has ended. Logits are processed as transformers' samplers do:
temperature, then top-k, then top-p.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from shardtune.model.loss import hf_model
from shardtune.runtime.distributed import all_reduce_sum


def warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Next-token logits (rows, V) as the sampler sees them: divided by the temperature, then all but the top_k set
    to -inf, then all but the smallest set whose probability reaches top_p (transformers' TopK / TopP warpers)."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = ordered.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - top_p)
        remove[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return logits


@torch.no_grad()
def sample(
    model: nn.Module,
    strategy,
    prompts: list[list[int]],
    seeds: list[int],
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    temperature: float,
    top_k: int,
    top_p: float,
    device: torch.device,
) -> list[list[int]]:
    """One completion per prompt (with its eos when it ended), row i sampled from a generator seeded ``seeds[i]``.
    Collective: every rank calls it with the same number of prompts."""
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    rows = len(prompts)
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((rows, longest), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, longest), dtype=torch.long)
    for i, ids in enumerate(prompts):  # left-padded: every row's next token is at the same column
        input_ids[i, longest - len(ids) :] = torch.tensor(ids)
        attention[i, longest - len(ids) :] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    inner = strategy.unwrap(model)
    cache_name = "cache" if "cache" in inspect.signature(hf_model(inner).forward).parameters else "past_key_values"
    was_training = inner.training
    inner.eval()
    try:
        with strategy.generating(model), strategy.autocast():
            past = None
            step_ids, step_positions = input_ids, positions
            for _ in range(max_new_tokens):
                result = inner(
                    input_ids=step_ids,
                    attention_mask=attention,
                    position_ids=step_positions,
                    use_cache=True,
                    **{cache_name: past},
                )
                past = getattr(result, cache_name)
                probs = warp(result.logits[:, -1], temperature, top_k, top_p).softmax(-1).cpu()
                chosen = []
                for i in range(rows):
                    token = int(torch.multinomial(probs[i], 1, generator=generators[i])) if not done[i] else pad_id
                    if not done[i]:
                        out[i].append(token)
                        done[i] = token in eos_ids
                    chosen.append(token)
                running = torch.tensor([float(not all(done))], dtype=torch.float64)
                if all_reduce_sum(running, device)[0] == 0:
                    break
                step_ids = torch.tensor(chosen, device=device)[:, None]
                attention = torch.cat([attention, torch.ones((rows, 1), dtype=attention.dtype, device=device)], 1)
                step_positions = step_positions[:, -1:] + 1
    finally:
        inner.train(was_training)
    return out
