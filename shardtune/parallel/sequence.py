"""Sequence splitting: one long row computed by the ranks of a context x sequence parallel group.

Data side (:func:`split_row`, per micro-batch, in the data loader): every rank of a ``cp x sp`` group collates the
same padding-free row (input_ids, position_ids restarting per document, cu_seq_lens), then

1. shifts the labels BEFORE the split (``shift_labels[t] = labels[t + 1]``, -100 where a document ends), because
   the next token of a slice's last position lives on another rank;
2. pads the row to a multiple of ``2 x cp x sp`` with masked tokens that form their own document (label -100,
   attended by nobody else), so they change neither the loss nor any gradient;
3. cuts it into ``2 cp`` chunks and keeps chunks ``(r, 2 cp - 1 - r)`` of context-parallel rank ``r`` (causal
   load balance: one chunk from the front, its mirror from the back);
4. cuts that context-parallel shard into ``sp`` contiguous slices and keeps the sequence-parallel rank's.

The loss is unchanged: each labelled token lives on exactly one rank, train.py all-reduces the count of labelled
tokens, so the loss stays normalised by the global number of labelled tokens (docs/architecture.md, principle 2).

Attention side (:func:`sequence_attention`, registered with transformers like ``shardtune_varlen``): an
all-to-all within the sequence-parallel group swaps sequence slices for head slices (DeepSpeed-Ulysses), so each
rank holds its context-parallel shard in full for H / sp heads; it runs the existing varlen attention on it with
the row's boundaries (or, with context parallelism, ring attention across the context-parallel group), and a
second all-to-all swaps back. When sp exceeds the KV heads, KV heads are repeated first (as ALST does).

The split's layout reaches the attention function as a model keyword (``sequence_layout``, see
:func:`shardtune.model.loss.model_inputs`), the process groups are bound when the function is registered: a context set
around the forward would be gone when activation checkpointing recomputes a layer in backward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.batching import EXAMPLE_IDS, EXAMPLE_LENGTHS
from shardtune.model.attention import varlen_attention_forward, varlen_mask
from shardtune.model.loss import IGNORE_INDEX, SEQUENCE_LAYOUT, SHIFT_LABELS, SPLIT_INPUT_TOKENS, shift_labels
from shardtune.parallel.dims import ParallelDims

SEQUENCE_ATTENTION = "shardtune_sequence_split"
# each token's sequence in the micro-batch's whole row (0, 1, ...; the split's padding: the number of sequences), so
# that per-sequence sums of a split row (DPO's log-probabilities) can be taken on each slice and all-reduced
SEQUENCE_INDEX = "sequence_index"
# a micro-batch's per-sequence values (not per token), which every slice of the row keeps whole
PER_SEQUENCE_KEYS = ("ref_logps", "completion_lengths")


# -- data side -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSlice:
    """Which slice of every row this rank computes."""

    cp_rank: int
    cp_size: int
    sp_rank: int
    sp_size: int

    @classmethod
    def of_rank(cls, dims: ParallelDims, rank: int) -> RowSlice | None:
        """The slice of global ``rank``, or None when rows are not split."""
        if not dims.sequence_split:
            return None
        return cls(dims.cp_rank(rank), dims.cp, dims.sp_rank(rank), dims.sp)

    @property
    def row_multiple(self) -> int:
        """Rows are padded to a multiple of this: 2 chunks per context-parallel rank, each split sp ways."""
        return 2 * self.cp_size * self.sp_size

    def chunk_ids(self) -> tuple[int, int]:
        if self.cp_size == 1:
            return 0, 1
        from shardtune.parallel.ring import load_balanced_chunk_ids

        return load_balanced_chunk_ids(self.cp_rank, self.cp_size)

    def __call__(self, batch: dict[str, torch.Tensor], pad_id: int) -> dict:
        """This rank's slice of a collated row (the data loader's row transform)."""
        return split_row(batch, self, pad_id)


@dataclass(frozen=True)
class SequenceLayout:
    """What attention needs to know about the whole row a split micro-batch is a slice of."""

    cu_seq_lens: torch.Tensor  # int32 document boundaries of the whole padded row, in global token indices
    max_length: int  # longest document
    chunk_ids: tuple[int, int]  # the row's chunks (of 2 x cp) this context-parallel rank holds
    chunk_len: int

    def to(self, device: torch.device) -> SequenceLayout:
        return replace(self, cu_seq_lens=self.cu_seq_lens.to(device, non_blocking=True))


def split_row(batch: dict[str, torch.Tensor], row_slice: RowSlice, pad_id: int) -> dict:
    """This rank's slice of a padding-free micro-batch (steps 1-4 of the module docstring)."""
    if "cu_seq_lens" not in batch:
        raise ValueError("sequence splitting takes padding-free rows (collate_flat), got a padded batch")
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    if "labels" in batch:
        labels = batch["labels"]
    else:  # pairs (shardtune.data.preference): the completion tokens are the targets
        labels = torch.where(batch["completion_mask"].bool(), input_ids, IGNORE_INDEX)
    targets = shift_labels(labels)
    length = input_ids.shape[1]
    padded = math.ceil(length / row_slice.row_multiple) * row_slice.row_multiple
    cu_seq_lens = batch["cu_seq_lens"].to(torch.int32)
    max_length = int(batch["max_length"])
    if padded > length:  # the padding is one more document: it attends to itself only and carries no label
        extra = padded - length
        input_ids = torch.cat([input_ids, input_ids.new_full((1, extra), pad_id)], dim=1)
        position_ids = torch.cat([position_ids, torch.arange(extra, dtype=position_ids.dtype)[None]], dim=1)
        targets = torch.cat([targets, targets.new_full((1, extra), IGNORE_INDEX)], dim=1)
        cu_seq_lens = torch.cat([cu_seq_lens, torch.tensor([padded], dtype=torch.int32)])
        max_length = max(max_length, extra)
    chunk_len = padded // (2 * row_slice.cp_size)
    chunk_ids = row_slice.chunk_ids()
    slice_len = 2 * chunk_len // row_slice.sp_size
    start = row_slice.sp_rank * slice_len

    def mine(row: torch.Tensor) -> torch.Tensor:
        shard = torch.cat([row[:, c * chunk_len : (c + 1) * chunk_len] for c in chunk_ids], dim=1)
        return shard[:, start : start + slice_len].contiguous()

    sequence = torch.repeat_interleave(torch.arange(len(cu_seq_lens) - 1), cu_seq_lens.diff().long())[None]
    split = {
        "input_ids": mine(input_ids),
        "position_ids": mine(position_ids),
        SHIFT_LABELS: mine(targets),
        SEQUENCE_INDEX: mine(sequence),
        SEQUENCE_LAYOUT: SequenceLayout(cu_seq_lens, max_length, chunk_ids, chunk_len),
        SPLIT_INPUT_TOKENS: mine((torch.arange(padded) < length)[None]).sum(),  # the split's padding not counted
    }
    split.update({key: batch[key] for key in PER_SEQUENCE_KEYS if key in batch})
    for key, fill in ((EXAMPLE_IDS, -1), (EXAMPLE_LENGTHS, 0)):  # LoRA dropout's keys (shardtune.model.lora_dropout)
        if key in batch:
            row = batch[key]
            split[key] = mine(torch.cat([row, row.new_full((1, padded - length), fill)], dim=1))
    return split


