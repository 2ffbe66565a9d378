"""TRL's names for how the model is loaded (ModelConfig's ``dtype`` / ``torch_dtype``, ``attn_implementation``,
``model_revision``; SFTConfig's / DPOConfig's ``model_init_kwargs``), as canonical settings. None means the default:
TRL's scripts pass ModelConfig's unset fields in ``model_init_kwargs``."""

from __future__ import annotations

from typing import Any, Callable

from shardtune.config.dialects import Pairs, text
from shardtune.config.dialects.cookbook import STATE as COOKBOOK
from shardtune.config.dialects.trl_values import _bool, _mapping
from shardtune.config.schema import ConfigError


def _dtype(name: str) -> Callable[[Any], Pairs]:
    def to(value: Any) -> Pairs:
        dtype = "auto" if value is None else text(value)  # None: the default (a script's unset ModelConfig.dtype)
        if dtype in ("auto", "float32", "fp32", "none", "null"):
            return []  # master weights are fp32 always; the compute dtype is --bf16 / --fp16
        if dtype in ("bfloat16", "bf16"):
            return [(COOKBOOK + "mixed_precision", True)]
        if dtype in ("float16", "fp16"):
            return [(COOKBOOK + "use_fp16", True)]
        raise ConfigError(f"--{name} {dtype} is not valid: choose auto, bfloat16, float16 or float32")

    return to


def _model_revision(value: Any) -> Pairs:
    return [] if text(value) == "main" else [("model.revision", text(value))]  # main: the hub id as it is


def _attn_implementation(value: Any) -> Pairs:
    if value is None or text(value) in ("none", "null"):  # ModelConfig's default: the model's own choice
        return []
    if text(value) in ("sdpa", "eager", "flash_attention_2"):
        return [("model.attn_implementation", text(value))]
    raise ConfigError(
        f"--attn_implementation {value} is not built: use sdpa, eager or flash_attention_2 (CUDA, "
        "flash-attn installed), or drop the flag (shardtune's choice: SDPA, varlen for packed rows)"
    )


def _device_map(value: Any) -> None:
    """Earlier TRL scripts' ``device_map`` (get_kbit_device_map: this process's GPU, or "auto" on one process): the
    placement shardtune's strategy gives every model anyway; another map is refused."""
    import os

    local = int(os.environ.get("LOCAL_RANK", 0))
    if value in ("auto", {"": local}, {"": f"cuda:{local}"}, local):
        return
    raise ConfigError(
        f"--model_init_kwargs device_map {value!r}: shardtune places the model by its strategy (this process's GPU, "
        "sharded by FSDP / DeepSpeed): drop the key"
    )


def _model_init_kwargs(value: Any) -> Pairs:
    """SFTConfig's / DPOConfig's model_init_kwargs: the keys shardtune has settings for."""
    given = _mapping("model_init_kwargs", value, '{"dtype": "bfloat16"}')
    pairs: Pairs = []
    for key, v in given.items():
        if v is None:  # TRL's scripts pass ModelConfig's unset fields: None is the default
            continue
        if key in ("dtype", "torch_dtype"):
            pairs += _dtype(key)(v)
        elif key == "attn_implementation":
            pairs += _attn_implementation(v)
        elif key == "trust_remote_code":
            pairs.append(("model.trust_remote_code", _bool("model_init_kwargs trust_remote_code", v)))
        elif key == "revision":
            pairs += _model_revision(v)
        elif key == "device_map":
            _device_map(v)
        elif key == "use_cache":
            _bool("model_init_kwargs use_cache", v)  # training never reads a KV cache (sampling keeps its own)
        elif key == "quantization_config":
            raise ConfigError(
                "--model_init_kwargs quantization_config: pass it to the trainer (quantization_config=...) or as "
                "--load_in_4bit / --load_in_8bit"
            )
        else:
            raise ConfigError(
                f"--model_init_kwargs {key} is not built: the model is loaded by shardtune's flags (dtype, "
                "attn_implementation, trust_remote_code, revision; placement by the strategy): drop the key"
            )
    return pairs
