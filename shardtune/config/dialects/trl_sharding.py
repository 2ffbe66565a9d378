"""TRL's (transformers') strategy names: ``fsdp``, ``fsdp_config`` (a file, JSON text, a YAML mapping, or its keys
one by one) and ``deepspeed`` (a JSON file), as shardtune's FSDP2 / DeepSpeed settings (part of trl_trainer.py's
table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from shardtune.config.dialects import Pairs, canonical, is_empty, same, text
from shardtune.config.dialects.trl_values import STATE, _bool, _given, _mapping, _shown
from shardtune.config.schema import ConfigError

# Trainer's (FSDP1) sharding strategy names in --fsdp, and in fsdp_config's reshard_after_forward under version 1
FSDP_STRATEGIES = {name.lower(): name for name in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")}


def _fsdp(value: Any) -> Pairs:
    """--fsdp: true (Trainer's name since transformers 5), or the older words: full_shard, shard_grad_op, no_shard,
    hybrid_shard, offload, auto_wrap."""
    given = _given(value)
    if isinstance(canonical(given), bool):
        return [("parallel.strategy", "fsdp"), (STATE + "fsdp", True)] if canonical(given) else []
    words = given if isinstance(given, list) else text(given).replace(",", " ").split()
    pairs: Pairs = [("parallel.strategy", "fsdp"), (STATE + "fsdp", True)]
    for word in (text(w).lower() for w in words):
        if word in FSDP_STRATEGIES:
            pairs.append(("parallel.sharding_strategy", FSDP_STRATEGIES[word]))
        elif word == "offload":
            pairs.append(("parallel.cpu_offload", True))
        elif word != "auto_wrap":  # shardtune shards each decoder layer, then the root: Trainer's auto_wrap
            raise ConfigError(
                f"--fsdp {word} is not built: use true, or full_shard, shard_grad_op, no_shard, hybrid_shard, "
                "offload, auto_wrap"
            )
    return pairs


def _switch(key: str, fsdp_key: str) -> Callable[[Any], Pairs]:
    return lambda value: [(key, _bool(f"fsdp_config.{fsdp_key}", value))]


def _fsdp_version(value: Any) -> Pairs:
    if same(value, 2):
        return []
    raise ConfigError(
        f"--fsdp_config.version {text(value)}: shardtune shards with FSDP2 (fully_shard; Trainer's version 2): set 2, "
        "or drop the key"
    )


def _reshard_after_forward(value: Any) -> Pairs:
    """FSDP2 says true / false; FSDP1's files name a sharding strategy in the same key."""
    given = canonical(value)
    if isinstance(given, bool):
        return [("parallel.sharding_strategy", "FULL_SHARD" if given else "SHARD_GRAD_OP")]
    if given in FSDP_STRATEGIES:
        return [("parallel.sharding_strategy", FSDP_STRATEGIES[given])]
    raise ConfigError(f"--fsdp_config.reshard_after_forward {text(value)} is not valid: use true or false")


def _state_dict_type(value: Any) -> Pairs:
    name = text(value).upper()
    if name in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        return [("checkpoint.checkpoint_type", name)]
    raise ConfigError(f"--fsdp_config.state_dict_type {value}: use FULL_STATE_DICT or SHARDED_STATE_DICT")


def _auto_wrap_policy(value: Any) -> Pairs:
    if text(value).upper() == "TRANSFORMER_BASED_WRAP":
        return []
    raise ConfigError(
        f"--fsdp_config.auto_wrap_policy {value} is not built: shardtune shards each decoder layer, then the root "
        "(TRANSFORMER_BASED_WRAP): drop the key"
    )


def _layer_classes(value: Any) -> Pairs:
    names = value if isinstance(value, list) else text(value).replace(",", " ").split()
    others = [text(n) for n in names if not text(n).endswith("DecoderLayer")]
    if others:
        raise ConfigError(
            f"--fsdp_config.transformer_layer_cls_to_wrap {', '.join(others)}: shardtune shards each decoder layer "
            "(the model's *DecoderLayer), then the root: drop the key"
        )
    return []


def _xla(key: str) -> Callable[[Any], Pairs]:
    def to(value: Any) -> Pairs:
        if is_empty(value) or canonical(value) is False:
            return []
        raise ConfigError(f"--fsdp_config.{key} {_shown(value)}: PyTorch/XLA (TPU) FSDP is not built: drop the key")

    return to


def _fsdp1(value: Any) -> Pairs:
    return []  # FSDP1's knobs: FSDP2 (shardtune's, Trainer's default) has none of them, and version 1 is refused


# fsdp_config's keys (transformers' TrainingArguments docs; a "fsdp_" prefix is dropped, as Trainer does)
FSDP_CONFIG: dict[str, tuple[Callable[[Any], Pairs], str, str]] = {
    "version": (_fsdp_version, "-", "2 only (FSDP2, fully_shard)"),
    "reshard_after_forward": (
        _reshard_after_forward,
        "parallel.sharding_strategy",
        "true: FULL_SHARD; false: SHARD_GRAD_OP (FSDP1's strategy names too)",
    ),
    "cpu_offload": (
        _switch("parallel.cpu_offload", "cpu_offload"),
        "parallel.cpu_offload",
        "parameters, gradients and optimizer state in CPU memory",
    ),
    "activation_checkpointing": (
        _switch("parallel.activation_checkpointing", "activation_checkpointing"),
        "parallel.activation_checkpointing",
        "recompute each decoder layer in backward",
    ),
    "cpu_ram_efficient_loading": (
        _switch("parallel.low_cpu_fsdp", "cpu_ram_efficient_loading"),
        "parallel.low_cpu_fsdp",
        "only rank 0 reads the weights; the others get them by broadcast",
    ),
    "state_dict_type": (
        _state_dict_type,
        "checkpoint.checkpoint_type",
        "FULL_STATE_DICT (also a gathered HF model in each checkpoint) or SHARDED_STATE_DICT",
    ),
    "auto_wrap_policy": (_auto_wrap_policy, "-", "TRANSFORMER_BASED_WRAP only: each decoder layer, then the root"),
    "transformer_layer_cls_to_wrap": (_layer_classes, "-", "the decoder layer class only (what shardtune shards)"),
    "min_num_params": (_fsdp1, "-", "read by SIZE_BASED_WRAP only (refused): no effect"),
    "xla": (_xla("xla"), "-", "false only (PyTorch/XLA is not built)"),
    "xla_fsdp_v2": (_xla("xla_fsdp_v2"), "-", "false only (PyTorch/XLA is not built)"),
    "xla_fsdp_grad_ckpt": (_xla("xla_fsdp_grad_ckpt"), "-", "false only (PyTorch/XLA is not built)"),
    "xla_fsdp_settings": (_xla("xla_fsdp_settings"), "-", "empty only (PyTorch/XLA is not built)"),
    **{
        key: (_fsdp1, "-", "FSDP1's (version 1, refused): FSDP2 has no such knob; no effect")
        for key in (
            "forward_prefetch",
            "backward_prefetch",
            "use_orig_params",
            "sync_module_states",
            "limit_all_gathers",
        )
    },
}
# llama-cookbook's fsdp_config section has these prefixed names with the same meaning (cookbook.py)
COOKBOOK_FSDP_NAMES = ("fsdp_cpu_offload", "fsdp_activation_checkpointing")


def _fsdp_config(value: Any) -> Pairs:
    """--fsdp_config: a JSON file or object of fsdp_config's keys (in a recipe, a mapping: its keys are flags)."""
    pairs: Pairs = []
    for key, v in _mapping("fsdp_config", value, '{"reshard_after_forward": true}').items():
        if is_empty(v):
            continue  # a key left empty: its default
        translate = FSDP_CONFIG.get(key.removeprefix("fsdp_"))
        if translate is None:
            raise ConfigError(
                f"--fsdp_config {key} is not a key shardtune knows (transformers' fsdp_config keys: "
                f"{', '.join(FSDP_CONFIG)}): drop it"
            )
        pairs += translate[0](v)
    return pairs


def _deepspeed(value: Any) -> Pairs:
    """--deepspeed ds_config.json: DeepSpeed, with that file merged over shardtune's config; its ZeRO stage and CPU
    offloading are the run's settings."""
    if isinstance(value, dict) or (isinstance(value, str) and value.strip().startswith("{")):
        raise ConfigError(
            "--deepspeed as a mapping: write it to a JSON file and pass its path (--deepspeed ds_config.json)"
        )
    path = text(value)
    try:
        loaded = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"--deepspeed {path}: cannot read it ({e.strerror}): pass an existing JSON file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed {path} is not valid JSON ({e.msg}, line {e.lineno}): fix the file") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"--deepspeed {path} must hold a JSON object: fix the file")
    pairs: Pairs = [
        ("parallel.strategy", "deepspeed"),
        ("parallel.deepspeed_config_file", path),
        (STATE + "deepspeed", True),
    ]
    zero = loaded.get("zero_optimization") or {}
    stage = zero.get("stage", "auto")
    if stage != "auto":
        if stage not in (1, 2, 3):
            raise ConfigError(
                f"--deepspeed {path}: zero_optimization.stage {stage} is not built: use 1, 2 or 3 (stage 0 is plain "
                "data parallelism: drop --deepspeed)"
            )
        pairs.append(("parallel.zero_stage", stage))
    for part, key in (("offload_optimizer", "parallel.offload_optimizer"), ("offload_param", "parallel.offload_param")):
        device = text((zero.get(part) or {}).get("device", "none")).lower()
        if device not in ("none", "cpu", "auto"):
            raise ConfigError(
                f"--deepspeed {path}: zero_optimization.{part}.device {device} is not built: use cpu or none"
            )
        if device == "cpu":
            pairs.append((key, True))
    return pairs
