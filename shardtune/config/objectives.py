"""The registry of training objectives: each verb that trains (``shardtune sft``, ``shardtune dpo``) is one entry.

An objective is implemented by one module of the training floor (a subclass of
shardtune.training.objective.Objective); here it is named, with what the command line and the planner need to know
without importing torch or the model libraries: its one-line help, its flags' section, and its memory terms. A new
objective is its module plus one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


def no_reference(cfg: Any) -> bool:
    return False


def grpo_reference(cfg: Any) -> bool:
    """GRPO's reference (beta > 0) is a frozen copy of the starting weights for full fine-tuning (with PEFT: the
    base, adapter off)."""
    return cfg.grpo.beta > 0 and not cfg.peft.method


def no_sampling(cfg: Any, world_size: int) -> int:
    return 0


def grpo_sampling_rows(cfg: Any, world_size: int) -> int:
    """The completions a GRPO process samples at once: one generation's share (shardtune.training.grpo_batches: k
    optimizer steps of its micro-batches)."""
    g, batch = cfg.grpo, cfg.train.batch_size
    if g.steps_per_generation:
        return g.steps_per_generation * batch
    if g.generation_batch_size:
        dp = world_size // (cfg.parallel.sequence_parallel_size * cfg.parallel.context_parallel_size)
        return max(1, g.generation_batch_size // dp)
    return cfg.train.gradient_accumulation_steps * batch


def dpo_reference(cfg: Any) -> bool:
    """DPO's reference is a frozen copy of the model for full fine-tuning (with PEFT: the base, adapter off), unless
    its log-probabilities are precomputed."""
    return not cfg.peft.method and not cfg.dpo.precompute_ref_log_probs


@dataclass(frozen=True)
class Registration:
    help: str  # its line in `shardtune --help`
    implementation: str  # "module:Class" of its Objective
    settings: str = ""  # the config section of its own flags (given to another objective: refused)
    rows_per_unit: int = 1  # planner: rows the model computes per unit of batch
    frozen_reference: Callable[[Any], bool] = no_reference  # planner: a frozen copy of the model beside it
    sampling_rows: Callable[[Any, int], int] = no_sampling  # planner: rows a process samples at once between steps
    streams: bool = False  # trains on --dataset_streaming data (rows read as the steps need them)
    packs: bool = True  # packs rows into blocks when asked (--packing); False: rows padded per micro-batch, always
    pooled_tokenising: bool = True  # tokenises its data into the cache in --dataset_num_proc processes
    # TRL's --shuffle_dataset value it honours: SFT's / DPO's false (no shuffle before tokenising; the seeded sampler
    # shuffles every epoch), GRPO's true (its sampler's shuffle: the seeded prompt order of every epoch)
    trl_shuffle_dataset: bool = False
    reference_setting: str = ""  # the canonical key naming its reference model ("": the starting weights, or none)
    # TRL's --loss_type for an objective whose section has no loss_type setting: the names it trains (the first is
    # TRL's default), and those TRL has that it does not, with why
    loss_types: tuple[str, ...] = ()
    loss_types_not_built: tuple[tuple[str, str], ...] = ()
    # "module:function" (cfg, number of units, data-parallel size) -> optimizer steps per epoch, where an epoch is
    # not the units over the effective batch (GRPO: prompts, each sampled num_generations times); "": that
    epoch_steps: str = ""


OBJECTIVES = {
    "sft": Registration(
        "fine-tune a model (launches torchrun; see shardtune sft --help)",
        "shardtune.training.sft:SFT",
        streams=True,
        loss_types=("nll",),
        loss_types_not_built=(("dft", "Dynamic Fine-Tuning: each token's loss weighted by its probability"),),
    ),
    "dpo": Registration(
        "preference training (DPO) on chosen / rejected pairs, same launcher and flags as sft (docs/dpo.md)",
        "shardtune.training.dpo:DPO",
        settings="dpo",
        rows_per_unit=2,
        packs=False,  # a micro-batch's pairs are padded rows (or one padding-free row with --padding_free)
        frozen_reference=dpo_reference,
        reference_setting="dpo.ref_model",
    ),
    "grpo": Registration(
        "online RL (GRPO): sample completions, score them with reward functions, same launcher (docs/grpo.md)",
        "shardtune.training.grpo:GRPO",
        settings="grpo",
        packs=False,  # prompts and their sampled completions are padded per micro-batch
        frozen_reference=grpo_reference,
        sampling_rows=grpo_sampling_rows,
        pooled_tokenising=False,  # its prompts are tokenised whole, in each process: they are small
        trl_shuffle_dataset=True,
        epoch_steps="shardtune.training.grpo_batches:epoch_steps",
    ),
}
