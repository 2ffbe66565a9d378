"""Every name a flag may be given by: the canonical dotted names (``optim.lr``) and the dialects' names
(shardtune.config.dialects), each meaning one thing. What a name sets, whether it takes a list, how a message names a
setting the user did not type, and the suggestion for a name that is none of these."""

from __future__ import annotations

import difflib
import functools

from shardtune.config.dialects import Spelling, cookbook, trl
from shardtune.config.fields import flat_fields, is_list, optional
from shardtune.config.objectives import OBJECTIVES
from shardtune.config.schema import ConfigError

DIALECTS = {"llama-cookbook": cookbook, "TRL": trl}


@functools.cache
def spellings() -> dict[str, Spelling]:
    """The dialects' names (each in one table only: a name means one thing)."""
    out: dict[str, Spelling] = {}
    for dialect in DIALECTS.values():
        for name, spelling in dialect.SPELLINGS.items():
            if name in out or name in flat_fields():
                raise AssertionError(f"--{name} is spelled twice (a dialect table, or a canonical name)")
            out[name] = spelling
    return out


def normalise(name: str) -> str:
    return name if "." in name else name.replace("-", "_")


def resolve(name: str, objective: str | None = None) -> Spelling:
    """What flag ``name`` sets: a canonical name is a plain Spelling of itself; an unknown one raises, with the
    closest known name (``objective``: the command's, whose suggestion is never another objective's flag)."""
    name = normalise(name)
    if name in flat_fields():
        return Spelling(name)
    found = spellings().get(name)
    if found is not None:
        return found
    # the closest of all names, suggested only if usable: a misspelt refused name gets no far-fetched suggestion
    close = difflib.get_close_matches(name, [*flat_fields(), *spellings()], n=1, cutoff=0.5)
    hint = (
        f"did you mean --{close[0]}?" if close and close[0] in usable_names(objective) else "see shardtune sft --help"
    )
    raise ConfigError(f"unknown flag --{name}: {hint}")


@functools.cache
def usable_names(objective: str | None = None) -> list[str]:
    """Names a suggestion may point at: not refused ones (a did-you-mean never points at a refusal), and with
    ``objective`` none that sets only another objective's settings (shardtune sft never suggests --beta)."""
    shared = OBJECTIVES[objective].shares if objective in OBJECTIVES else ()
    foreign = tuple(
        f"{registration.settings}."
        for other, registration in OBJECTIVES.items()
        if objective and other != objective and registration.settings and registration.settings not in shared
    )

    def ours(targets: list[str]) -> bool:
        return not targets or not all(target.startswith(foreign) for target in targets)

    return [
        *(key for key in flat_fields() if ours([key])),
        *(n for n, s in spellings().items() if not s.refuse and ours(s.target.replace("/", " ").split())),
    ]


def takes_a_list(name: str) -> bool:
    """Whether flag ``name`` sets a list, whose values may follow it one by one (``--loss_type sigmoid sft``, as
    TRL's parser takes them)."""
    try:
        spelling = resolve(name)
    except ConfigError:
        return False
    info = flat_fields().get(spelling.target)
    return info is not None and is_list(optional(info.type)[0]) and (spelling.to is None or name in LIST_VALUED)


# Translated names whose value is a list too (their translation reads the comma-separated form).
LIST_VALUED = ("report_to", "loss_type")


# TRL's booleans whose table entry takes one of true / false only (the other refused: trl_trainer's ``only``; use_cpu
# where GPUs are visible) or any value (it changes nothing here: ``no_effect``), so that their translation cannot show
# that they take a boolean (tests/unit/test_switches.py checks this list against TRL's own dataclasses).
SWITCHES_BY_NAME = (
    "use_cpu",
    "ignore_bias_buffers",
    "dataloader_drop_last",
    "dataloader_pin_memory",
    "dataloader_persistent_workers",
    "dataloader_in_order",
    "remove_unused_columns",
    "logging_nan_inf_filter",
    "log_on_each_node",
    "skip_memory_metrics",
    "prediction_loss_only",
    "eval_do_concat_batches",
    "eval_use_gather_object",
    "enable_jit_checkpoint",
    "hub_always_push",
    "do_train",
    "do_eval",
    "do_predict",
    "ddp_find_unused_parameters",
    "ddp_broadcast_buffers",
    "ddp_static_graph",
    "average_tokens_across_devices",
    "tf32",
    "use_cache",
    "disable_tqdm",
)
NOT_A_BOOLEAN = "neither-true-nor-false"  # what a switch's translation refuses


