"""What a training objective brings to the one engine: its data and batches, a micro-batch's loss as a sum with its
normaliser and statistics, its evaluation, its metric names, its checks before launch (its registration in
shardtune.config.objectives has the planner's terms).

The engine (shardtune.training.engine.step, shardtune.training.engine.loop) owns everything else, alike for every
objective:
accumulation, the gradient scale that undoes the strategies' averaging, clipping, the step / skip / stop decision
(--nan_policy), checkpoints, metrics rows. The loss of an optimizer step is

    sum(micro-batch loss sums over all micro-batches of all ranks) / N

where N is the objective's global normaliser of the step (SFT: labelled tokens; DPO: pairs), all-reduced before the
first backward, so that any split of the same step over processes and accumulation steps gives the same gradients.

The objectives are named in shardtune.config.objectives (torch-free, for the command line); :func:`objective_class`
imports the one a run trains.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Iterator

import torch
from torch import nn

from shardtune import data
from shardtune.accounting.flops import ModelShape
from shardtune.config.objectives import OBJECTIVES, registration
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.streaming import stream_steps
from shardtune.model.loading import vision_run
from shardtune.runtime.distributed import DistEnv

if TYPE_CHECKING:
    from shardtune.training.engine.metrics import MetricsWriter

# The counts every objective gives for a step (per rank, summed over ranks by the engine), in this order; an objective
# may add its own after them (``Objective.count_names``). label_tokens: the tokens that carry a loss (the rows'
# ``label_tokens``); input_tokens: the real (non-pad) tokens of the inputs, whose running total is TRL's ``num_tokens``.
COUNTS = ("normaliser", "label_tokens", "input_tokens", "flops", "palm_flops")


def data_splits(cfg: TrainConfig) -> tuple[str, ...]:
    """The splits an objective's data has: the training split, and the evaluation split when the run evaluates."""
    return ("train", "validation") if cfg.eval.enabled else ("train",)


