"""DeepSpeed's JSON config files: the object of ``--deepspeed_config.config_file`` (parallel.deepspeed_config_file),
merged over the config shardtune builds, and the keys shardtune sets itself in it (a file may only repeat them or say
"auto")."""

from __future__ import annotations

from pathlib import Path

from shardtune.config.schema import ConfigError, TrainConfig

# Keys of a --deepspeed_config.config_file that shardtune sets itself: the file may repeat our value or say "auto".
DEEPSPEED_OWNED_KEYS = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "managed_gradient_accumulation",
    "optimizer",
    "scheduler",
)


def deepspeed_file_config(cfg: TrainConfig) -> dict:
    """The JSON object of --deepspeed_config.config_file ({} when none)."""
    import json

    path = cfg.parallel.deepspeed_config_file
    if not path:
        return {}
    try:
        loaded = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(
            f"--deepspeed_config.config_file {path}: cannot read it ({e.strerror}): pass an existing JSON file"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--deepspeed_config.config_file {path} is not valid JSON ({e.msg}, line {e.lineno}): fix the file"
        ) from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"--deepspeed_config.config_file {path} must hold a JSON object: fix the file")
    return loaded
