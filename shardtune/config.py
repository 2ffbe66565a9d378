"""Typed configuration: llama-cookbook's train_config names, YAML recipes, CLI overrides.

Every field has a ``help`` string in its metadata; ``shardtune sft --help`` is generated from it.
Nested configs (datasets, FSDP, PEFT) are reached with dotted flags: ``--samsum_dataset.data_path X``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import tempfile
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from shardtune.elastic import worker_group_attempt


class ConfigError(ValueError):
    """A user-facing configuration error: one line naming the value and the fix."""


def _f(default: Any, help: str, **kwargs: Any) -> Any:
    if isinstance(default, (list, dict)) or is_dataclass(default):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


DATASETS = ("synthetic_dialogues", "samsum_dataset", "alpaca_dataset", "custom_dataset", "grammar_dataset")
BATCHING_STRATEGIES = ("packing", "padding")
LR_SCHEDULERS = ("step", "cosine")


@dataclass
class SyntheticDialoguesConfig:
    num_train: int = _f(4000, "number of generated training dialogues")
    num_validation: int = _f(200, "number of generated validation dialogues")
    seed: int = _f(1234, "seed of the dialogue generator (independent of the training seed)")
    chatter: bool = _f(False, "mix off-topic talk into about half of the dialogues: 3 to 30 turns with a long tail "
                              "of long chats, like SAMSum (the summaries do not change)")


@dataclass
class SamsumDatasetConfig:
    data_path: str = _f("", "local file or folder (JSON, JSONL, CSV, Parquet with fields dialogue, summary); "
                            "empty: the hub dataset named by hub_name")
    hub_name: str = _f("knkarthick/samsum", "hub dataset used when data_path is empty")
    train_split: str = _f("train", "split used for training")
    test_split: str = _f("validation", "split used for evaluation")
    validation_fraction: float = _f(0.0, "if > 0 and no validation file exists, hold out this fraction of the "
                                         "training rows (deterministic from the seed)")


@dataclass
class AlpacaDatasetConfig:
    data_path: str = _f("", "JSON / JSONL file of {instruction, input, output} rows")
    validation_fraction: float = _f(0.05, "fraction of rows held out for evaluation")


@dataclass
class CustomDatasetConfig:
    file: str = _f("", "path.py[:function]; the function takes (dataset_config, tokenizer, split) and returns "
                       "rows of input_ids / labels (and optionally attention_mask); default function: "
                       "get_custom_dataset")
    train_split: str = _f("train", "split name passed for training")
    test_split: str = _f("validation", "split name passed for evaluation")
    data_path: str = _f("", "free path your function may read (dataset_config.data_path)")


SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
CHECKPOINT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
PEFT_METHODS = ("lora", "llama_adapter", "prefix")
QUANTIZATIONS = ("", "4bit", "8bit")
QUANTIZATION_SPELLINGS = {"int4": "4bit", "int8": "8bit"}  # older llama-cookbook pages write int4 / int8
NAN_POLICIES = ("stop", "skip")
ROPE_SCALINGS = ("", "yarn")
REPORT_TO = ("none", "tensorboard", "wandb", "trackio", "all")


@dataclass
class FsdpConfig:
    sharding_strategy: str = _f("FULL_SHARD", "FULL_SHARD (params, grads, optimizer state sharded), SHARD_GRAD_OP "
                                              "(params kept after forward), NO_SHARD (like DDP), HYBRID_SHARD "
                                              "(shard within a group, replicate across groups)",
                                choices=SHARDING_STRATEGIES)
    hsdp: bool = _f(False, "hybrid sharding with explicit group sizes (selects HYBRID_SHARD, as in llama-cookbook)")
    sharding_group_size: int = _f(0, "ranks that shard one replica; 0: the processes of one node")
    replica_group_size: int = _f(0, "number of replicas; 0: world size / sharding_group_size")
    pure_bf16: bool = _f(False, "parameters, gradients and optimizer state in bf16 (less memory, less accuracy)")
    fsdp_activation_checkpointing: bool = _f(False, "recompute each decoder layer's activations in backward")
    fsdp_cpu_offload: bool = _f(False, "keep sharded parameters, gradients and optimizer state in CPU memory")
    checkpoint_type: str = _f("", "SHARDED_STATE_DICT (each rank writes its shard) or FULL_STATE_DICT (also a "
                                  "gathered HF model in the checkpoint); setting it turns checkpoints on (at epoch "
                                  "ends); empty: SHARDED_STATE_DICT when --save_steps > 0, else no checkpoints",
                              choices=("", *CHECKPOINT_TYPES))


@dataclass
class DeepSpeedConfig:
    zero_stage: int = _f(2, "ZeRO stage: 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters)")
    offload_optimizer: bool = _f(False, "keep the optimizer state (and its step) in CPU memory (ZeRO-Offload)")
    offload_param: bool = _f(False, "keep the sharded parameters in CPU memory (ZeRO-3 only)")
    config_file: str = _f("", "a DeepSpeed JSON config merged over the one built from these flags (e.g. a TRL / "
                              "HF Trainer ds_config.json); batch sizes and accumulation must agree with ours or be "
                              "\"auto\"")


@dataclass
class LoraConfig:
    r: int = _f(8, "LoRA rank")
    lora_alpha: int = _f(32, "LoRA scaling numerator (scale = lora_alpha / r)")
    target_modules: list[str] = _f(["q_proj", "v_proj"], "module names to adapt (comma-separated on the CLI)")
    lora_dropout: float = _f(0.05, "dropout on the LoRA input")
    bias: str = _f("none", "none, all or lora_only")
    use_dora: bool = _f(False, "weight-decomposed LoRA (DoRA)")


@dataclass
class LlamaAdapterConfig:
    adapter_len: int = _f(10, "adaption prompt length")
    adapter_layers: int = _f(30, "number of top layers adapted (clamped to the model's depth)")


@dataclass
class PrefixConfig:
    num_virtual_tokens: int = _f(30, "prefix length")


@dataclass
class QuantizationConfig:
    quant_type: str = _f("nf4", "4-bit data type: nf4 or fp4", choices=("nf4", "fp4"))
    use_double_quant: bool = _f(True, "quantise the quantisation constants too")
    compute_dtype: str = _f("", "matmul dtype of 4-bit layers; empty: bf16 on GPU, fp32 on CPU")


@dataclass
class GrammarDatasetConfig:
    train_split: str = _f("gtrain_10k.csv", "CSV file of training rows with columns input, target (llama-cookbook's "
                                            "grammar_dataset)")
    test_split: str = _f("grammar_validation.csv", "CSV file of evaluation rows with columns input, target")


COOKBOOK_OPTIMIZERS = ("AdamW", "anyprecision")


@dataclass
class WandbConfig:
    project: str = _f("shardtune", "W&B project")
    entity: str = _f("", "W&B team or user; empty: your default entity")
    job_type: str = _f("", "W&B job type (e.g. train)")
    tags: list[str] = _f([], "W&B tags (comma-separated on the CLI)")
    group: str = _f("", "W&B group, to see related runs together")
    notes: str = _f("", "W&B notes: a longer description of the run")
    mode: str = _f("", "online, offline or disabled; empty: online when api.wandb.ai answers and you are logged "
                       "in, else offline (sync later with wandb sync)", choices=("", "online", "offline", "disabled"))


@dataclass
class TrainConfig:
    model_name: str = _f("", "local Hugging Face directory, hub id, or preset:NAME (tiny, demo); empty: the demo "
                             "preset, built once and cached")
    tokenizer_name: str = _f("", "tokenizer directory or hub id; empty: same as model_name")
    dataset: str = _f("synthetic_dialogues", "one of: " + ", ".join(DATASETS), choices=DATASETS)
    batch_size_training: int = _f(4, "micro-batch size per device (TRL: per_device_train_batch_size)")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step; effective batch = "
                                             "batch_size_training x data-parallel processes (processes / "
                                             "(sequence_parallel_size x context_parallel_size)) x "
                                             "gradient_accumulation_steps")
    num_epochs: int = _f(1, "passes over the training data")
    max_train_step: int = _f(0, "stop after this many OPTIMIZER steps (llama-cookbook counts micro-batches); 0: no limit")
    max_eval_step: int = _f(0, "evaluate on at most this many eval batches per rank; 0: all")
    lr: float = _f(1e-4, "peak learning rate (AdamW)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    gamma: float = _f(0.85, "StepLR decay applied once per epoch (lr_scheduler=step)")
    lr_scheduler: str = _f("step", "step (llama-cookbook: x gamma per epoch) or cosine (with warmup_steps)",
                           choices=LR_SCHEDULERS)
    warmup_steps: int = _f(0, "linear warm-up optimizer steps (lr_scheduler=cosine)")
    seed: int = _f(42, "seed of model init, data order and dropout")
    context_length: int = _f(1024, "tokens per packed block / longest example kept")
    batching_strategy: str = _f("packing", "packing (blocks of up to context_length tokens of whole examples, "
                                           "computed without padding, no attention across examples) or padding "
                                           "(length-grouped, padded to the longest in the micro-batch)",
                                choices=BATCHING_STRATEGIES)
    padding_free: bool = _f(False, "with padding: compute each micro-batch as one row of its examples without pad "
                                   "tokens (same examples and loss, no wasted compute); packing always is")
    val_batch_size: int = _f(1, "eval micro-batch size per device")
    run_validation: bool = _f(True, "evaluate at the end of each epoch")
    output_dir: str = _f("output", "where the model, config.yaml and metrics.jsonl are written")
    overwrite_output_dir: bool = _f(False, "allow a new run to replace the outputs of a previous run in output_dir")
    save_model: bool = _f(True, "write the final model (or adapter) to output_dir")
    save_metrics: bool = _f(True, "write metrics.jsonl to output_dir")
    use_fp16: bool = _f(False, "fp16 compute with a gradient scaler, for CUDA GPUs without bf16 (refused on CPU, "
                                     "which computes in fp32)")
    mixed_precision: bool = _f(True, "bf16 compute where the device supports it fast (CUDA); fp32 on CPU")
    gradient_clipping: bool = _f(False, "clip the global gradient norm")
    gradient_clipping_threshold: float = _f(1.0, "max global gradient norm when gradient_clipping")
    num_workers_dataloader: int = _f(1, "data loader worker processes per rank (0: in the training process)")
    strict_data: bool = _f(False, "fail on the first bad data row (naming file and row) instead of skipping it")
    debug: bool = _f(False, "print tracebacks with errors")
    dry_run: bool = _f(False, "build the model on the meta device, resolve the mesh for the world size (no GPU, no "
                              "process started, no weights or data read, nothing written), print the per-rank shard "
                              "sizes and the plan (shardtune plan; its --gpu / --gpu_memory / --gpus_per_node "
                              "flags too), and exit")

    enable_fsdp: bool = _f(False, "shard with PyTorch FSDP2 (fully_shard) instead of DDP")
    enable_deepspeed: bool = _f(False, "shard with DeepSpeed ZeRO (--deepspeed_config.zero_stage 1/2/3) instead of "
                                       "DDP (pip install 'shardtune[deepspeed]')")
    low_cpu_fsdp: bool = _f(False, "only global rank 0 reads the weights; the others build on the meta device")
    use_peft: bool = _f(False, "train an adapter (peft_method) instead of all parameters")
    peft_method: str = _f("lora", "lora, llama_adapter or prefix", choices=PEFT_METHODS)
    from_peft_checkpoint: str = _f("", "adapter directory to continue training from")
    quantization: str = _f("", "4bit (QLoRA, bitsandbytes) or 8bit (not with FSDP); empty: none; int4 / int8 are "
                               "the same", choices=QUANTIZATIONS, spellings=QUANTIZATION_SPELLINGS)
    use_fast_kernels: bool = _f(False, "fastest attention / fused kernels the install supports: flash-attention 2 "
                                       "(if installed, CUDA), else SDPA; liger-kernel fused RMSNorm / SwiGLU / "
                                       "RoPE on CUDA (pip install 'shardtune[fast]')")
    compile: bool = _f(False, "torch.compile each decoder layer (first steps are slower while it compiles)")
    save_steps: int = _f(0, "write a sharded checkpoint to output_dir/checkpoints/ every N optimizer steps, at each "
                            "epoch end and after the last step; 0: none, unless --checkpoint_type is set (then at "
                            "epoch ends and after the last step)")
    save_total_limit: int = _f(0, "keep the last K checkpoints; 0: keep all")
    resume: str = _f("", "latest (newest complete checkpoint of output_dir), a checkpoint folder, or another run's "
                         "output dir: continue exactly where it stopped (any number of processes); auto: latest if "
                         "output_dir has a checkpoint, else start (for jobs that requeue themselves); a worker group "
                         "restarted by torchrun (--max_restarts) resumes from latest by itself")
    nan_policy: str = _f("stop", "on a non-finite (NaN/Inf) loss or gradient norm on any rank: stop (before the "
                                 "optimizer step; the last checkpoint stays latest) or skip (no weight or optimizer "
                                 "update; the step still counts: its data is used up and the LR schedule advances)",
                         choices=NAN_POLICIES)

    # llama-cookbook train_config flags (shardtune/cookbook.py gives them the cookbook's meaning)
    freeze_layers: bool = _f(False, "full fine-tuning: freeze the first num_freeze_layers decoder layers")
    num_freeze_layers: int = _f(1, "decoder layers frozen by freeze_layers, counted from the embeddings")
    freeze_LLM_only: bool = _f(False, "vision models only (llama-cookbook's mllama recipe); refused for text-only "
                                      "models")
    one_gpu: bool = _f(False, "train in one process (llama-cookbook's single-GPU run); refused with more processes")
    save_optimizer: bool = _f(True, "checkpoints hold the optimizer state (--resume needs it); false: the model "
                                    "only (smaller; such a checkpoint exports but does not resume)")
    dist_checkpoint_root_folder: str = _f("", "write checkpoints to <root>/<dist_checkpoint_folder>-<model_name> "
                                              "(llama-cookbook's FSDP layout; turns on epoch-end checkpoints) "
                                              "instead of output_dir/checkpoints; shardtune export reads it")
    dist_checkpoint_folder: str = _f("fine-tuned", "see dist_checkpoint_root_folder")
    optimizer: str = _f("AdamW", "AdamW (llama-cookbook's fsdp_config.optimizer; anyprecision is refused: use "
                                 "--pure_bf16 for bf16 optimizer state)", choices=COOKBOOK_OPTIMIZERS)
    activation_checkpointing_use_reentrant: bool = _f(False, "llama-cookbook's reentrant checkpointing; shardtune "
                                                             "recomputes non-reentrantly (true is refused)")
    enable_memory_monitoring: bool = _f(False, "llama-cookbook's memory logging: shardtune records peak memory in "
                                               "every metrics.jsonl row and the start log, always")
    memory_monitoring_interval: int = _f(100, "accepted for llama-cookbook configs; memory is logged every step")
    grammar_dataset: GrammarDatasetConfig = _f(GrammarDatasetConfig(), "llama-cookbook's grammar correction CSVs")
    # long sequences: sequence parallelism (DeepSpeed-Ulysses) and context parallelism (ring attention)
    sequence_parallel_size: int = _f(1, "Ulysses sequence parallelism: each row of a micro-batch is split over this "
                                        "many processes, which swap sequence slices for attention heads around "
                                        "attention (must divide the attention heads); these processes share their "
                                        "micro-batches, so they count once in the effective batch")
    context_parallel_size: int = _f(1, "ring attention: each row is split over this many processes (load-balanced "
                                       "causal chunks), K/V rotate around the ring; no head limit; these processes "
                                       "share their micro-batches, so they count once in the effective batch")

    # long sequences: memory levers (issue 10, shardtune.longseq)
    tiled_mlp: bool = _f(False, "run each decoder layer's MLP over sequence tiles of hidden_size tokens, recomputed "
                                "in backward (ALST): its (sequence x intermediate) activations never exist for the "
                                "whole sequence; same results")
    activation_offloading: bool = _f(False, "keep the activations saved for backward (with activation checkpointing: "
                                            "each checkpointed layer's input) in pinned CPU memory until backward "
                                            "(CUDA; on CPU they are in CPU memory anyway); same results")
    rope_scaling: str = _f("", "yarn: YaRN RoPE scaling by --rope_factor, set in the model config before the model is "
                               "built (a model trained at N tokens fine-tunes at N x factor); empty: the model's own",
                           choices=ROPE_SCALINGS)
    rope_factor: float = _f(1.0, "context extension factor of --rope_scaling (> 1): max_position_embeddings grows "
                                 "by it")
    # What a person sees (issue 13): trackers, profiles, FLOP counts, eval samples
    report_to: str = _f("none", "where rank 0 also sends the metrics.jsonl rows: none, tensorboard (event files in "
                                "output_dir/tensorboard), wandb, trackio, or all (TRL's name; each is an optional "
                                "extra: pip install 'shardtune[tensorboard]')", choices=REPORT_TO)
    use_wandb: bool = _f(False, "log to Weights & Biases (llama-cookbook's spelling of --report_to wandb)")
    wandb_config: WandbConfig = _f(WandbConfig(), "Weights & Biases settings")
    use_profiler: bool = _f(False, "torch.profiler traces per rank in profiler_dir: steps 4-6 after 1 wait and 2 "
                                   "warm-up steps (llama-cookbook's schedule); open in TensorBoard or ui.perfetto.dev")
    profiler_dir: str = _f("", "where the profiler traces go; empty: output_dir/profiler")
    flop_counter: bool = _f(False, "measure the FLOPs of one optimizer step with torch's FlopCounterMode and print "
                                   "them next to the analytic count (not with use_profiler)")
    flop_counter_start: int = _f(3, "warm-up optimizer steps before the measured one (the measured step is the "
                                    "next one)")
    log_eval_samples: int = _f(0, "at each evaluation, write N greedy generated answers with their references to "
                                  "output_dir/eval_samples.jsonl (and to the tracker); 0: none")
    # many nodes, no hangs (issue 11)
    dist_timeout: int = _f(1800, "seconds a collective (all-reduce, barrier, checkpoint exchange) waits for the other "
                                 "ranks before the job fails with a timeout error instead of hanging")

    synthetic_dialogues: SyntheticDialoguesConfig = _f(SyntheticDialoguesConfig(), "embedded dialogue data")
    samsum_dataset: SamsumDatasetConfig = _f(SamsumDatasetConfig(), "SAMSum-format data")
    alpaca_dataset: AlpacaDatasetConfig = _f(AlpacaDatasetConfig(), "alpaca-format data")
    custom_dataset: CustomDatasetConfig = _f(CustomDatasetConfig(), "your own dataset function")
    fsdp_config: FsdpConfig = _f(FsdpConfig(), "FSDP settings")
    deepspeed_config: DeepSpeedConfig = _f(DeepSpeedConfig(), "DeepSpeed ZeRO settings")
    lora_config: LoraConfig = _f(LoraConfig(), "LoRA settings")
    llama_adapter_config: LlamaAdapterConfig = _f(LlamaAdapterConfig(), "llama-adapter settings")
    prefix_config: PrefixConfig = _f(PrefixConfig(), "prefix tuning settings")
    quantization_config: QuantizationConfig = _f(QuantizationConfig(), "4-bit quantisation settings")

    @property
    def dataset_config(self) -> Any:
        return getattr(self, self.dataset)


# TRL / HF Trainer spellings accepted as aliases of ours.
ALIASES = {
    "per_device_train_batch_size": "batch_size_training",
    "per_device_eval_batch_size": "val_batch_size",
    "learning_rate": "lr",
    "num_train_epochs": "num_epochs",
    "max_steps": "max_train_step",
    "max_grad_norm": "gradient_clipping_threshold",
    "max_seq_length": "context_length",
    "max_length": "context_length",
    "sp_size": "sequence_parallel_size",
    "cp_size": "context_parallel_size",
    "fsdp_config.use_fp16": "use_fp16",
    "fsdp_config.mixed_precision": "mixed_precision",
    "fsdp_config.optimizer": "optimizer",
    "enable_activation_checkpointing": "fsdp_config.fsdp_activation_checkpointing",
}


# ---------------------------------------------------------------------------------------------------------------
# Flat view of the (nested) dataclass tree: "samsum_dataset.data_path" -> (owner type, field)


def flat_fields(cls: type = TrainConfig, prefix: str = "") -> dict[str, tuple[type, dataclasses.Field]]:
    out: dict[str, tuple[type, dataclasses.Field]] = {}
    hints = get_type_hints(cls)
    for f in fields(cls):
        typ = hints[f.name]
        if is_dataclass(typ):
            out.update(flat_fields(typ, prefix + f.name + "."))
        else:
            out[prefix + f.name] = (typ, f)
    return out


def _parse_value(key: str, typ: type, raw: Any) -> Any:
    if isinstance(raw, str):
        text = raw.strip()
        if typ is bool:
            low = text.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ConfigError(f"--{key} {raw!r} is not a boolean: use true or false")
        if typ is int:
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"--{key} {raw!r} is not an integer: pass a whole number") from None
        if typ is float:
            try:
                return float(text)
            except ValueError:
                raise ConfigError(f"--{key} {raw!r} is not a number: pass e.g. 1e-4") from None
        if typ == list[str]:
            return [p.strip() for p in text.split(",") if p.strip()]
        return raw
    # values from YAML keep their type, checked here
    if typ is bool and not isinstance(raw, bool):
        raise ConfigError(f"{key}: {raw!r} is not a boolean: use true or false")
    if typ is int and (isinstance(raw, bool) or not isinstance(raw, int)):
        raise ConfigError(f"{key}: {raw!r} is not an integer: pass a whole number")
    if typ is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(f"{key}: {raw!r} is not a number: pass e.g. 1e-4")
        return float(raw)
    if typ is str and not isinstance(raw, str):
        return str(raw)
    if typ == list[str]:
        if isinstance(raw, list):
            return [str(x) for x in raw]
        raise ConfigError(f"{key}: {raw!r} is not a list: pass a YAML list or a comma-separated string")
    return raw


def resolve_key(key: str) -> str:
    """Map a flag name (maybe an alias or a short spelling of a nested field) to its canonical dotted name."""
    known = flat_fields()
    key = key.replace("-", "_") if "." not in key else key
    if key in known:
        return key
    if key in ALIASES:
        return ALIASES[key]
    # short spellings of nested fields, as llama-cookbook accepts them (--pure_bf16 -> fsdp_config.pure_bf16)
    for owner in SHORT_SPELLING_OWNERS:
        if f"{owner}.{key}" in known:
            return f"{owner}.{key}"
    candidates = list(known) + list(ALIASES)
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    hint = f"did you mean --{close[0]}?" if close else "see shardtune sft --help"
    raise ConfigError(f"unknown flag --{key}: {hint}")


# Nested configs whose fields may also be given without their prefix (llama-cookbook spells --pure_bf16).
SHORT_SPELLING_OWNERS: list[str] = ["fsdp_config"]


def set_value(cfg: TrainConfig, key: str, raw: Any) -> None:
    """Set a flat key from a flag or YAML value; None (YAML's empty value, ``data_path:``) means the default."""
    key = resolve_key(key)
    typ, f = flat_fields()[key]
    value = field_default(f) if raw is None else _parse_value(key, typ, raw)
    if "spellings" in f.metadata:  # another accepted spelling of a choice (int4 -> 4bit)
        value = f.metadata["spellings"].get(value, value)
    *owners, name = key.split(".")
    target: Any = cfg
    for owner in owners:
        target = getattr(target, owner)
    setattr(target, name, value)


def flatten_dict(data: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested config mappings as dotted flag names."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(flatten_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file: pass the path of a YAML recipe (see recipes/)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]}): fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping of flag names to values")
    return flatten_dict(data)


def parse_args(argv: list[str]) -> TrainConfig:
    """Parse ``--config FILE`` plus ``--key value`` / ``--key=value`` / bare ``--flag`` (true) overrides."""
    pairs: list[tuple[str, Any]] = []
    i = 0
    config_path = None
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: flags look like --name value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("--"):
                value = None
            else:
                value = nxt
                i += 1
        i += 1
        if name == "config":
            if value is None:
                raise ConfigError("--config needs a path: --config recipes/demo.yaml")
            config_path = value
            continue
        pairs.append((name, value))
    cfg = TrainConfig()
    if config_path:
        for key, value in load_yaml(config_path).items():
            set_value(cfg, key, value)
    for name, value in pairs:
        key = resolve_key(name)
        typ, _ = flat_fields()[key]
        if value is None:
            if typ is not bool:
                raise ConfigError(f"--{name} needs a value")
            value = "true"
        set_value(cfg, key, value)
    select_hybrid_sharding(cfg)
    return cfg


def select_hybrid_sharding(cfg: TrainConfig) -> None:
    """llama-cookbook's --hsdp means hybrid sharding (with --sharding_group_size / --replica_group_size): it selects
    HYBRID_SHARD over the default FULL_SHARD; with SHARD_GRAD_OP or NO_SHARD it is refused by the FSDP check."""
    if cfg.fsdp_config.hsdp and cfg.fsdp_config.sharding_strategy == "FULL_SHARD":
        cfg.fsdp_config.sharding_strategy = "HYBRID_SHARD"


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def from_dict(data: dict[str, Any]) -> TrainConfig:
    cfg = TrainConfig()
    for key, value in flatten_dict(data).items():
        set_value(cfg, key, value)
    return cfg


def field_default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def help_text() -> str:
    lines = ["usage: shardtune sft [--config recipe.yaml] [--accelerate_config accelerate.yaml] [--flag value ...] "
             "[torchrun flags]", "", "training flags:"]
    for key, (typ, f) in flat_fields().items():
        default = field_default(f)
        tname = getattr(typ, "__name__", str(typ))
        lines.append(f"  --{key} {tname.upper()}  (default: {default!r})")
        lines.append(f"      {f.metadata.get('help', '')}")
    lines.append("")
    lines.append("aliases: " + ", ".join(f"--{a} = --{c}" for a, c in ALIASES.items()))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Validation: one pass, before any process group exists.

VALIDATORS: list = []


def validator(fn):
    """Register a validation function ``fn(cfg, world_size)``; later modules (FSDP, PEFT) add their own."""
    VALIDATORS.append(fn)
    return fn


@validator
def _check_core(cfg: TrainConfig, world_size: int) -> None:
    for name in ("batch_size_training", "gradient_accumulation_steps", "num_epochs", "context_length",
                 "val_batch_size"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name} {getattr(cfg, name)} must be positive: pass a value >= 1")
    for name in ("max_train_step", "max_eval_step", "num_workers_dataloader", "warmup_steps"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} {getattr(cfg, name)} must be >= 0 (0 means no limit / none)")
    if cfg.lr <= 0:
        raise ConfigError(f"--lr {cfg.lr} must be positive: pass e.g. 1e-4")
    if cfg.weight_decay < 0:
        raise ConfigError(f"--weight_decay {cfg.weight_decay} must be >= 0")
    if not 0 < cfg.gamma <= 1:
        raise ConfigError(f"--gamma {cfg.gamma} must be in (0, 1]: it multiplies the lr once per epoch")
    if cfg.gradient_clipping and cfg.gradient_clipping_threshold <= 0:
        raise ConfigError(f"--gradient_clipping_threshold {cfg.gradient_clipping_threshold} must be positive")
    for key, (typ, f) in flat_fields().items():
        choices = f.metadata.get("choices")
        if choices:
            *owners, name = key.split(".")
            target: Any = cfg
            for o in owners:
                target = getattr(target, o)
            value = getattr(target, name)
            if value not in choices:
                close = difflib.get_close_matches(str(value), choices, n=1)
                hint = f"did you mean {close[0]}?" if close else "choose one of " + ", ".join(choices)
                raise ConfigError(f"--{key} {value!r} is not valid: {hint}")
    for frac_key in ("samsum_dataset.validation_fraction", "alpaca_dataset.validation_fraction"):
        owner, name = frac_key.split(".")
        frac = getattr(getattr(cfg, owner), name)
        if not 0 <= frac < 1:
            raise ConfigError(f"--{frac_key} {frac} must be in [0, 1)")
    _check_output_dir(cfg.output_dir)
    _check_previous_run(cfg)


# Files whose presence means output_dir already holds a run.
RUN_FILES = ("metrics.jsonl", "config.yaml", "config.json", "adapter_config.json")


def _check_previous_run(cfg: TrainConfig) -> None:
    """Never overwrite a previous run's outputs by accident (resuming it, or a torchrun restart, is fine)."""
    restarted = worker_group_attempt() > 0
    resuming = bool(cfg.resume)
    if cfg.resume == "auto":  # resumes only where a checkpoint is: else it is a new run like any other
        from shardtune.checkpoint import checkpoint_root, latest_checkpoint

        resuming = latest_checkpoint(checkpoint_root(cfg)) is not None
    if cfg.overwrite_output_dir or resuming or restarted:
        return
    found = [name for name in RUN_FILES if (Path(cfg.output_dir) / name).exists()]
    if found:
        raise ConfigError(f"--output_dir {cfg.output_dir} already holds a run ({found[0]}): pass another directory, "
                          "--resume latest to continue it, or --overwrite_output_dir true to replace it")


def _check_output_dir(output_dir: str) -> None:
    """Probe with a real file write (os.access says yes to root even on a read-only filesystem)."""
    if not output_dir:
        raise ConfigError("--output_dir is empty: pass a directory to write the model and metrics to")
    p = Path(output_dir).resolve()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--output_dir {output_dir} is a file: pass a directory path")
    probe_dir = p
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir}: {probe_dir} is a file, not a directory: pass another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".shardtune-write-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--output_dir {output_dir} is not writable ({probe_dir}: {e.strerror}): "
                          "pass a directory you can write to") from None


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Check every setting (and combination) that can be checked without a process group."""
    for fn in VALIDATORS:
        fn(cfg, world_size)


def effective_batch_size(cfg: TrainConfig, dp_size: int) -> int:
    """Examples (or packed blocks) per optimizer step: per-device batch x data-parallel processes (the world size
    without sequence / context parallelism; shardtune.parallel.dims) x accumulation steps."""
    return cfg.batch_size_training * dp_size * cfg.gradient_accumulation_steps


# FSDP settings that only mean something with --enable_fsdp (checkpoint_type belongs to checkpointing).
FSDP_ONLY_SETTINGS = ("hsdp", "sharding_strategy", "sharding_group_size", "replica_group_size", "pure_bf16",
                      "fsdp_activation_checkpointing", "fsdp_cpu_offload")


@validator
def _check_fsdp(cfg: TrainConfig, world_size: int) -> None:
    fc, defaults = cfg.fsdp_config, FsdpConfig()
    if cfg.use_fp16 and fc.pure_bf16:
        raise ConfigError("--use_fp16 and --fsdp_config.pure_bf16 are both set: fp16 and bf16 exclude each other; "
                          "drop one of them")
    if not cfg.enable_fsdp:
        changed = [n for n in FSDP_ONLY_SETTINGS if getattr(fc, n) != getattr(defaults, n)]
        if changed:
            raise ConfigError(f"--fsdp_config.{changed[0]} {getattr(fc, changed[0])} has no effect without FSDP: "
                              "add --enable_fsdp or drop the flag")
        if cfg.low_cpu_fsdp:
            raise ConfigError("--low_cpu_fsdp needs --enable_fsdp (rank-0-only loading shards the model): "
                              "add --enable_fsdp or drop the flag")
        return
    if cfg.quantization == "8bit":
        raise ConfigError("--quantization 8bit is not supported with --enable_fsdp (bitsandbytes 8-bit weights "
                          "cannot be sharded): use --quantization 4bit, or drop --enable_fsdp")
    hybrid = fc.sharding_strategy == "HYBRID_SHARD"
    if fc.hsdp and not hybrid:
        raise ConfigError(f"--fsdp_config.hsdp true needs --fsdp_config.sharding_strategy HYBRID_SHARD, not "
                          f"{fc.sharding_strategy}: set it, or drop --fsdp_config.hsdp")
    sizes = {"sharding_group_size": fc.sharding_group_size, "replica_group_size": fc.replica_group_size}
    for name, size in sizes.items():
        if size < 0:
            raise ConfigError(f"--fsdp_config.{name} {size} must be >= 0 (0: derived)")
        if size and not hybrid:
            raise ConfigError(f"--fsdp_config.{name} {size} only applies to --fsdp_config.sharding_strategy "
                              f"HYBRID_SHARD (not {fc.sharding_strategy}): set it, or drop the flag")
        if size and world_size % size:
            raise ConfigError(f"--fsdp_config.{name} {size} does not divide the world size {world_size}: pass a "
                              f"divisor of {world_size}")
    shard, replicas = fc.sharding_group_size, fc.replica_group_size
    if shard and replicas and shard * replicas != world_size:
        raise ConfigError(f"--fsdp_config.sharding_group_size {shard} x --fsdp_config.replica_group_size {replicas} "
                          f"= {shard * replicas}, but the world size is {world_size}: make their product "
                          f"{world_size}, or set one of them to 0 (derived)")


# Keys of a --deepspeed_config.config_file that shardtune sets itself: the file may repeat our value or say "auto".
DEEPSPEED_OWNED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                        "managed_gradient_accumulation", "optimizer", "scheduler")


def deepspeed_file_config(cfg: TrainConfig) -> dict:
    """The JSON object of --deepspeed_config.config_file ({} when none)."""
    import json

    path = cfg.deepspeed_config.config_file
    if not path:
        return {}
    try:
        loaded = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"--deepspeed_config.config_file {path}: cannot read it ({e.strerror}): pass an existing "
                          "JSON file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config.config_file {path} is not valid JSON ({e.msg}, line {e.lineno}): "
                          "fix the file") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"--deepspeed_config.config_file {path} must hold a JSON object: fix the file")
    return loaded


@validator
def _check_deepspeed(cfg: TrainConfig, world_size: int) -> None:
    dc, defaults = cfg.deepspeed_config, DeepSpeedConfig()
    if not cfg.enable_deepspeed:
        changed = [f.name for f in fields(DeepSpeedConfig) if getattr(dc, f.name) != getattr(defaults, f.name)]
        if changed:
            raise ConfigError(f"--deepspeed_config.{changed[0]} {getattr(dc, changed[0])} has no effect without "
                              "DeepSpeed: add --enable_deepspeed or drop the flag")
        return
    import importlib.util

    if cfg.enable_fsdp:
        raise ConfigError("--enable_fsdp and --enable_deepspeed are both set: they are two sharding strategies; "
                          "drop one of them")
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("--enable_deepspeed needs DeepSpeed, which is not installed: pip install "
                          "--no-build-isolation 'shardtune[deepspeed]' (its build needs torch), or drop the flag")
    if dc.zero_stage not in (1, 2, 3):
        raise ConfigError(f"--deepspeed_config.zero_stage {dc.zero_stage} is not valid: choose 1, 2 or 3")
    if dc.offload_param and dc.zero_stage != 3:
        raise ConfigError(f"--deepspeed_config.offload_param needs --deepspeed_config.zero_stage 3 (not "
                          f"{dc.zero_stage}): set it, or drop --deepspeed_config.offload_param")
    if cfg.quantization == "8bit" and dc.zero_stage == 3:
        raise ConfigError("--quantization 8bit cannot be partitioned by ZeRO-3: use --quantization 4bit (stored in the "
                          "compute dtype, which ZeRO-3 partitions), or --deepspeed_config.zero_stage 2")
    if cfg.nan_policy == "skip":
        raise ConfigError("--nan_policy skip is not supported with --enable_deepspeed (its step cannot be skipped "
                          "once gradients are accumulated): use --nan_policy stop, or --enable_fsdp")
    if cfg.compile:
        raise ConfigError("--compile is not supported with --enable_deepspeed yet: drop one of them")
    ours = {"train_micro_batch_size_per_gpu": cfg.batch_size_training,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "train_batch_size": effective_batch_size(cfg, world_size)}
    file_config = deepspeed_file_config(cfg)
    stage = (file_config.get("zero_optimization") or {}).get("stage", "auto")
    if stage not in ("auto", dc.zero_stage):
        raise ConfigError(f"--deepspeed_config.config_file {dc.config_file}: zero_optimization.stage is {stage}, but "
                          f"--deepspeed_config.zero_stage is {dc.zero_stage}: make them agree (or drop the stage "
                          "from the file)")
    for key, value in file_config.items():
        if key not in DEEPSPEED_OWNED_KEYS or value == "auto" or ours.get(key) == value:
            continue
        what = (f"{value}, but shardtune's is {ours[key]} (from --batch_size_training, the world size and "
                "--gradient_accumulation_steps)" if key in ours else "set by shardtune")
        raise ConfigError(f"--deepspeed_config.config_file {dc.config_file}: \"{key}\" is {what}: remove the key "
                          "or set it to \"auto\"")


@validator
def _check_fp16_device(cfg: TrainConfig, world_size: int) -> None:
    from shardtune.precision import fp16_compute_available

    if cfg.use_fp16 and not fp16_compute_available():
        raise ConfigError("--use_fp16 needs CUDA GPUs (fp16 compute with a gradient scaler, for GPUs without bf16); "
                          "this machine has none, and on CPU shardtune computes in fp32: drop --use_fp16")


@validator
def _check_long_sequence_levers(cfg: TrainConfig, world_size: int) -> None:
    if cfg.rope_scaling and cfg.rope_factor <= 1:
        raise ConfigError(f"--rope_factor {cfg.rope_factor} must be > 1 with --rope_scaling {cfg.rope_scaling}: pass "
                          "the context extension, e.g. --rope_factor 4")
    if not cfg.rope_scaling and cfg.rope_factor != 1:
        raise ConfigError(f"--rope_factor {cfg.rope_factor} has no effect without --rope_scaling: add "
                          "--rope_scaling yarn or drop the flag")


# Trackers: --report_to name -> (module to import, the optional extra that installs it)
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "trackio": ("trackio", "trackio")}
PROFILER_SCHEDULE = {"wait": 1, "warmup": 2, "active": 3}  # llama-cookbook's torch.profiler schedule


def trackers(cfg: TrainConfig) -> list[str]:
    """The trackers a run reports to: --report_to (all: every one) plus --use_wandb."""
    names = list(TRACKER_PACKAGES) if cfg.report_to == "all" else [] if cfg.report_to == "none" else [cfg.report_to]
    if cfg.use_wandb and "wandb" not in names:
        names.append("wandb")
    return names


@validator
def _check_observability(cfg: TrainConfig, world_size: int) -> None:
    import importlib.util

    for name in trackers(cfg):
        module, extra = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            flag = "--use_wandb" if name == "wandb" and cfg.report_to not in ("wandb", "all") else \
                f"--report_to {cfg.report_to}"
            raise ConfigError(f"{flag} needs {module}, which is not installed: pip install 'shardtune[{extra}]', "
                              "or drop the flag")
    if cfg.use_profiler and cfg.flop_counter:
        raise ConfigError("--use_profiler and --flop_counter are both set: the FLOP counter would count the "
                          "profiler's steps too; drop one of them")
    if cfg.flop_counter_start < 0 or cfg.log_eval_samples < 0:
        bad = "flop_counter_start" if cfg.flop_counter_start < 0 else "log_eval_samples"
        raise ConfigError(f"--{bad} {getattr(cfg, bad)} must be >= 0")
    if cfg.flop_counter and cfg.max_train_step and cfg.max_train_step <= cfg.flop_counter_start:
        raise ConfigError(f"--flop_counter measures step {cfg.flop_counter_start + 1} (after --flop_counter_start "
                          f"{cfg.flop_counter_start} warm-up steps), but --max_train_step is {cfg.max_train_step}: "
                          "raise --max_train_step or lower --flop_counter_start")
    profiled = sum(PROFILER_SCHEDULE.values())
    if cfg.use_profiler and cfg.max_train_step and cfg.max_train_step <= profiled:
        raise ConfigError(f"--use_profiler records steps 4-6 after {PROFILER_SCHEDULE['wait']} wait and "
                          f"{PROFILER_SCHEDULE['warmup']} warm-up steps, so it needs more than {profiled} steps, but "
                          f"--max_train_step is {cfg.max_train_step}: raise it to {profiled + 1} or more")


@validator
def _check_dist_timeout(cfg: TrainConfig, world_size: int) -> None:
    if cfg.dist_timeout <= 0:
        raise ConfigError(f"--dist_timeout {cfg.dist_timeout} must be a positive number of seconds (default 1800)")