class Objective(ABC):
    """One objective of the engine; one instance per worker (it may hold models, e.g. DPO's reference)."""

    name: ClassVar[str]
    count_names: ClassVar[tuple[str, ...]] = COUNTS
    stat_names: ClassVar[tuple[str, ...]]  # what a micro-batch's loss returns beside its sum
    # how each stat combines over the step's micro-batches and ranks: "sum" (the default for all), "min" or "max"
    # (TRL's clip_ratio/low_min); reduced on the device by the step, read in its one host read
    stat_reductions: ClassVar[tuple[str, ...]] = ()
    step_metric_names: ClassVar[tuple[str, ...]] = ()  # keys its step rows carry beyond the engine's
    eval_metric_names: ClassVar[tuple[str, ...]]  # keys of its evaluation rows (--metric_for_best_model)
    # whether its evaluation can keep each example's predictions (shardtune.training.engine.predictions:
    # compute_metrics,
    # predict()); while one does, ``predictions`` is the evaluation's PredictionKeeper
    predicts: ClassVar[bool] = False
    predictions: Any = None

    # -- before launch (no process group) -----------------------------------------------------------------------
    @classmethod
    def check(cls, cfg: TrainConfig, world_size: int) -> None:
        """Its settings, alone (one ConfigError line)."""

    @classmethod
    def padding_free_by_default(cls, cfg: TrainConfig) -> bool:
        """What --padding_free is when not given (shardtune.training.engine.checks.resolve_padding_free): padded
        rows unless the objective computes padding-free rows to the same numbers, faster."""
        return False

    @classmethod
    @abstractmethod
    def prepare_data(cls, cfg: TrainConfig, tokenizer, dp_size: int) -> None:
        """Tokenise its data into the cache (a bad row found here, before any worker) and check there is a step."""

    # -- in the worker -----------------------------------------------------------------------------------------
    def __init__(self, cfg: TrainConfig, env: DistEnv, strategy, tokenizer) -> None:
        self.cfg, self.env, self.strategy, self.tokenizer = cfg, env, strategy, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer is not None else 0

    @abstractmethod
    def load_data(self) -> tuple[list, list]:
        """(training units, evaluation items), the same on every rank."""

    # the run's MetricsWriter (set by the loop): an objective's own samples (GRPO's completions)
    writer: MetricsWriter | None = None

    # (units, cfg, pad_id) -> a training micro-batch; None: the data floor's collate of examples
    collate_fn: ClassVar[Any] = None

    # a streamed run's data position (shardtune.data.streaming): where it resumed (set by the loop) and where the
    # next step's rows start, saved with each checkpoint
    resume_data: dict | None = None
    data_position: dict | None = None

    def batches(self, units: list, epoch: int, first: int, dp_rank: int, dp_size: int, row_slice=None):
        """This rank's micro-batches of each step of ``epoch`` from its step ``first`` on: the data floor's loader
        (with --dataset_streaming, rows read as the steps need them, from the resumed position). An objective that
        makes a step's batches as it trains (GRPO: completions sampled with the current weights, scored) overrides
        it; the loop asks for a step's batches after the previous step is done."""
        if self.cfg.data.streaming:
            return self._streamed(units, dp_rank, dp_size, row_slice)
        return data.train_loader(
            units, self.cfg, dp_rank, dp_size, epoch, self.pad_id, first, row_slice, self.collate_fn
        )

    def _streamed(self, units: Any, dp_rank: int, dp_size: int, row_slice) -> Iterator[list[dict]]:
        """A streamed run's steps from the resumed position; each step's position kept for the next checkpoint
        (before the step: its checkpoint is written before the loop asks again). ``units``: a streamed run's
        StreamSource (shardtune.data.streaming), what its load_data gave for training."""
        for micro_batches, position in stream_steps(units, dp_rank, dp_size, self.pad_id, self.resume_data, row_slice):
            self.data_position = position
            yield micro_batches

    def state_to_save(self) -> dict | None:
        """This rank's state a checkpoint must keep beyond the weights, optimizer, RNG and data position (GRPO: the
        generation its next steps train on; tensors, numbers, strings), or None."""
        return None

    def restore_state(self, state: dict | None) -> None:
        """What state_to_save gave, from the checkpoint resumed (None: nothing saved, or not resuming)."""

    def attach(self, model: nn.Module, units: list, eval_items: list) -> None:
        """After the model is wrapped, before the first step: build what the loss needs besides the model."""

    def processing_class(self) -> Any:
        """What is saved beside the model (checkpoints, the final model, adapters): the tokenizer; a vision-language
        model's processor (tokenizer, image processor, chat template) for one. Asked after load_data."""
        return self.tokenizer

    @abstractmethod
    def counts(self, micro_batches: list[dict], shape: ModelShape | None) -> list[float] | torch.Tensor:
        """This rank's counts of the step, in ``count_names`` order (flops 0 without a shape): numbers, or a float64
        tensor on the device where a count is computed there (KTO's KL rows, scored before the first backward: no host
        read)."""

    @abstractmethod
    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor], totals: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's loss SUM with its graph, its statistics in ``stat_names`` order, detached, on the
        device). ``totals``: the step's global counts (``count_names``), on the device."""

    @abstractmethod
    def step_metrics(self, totals: dict[str, float], stats: list[float]) -> dict[str, float]:
        """The step's ``loss`` and its own metrics from the global totals and summed statistics."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> tuple[dict[str, float], list[dict]]:
        """Collective: (the evaluation row, with ``eval_loss``; generated samples to log, maybe none)."""

    def describe_eval(self, row: dict[str, float]) -> str:
        return f"eval loss {row['eval_loss']:.4f}"

    def report_eval(self, row: dict[str, float]) -> str:
        """What the run's closing report adds after the last evaluation's loss (", perplexity 3.2")."""
        return ""


def objective_class(name: str, cfg: TrainConfig | None = None) -> type[Objective]:
    """The objective ``name``'s class (its registration's ``implementation``: shardtune.config.objectives); with the
    run's ``cfg``, the one that trains its model: a vision-language model's (``vision_implementation``) for one."""
    entry = registration(name)
    spec = entry.implementation
    if cfg is not None and entry.vision_implementation and vision_run(cfg):
        spec = entry.vision_implementation
    module, _, cls = spec.partition(":")
    return getattr(importlib.import_module(module), cls)


def foreign_setting(cfg: TrainConfig) -> tuple[str, str] | None:
    """(another objective, one of its flags) when a flag of an objective the run does not train is given: it would
    be ignored; None when there is none."""
    read = registration(cfg.objective).shares  # other objectives' sections this one reads (RLOO: GRPO's)
    for name, entry in OBJECTIVES.items():
        section = entry.settings
        if name == cfg.objective or not section or section in read:
            continue
        given, default = getattr(cfg, section), type(getattr(cfg, section))()
        changed = [key for key, value in vars(given).items() if value != getattr(default, key)]
        if changed:
            return name, changed[0]
    return None


def check_objective(cfg: TrainConfig, world_size: int) -> None:
    """The objective's own checks, and no other objective's flag given."""
    foreign = foreign_setting(cfg)
    if foreign:
        raise ConfigError(f"--{foreign[1]} is a flag of shardtune {foreign[0]}: run shardtune {foreign[0]}, or drop it")
    if vision_run(cfg) and not registration(cfg.objective).vision_implementation:
        raise ConfigError(
            f"{cfg.model.name} is a vision-language model, and shardtune {cfg.objective} trains text-only models "
            "(images are built for shardtune sft: docs/vision.md): use a text model, or train with shardtune sft"
        )
    objective_class(cfg.objective, cfg).check(cfg, world_size)
