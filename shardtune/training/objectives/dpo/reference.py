"""DPO's reference log-probabilities computed once before training (--precompute_ref_log_probs) and kept in the
tokenised-data cache beside the pairs, keyed by what they depend on (:func:`reference_key`), so that a later or
resumed run of the same reference reads them and loads no reference model."""

from __future__ import annotations

import hashlib
import json
import math
import sys

import torch
import transformers
from torch import nn

from shardtune.data.cache import read_reference_log_probs, write_reference_log_probs
from shardtune.data.preference import collate_pair_units
from shardtune.model.loading import weights_identity
from shardtune.runtime.distributed import all_reduce_sum
from shardtune.runtime.precision import weights_dtype
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
    training and stored in the pair (``ref_logps``), which :func:`collate_pairs` carries into each batch; returned
    as (pairs, 2) float64, the same on every rank. Data-parallel rank r of D takes pairs r, r + D, ... in chunks of
    --precompute_ref_batch_size (or --batch_size_training; the ranks of a split group each their slice of the same
    chunk); every rank runs the same number of forwards (a rank short of pairs repeats the first, not kept), as
    FSDP's collectives need; one all-reduce shares them."""
    dp_rank, dp_size = strategy.dims.dp_rank(env.rank), strategy.dims.dp_size
    mine = list(range(dp_rank, len(pairs), dp_size))
    size = cfg.dpo.precompute_ref_batch_size or cfg.train.batch_size
    num_chunks = math.ceil(math.ceil(len(pairs) / dp_size) / size)
    values = torch.zeros(len(pairs), 2, dtype=torch.float64)
    policy.eval()
    for c in range(num_chunks):
        chunk = mine[c * size : (c + 1) * size]
        batch = collate_pair_units([[pairs[i]] for i in chunk or [0]], cfg, pad_id)
        batch = split(batch, pad_id) if split else batch
        with strategy.autocast():
            chosen, rejected = reference_logps(policy, ref_model, peft_model, batch, env.device, split)
        if chunk:
            values[chunk] = torch.stack([chosen, rejected], dim=1).double().cpu()
    policy.train()
    values = all_reduce_sum(values, env.device).cpu() / (split.size if split else 1)
    store_reference(pairs, values)
    return values


def store_reference(pairs: list[dict], values: torch.Tensor) -> None:
    for pair, logps in zip(pairs, values.tolist()):
        pair["ref_logps"] = tuple(logps)


def reference_key(cfg, compute_dtype: torch.dtype, device: torch.device) -> str | None:
    """What a pair's reference log-probabilities depend on besides the pair: the weights (their files), how the
    reference is built and computed (quantisation, RoPE scaling, dtype, attention kernel, padding-free rows, device)
    and the library versions. None when the weights cannot be named (a hub id not in the local cache): then they are
    computed every run. The batch layout (processes, pairs per forward) is not in it: it changes float rounding
    only, as between any two layouts of the guarantee."""
    ref = cfg.dpo.ref_model
    weights = weights_identity(ref) if ref else weights_identity(cfg.model.name, cfg.model.revision)
    if weights is None:
        return None
    return hashlib.sha256(
        json.dumps(
            {
                "weights": weights,
                "quantization": [
                    cfg.model.quantization,
                    cfg.model.quant_type,
                    cfg.model.double_quant,
                    cfg.model.quant_compute_dtype,
                ],
                "rope": [cfg.model.rope_scaling, cfg.model.rope_factor],
                "dtype": str(compute_dtype),
                "pure_bf16": weights_dtype(cfg.parallel.strategy, cfg.train.precision) == torch.bfloat16,
                "attention": [cfg.model.attn_implementation, cfg.model.fast_kernels, cfg.data.padding_free],
                "device": device.type,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:24]


def read_cached_reference(pairs: list[dict], cache_file, env) -> bool:
    """Collective. The pairs' reference log-probabilities from the tokenised-data cache (``<pairs' entry>/
    reference-<key>.npy``, see :func:`reference_key`) when every rank finds the file whole; True when read.
    ``cache_file`` None (no key): False."""
    found = read_reference_log_probs(cache_file, len(pairs)) if cache_file is not None else None
    hits = all_reduce_sum(torch.tensor([float(found is not None)], dtype=torch.float64), env.device)
    if int(hits[0]) != env.world_size:
        return False
    store_reference(pairs, torch.from_numpy(found))
    return True


def compute_and_cache_reference(
    pairs: list[dict], cache_file, policy: nn.Module, strategy, cfg, env, pad_id: int, **reference
) -> None:
    """:func:`precompute_reference`, then each node's first rank writes the values to ``cache_file`` (when not
    None); a failed write is a note: the run goes on with the values in memory."""
    values = precompute_reference(pairs, policy, strategy, cfg, env, pad_id, **reference)
    if cache_file is not None and env.local_rank == 0:
        try:
            write_reference_log_probs(cache_file, values.numpy())
        except OSError as e:
            print(
                f"shardtune: note: the reference's log-probabilities could not be cached in {cache_file.parent} "
                f"({e}); this run goes on with them in memory, the next computes them again",
                file=sys.stderr,
                flush=True,
            )
