"""The one list of checks that run before launch, in the order they run. Each check lives beside the code that owns
the setting (config, model, parallel, training) and is listed here; nothing registers itself on import.

- ``validate``: the settings alone (no model, no data): what recipes and flag combinations are checked with.
- ``check_before_launch``: plus the model's config.json (structure, adapters, RoPE scaling, split rows): what
  ``shardtune sft --dry_run`` runs.
- ``prepare``: plus the tokenizer and the data (tokenised into the cache): what ``shardtune sft`` runs before any
  process group exists, so a bad row is reported before any worker starts.
"""

from __future__ import annotations

from shardtune import data
from shardtune.config.checks import CONFIG_CHECKS
from shardtune.config.schema import TrainConfig
from shardtune.model.freezing import check_freeze_layers, check_freezing_settings, check_vision_freezing
from shardtune.model.loading import (
    auto_config,
    check_model_source,
    check_tokenizer_fits,
    load_tokenizer,
    resolve_model_name,
    resolve_revision,
)
from shardtune.model.longseq import check_rope_scaling
from shardtune.model.peft import check_peft
from shardtune.model.speed import check_attention_fits, check_attn_implementation
from shardtune.model.structure import check_model_structure
from shardtune.parallel.dims import ParallelDims, check_parallel_dims
from shardtune.parallel.optim import check_optim, check_schedule
from shardtune.parallel.sequence import check_sequence_split
from shardtune.publishing.hub import check_push_to_hub
from shardtune.runtime.distributed import is_torchrun_worker
from shardtune.training.engine.checkpoint.best import check_intervals
from shardtune.training.engine.checkpoint.checkpointer import check_checkpointing, check_resume_fits
from shardtune.training.engine.objective import check_objective, objective_class

# Settings alone, in order: the objective's, the config floor's own, then those owned by the floors above.
SETTING_CHECKS = (
    check_objective,
    *CONFIG_CHECKS,
    check_parallel_dims,
    check_schedule,
    check_optim,
    check_checkpointing,
    check_intervals,
    check_attn_implementation,
    check_push_to_hub,
    check_freezing_settings,
)


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Check every setting (and combination) that can be checked without a model, data or process group."""
    for check in SETTING_CHECKS:
        check(cfg, world_size)


def check_before_launch(cfg: TrainConfig, world_size: int) -> None:
    """The settings, then what the model's config.json says about them (needs no tokenizer and no data)."""
    validate(cfg, world_size)
    check_with_model(cfg, world_size)


def check_with_model(cfg: TrainConfig, world_size: int) -> None:
    """What the model's config.json says about the settings: structure, cookbook model flags, adapters, RoPE
    scaling, split rows."""
    check_model_structure(cfg)
    check_freeze_layers(cfg)
    check_vision_freezing(cfg)
    check_peft(cfg)
    check_resume_fits(cfg)
    check_rope_scaling(cfg)
    if cfg.model.attn_implementation:
        check_attention_fits(cfg, auto_config(cfg.model.name, cfg.model.trust_remote_code))
    if ParallelDims.from_config(cfg, world_size).sequence_split:
        check_sequence_split(cfg, auto_config(cfg.model.name, cfg.model.trust_remote_code))


def prepare(cfg: TrainConfig, world_size: int) -> None:
    """Everything checkable before a process group exists: settings, model source, data, context length.

    The data is loaded (and tokenised into the cache) by the objective here too, so a bad row is reported before any
    worker.
    """
    validate(cfg, world_size)
    resolve_padding_free(cfg)
    cfg.model.name = resolve_revision(resolve_model_name(cfg.model.name), cfg.model.revision)
    cfg.model.revision = ""  # resolved: model_name is the revision's snapshot (the workers and config.yaml read it)
    check_model_source(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code)
    check_with_model(cfg, world_size)
    if cfg.model.tokenizer:
        check_model_source(cfg.model.tokenizer, "tokenizer_name", cfg.model.trust_remote_code)
    data.check_data_config(cfg)
    tokenizer = data.apply_tokenizer_options(
        cfg, load_tokenizer(cfg.model.tokenizer or cfg.model.name, cfg.model.trust_remote_code)
    )
    data.drop_absent_validation(cfg, say=not is_torchrun_worker())
    check_tokenizer_fits(cfg.model.name, tokenizer, cfg.model.tokenizer, cfg.model.trust_remote_code)
    data.check_context_length(cfg, tokenizer)
    objective_class(cfg.objective, cfg).prepare_data(cfg, tokenizer, ParallelDims.from_config(cfg, world_size).dp_size)


def resolve_padding_free(cfg: TrainConfig) -> None:
    """--padding_free not given (None): the objective's choice (:meth:`Objective.padding_free_by_default`), made
    once before launch; the workers get it as a flag (shardtune.commands.sft.worker_argv)."""
    if cfg.data.padding_free is None:
        cfg.data.padding_free = objective_class(cfg.objective, cfg).padding_free_by_default(cfg)
