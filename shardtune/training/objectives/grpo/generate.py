"""GRPO's completions, sampled with the model being trained (any strategy: FSDP gathers the parameters for the
generation, KV cache on), each with its own random generator (shardtune.training.objectives.grpo.batches.sampling_seed)
so that
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


def warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Next-token logits (rows, V) as the sampler sees them: divided by the temperature, then all but the top_k set
    to -inf, then all but the smallest set whose probability reaches top_p, then those less likely than min_p x the
    most likely (transformers' Temperature, TopK, TopP, MinP warpers, in generate's order)."""
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
    if min_p > 0:
        probs = logits.softmax(-1)
        remove = probs < min_p * probs.amax(-1, keepdim=True)
        remove.scatter_(-1, probs.argmax(-1, keepdim=True), False)  # the most likely token always stays
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def penalise_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor on a row's own tokens (``seen``, rows x V: its prompt and its
    completion so far; a padded batch's pad tokens are not the row's)."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


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
    gather_whole: bool = False,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    budgets: list[int] | None = None,
) -> list[list[int]]:
    """One completion per prompt (with its eos when it ended), row i sampled from a generator seeded ``seeds[i]``,
    at most ``budgets[i]`` tokens long (default: max_new_tokens each). Collective: every rank calls it alike (its
    forwards may be collective), a rank without prompts too (it runs a stand-in row and returns [])."""
    stand_in = not prompts  # a rank with nothing to sample still runs the forwards the others run
    if stand_in:
        prompts, seeds, budgets = [[pad_id]], [0], [0]
    budgets = [max_new_tokens] * len(prompts) if budgets is None else [min(b, max_new_tokens) for b in budgets]
    generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    rows = len(prompts)
    input_ids, attention = left_padded(prompts, pad_id, device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(sorted(eos_ids), device=device)
    budget = torch.tensor(budgets, device=device)
    done = budget <= 0
    seen = None  # the tokens of each row so far (with a repetition penalty)
    generated: list[torch.Tensor] = []
    inner = strategy.unwrap(model)
    accepted = inspect.signature(hf_model(inner).forward).parameters
    cache_name = "cache" if "cache" in accepted else "past_key_values"
    # the last position's logits only: the prompts' (rows x prompt x vocabulary) would be the sampling's largest tensor
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
    was_training = inner.training
    inner.eval()
    try:
        with strategy.generating(model, gather_whole), strategy.autocast():
            past = None
            step_ids, step_positions = input_ids, positions
            for step in range(max_new_tokens):
                result = inner(
                    input_ids=step_ids,
                    attention_mask=attention,
                    position_ids=step_positions,
                    use_cache=True,
                    **{cache_name: past},
                    **last_only,
                )
                past = getattr(result, cache_name)
                logits = result.logits[:, -1].float()
                if repetition_penalty != 1.0:
                    if seen is None:
                        counts = torch.zeros(logits.shape, dtype=torch.long, device=device)
                        seen = counts.scatter_add_(1, input_ids, attention) > 0  # the prompt's tokens, not its pads
                    logits = penalise_repeats(logits, seen, repetition_penalty)
                logits = warp(logits, temperature, top_k, top_p, min_p)
                tokens = torch.where(done, pad_id, keyed_choice(logits, generators))
                if seen is not None:
                    seen.scatter_(1, tokens[:, None], True)
                generated.append(tokens)
                done |= torch.isin(tokens, eos) | (budget <= step + 1)
                running = (~done).any().to(torch.float64).reshape(1)
                if all_reduce_sum(running, device)[0] == 0:  # the one host read of a token: every rank stops alike
                    break
                step_ids = tokens[:, None]
                attention = torch.cat([attention, torch.ones((rows, 1), dtype=attention.dtype, device=device)], 1)
                step_positions = step_positions[:, -1:] + 1
    finally:
        inner.train(was_training)
    if stand_in:
        return []
    ended = cut_at_eos(torch.stack(generated, 1).tolist() if generated else [[] for _ in range(rows)], eos_ids)
    return [row[:limit] for row, limit in zip(ended, budgets)]


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the prompts left-padded: every row's next token is at the same column."""
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, ids in enumerate(prompts):
        input_ids[i, longest - len(ids) :] = torch.tensor(ids)
        attention[i, longest - len(ids) :] = 1
    return input_ids.to(device), attention.to(device)


def keyed_choice(logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row drawn from softmax(logits) by the Gumbel-max trick, row i's noise from ``generators[i]``:
    no draw depends on the other rows (nor on how many there are)."""
    uniform = torch.stack(
        [torch.rand(logits.size(-1), generator=g, device=logits.device, dtype=torch.float64) for g in generators]
    )
    gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-300)))
    return (logits.double() + gumbel).argmax(-1)


def cut_at_eos(rows: list[list[int]], eos_ids: set[int]) -> list[list[int]]:
    """Each row up to and with its first eos (all of it when it has none)."""
    out = []
    for row in rows:
        end = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
        out.append(row[:end])
    return out
