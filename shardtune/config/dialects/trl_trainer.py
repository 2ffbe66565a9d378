"""TRL's inherited names: the fields of transformers' TrainingArguments (and TRL's ModelConfig / ScriptArguments)
beyond the common ones of trl.py, each honoured as a canonical setting or refused in one line with its own reason."""

from __future__ import annotations

from shardtune.config.dialects import Spelling

SPELLINGS: dict[str, Spelling] = {}
