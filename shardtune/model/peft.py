"""Parameter-efficient fine-tuning on Hugging Face peft: LoRA / DoRA, llama-adapter, prefix tuning, QLoRA.

    check_peft(cfg)                      # before any process group: methods, target modules, bitsandbytes, adapter
    quantization_config(cfg, device)     # BitsAndBytesConfig for --quantization, or None
    model = apply_peft(model, cfg)       # between build_model and strategy.wrap
    save_adapter(model, state, ...)      # rank 0: a PEFT directory from the gathered trainable parameters

Everything here is checked on a meta-device copy of the model first, so a wrong target module or an adapter
trained on another base fails in one line before any process starts. The adapter is written from the
trainable parameters only (the strategy gathers just those), never from the whole model.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.model.structure import unwrapped_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# config.json fields of the base that training changed (--rope_scaling), written beside the adapter: loading the
# adapter on the plain base would otherwise give another model than the one trained (shardtune applies them when it
# loads or merges the adapter; with plain peft, set them on the base's config)
BASE_OVERRIDES = "base_config_overrides.json"
QLORA_INSTALL = "pip install 'shardtune[qlora]'"
# peft_type names as written in adapter_config.json, per --peft_method
PEFT_TYPES = {"lora": "LORA", "llama_adapter": "ADAPTION_PROMPT", "prefix": "PREFIX_TUNING"}
DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}
# config.json fields that must agree between the base an adapter was trained on and --model_name
SHAPE_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)


# -- configuration -------------------------------------------------------------------------------------------------


def peft_config(cfg: TrainConfig, num_layers: int):
    """The peft config object for --peft_method, with llama-cookbook's field names and defaults; its task type is the
    objective's head's (SEQ_CLS for a score head: peft then trains it in full and saves it with the adapter)."""
    import peft

    from shardtune.model.loading import MODEL_HEADS, model_head

    task_type = MODEL_HEADS[model_head(cfg)].task_type
    if cfg.peft.method == "lora":
        lc = cfg.peft.lora
        # all-linear (TRL's spelling too): peft expands it to every linear layer but the output head
        targets = "all-linear" if list(lc.target_modules) == ["all-linear"] else list(lc.target_modules)
        return peft.LoraConfig(
            r=lc.r,
            lora_alpha=lc.alpha,
            target_modules=targets,
            lora_dropout=lc.dropout,
            bias=lc.bias,
            use_dora=lc.use_dora,
            use_rslora=lc.use_rslora,
            modules_to_save=list(lc.modules_to_save) or None,
            task_type=task_type,
        )
    if cfg.peft.method == "llama_adapter":
        ac = cfg.peft.llama_adapter
        return peft.AdaptionPromptConfig(
            adapter_len=ac.adapter_len, adapter_layers=min(ac.adapter_layers, num_layers), task_type=task_type
        )
    return peft.PrefixTuningConfig(num_virtual_tokens=cfg.peft.prefix.num_virtual_tokens, task_type=task_type)


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """Matmul dtype of quantised layers: as set, else bf16 on GPU and fp32 on CPU (bf16 is ~400x slower there)."""
    name = cfg.model.quant_compute_dtype
    if name:
        return DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def shards_parameters(cfg: TrainConfig) -> bool:
    """FSDP and ZeRO-3 cut every parameter into shards: quantised weights must then look like ordinary ones."""
    return cfg.parallel.strategy == "fsdp" or (cfg.parallel.strategy == "deepspeed" and cfg.parallel.zero_stage == 3)


def quantization_config(cfg: TrainConfig, device: torch.device):
    """transformers' BitsAndBytesConfig for --quantization (None without). Under FSDP and ZeRO-3 the packed 4-bit
    weights are stored in the compute dtype, so they are sharded like any other parameter of that dtype."""
    if not cfg.model.quantization:
        return None
    from transformers import BitsAndBytesConfig

    if cfg.model.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    qc, dtype = cfg.model, compute_dtype(cfg, device)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=qc.quant_type,
        bnb_4bit_use_double_quant=qc.double_quant,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype if shards_parameters(cfg) else torch.uint8,
    )


def load_quantized_model(cfg: TrainConfig, device: torch.device) -> nn.Module:
    """The base model with bitsandbytes-quantised linear layers, on ``device``; other weights in the compute dtype
    (with the objective's head: a new head drawn from --seed)."""
    from shardtune.model.attention import attention_implementation
    from shardtune.model.loading import auto_model_class, head_weights, model_head, training_model_config

    config = training_model_config(cfg)
    head = model_head(cfg)
    with head_weights(head, cfg.train.seed):
        model = auto_model_class(head).from_pretrained(
            cfg.model.name,
            config=config,
            quantization_config=quantization_config(cfg, device),
            dtype=compute_dtype(cfg, device),
            device_map={"": device},
            attn_implementation=attention_implementation(config),
            trust_remote_code=cfg.model.trust_remote_code,
        )
    if device.type == "cpu":
        use_generic_cpu_kernels(model)
    return model


def use_generic_cpu_kernels(model: nn.Module) -> None:
    """bitsandbytes' CPU inference path (eval mode, no grad, on AVX512-BF16 CPUs) repacks each 4-bit weight in
    place for a bf16 kernel, which needs out_features divisible by 32 and computes in bf16. Turned off, eval
    computes exactly as training does (dequantise, matmul in the compute dtype) for every layer shape."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


# -- checks before any process group ---------------------------------------------------------------------------------


def check_peft(cfg: TrainConfig) -> None:
    """Every PEFT / quantisation problem that can be found without a process group, as one-line errors.
    ``cfg.model.name`` is already resolved to a directory or hub id."""
    if cfg.model.quantization:
        _check_bitsandbytes(cfg)
        if not bool(cfg.peft.method):
            raise ConfigError(
                f"--quantization {cfg.model.quantization} without --use_peft: quantised weights cannot be "
                "trained directly; add --use_peft (QLoRA) or drop --quantization"
            )
    if cfg.peft.from_checkpoint and not bool(cfg.peft.method):
        raise ConfigError(
            f"--from_peft_checkpoint {cfg.peft.from_checkpoint} needs --use_peft (and the adapter's "
            "--peft_method): add them, or drop --from_peft_checkpoint"
        )
    if not bool(cfg.peft.method):
        return
    _check_method_settings(cfg)
    from shardtune.model.loading import build_model_on_meta, model_head, training_model_config

    model = build_model_on_meta(
        cfg.model.name,
        config=training_model_config(cfg),
        trust_remote_code=cfg.model.trust_remote_code,
        head=model_head(cfg),
    )
    if cfg.peft.method == "lora":
        if cfg.peft.lora.target_modules != ["all-linear"]:
            _check_target_modules(model, cfg.peft.lora.target_modules, "target_modules")
        _check_target_modules(model, cfg.peft.lora.modules_to_save, "modules_to_save")
    elif cfg.peft.method == "llama_adapter":
        _check_adapter_architecture(model)
    if cfg.peft.from_checkpoint:
        _check_adapter_base(cfg, model)
    _dry_run(model, cfg)


def _check_bitsandbytes(cfg: TrainConfig) -> None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"--quantization {cfg.model.quantization} needs bitsandbytes, which is not installed: {QLORA_INSTALL}"
        ) from None
    name = cfg.model.quant_compute_dtype
    if name and name not in DTYPES:
        raise ConfigError(
            f"--quantization_config.compute_dtype {name!r} is not a dtype: use bfloat16, float16 or "
            "float32 (or leave it empty: bf16 on GPU, fp32 on CPU)"
        )


def _check_method_settings(cfg: TrainConfig) -> None:
    if cfg.peft.method == "lora" and not cfg.peft.lora.target_modules:
        raise ConfigError("--lora_config.target_modules is empty: name the modules to adapt, e.g. q_proj,v_proj")


def _module_matches(name: str, target: str) -> bool:
    """peft's rule for a plain target_modules entry: the full name, or its last dotted components."""
    return name == target or name.endswith("." + target)


def _check_target_modules(model: nn.Module, targets: list[str], setting: str) -> None:
    names = [n for n, _ in model.named_modules() if n]
    linear_leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    for target in targets:
        if not any(_module_matches(n, target) for n in names):
            close = difflib.get_close_matches(target, linear_leaves, n=1)
            hint = f"did you mean {close[0]}?" if close else "its linear layers are " + ", ".join(linear_leaves)
            raise ConfigError(f"--lora_config.{setting} {target!r} matches no module of {type(model).__name__}: {hint}")


def _check_adapter_architecture(model: nn.Module) -> None:
    from peft.tuners.adaption_prompt.config import TRANSFORMERS_MODEL_CONFIG

    model_type = model.config.model_type
    if model_type not in TRANSFORMERS_MODEL_CONFIG:
        raise ConfigError(
            f"--peft_method llama_adapter does not support model type {model_type!r} (peft's adaption "
            f"prompt supports {', '.join(sorted(TRANSFORMERS_MODEL_CONFIG))}): use --peft_method lora "
            "or prefix"
        )


def read_adapter_config(adapter_dir: str | Path, flag: str = "--from_peft_checkpoint") -> dict[str, Any]:
    path = Path(adapter_dir).expanduser()
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(
            f"{flag} {adapter_dir}: not a PEFT adapter directory (needs {ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS}): pass the --output_dir of a --use_peft run"
        )
    return json.loads((path / ADAPTER_CONFIG).read_text())


def _same_path(a: str, b: str) -> bool:
    return a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


def base_config_dict(name_or_path: str, trust_remote_code: bool = False) -> dict[str, Any] | None:
    """config.json of a model directory or hub id (local cache only), or None when it cannot be read."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            name_or_path, local_files_only=True, trust_remote_code=trust_remote_code
        ).to_dict()
    except Exception:  # noqa: BLE001 - unreadable base: the shape check below decides
        return None


def _check_adapter_base(cfg: TrainConfig, model: nn.Module) -> None:
    """The adapter must have been trained on --model_name: the same model, or one with the same architecture and
    shapes (a copy, a hub snapshot of it); anything else is an error naming both."""
    adapter = read_adapter_config(cfg.peft.from_checkpoint)
    want = PEFT_TYPES[cfg.peft.method]
    if adapter.get("peft_type") != want:
        method = {v: k for k, v in PEFT_TYPES.items()}.get(adapter.get("peft_type"), adapter.get("peft_type"))
        raise ConfigError(
            f"--from_peft_checkpoint {cfg.peft.from_checkpoint} holds a {method} adapter, but "
            f"--peft_method is {cfg.peft.method}: pass --peft_method {method}"
        )
    base = adapter.get("base_model_name_or_path") or ""
    if base and _same_path(base, cfg.model.name):
        return
    ours = model.config.to_dict()
    theirs = base_config_dict(base, cfg.model.trust_remote_code) if base else None
    if theirs is not None:
        diffs = [f"{k} {theirs.get(k)} vs {ours.get(k)}" for k in SHAPE_FIELDS if theirs.get(k) != ours.get(k)]
        if diffs:
            raise ConfigError(
                f"--from_peft_checkpoint {cfg.peft.from_checkpoint} was trained on {base}, which "
                f"differs from --model_name {cfg.model.name} ({'; '.join(diffs)}): pass --model_name "
                f"{base}"
            )
    warnings.warn(
        f"--from_peft_checkpoint: the adapter was trained on {base or 'an unrecorded base'}; continuing on "
        f"{cfg.model.name}, which has the same architecture and shapes",
        stacklevel=2,
    )


def _dry_run(model: nn.Module, cfg: TrainConfig) -> None:
    """Build (or load) the adapter on the meta-device model: what peft itself refuses, or an adapter whose tensor
    shapes do not fit the model, fails here rather than after the processes have started."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _attach(model, cfg, num_layers=model.config.get_text_config().num_hidden_layers)
    except (ValueError, RuntimeError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        source = (
            f"--from_peft_checkpoint {cfg.peft.from_checkpoint}"
            if cfg.peft.from_checkpoint
            else f"--peft_method {cfg.peft.method}"
        )
        raise ConfigError(f"{source} does not fit --model_name {cfg.model.name}: {first}") from None


# -- building ------------------------------------------------------------------------------------------------------


def _attach(model: nn.Module, cfg: TrainConfig, num_layers: int) -> nn.Module:
    import peft

    if cfg.peft.from_checkpoint:
        return peft.PeftModel.from_pretrained(
            model,
            cfg.peft.from_checkpoint,
            is_trainable=True,
            low_cpu_mem_usage=any(p.is_meta for p in model.parameters()),
        )
    config = peft_config(cfg, num_layers)
    if cfg.peft.method == "lora":
        from shardtune.model.vision import language_model_targets

        config.target_modules = language_model_targets(model, config.target_modules)
    return peft.get_peft_model(model, config)


def apply_peft(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """Freeze the base model and attach the adapter (new, or --from_peft_checkpoint); prints what trains."""
    from shardtune.runtime.distributed import print0, warn0

    num_layers = model.config.get_text_config().num_hidden_layers
    ac = cfg.peft.llama_adapter
    if cfg.peft.method == "llama_adapter" and ac.adapter_layers > num_layers and not cfg.peft.from_checkpoint:
        warn0(
            f"--llama_adapter_config.adapter_layers {ac.adapter_layers} > the model's {num_layers} layers: "
            f"adapting all {num_layers}"
        )
    if cfg.model.quantization and not shards_parameters(cfg):
        import peft

        # fp32 norms / embeddings for stable QLoRA; when sharded, every parameter stays in the storage dtype instead
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = _attach(model, cfg, num_layers)
    if cfg.peft.method == "lora":  # masks that do not depend on the rank layout: 1 x 4 trains as 2 x 2
        from shardtune.model.lora_dropout import use_example_keyed_dropout

        use_example_keyed_dropout(model)
    trainable, total = model.get_nb_trainable_parameters()
    what = f"from {cfg.peft.from_checkpoint}" if cfg.peft.from_checkpoint else "new"
    print0(
        f"peft: {cfg.peft.method} ({what}), {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / total:.3f}%)"
    )
    return model


# -- saving --------------------------------------------------------------------------------------------------------


def adapter_state_dict(model: nn.Module, trainable_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of adapter_model.safetensors, from the gathered trainable parameters (full names)."""
    from peft.utils import get_peft_model_state_dict

    config = model.active_peft_config
    if config.is_prompt_learning:
        # prefix tuning without projection: the saved prompt embeddings are the embedding table itself
        key = f"prompt_encoder.{model.active_adapter}.embedding.weight"
        return {"prompt_embeddings": trainable_state[key]}
    # peft finds the adapter's tensors by the modules' names, which carry activation checkpointing's wrappers (the
    # state dict's names do not): keyed as the modules are for peft, and back to the state dict's names after
    modules_name = {unwrapped_name(name): name for name, _ in model.named_parameters()}
    selected = get_peft_model_state_dict(
        model, state_dict={modules_name.get(k, k): v for k, v in trainable_state.items()}
    )
    return {unwrapped_name(k): v for k, v in selected.items()}


def save_adapter(
    model: nn.Module, trainable_state: dict[str, torch.Tensor], base_name: str, tokenizer, out_dir: Path
) -> list[str]:
    """Rank 0: write a PEFT directory (adapter_config.json last, atomically) that PeftModel.from_pretrained loads;
    returns the names of the files written."""
    from safetensors.torch import save_file

    from shardtune.runtime.files import publish_dir, staging_dir

    out_dir.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out_dir, "adapter")
    tensors = {k: v.detach().contiguous().cpu() for k, v in adapter_state_dict(model, trainable_state).items()}
    save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = model.active_peft_config
    inference_mode, base = config.inference_mode, config.base_model_name_or_path
    config.inference_mode, config.base_model_name_or_path = True, base_name
    try:
        config.save_pretrained(staging)
    finally:
        config.inference_mode, config.base_model_name_or_path = inference_mode, base
    tokenizer.save_pretrained(staging)
    overrides = trained_base_overrides(model.get_base_model().config)
    if overrides:
        (staging / BASE_OVERRIDES).write_text(json.dumps(overrides, indent=1) + "\n", encoding="utf-8")
    return publish_dir(staging, out_dir)


def trained_base_overrides(config) -> dict[str, Any]:
    """The fields of the trained base's config that a plain load of the base would lose: RoPE scaling."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") == "default":
        return {}
    return {"rope_parameters": dict(rope), "max_position_embeddings": config.max_position_embeddings}


def adapter_base_config(base: str, adapter_dir: str | Path = "", trust_remote_code: bool = False):
    """The config of ``base`` as the adapter was trained on it: config.json plus the adapter's BASE_OVERRIDES."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
    path = Path(adapter_dir) / BASE_OVERRIDES if adapter_dir else None
    if path is not None and path.is_file():
        for key, value in json.loads(path.read_text(encoding="utf-8")).items():
            setattr(config, key, value)
    return config


# -- merging -------------------------------------------------------------------------------------------------------


def merge_adapter(
    adapter_dir: str,
    out_dir: str | Path,
    base: str = "",
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> tuple[str, list[str]]:
    """Write base + LoRA adapter, merged, as a plain Hugging Face directory in ``dtype`` (default: the base
    model's, from its config.json), with the tokenizer. Returns (the base used, the files written). Merged in
    fp32."""
    import peft
    from transformers import AutoConfig

    from shardtune.model.loading import load_model, load_tokenizer
    from shardtune.model.vision import saved_processor
    from shardtune.publishing.saving import save_hf_model

    peft_type = read_adapter_config(adapter_dir, "--merge").get("peft_type")
    if peft_type != PEFT_TYPES["lora"]:
        raise ConfigError(
            f"--merge {adapter_dir}: a {peft_type} adapter has no weights to merge (only LoRA adapters "
            "do): load it on its base instead, e.g. shardtune generate --adapter " + str(adapter_dir)
        )
    base, adapter = resolve_model_and_adapter(base, adapter_dir, trust_remote_code)
    trust = {"trust_remote_code": trust_remote_code}
    dtype = dtype or AutoConfig.from_pretrained(base, **trust).dtype or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    trained_base = load_model(base, dtype=torch.float32, config=adapter_base_config(base, adapter, **trust), **trust)
    model = peft.PeftModel.from_pretrained(trained_base, adapter).merge_and_unload()
    model.config.dtype = dtype
    tokenizer_dir = adapter if (Path(adapter) / "tokenizer_config.json").is_file() else base
    # a vision-language model's processor (tokenizer + image processor) where the run saved one
    processing = saved_processor(tokenizer_dir, trust_remote_code) or load_tokenizer(tokenizer_dir, **trust)
    return base, save_hf_model(model, model.state_dict(), processing, Path(out_dir))


def resolve_model_and_adapter(model_name: str, adapter: str = "", trust_remote_code: bool = False) -> tuple[str, str]:
    """(base model, adapter dir or ""): a PEFT directory given as the model brings its base from its config."""
    from shardtune.model.loading import check_model_source, resolve_model_name

    if not adapter and model_name and (Path(model_name) / ADAPTER_CONFIG).is_file():
        model_name, adapter = "", model_name
    if adapter:
        base = read_adapter_config(adapter, "--adapter").get("base_model_name_or_path") or ""
        model_name = model_name or base
        if not model_name:
            raise ConfigError(f"--adapter {adapter}: its adapter_config.json names no base model: pass --model_name")
    model_name = resolve_model_name(model_name)
    check_model_source(model_name, trust_remote_code=trust_remote_code)
    return model_name, adapter


def adapter_disabled(model: nn.Module) -> contextlib.AbstractContextManager:
    """The PEFT model's base (its adapter switched off) for the duration of the block: a reference model that costs
    no copy (DPO's and GRPO's with an adapter)."""
    return model.disable_adapter()
