"""Per-sequence log-probabilities of a model on the completion tokens of a micro-batch: what every objective that
scores whole completions against a reference needs (DPO's pairs, KTO's unpaired rows).

A micro-batch here is rows of ``input_ids`` with a ``completion_mask`` marking the completion tokens: right-padded
rows (one sequence a row, ``attention_mask``), or one padding-free row of several sequences (``cu_seq_lens``), or a
rank's slice of such a row (sequence / context parallelism: targets shifted before the split, each token knowing its
sequence). A sequence's log-probability is the sum of its completion tokens' log-probabilities (shifted: position t
predicts token t + 1), taken per sequence by the memory-lean head (shardtune.model.loss.sequence_log_prob_sums: no
sequence x vocabulary logits); with the per-token predictions (argmax hit, entropy, mean logit) from the same logits.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtune.data.formatting import IGNORE_INDEX
from shardtune.model.loss import SHIFT_LABELS, sequence_log_prob_and_prediction_sums, sequence_log_prob_sums
from shardtune.parallel.sequence import SEQUENCE_INDEX


def predicted_completion(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which targets (positions 1..T-1, the next token of each position) are completion tokens: (rows, T - 1). In a
    padding-free row (``cu_seq_lens``) a sequence's first token is nobody's target, as a padded row's position 0."""
    mask = batch["completion_mask"][:, 1:].clone()
    if "cu_seq_lens" in batch:
        mask[0, batch["cu_seq_lens"][1:-1].long() - 1] = 0
    return mask


def completion_targets(batch: dict[str, torch.Tensor], num_sequences: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(targets, segments, number of segments) of a micro-batch of ``num_sequences`` sequences, each (rows, T): every
    position's next token where that token is a completion token (IGNORE_INDEX elsewhere), and the sequence it belongs
    to (padded rows: the row; a padding-free row: its sequence; a slice of a split row: the token's sequence, the
    split's padding in one extra segment)."""
    n = num_sequences
    if SHIFT_LABELS in batch:  # a slice of a split row: targets shifted before the split
        return batch[SHIFT_LABELS], batch[SEQUENCE_INDEX].clamp(max=n), n + 1
    ids = batch["input_ids"]
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, :-1] = torch.where(predicted_completion(batch).bool(), ids[:, 1:], IGNORE_INDEX)
    if "cu_seq_lens" in batch:
        lengths = batch["cu_seq_lens"].diff().long()
        segments = torch.repeat_interleave(torch.arange(n), lengths)[None]
    else:
        segments = torch.arange(ids.shape[0])[:, None].expand_as(ids)
    return targets, segments, n


def completion_logps(
    model: nn.Module, batch: dict[str, torch.Tensor], num_sequences: int, device: torch.device
) -> torch.Tensor:
    """Each sequence's completion log-probability, (num_sequences,) in fp32 with its graph (a split row's slice: its
    own tokens' part, plus one segment of the split's padding)."""
    return sequence_log_prob_sums(model, batch, *completion_targets(batch, num_sequences), device)


def completion_logps_and_predictions(
    model: nn.Module, batch: dict[str, torch.Tensor], num_sequences: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`completion_logps`, per sequence the sums of shardtune.model.loss.TOKEN_PREDICTIONS over its completion
    tokens: (segments, 3) fp64 without a graph), from one forward."""
    return sequence_log_prob_and_prediction_sums(model, batch, *completion_targets(batch, num_sequences), device)


def completion_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Completion tokens of each sequence, as TRL counts them (the unshifted completion mask), in fp32."""
    if "completion_lengths" in batch:  # counted at collation (a split row's slices keep them)
        return batch["completion_lengths"].float()
    mask = batch["completion_mask"].float()
    if "cu_seq_lens" not in batch:
        return mask.sum(dim=1)
    return torch.stack([part.sum() for part in mask[0].split(batch["cu_seq_lens"].diff().tolist())])


def num_completion_targets(batch: dict[str, torch.Tensor]) -> int:
    """Completion tokens predicted in this micro-batch (of this slice, for a split row)."""
    if SHIFT_LABELS in batch:
        return int((batch[SHIFT_LABELS] != IGNORE_INDEX).sum())
    return int(predicted_completion(batch).sum())