# -- attention side --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SequenceGroups:
    """The process groups of this rank's sequence-parallel and context-parallel dimensions (from the mesh)."""

    sp_group: dist.ProcessGroup | None
    sp_size: int
    cp_group: dist.ProcessGroup | None
    cp_size: int

    @classmethod
    def from_mesh(cls, mesh, dims: ParallelDims) -> SequenceGroups:
        return cls(mesh["sp"].get_group(), dims.sp, mesh["cp"].get_group(), dims.cp)


def use_sequence_attention(model: nn.Module, groups: SequenceGroups) -> str:
    """Make ``model`` (a bare Hugging Face model) run split rows through :func:`sequence_attention`."""
    AttentionInterface.register(SEQUENCE_ATTENTION, functools.partial(sequence_attention, groups=groups))
    AttentionMaskInterface.register(SEQUENCE_ATTENTION, varlen_mask)
    model.set_attn_implementation(SEQUENCE_ATTENTION)
    parts = [f"Ulysses sequence parallel {groups.sp_size} (all-to-all of heads)"] if groups.sp_size > 1 else []
    parts += [f"ring context parallel {groups.cp_size}"] if groups.cp_size > 1 else []
    return "long rows split over ranks: " + ", ".join(parts)


def sequence_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    groups: SequenceGroups,
    sequence_layout: SequenceLayout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of a split row: q (1, H, T/sp, D), k / v (1, H_kv, T/sp, D) -> (1, T/sp, H, D).

    Without a layout (evaluation, generation: whole rows) it is the varlen attention function."""
    if sequence_layout is None:
        return varlen_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    layout = sequence_layout
    sp = groups.sp_size
    if sp > 1:
        key, value = repeat_kv_for_split(key, sp), repeat_kv_for_split(value, sp)
        query, key, value = (heads_for_sequence(t, groups.sp_group, sp) for t in (query, key, value))
    if groups.cp_size > 1:
        from shardtune.parallel.ring import ring_attention

        if module.training and dropout > 0:
            raise ValueError(
                f"ring attention has no attention dropout, and this model asks for {dropout}: set the "
                "model's attention_dropout to 0, or use --sequence_parallel_size instead"
            )

        out = ring_attention(
            query,
            key,
            value,
            group=groups.cp_group,
            cu_seq_lens=layout.cu_seq_lens,
            chunk_ids=layout.chunk_ids,
            chunk_len=layout.chunk_len,
            scaling=scaling,
        )
    else:
        cu = layout.cu_seq_lens
        out, _ = varlen_attention_forward(
            module,
            query,
            key,
            value,
            None,
            dropout,
            scaling,
            is_causal,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=layout.max_length,
            max_length_k=layout.max_length,
        )
    if sp > 1:
        out = sequence_for_heads(out, groups.sp_group, sp)
    return out, None


def repeat_kv_for_split(kv: torch.Tensor, sp: int) -> torch.Tensor:
    """Repeat KV heads until sp divides their count (lcm(H_kv, sp), which divides H since sp and H_kv both do).

    Repetition keeps each query head's KV head: repeated head j is original j // r, and query head h, served by
    repeated head h // (H / lcm), gets original h // (H / H_kv), as before."""
    num_kv = kv.shape[1]
    repeats = math.lcm(num_kv, sp) // num_kv
    return kv if repeats == 1 else kv.repeat_interleave(repeats, dim=1)


