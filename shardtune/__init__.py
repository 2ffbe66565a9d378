"""shardtune: fine-tune Llama-family models on one GPU, all GPUs of a machine, or many machines.

``shardtune sft ...`` is the command line; ``from shardtune import SFTTrainer, SFTConfig`` (DPO, GRPO alike) the Python
face in TRL's shape (shardtune.api): every public name a TRL 1.16 script imports from ``trl``, each imported on first
use (the command line does not pay for it). docs/python-api.md lists TRL's names, honoured or refused.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(
        ("DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "SFTConfig", "SFTTrainer"), "shardtune.api"
    ),
    "TrlParser": "shardtune.api.parser",
    **dict.fromkeys(("RewardConfig", "RewardTrainer"), "shardtune.api.reward"),
    **dict.fromkeys(("RLOOConfig", "RLOOTrainer"), "shardtune.api.rloo"),
    **dict.fromkeys(("KTOConfig", "KTOTrainer"), "shardtune.api.kto"),
    **dict.fromkeys(
        (
            "DatasetConfig",
            "DatasetMixtureConfig",
            "ModelConfig",
            "ScriptArguments",
            "get_dataset",
            "get_kbit_device_map",
            "get_peft_config",
            "get_quantization_config",
        ),
        "shardtune.api.script_args",
    ),
    **dict.fromkeys(
        (
            "apply_chat_template",
            "extract_prompt",
            "is_conversational",
            "is_conversational_from_value",
            "maybe_apply_chat_template",
            "maybe_convert_to_chatml",
            "maybe_extract_prompt",
            "maybe_unpair_preference_dataset",
            "supports_tool_calling",
            "unpair_preference_dataset",
        ),
        "shardtune.data.trl_utils",
    ),
    "create_reference_model": "shardtune.model.reference",
    "pack_dataset": "shardtune.data.packing",
}

__all__ = sorted(_EXPORTS)

_TRAINERS = "shardtune trains with SFTTrainer, DPOTrainer, GRPOTrainer, RewardTrainer, KTOTrainer and RLOOTrainer"
# trl's other public names: importing one says why it is not here (an ImportError naming the reason and the way out)
REFUSED = {
    **{
        name: f"{name}: distillation is not built ({_TRAINERS}): use trl for it"
        for name in ("DistillationConfig", "DistillationTrainer")
    },
    "BEMACallback": "BEMACallback: an EMA of the weights is not built: drop the callback",
    "LogCompletionsCallback": "LogCompletionsCallback: completions are logged by GRPO's log_completions; for SFT and "
    "DPO sample with `shardtune generate` after training: drop the callback",
    "RichProgressCallback": "RichProgressCallback: shardtune prints its own progress bar (rank 0): drop the callback",
    "SyncRefModelCallback": "SyncRefModelCallback: the reference stays the starting weights (TR-DPO's syncing is not "
    "built): drop the callback",
    "WeaveCallback": "WeaveCallback: W&B Weave tracing is not built (report_to wandb logs the metrics): drop it",
    "add_response_schema": "add_response_schema: with tools, shardtune reads the tool-call format off the chat "
    "template (or the tokenizer's own response_template): drop the call",
    "clone_chat_template": "clone_chat_template: give the tokenizer its template with --chat_template_path (a Jinja "
    "file or a tokenizer directory) instead",
    "get_training_chat_template": "get_training_chat_template: pass a template with {% generation %} markers as "
    "--chat_template_path (TRL's templates in trl/chat_templates/ work as they are)",
    "prepare_multimodal_messages": "prepare_multimodal_messages: shardtune trains text-only models (no images yet)",
    "init_zero_verbose": "init_zero_verbose: shardtune's logging needs no set-up (rank 0 talks): drop the call",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in REFUSED:  # `from shardtune import X` shows this message, where an AttributeError would show none
        raise ImportError(f"shardtune: {REFUSED[name]}", name=name)
    raise AttributeError(f"module 'shardtune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
