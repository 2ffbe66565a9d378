"""Units, the global-batch rule, collation and the per-rank loaders.

A *unit* is what batching never splits: one example (padding) or one packed block of examples (packing, by
--packing_strategy: shardtune.data.packing). Units depend on the examples, the seed, context_length and the packing
strategy only, never on world size, batch size or accumulation, which is why 1 x 8 x 1, 1 x 2 x 4, 2 x 4 x 1 and
4 x 2 x 1 (processes x micro-batch x accumulation) train on exactly the same global batches:

1. Each epoch permutes the units with ``torch.Generator().manual_seed(seed + epoch)`` (--train_sampling_strategy
   sequential: keeps their order).
2. The permutation is cut into global batches of G = batch_size_training x dp_size x accumulation
   units, one per optimizer step; a last partial global batch is dropped (every step sees G units). dp_size is
   the number of data-parallel ranks (shardtune.parallel.dims): the world size, divided by the sequence /
   context parallel degrees, whose ranks share micro-batches and split each row (rule 6).
3. With padding, each global batch is sorted by unit length (ties by unit index) so that micro-batches
   hold similar lengths and waste little padding; packed blocks all hold at most context_length tokens.
4. The global batch is cut into dp_size x accumulation micro-batches of batch_size_training contiguous
   units; micro-batch j (0 <= j < accumulation) of rank r is slice ``j * dp_size + r``. This interleaving
   gives the ranks' concurrent micro-batches neighbouring lengths, so ranks wait less for each other at
   FSDP's collectives. Any fixed split is equivalent because the loss is normalised by the global count of
   labelled tokens.
5. Collation: padding pads a micro-batch's examples to the longest (what Hugging Face's collators do); packing,
   and padding with --padding_free, put them in one row without pad tokens (:func:`collate_flat`), which
   trains on the same examples with the same loss and computes no padding at all.
6. Sequence / context parallelism: every rank of a cp x sp group collates the same micro-batch (always a flat
   row) and keeps its own slice of it (``row_slice``: a RowTransform, shardtune.parallel.sequence.RowSlice).
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from shardtune.config.schema import TrainConfig, effective_batch_size
from shardtune.data.formatting import IGNORE_INDEX
from shardtune.data.packing import eval_examples, pack_examples
from shardtune.data.report import DataError

# Per token of a training micro-batch: its example's global index in the units (-1: padding) and the whole example's
# length, for LoRA dropout masks that do not depend on the rank layout (shardtune.model.lora_dropout)
EXAMPLE_IDS = "example_ids"
EXAMPLE_LENGTHS = "example_lengths"


class RowTransform(Protocol):
    """What cuts a collated row to this rank's part of it (sequence / context parallelism: the parallel floor's
    RowSlice); the loader applies it and knows nothing else about it."""

    def __call__(self, batch: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]: ...


Example = dict[str, list[int]]
Unit = list[Example]
MicroBatch = dict[str, torch.Tensor]


def example_length(example: Example) -> int:
    """Its tokens; a cached example (shardtune.data.cache.ExampleView) says so without reading them."""
    length = getattr(example, "length", None)
    return length if length is not None else len(example["input_ids"])


def unit_length(unit: Unit) -> int:
    """Its tokens (a preference pair: its longer sequence; a cached example or pair says so without reading them)."""
    return sum(
        example_length(example)
        if getattr(example, "length", None) is not None or "input_ids" in example
        else len(example["prompt_ids"]) + max(len(example["chosen_ids"]), len(example["rejected_ids"]))
        for example in unit
    )


def build_units(examples: list[Example], cfg: TrainConfig) -> list[Unit]:
    """One example per unit (padding), or packed blocks of at most context_length tokens (packing, by
    --packing_strategy: shardtune.data.packing)."""
    if cfg.data.batching == "padding":
        return [[example] for example in examples]
    return pack_examples(examples, cfg.data.packing_strategy, cfg.data.context_length, cfg.train.seed)


def steps_per_epoch(num_units: int, cfg: TrainConfig, dp_size: int) -> int:
    """Full global batches per epoch; the last partial one is dropped so that every step has G units."""
    size = effective_batch_size(cfg, dp_size)
    steps = num_units // size
    if steps == 0:
        what = "packed blocks" if cfg.data.batching == "packing" else "examples"
        raise DataError(
            f"dataset too small for effective batch {size} (batch_size_training "
            f"{cfg.train.batch_size} x {dp_size} data-parallel processes x gradient_accumulation_steps "
            f"{cfg.train.gradient_accumulation_steps}): it has {num_units} {what}: add data or lower "
            "--batch_size_training / --gradient_accumulation_steps"
        )
    return steps


def epoch_order(units: list[Unit], cfg: TrainConfig, dp_size: int, epoch: int) -> list[int]:
    """Unit indices of ``epoch``, global batch after global batch (rules 1-3 of the module docstring)."""
    size = effective_batch_size(cfg, dp_size)
    num_steps = steps_per_epoch(len(units), cfg, dp_size)
    if cfg.data.sampling == "sequential":
        order = list(range(num_steps * size))
    else:
        generator = torch.Generator().manual_seed(cfg.train.seed + epoch)
        order = torch.randperm(len(units), generator=generator).tolist()[: num_steps * size]
    if cfg.data.batching == "padding":
        for start in range(0, len(order), size):
            order[start : start + size] = sorted(order[start : start + size], key=lambda i: (unit_length(units[i]), i))
    return order


def micro_batch_slice(step: int, micro_step: int, dp_rank: int, cfg: TrainConfig, dp_size: int) -> slice:
    """Where data-parallel rank ``dp_rank``'s micro-batch ``micro_step`` of optimizer step ``step`` lies in the epoch
    order."""
    index = micro_step * dp_size + dp_rank
    start = step * effective_batch_size(cfg, dp_size) + index * cfg.train.batch_size
    return slice(start, start + cfg.train.batch_size)


def collate_padding(examples: list[Example], pad_id: int) -> MicroBatch:
    """Right-padded to the longest example; pads get pad_id, label -100, attention_mask 0."""
    length = max(len(example["input_ids"]) for example in examples)
    batch = len(examples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        input_ids[row, :n] = torch.from_numpy(np.asarray(example["input_ids"], dtype=np.int64))
        labels[row, :n] = torch.from_numpy(np.asarray(example["labels"], dtype=np.int64))
        attention_mask[row, :n] = 1
    position_ids = torch.arange(length).expand(batch, length).clone()
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask, "position_ids": position_ids}


def collate_flat(examples: list[Example]) -> MicroBatch:
    """All examples in one row, back to back, without a single pad token (a padding-free micro-batch).

    Positions restart at 0 for each example and ``cu_seq_lens`` holds the cumulative lengths, so attention stays
    inside each example (shardtune.model.attention); each example's first label is -100 so that no example predicts
    across a boundary. The model computes on exactly the examples' tokens, whatever their lengths.
    """
    lengths = [len(example["input_ids"]) for example in examples]
    input_ids = torch.from_numpy(np.concatenate([np.asarray(e["input_ids"], dtype=np.int64) for e in examples]))
    labels = torch.from_numpy(np.concatenate([np.asarray(e["labels"], dtype=np.int64) for e in examples]))
    labels[torch.tensor(lengths).cumsum(0) - torch.tensor(lengths)] = IGNORE_INDEX  # no example predicts across
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    cu_seq_lens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seq_lens[1:] = torch.tensor(lengths).cumsum(0)
    return {
        "input_ids": input_ids[None],
        "labels": labels[None],
        "position_ids": position_ids[None],
        "cu_seq_lens": cu_seq_lens,
        "max_length": torch.tensor(max(lengths)),
    }


def flattened(cfg: TrainConfig) -> bool:
    """Whether training micro-batches are padding-free rows: always with packing, with padding on request, and
    whenever rows are split over sequence / context parallel ranks (a split needs one row with boundaries)."""
    return (
        cfg.data.batching == "packing"
        or cfg.data.padding_free
        or cfg.parallel.sequence_parallel_size * cfg.parallel.context_parallel_size > 1
    )


def collate(units: list[Unit], cfg: TrainConfig, pad_id: int, example_ids: list[int] | None = None) -> MicroBatch:
    """``example_ids`` (the global index of each example, in order): recorded per token, for LoRA dropout masks that
    depend on the example and not on the rank layout (shardtune.model.lora_dropout)."""
    examples = [example for unit in units for example in unit]
    batch = collate_flat(examples) if flattened(cfg) else collate_padding(examples, pad_id)
    if example_ids is not None:
        batch.update(per_token_example_ids(examples, example_ids, batch["input_ids"].shape, flattened(cfg)))
    return batch


def per_token_example_ids(examples: list[Example], example_ids: list[int], shape: torch.Size, flat: bool) -> MicroBatch:
    """Per token: the global index of its example and the example's length (-1 and 0 on padding)."""
    ids, lengths = torch.full(shape, -1, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    start = 0
    for row, (example, example_id) in enumerate(zip(examples, example_ids)):
        n = len(example["input_ids"])
        where = (0, slice(start, start + n)) if flat else (row, slice(0, n))
        ids[where], lengths[where] = example_id, n
        start += n
    return {EXAMPLE_IDS: ids, EXAMPLE_LENGTHS: lengths}


class StepDataset(Dataset):
    """Item i: this rank's gradient_accumulation_steps micro-batches of optimizer step ``start_step + i``
    (with ``row_slice``: this rank's slice of each, for sequence / context parallelism)."""

    def __init__(
        self,
        units: list[Unit],
        cfg: TrainConfig,
        dp_rank: int,
        dp_size: int,
        epoch: int,
        pad_id: int,
        start_step: int = 0,
        row_slice: RowTransform | None = None,
        collate_fn: Callable[[list[Unit], TrainConfig, int], MicroBatch] | None = None,
    ) -> None:
        self.units = units
        self.collate_fn = collate_fn
        self.cfg = cfg
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.pad_id = pad_id
        self.row_slice = row_slice
        self.order = epoch_order(units, cfg, dp_size, epoch)
        num_steps = len(self.order) // effective_batch_size(cfg, dp_size)
        if not 0 <= start_step <= num_steps:
            raise ValueError(f"start_step {start_step} is outside the epoch's {num_steps} steps")
        self.start_step = start_step
        self.num_steps = num_steps
        # global index of each unit's first example: the same whatever the world size and batch
        self.first_example = [0]
        for unit in units:
            self.first_example.append(self.first_example[-1] + len(unit))

    def __len__(self) -> int:
        return self.num_steps - self.start_step

    def __getitem__(self, index: int) -> list[MicroBatch]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        step = self.start_step + index
        return [self._micro_batch(step, micro_step) for micro_step in range(self.cfg.train.gradient_accumulation_steps)]

    def _micro_batch(self, step: int, micro_step: int) -> MicroBatch:
        chosen = self.order[micro_batch_slice(step, micro_step, self.dp_rank, self.cfg, self.dp_size)]
        example_ids = [self.first_example[i] + j for i in chosen for j in range(len(self.units[i]))]
        units = [self.units[i] for i in chosen]
        batch = (
            collate(units, self.cfg, self.pad_id, example_ids)
            if self.collate_fn is None
            else self.collate_fn(units, self.cfg, self.pad_id)
        )
        return batch if self.row_slice is None else self.row_slice(batch, self.pad_id)


def train_loader(
    units: list[Unit],
    cfg: TrainConfig,
    dp_rank: int,
    dp_size: int,
    epoch: int,
    pad_id: int,
    start_step: int = 0,
    row_slice: RowTransform | None = None,
    collate_fn: Callable[[list[Unit], TrainConfig, int], MicroBatch] | None = None,
) -> DataLoader:
    """Yields one list of micro-batches per optimizer step (collated in workers when num_workers > 0); ``collate_fn``
    (units, cfg, pad_id) -> micro-batch replaces :func:`collate` (preference pairs).

    The loader gets its own generator: starting it draws no number from the global RNG, whose state (dropout)
    a checkpoint saves, so resuming mid-epoch continues the same random stream.
    """
    workers = cfg.data.num_workers
    return DataLoader(
        StepDataset(units, cfg, dp_rank, dp_size, epoch, pad_id, start_step, row_slice, collate_fn),
        batch_size=None,
        shuffle=False,
        num_workers=workers,
        prefetch_factor=2 if workers > 0 else None,
        persistent_workers=False,
        generator=torch.Generator().manual_seed(cfg.train.seed + epoch),
    )


def eval_shares(items: list, cfg: TrainConfig, dp_rank: int, dp_size: int) -> tuple[list[list], int]:
    """This rank's eval chunks (--val_batch_size items each; chunk c goes to data-parallel rank c % dp_size) and the
    number of eval batches every rank runs (the same on all; at most --max_eval_step): a rank with fewer chunks
    makes up the difference with batches it does not count, because FSDP's forward is a collective."""
    size = cfg.eval.batch_size
    num_batches = math.ceil(math.ceil(len(items) / size) / dp_size)
    if cfg.eval.max_batches > 0:
        num_batches = min(num_batches, cfg.eval.max_batches)
    return [items[start : start + size] for start in eval_chunk_starts(len(items), cfg, dp_rank, dp_size)], num_batches


def eval_chunk_starts(num_items: int, cfg: TrainConfig, dp_rank: int, dp_size: int) -> list[int]:
    """Where each of this rank's eval chunks (:func:`eval_shares`) starts in the split: the index of its first item, so
    that what a rank computes for its chunks can be put back in the split's order
    (shardtune.training.engine.predictions)."""
    size = cfg.eval.batch_size
    starts = list(range(dp_rank * size, num_items, dp_size * size))
    return starts[: cfg.eval.max_batches] if cfg.eval.max_batches > 0 else starts


def grouped_eval_batches(examples: list[Example], cfg: TrainConfig, dp_rank: int, dp_size: int, pad_id: int) -> list:
    """This rank's eval chunks (:func:`eval_shares`: the same examples on the same rank as :func:`eval_batches`),
    with consecutive chunks run as one micro-batch while it holds at most a training micro-batch's tokens
    (context_length x batch_size_training; an example longer than that alone): one forward for many examples when
    --val_batch_size is small (the cookbook's default is 1), the loss and metrics the same sums over the same tokens
    (up to the float rounding of summing them in another grouping). A padding-free row where training's rows are
    (:func:`flattened`: the model attends within examples), else padded batches (the budget counts their padding).
    Every rank runs as many batches (the most any rank needs; dummies for the rest), FSDP's forward being a
    collective: each rank groups every rank's chunks alike to know that number without communicating. Not for split
    rows (sequence / context parallelism), nor where predictions are kept per chunk (compute_metrics)."""
    budget = cfg.data.context_length * cfg.train.batch_size
    flat = flattened(cfg)
    evaluated = eval_examples(examples, cfg)
    groups_of = [_eval_groups(eval_shares(evaluated, cfg, rank, dp_size)[0], budget, flat) for rank in range(dp_size)]
    mine = groups_of[dp_rank]
    dummy: Example = {"input_ids": [pad_id], "labels": [IGNORE_INDEX]}
    mine += [[dummy]] * (max(len(groups) for groups in groups_of) - len(mine))
    return [collate_flat(group) if flat else collate_padding(group, pad_id) for group in mine]


def _eval_groups(chunks: list[list[Example]], budget: int, flat: bool) -> list[list[Example]]:
    """Consecutive chunks joined while a group's tokens (padded: rows x its longest) stay within ``budget``."""
    groups: list[list[Example]] = []
    rows = tokens = longest = 0  # the last group's
    for chunk in chunks:
        lengths = [len(example["input_ids"]) for example in chunk]
        joined = (rows + len(lengths), tokens + sum(lengths), max(longest, *lengths))
        if groups and (joined[1] if flat else joined[0] * joined[2]) <= budget:
            groups[-1] += chunk
            rows, tokens, longest = joined
        else:
            groups.append(list(chunk))
            rows, tokens, longest = len(lengths), sum(lengths), max(lengths)
    return groups


def eval_batches(
    examples: list[Example],
    cfg: TrainConfig,
    dp_rank: int,
    dp_size: int,
    pad_id: int,
    row_slice: RowTransform | None = None,
) -> list[MicroBatch]:
    """This rank's eval micro-batches: the same count on every rank, each example on exactly one data-parallel rank.

    Examples keep their order (with packing that splits rows, bfd_split / wrapped: the sequences it makes of them,
    shardtune.data.packing.eval_examples) and are cut into chunks of val_batch_size; chunk c goes to data-parallel rank
    c % dp_size. Eval uses padding collation: an example's logits are the same as inside a packed block, and no
    L x L mask is built. With ``row_slice`` (sequence / context parallelism) the ranks of a cp x sp group share their
    chunks and split them as in training: one padding-free row per chunk, of which each keeps its slice, so an eval
    row needs no more memory per rank than a training row. Ranks with fewer chunks get dummy batches (one pad token,
    label -100) because FSDP's forward is a collective every rank must join. max_eval_step > 0 keeps at most that
    many batches per rank.
    """
    mine, num_batches = eval_shares(eval_examples(examples, cfg), cfg, dp_rank, dp_size)
    dummy: Example = {"input_ids": [pad_id], "labels": [IGNORE_INDEX]}
    chunks = mine + [[dummy]] * (num_batches - len(mine))
    if row_slice is None:
        return [collate_padding(chunk, pad_id) for chunk in chunks]
    return [row_slice(collate_flat(chunk), pad_id) for chunk in chunks]