def heads_for_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, sp: int) -> torch.Tensor:
    """(1, H, T/sp, D) slices of the sequence -> (1, H/sp, T, D): all tokens of this rank's H/sp heads."""
    _, heads, length, dim = x.shape
    send = x[0].reshape(sp, heads // sp, length, dim).contiguous()  # [j]: the heads rank j will own
    received = all_to_all(send, group)  # [j]: rank j's tokens
    return received.transpose(0, 1).reshape(1, heads // sp, sp * length, dim)


def sequence_for_heads(out: torch.Tensor, group: dist.ProcessGroup | None, sp: int) -> torch.Tensor:
    """(1, T, H/sp, D) attention output of this rank's heads -> (1, T/sp, H, D) of its own tokens."""
    _, length, heads, dim = out.shape
    send = out[0].reshape(sp, length // sp, heads, dim).contiguous()  # [j]: rank j's tokens
    received = all_to_all(send, group)  # [j]: rank j's heads
    return received.transpose(0, 1).reshape(1, length // sp, sp * heads, dim)


def all_to_all(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all of equal blocks along dim 0 (the single-tensor form, which gloo supports too)."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, group))


# -- checks before launch --------------------------------------------------------------------------------------------


def check_sequence_split(cfg: TrainConfig, model_config) -> None:
    """What the model's shape allows (read from its config.json in prepare(), before any process starts)."""
    sp, cp = cfg.parallel.sequence_parallel_size, cfg.parallel.context_parallel_size
    heads = getattr(model_config, "num_attention_heads", None)
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if sp > 1 and heads is not None and heads % sp:
        raise ConfigError(
            f"--sequence_parallel_size {sp} must divide the model's {heads} attention heads "
            f"({kv_heads} KV heads, repeated when fewer than {sp}): pick a divisor of {heads}, or "
            "use --context_parallel_size for the rest"
        )
    if cp > 1 and uses_sliding_window(model_config):
        raise ConfigError(
            f"--context_parallel_size {cp}: the model attends within a sliding window "
            f"({model_config.sliding_window} tokens), which ring attention cannot express: use "
            "--sequence_parallel_size instead"
        )


def uses_sliding_window(model_config) -> bool:
    if getattr(model_config, "sliding_window", None) is None:
        return False
    if getattr(model_config, "use_sliding_window", True) is False:
        return False
    layer_types = getattr(model_config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types
