"""The frozen reference of the objectives that score a policy against one (DPO, KTO): its settings' checks, the model
(the starting weights, another model, or with PEFT the policy's own base with the adapter off), and its
log-probabilities computed once before training (--precompute_ref_log_probs), kept in the tokenised-data cache under
a key of what they depend on (:func:`reference_key`), so that a later or resumed run of the same reference reads them
and loads no reference model.

An objective's settings section holding ``ref_model``, ``precompute_ref_log_probs`` and ``precompute_ref_batch_size``
(TRL's names) is what these read; what the reference scores (a pair, an unpaired row and its KL row) is the
objective's, handed in as a function of a model.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import transformers
from torch import nn

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.cache import read_reference_log_probs, write_reference_log_probs
from shardtune.model.loading import (
    check_model_source,
    check_tokenizer_fits,
    resolve_model_name,
    weights_identity,
)
from shardtune.model.peft import adapter_disabled
from shardtune.model.speed import apply_speed_features
from shardtune.parallel.sequence import SequenceGroups, use_sequence_attention
from shardtune.runtime.distributed import all_reduce_sum
from shardtune.runtime.precision import weights_dtype
from shardtune.training.engine.building import build_model

T = TypeVar("T")


# -- before launch ----------------------------------------------------------------------------------------------------


def check_reference_settings(cfg: TrainConfig, section: Any) -> None:
    """The reference settings alone (one ConfigError line): a batch size without the precompute, a ref_model with an
    adapter (whose reference is its own base)."""
    if section.precompute_ref_batch_size and not section.precompute_ref_log_probs:
        raise ConfigError(
            f"--precompute_ref_batch_size {section.precompute_ref_batch_size} has no effect "
            "without --precompute_ref_log_probs: add it, or drop the flag"
        )
    if section.ref_model and cfg.peft.method:
        raise ConfigError(
            f"--ref_model {section.ref_model} with --peft_method {cfg.peft.method}: an adapter's reference is "
            "its own base with the adapter off (as TRL refuses a ref_model with a peft_config): drop --ref_model"
        )


def prepare_reference_model(cfg: TrainConfig, section: Any, tokenizer: Any) -> None:
    """A --ref_model resolved (a preset built, a local path or hub id checked) and its embedding fitting the
    tokenizer, before launch."""
    if section.ref_model:
        section.ref_model = resolve_model_name(section.ref_model)
        check_model_source(section.ref_model, "ref_model", cfg.model.trust_remote_code)
        check_tokenizer_fits(section.ref_model, tokenizer, cfg.model.tokenizer, cfg.model.trust_remote_code)


# -- in the worker ----------------------------------------------------------------------------------------------------


def build_reference(model: nn.Module, strategy, cfg: TrainConfig, env, ref_model: str, split: bool = False) -> dict:
    """The reference beside ``model`` (wrapped): ``{"peft_model": the unwrapped PEFT model}`` with an adapter (its base
    with the adapter off, no copy); else ``{"ref_model": a frozen copy}`` of the starting weights (or of ``ref_model``,
    built as the policy is), with the policy's kernels, placed by the strategy like the policy (whole under DDP,
    sharded under FSDP / ZeRO-3) so that the first step's policy and reference agree. ``split``: rows are split over
    sequence / context parallel ranks, and the reference computes the slices as the policy does."""
    if cfg.peft.method:
        return {"peft_model": strategy.unwrap(model)}
    built = cfg
    if ref_model:  # another model as the reference (its own weights, built as the policy is)
        built = copy.deepcopy(cfg)
        built.model.name = ref_model
    frozen = build_model(built, env).eval().requires_grad_(False)
    apply_speed_features(frozen, cfg, env.device, say=False)  # the policy's kernels
    if split:
        use_sequence_attention(frozen, SequenceGroups.from_mesh(strategy.mesh, strategy.dims))
    return {"ref_model": strategy.place_frozen(frozen)}


@torch.no_grad()
def with_reference(
    policy: nn.Module, ref_model: nn.Module | None, peft_model: nn.Module | None, score: Callable[[nn.Module], T]
) -> T:
    """``score`` of the reference, without a graph: ``ref_model``'s when given, else the policy's with the adapter of
    ``peft_model`` (the unwrapped PEFT model) switched off."""
    if ref_model is not None:
        return score(ref_model)
    if peft_model is None:
        raise ValueError("a reference needs ref_model (full fine-tuning) or peft_model (the adapter switched off)")
    with adapter_disabled(peft_model):
        return score(policy)


@torch.no_grad()
def precompute(
    num_items: int,
    width: int,
    score_chunk: Callable[[list[int]], torch.Tensor],
    strategy,
    env,
    batch_size: int,
    copies: int = 1,
) -> torch.Tensor:
    """--precompute_ref_log_probs' pass: ``score_chunk(indices)`` ((len, width) values of those items) over every item,
    returned as (num_items, width) float64, the same on every rank. Data-parallel rank r of D takes items r, r + D, ...
    in chunks of ``batch_size`` (the ``copies`` ranks of a split group each their slice of the same chunk, whose
    values are then summed over the group: divided by ``copies`` after the all-reduce); every rank runs the same
    number of forwards (a rank short of items repeats the first, not kept), as FSDP's collectives need; one
    all-reduce shares them."""
    dp_rank, dp_size = strategy.dims.dp_rank(env.rank), strategy.dims.dp_size
    mine = list(range(dp_rank, num_items, dp_size))
    num_chunks = math.ceil(math.ceil(num_items / dp_size) / batch_size)
    values = torch.zeros(num_items, width, dtype=torch.float64)
    for c in range(num_chunks):
        chunk = mine[c * batch_size : (c + 1) * batch_size]
        with strategy.autocast():
            scored = score_chunk(chunk or [0])
        if chunk:
            values[chunk] = scored.reshape(len(chunk), width).double().cpu()
    return all_reduce_sum(values, env.device).cpu() / copies


def reference_key(
    cfg: TrainConfig, ref_model: str, compute_dtype: torch.dtype, device: torch.device, **more: Any
) -> str | None:
    """What an item's reference log-probabilities depend on besides the item: the weights (their files; ``ref_model``,
    else the policy's starting weights), how the reference is built and computed (quantisation, RoPE scaling, dtype,
    attention kernel, padding-free rows, device), the library versions, and ``more`` (what the objective's scores
    depend on besides). None when the weights cannot be named (a hub id not in the local cache): then they are
    computed every run. The batch layout (processes, items per forward) is not in it: it changes float rounding
    only, as between any two layouts of the guarantee."""
    weights = weights_identity(ref_model) if ref_model else weights_identity(cfg.model.name, cfg.model.revision)
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
                **more,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:24]


def read_cached_reference(num_items: int, cache_file: Path | None, env) -> torch.Tensor | None:
    """Collective. The items' reference log-probabilities ((num_items, 2) float64) from the tokenised-data cache when
    every rank finds the file whole, else None; ``cache_file`` None (no key): None."""
    found = read_reference_log_probs(cache_file, num_items) if cache_file is not None else None
    hits = all_reduce_sum(torch.tensor([float(found is not None)], dtype=torch.float64), env.device)
    if int(hits[0]) != env.world_size or found is None:
        return None
    return torch.from_numpy(found)


def cache_reference(values: torch.Tensor, cache_file: Path | None, env) -> None:
    """Each node's first rank writes the values to ``cache_file`` (when not None); a failed write is a note: the run
    goes on with the values in memory."""
    if cache_file is None or env.local_rank != 0:
        return
    try:
        write_reference_log_probs(cache_file, values.numpy())
    except OSError as e:
        print(
            f"shardtune: note: the reference's log-probabilities could not be cached in {cache_file.parent} "
            f"({e}); this run goes on with them in memory, the next computes them again",
            file=sys.stderr,
            flush=True,
        )


def how_reference_was_had(all_read: bool, keyed: bool) -> str:
    """The end of the line a run prints about its precomputed reference."""
    if all_read:
        return "read from the tokenised-data cache (an earlier run of this reference; no reference model is loaded)"
    kept = (
        ", kept in the tokenised-data cache"
        if keyed
        else " (not cached: the hub id's snapshot is not in the local cache)"
    )
    return "computed before training" + kept + "; the reference model is freed"