@functools.cache
def is_switch(name: str) -> bool:
    """Whether flag ``name`` takes a boolean (true / false) in the canonical config or in its dialect: what
    ``--no_<name>`` turns off. A canonical name (or a plain rename) by its field's type; a translated name when it takes
    true and false and refuses a word that is neither (or is in SWITCHES_BY_NAME); a refused name always (``--no_X``
    then gets ``--X false``'s answer: no change where false asks for nothing, else X's refusal)."""
    spelling = resolve(name)
    if spelling.refuse:
        return True
    if spelling.to is None:
        return optional(flat_fields()[spelling.target].type)[0] is bool
    return normalise(name) in SWITCHES_BY_NAME or translates_a_boolean(spelling)


def translates_a_boolean(spelling: Spelling) -> bool:
    """Whether a translation takes true and false and refuses a word that is neither."""
    return _takes(spelling, "true") and _takes(spelling, "false") and not _takes(spelling, NOT_A_BOOLEAN)


def _takes(spelling: Spelling, value: str) -> bool:
    try:
        spelling.to(value)  # type: ignore[misc]
    except ConfigError:
        return False
    return True


def negated(name: str) -> str | None:
    """``--no_X`` is ``--X false`` for every switch X (transformers' HfArgumentParser, which TRL's commands use, has it
    for its booleans that default to true): X when ``name`` is that form of a known name; None when it is not (a name
    of its own, or no_ before an unknown name: refused as it is). A known X that takes a value is refused."""
    name = normalise(name)
    if not name.startswith(("no_", "no-")) or name in flat_fields() or name in spellings():
        return None
    switch = normalise(name[3:])
    try:
        resolve(switch)
    except ConfigError:
        return None
    if not is_switch(switch):
        raise ConfigError(
            f"--{name}: --{switch} is not a switch (it takes a value, not true / false): pass --{switch} VALUE, "
            "or drop the flag"
        )
    return switch


@functools.cache
def default_spelling(key: str) -> str:
    """The flag name a message uses for the canonical ``key`` when the user did not type it: the flat name users
    know it by (shardtune's and llama-cookbook's first, then TRL's), else the key itself."""
    for dialect in DIALECTS.values():
        for name, spelling in dialect.SPELLINGS.items():
            if spelling.target == key and spelling.to is None and "." not in name:
                return name
    return key


def names_of(key: str, dialect: str) -> list[str]:
    """The names of ``dialect`` that set the canonical ``key`` (for --help and the docs)."""
    return [
        name
        for name, spelling in DIALECTS[dialect].SPELLINGS.items()
        if not spelling.refuse and key in spelling.target.replace("/", " ").split()
    ]


# Names that say whose defaults a command means (shardtune.config.defaults): TRL's name of a setting and
# llama-cookbook's name of the same setting, and each tool's own switches of its documented commands. Names both tools
# use (--output_dir, --seed, --use_peft), shardtune's own, and the names of settings whose default both share
# (precision, data selection, LoRA's section) say nothing.
SPEAKERS = {
    "trl": (
        "model_name_or_path",
        "learning_rate",
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "num_train_epochs",
        "max_grad_norm",
        "packing",
        "eval_strategy",
        "save_strategy",
        "gradient_checkpointing",
        "dataloader_num_workers",
        "lr_scheduler_type",
    ),
    "cookbook": (
        "model_name",
        "lr",
        "batch_size_training",
        "val_batch_size",
        "num_epochs",
        "gradient_clipping",
        "gradient_clipping_threshold",
        "batching_strategy",
        "run_validation",
        "fsdp_config.fsdp_activation_checkpointing",
        "fsdp_activation_checkpointing",
        "num_workers_dataloader",
        "enable_fsdp",
        "enable_deepspeed",
        "peft_method",
    ),
}


def dialect_of(name: str) -> str:
    """Whose defaults flag ``name`` speaks for: "trl", "cookbook", or "" (see SPEAKERS)."""
    name = normalise(name)
    return next((dialect for dialect, names in SPEAKERS.items() if name in names), "")
