"""``trl.data_utils``'s path, for scripts that import TRL's data utilities from there
(``from trl.data_utils import maybe_apply_chat_template`` becomes ``from shardtune.data_utils import ...``): the same
functions as ``shardtune``'s top level (shardtune.data.trl_utils, shardtune.data.packing)."""

from shardtune.data.packing import pack_dataset
from shardtune.data.trl_utils import (
    apply_chat_template,
    extract_prompt,
    is_conversational,
    is_conversational_from_value,
    maybe_apply_chat_template,
    maybe_convert_to_chatml,
    maybe_extract_prompt,
    maybe_unpair_preference_dataset,
    unpair_preference_dataset,
)

__all__ = [
    "apply_chat_template",
    "extract_prompt",
    "is_conversational",
    "is_conversational_from_value",
    "maybe_apply_chat_template",
    "maybe_convert_to_chatml",
    "maybe_extract_prompt",
    "maybe_unpair_preference_dataset",
    "pack_dataset",
    "unpair_preference_dataset",
]
