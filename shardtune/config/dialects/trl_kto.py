"""TRL's KTOConfig names (``trl kto``) that DPOConfig lacks, as shardtune kto's settings
(shardtune.config.kto_settings). The names KTO shares with DPO (``beta``, ``ref_model``, ``precompute_ref_log_probs``,
``precompute_ref_batch_size``) set DPO's section, which shardtune kto reads (Registration.shares); ``loss_type`` sets
the command's own section (trl.py)."""

from __future__ import annotations

from dataclasses import fields

from shardtune.config.dialects import Spelling
from shardtune.config.kto_settings import KtoConfig

SPELLINGS: dict[str, Spelling] = {
    f.name: Spelling(f"kto.{f.name}", f.metadata["help"]) for f in fields(KtoConfig) if f.name != "loss_type"
}
