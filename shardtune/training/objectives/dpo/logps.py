"""Per-pair log-probabilities of DPO's micro-batches: the policy's and the reference's.

A micro-batch is :func:`shardtune.data.preference.collate_pairs`' layout: ``n`` chosen rows then ``n`` rejected
rows (or one padding-free row of those 2n sequences), so chosen and rejected run through the model in ONE forward.
A pair's log-probability is the sum of its completion tokens' log-probabilities (``completion_mask``, shifted:
position t predicts token t + 1), taken per sequence by the memory-lean head
(shardtune.model.loss.sequence_log_prob_sums: no sequence x vocabulary logits).

Rows split over ranks (--sp_size / --cp_size, :class:`SplitRows`): the ranks of a cp x sp group hold slices of the
same padding-free row of pairs (shardtune.parallel.sequence.split_row: targets shifted before the split, each token
knowing its sequence). Each rank sums its slice's log-probabilities per sequence and one all-reduce over the group
gives every rank the whole sums; the group's ranks then compute the same pair losses, and each backpropagates them
into its own slice (:class:`SummedOverSplit`: the sum's gradient is the same for every part).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardtune.data.formatting import IGNORE_INDEX
from shardtune.model.loss import SHIFT_LABELS, sequence_log_prob_and_prediction_sums, sequence_log_prob_sums
from shardtune.model.shared_prompt import shared_inputs
from shardtune.parallel.sequence import SEQUENCE_INDEX
from shardtune.training.engine.completions import completion_lengths, num_completion_targets, predicted_completion
from shardtune.training.engine.completions import completion_targets as shared_targets
from shardtune.training.engine.reference import with_reference

__all__ = ["completion_lengths", "num_completion_targets", "predicted_completion"]  # the engine's, DPO's too


@dataclass(frozen=True)
class SplitRows:
    """The ranks that split each row (a context x sequence parallel group): its process group, its size, and this
    rank's slice of a collated row (shardtune.parallel.sequence.RowSlice)."""

    group: dist.ProcessGroup
    size: int
    row_slice: object

    def __call__(self, batch: dict, pad_id: int) -> dict:
        return self.row_slice(batch, pad_id)


class SummedOverSplit(torch.autograd.Function):
    """Forward: the sum of every rank's partial per-sequence sums (all-reduce over the split group). Backward: the
    incoming gradient as it is. Every rank of the group computes the same losses from the same totals, so the
    gradient of a total is the same on each, and it is the gradient of each rank's part."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = partial.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def num_pairs(batch: dict[str, torch.Tensor]) -> int:
    if "completion_lengths" in batch:
        return batch["completion_lengths"].numel() // 2
    sequences = len(batch["cu_seq_lens"]) - 1 if "cu_seq_lens" in batch else batch["input_ids"].shape[0]
    return sequences // 2


def completion_targets(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(targets, segments, number of segments) of a micro-batch of pairs: its 2n sequences'
    (shardtune.training.engine.completions.completion_targets)."""
    return shared_targets(batch, 2 * num_pairs(batch))


def pair_logps(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device, split: SplitRows | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) log-probabilities of the micro-batch's pairs, each (n,) in fp32, from one forward (of
    2n padded rows, or of one padding-free row, or of this rank's slice of it: ``split``; padded rows of a prompt
    over one copy of it where the model can: shardtune.model.shared_prompt)."""
    sums = sequence_log_prob_sums(model, batch, *completion_targets(batch), device, shared_inputs(model, batch, device))
    return chosen_and_rejected(sums, batch, split)


def chosen_and_rejected(
    sums: torch.Tensor, batch: dict[str, torch.Tensor], split: SplitRows | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-sequence sums of a micro-batch as (chosen, rejected); a slice's sums are partial: all-reduced over
    the split group."""
    if SHIFT_LABELS in batch:
        return SummedOverSplit.apply(sums[: 2 * num_pairs(batch)], split.group).chunk(2, dim=0)
    return sums.chunk(2, dim=0)


# Sums over a micro-batch's completion tokens, from the policy's logits (TRL's token metrics once divided by the
# step's counts): chosen tokens whose argmax is the label, the entropy of all completion tokens, the mean logit (over
# the vocabulary) of the chosen and of the rejected tokens
TOKEN_SUMS = ("num_correct", "entropy_sum", "chosen_logits_sum", "rejected_logits_sum")


def policy_logps(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device, split: SplitRows | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pair_logps` and the micro-batch's :data:`TOKEN_SUMS` (fp64, no graph) from the same forward. A slice of a
    split row sums its own tokens only (no collective: the slices' tokens are disjoint, so the step's all-reduce
    over all ranks adds them up)."""
    shared = shared_inputs(model, batch, device)
    sums, predictions = sequence_log_prob_and_prediction_sums(model, batch, *completion_targets(batch), device, shared)
    n = num_pairs(batch)
    chosen, rejected = predictions[:n].sum(0), predictions[n : 2 * n].sum(0)  # TOKEN_PREDICTIONS' sums
    token_sums = torch.stack([chosen[0], chosen[1] + rejected[1], chosen[2], rejected[2]])
    return (*chosen_and_rejected(sums, batch, split), token_sums)


@torch.no_grad()
def reference_logps(
    policy: nn.Module,
    ref_model: nn.Module | None,
    peft_model: nn.Module | None,
    batch: dict[str, torch.Tensor],
    device: torch.device,
    split: SplitRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's (chosen, rejected) log-probabilities: those the batch carries (--precompute_ref_log_probs),
    else ``ref_model``'s when given, else the policy's with the adapter of ``peft_model`` (the unwrapped PEFT model)
    switched off."""
    if "ref_logps" in batch:
        ref = batch["ref_logps"].to(device)
        return ref[:, 0], ref[:, 1]
    return with_reference(policy, ref_model, peft_model, lambda model: pair_logps(model, batch, device, split))


def chosen_completion_targets(batch: dict[str, torch.Tensor]) -> int:
    """Completion tokens of the chosen sequences predicted in this micro-batch (of this slice, for a split row): the
    tokens of TRL's ``sft`` term."""
    n = num_pairs(batch)
    if SHIFT_LABELS in batch:
        return int(((batch[SHIFT_LABELS] != IGNORE_INDEX) & (batch[SEQUENCE_INDEX] < n)).sum())
    mask = predicted_completion(batch)
    if "cu_seq_lens" not in batch:
        return int(mask[:n].sum())
    return int(mask[0, : int(batch["cu_seq_lens"][n]) - 1].sum())  # targets of the row's first n sequences
