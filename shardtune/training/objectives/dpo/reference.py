"""DPO's reference log-probabilities computed once before training (--precompute_ref_log_probs) and kept in the
tokenised-data cache beside the pairs (shardtune.training.engine.reference: the pass, the key, the cache), so that a
later or resumed run of the same reference reads them and loads no reference model."""

from __future__ import annotations

import torch
from torch import nn

from shardtune.data.preference import collate_pair_units
from shardtune.training.engine import reference as shared
from shardtune.training.objectives.dpo.logps import SplitRows, reference_logps


@torch.no_grad()
def precompute_reference(
    pairs: list[dict],
    policy: nn.Module,
    strategy,
    cfg,
    env,
    pad_id: int,
    *,
    ref_model: nn.Module | None = None,
    peft_model: nn.Module | None = None,
    split: SplitRows | None = None,
) -> torch.Tensor:
    """--precompute_ref_log_probs: every pair's reference (chosen, rejected) log-probabilities, computed once before
    training in chunks of --precompute_ref_batch_size (or --batch_size_training) per data-parallel rank
    (shardtune.training.engine.reference.precompute) and stored in the pair (``ref_logps``), which
    :func:`collate_pairs` carries into each batch; returned as (pairs, 2) float64, the same on every rank."""

    def score(chunk: list[int]) -> torch.Tensor:
        batch = collate_pair_units([[pairs[i]] for i in chunk], cfg, pad_id)
        batch = split(batch, pad_id) if split else batch
        return torch.stack(reference_logps(policy, ref_model, peft_model, batch, env.device, split), dim=1)

    size = cfg.dpo.precompute_ref_batch_size or cfg.train.batch_size
    policy.eval()
    values = shared.precompute(len(pairs), 2, score, strategy, env, size, split.size if split else 1)
    policy.train()
    store_reference(pairs, values)
    return values


def store_reference(pairs: list[dict], values: torch.Tensor) -> None:
    for pair, logps in zip(pairs, values.tolist()):
        pair["ref_logps"] = tuple(logps)


def reference_key(cfg, compute_dtype: torch.dtype, device: torch.device) -> str | None:
    """What a pair's reference log-probabilities depend on besides the pair (shardtune.training.engine.reference's
    reference_key, of --ref_model or the starting weights)."""
    return shared.reference_key(cfg, cfg.dpo.ref_model, compute_dtype, device)


def read_cached_reference(pairs: list[dict], cache_file, env) -> bool:
    """Collective. The pairs' reference log-probabilities from the tokenised-data cache (``<pairs' entry>/
    reference-<key>.npy``, see :func:`reference_key`) when every rank finds the file whole; True when read.
    ``cache_file`` None (no key): False."""
    found = shared.read_cached_reference(len(pairs), cache_file, env)
    if found is None:
        return False
    store_reference(pairs, found)
    return True


def compute_and_cache_reference(
    pairs: list[dict], cache_file, policy: nn.Module, strategy, cfg, env, pad_id: int, **reference
) -> None:
    """:func:`precompute_reference`, then each node's first rank writes the values to ``cache_file`` (when not
    None); a failed write is a note: the run goes on with the values in memory."""
    values = precompute_reference(pairs, policy, strategy, cfg, env, pad_id, **reference)
    shared.cache_reference(values, cache_file, env)
