"""TRL's inherited names: the fields of transformers' TrainingArguments (and TRL's ModelConfig / ScriptArguments)
beyond the common ones of trl.py, each honoured as a canonical setting or refused in one line with its own reason.

Three kinds, as trl.py's: a translation (``ddp_timeout`` is parallel.dist_timeout; ``fsdp`` / ``fsdp_config`` /
``deepspeed`` choose and tune the strategy); a name accepted only with the values that mean what shardtune does
anyway (:func:`only`, :func:`no_effect`: said in its meaning, any other value refused naming it); and a name of
something not built (``refused``), accepted only given TRL's default or nothing, so that a dumped config loads.
:func:`finish` settles the names whose meaning depends on other flags (``data_seed`` against ``--seed``).
"""

from __future__ import annotations

from typing import Any, Callable

from shardtune.config.dialects import Pairs, Spelling, canonical, is_empty, refused, same, text, trl_reward
from shardtune.config.dialects.trl_sharding import COOKBOOK_FSDP_NAMES, FSDP_CONFIG, _deepspeed, _fsdp, _fsdp_config
from shardtune.config.dialects.trl_values import STATE, _bool, _given, _mapping, _shown, gpus_visible, no_effect, only
from shardtune.config.mixture import MIXTURE_KEY, mixture_entries
from shardtune.config.schema import ConfigError, TrainConfig


def _state(name: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], Pairs]:
    """A name :func:`finish` settles with other flags."""
    return lambda value: [] if is_empty(_given(value)) else [(STATE + name, convert(_given(value)))]


# -- the others -------------------------------------------------------------------------------------------------------


def _activation_checkpointing(value: Any) -> Pairs:
    return [("parallel.activation_checkpointing", _bool("activation_checkpointing", value))]


def checkpointing_kwargs(name: str) -> Spelling:
    """TRL's --gradient_checkpointing_kwargs and transformers 5's --activation_checkpointing_kwargs, one setting: JSON
    text, a JSON file or a mapping, accepted with the keys and values that are what shardtune does (every decoder
    layer recomputed, non-reentrantly)."""

    def to(value: Any) -> Pairs:
        for key, v in _mapping(name, value, '{"use_reentrant": false}').items():
            if (key, canonical(v)) not in (("use_reentrant", False), ("every_n_layers", 1.0)):
                raise ConfigError(
                    f"--{name} {key} {_shown(v)}: shardtune recomputes every decoder layer, non-reentrantly: pass "
                    "'{\"use_reentrant\": false}' or drop the flag"
                )
        return []

    return S(
        "-",
        "JSON text, a JSON file or a mapping: use_reentrant false and every_n_layers 1 only (every decoder layer, "
        "recomputed non-reentrantly)",
        to,
    )


def _torch_compile(name: str, accepted: str) -> Callable[[Any], Pairs]:
    def to(value: Any) -> Pairs:
        if same(value, accepted):
            return [("model.compile", True)]  # Trainer: setting it turns torch_compile on
        raise ConfigError(
            f"--{name} {text(value)}: shardtune compiles each decoder layer with torch.compile's {accepted}: pass "
            f"{accepted} (or --torch_compile), or drop the flag"
        )

    return to


def _logging_strategy(value: Any) -> Pairs:
    strategy = canonical(_given(value))
    if strategy in ("steps", False):  # "no" reads as false
        return [(STATE + "logging_strategy", strategy or "no")]
    raise ConfigError(
        f"--logging_strategy {_shown(_given(value))}: the trackers receive every --logging_steps-th step row (and "
        "every evaluation): use steps with --logging_steps N, or no (with no --report_to)"
    )


def _use_cpu(value: Any) -> Pairs:
    if _bool("use_cpu", value) and gpus_visible():
        raise ConfigError(
            "--use_cpu true: shardtune trains on the visible GPUs (on CPU processes only where there are none): hide "
            "them (CUDA_VISIBLE_DEVICES= shardtune sft ...) and drop the flag"
        )
    return []


def _ddp_backend(value: Any) -> Pairs:
    expected = "nccl" if gpus_visible() else "gloo"
    if same(value, expected):
        return []
    raise ConfigError(
        f"--ddp_backend {text(value)}: shardtune uses nccl with GPUs and gloo on CPU ({expected} here): drop the flag"
    )


def _accelerator_config(value: Any) -> Pairs:
    for key, v in _mapping("accelerator_config", value, '{"even_batches": true}').items():
        if key not in ACCELERATOR_CONFIG:
            raise ConfigError(
                f"--accelerator_config {key} is not a key shardtune knows ({', '.join(ACCELERATOR_CONFIG)}): drop it"
            )
        accepted, why = ACCELERATOR_CONFIG[key]
        if not (is_empty(v) or any(same(v, a) for a in accepted)):
            raise ConfigError(f"--accelerator_config {key} {_shown(v)}: {why}")
    return []


# accelerator_config's keys: the values that are what shardtune does, and why another is refused
ACCELERATOR_CONFIG: dict[str, tuple[tuple[Any, ...], str]] = {
    "split_batches": ((False,), "the batch size is per device (--per_device_train_batch_size): set false"),
    "dispatch_batches": ((False,), "each rank builds its own batches from the same seeded order: set false"),
    "even_batches": ((True,), "every rank runs the same number of batches: set true"),
    "use_seedable_sampler": ((True,), "the data order is seeded by --seed: set true"),
    "non_blocking": ((False,), "batches are copied to the device as they are (no pinned memory): set false"),
    "gradient_accumulation_kwargs": (
        (),
        "accumulation is --gradient_accumulation_steps (the loss normalised by the step's tokens): drop the key",
    ),
}


def S(target: str, meaning: str, to: Callable[[Any], Pairs] | None = None) -> Spelling:
    """A translation; an empty value given ("", "none": unset, TRL's default of most names) changes nothing."""
    return Spelling(target, meaning, None if to is None else lambda value: [] if _unset(value) else to(value))


def _unset(value: Any) -> bool:
    return value is not None and is_empty(value)  # None: a bare flag, the translation's to decide


DROP = "drop the flag"


def _train_sampling_strategy(value: Any) -> Pairs:
    strategy = text(_given(value))
    if strategy in ("random", "sequential"):
        return [("data.sampling", strategy)]
    raise ConfigError(
        f"--train_sampling_strategy {_shown(_given(value))}: choose random (a seeded shuffle every epoch) or "
        "sequential (the data's order); group_by_length is not built"
    )


def _datasets(value: Any) -> Pairs:
    return [] if is_empty(value) else [(MIXTURE_KEY, mixture_entries("datasets:", value))]


SPELLINGS: dict[str, Spelling] = {
    "lora_task_type": Spelling(
        "-", "CAUSAL_LM (TRL's default), or SEQ_CLS for shardtune reward's score head", trl_reward.lora_task_type
    ),
    "datasets": Spelling(
        MIXTURE_KEY,
        "TRL's mixture: a list of path, name, data_dir, data_files, split, columns, fraction (and shardtune's "
        "weight): several datasets in one run (docs/data-formats.md#mixtures)",
        _datasets,
    ),
    # the strategy (TrainingArguments)
    "fsdp": S(
        "parallel.strategy / parallel.sharding_strategy / parallel.cpu_offload",
        "true: FSDP2; Trainer's older words: full_shard, shard_grad_op, no_shard, hybrid_shard, offload (CPU), "
        "auto_wrap (each decoder layer: shardtune's)",
        _fsdp,
    ),
    "fsdp_config": S(
        "parallel.sharding_strategy / parallel.cpu_offload / parallel.activation_checkpointing / "
        "parallel.low_cpu_fsdp / checkpoint.checkpoint_type",
        "FSDP's tuning: a JSON file or mapping of the fsdp_config.* keys below",
        _fsdp_config,
    ),
    **{f"fsdp_config.{key}": S(target, meaning, to) for key, (to, target, meaning) in FSDP_CONFIG.items()},
    **{
        f"fsdp_config.fsdp_{key}": S(target, f"as fsdp_config.{key}", to)
        for key, (to, target, meaning) in FSDP_CONFIG.items()
        if f"fsdp_{key}" not in COOKBOOK_FSDP_NAMES
    },
    "deepspeed": S(
        "parallel.strategy / parallel.deepspeed_config_file / parallel.zero_stage",
        "a DeepSpeed JSON file: DeepSpeed with that file merged over shardtune's config (its ZeRO stage and CPU "
        "offloading are the run's; batch sizes and accumulation must agree or be auto)",
        _deepspeed,
    ),
    "ddp_timeout": S("parallel.dist_timeout", "seconds a collective waits for the other ranks before the job fails"),
    "ddp_backend": S("-", "nccl with GPUs, gloo on CPU: shardtune's choice, the only value accepted", _ddp_backend),
    "ddp_find_unused_parameters": only(
        "ddp_find_unused_parameters",
        (False,),
        "false: DDP without find_unused_parameters (every trainable parameter gets a gradient every step)",
        "every trainable parameter gets a gradient every step here (DDP runs without it): " + DROP,
    ),
    "ddp_bucket_cap_mb": only(
        "ddp_bucket_cap_mb",
        (25,),
        "25: DDP's gradient buckets are torch's default size",
        "DDP's gradient buckets are torch's default (25 MB): " + DROP,
    ),
    "ddp_broadcast_buffers": only(
        "ddp_broadcast_buffers",
        (False,),
        "false: DDP broadcasts no buffers (they are the same on every rank; evaluation stays local)",
        "DDP broadcasts no buffers here (they are the same on every rank, and evaluation must not be a "
        "collective): " + DROP,
    ),
    "ddp_static_graph": only(
        "ddp_static_graph",
        (False,),
        "false: DDP without static_graph (torch's default)",
        "DDP runs without static_graph (torch's default): " + DROP,
    ),
    "ignore_bias_buffers": no_effect(
        "DDP never broadcasts buffers here: the fix TRL's DPO script applies with it is always in effect"
    ),
    "use_cpu": S(
        "-",
        "true: accepted where no GPU is visible (then CPU processes with gloo: what shardtune does); refused "
        "where GPUs are visible (hide them with CUDA_VISIBLE_DEVICES=)",
        _use_cpu,
    ),
    "accelerator_config": S(
        "-",
        "a JSON file or mapping: split_batches false, dispatch_batches false, even_batches true, "
        "use_seedable_sampler true, non_blocking false (what shardtune does); other values refused",
        _accelerator_config,
    ),
    "parallelism_config": refused(
        "give the sizes as flags (--cp_size, --sp_size) or in the Accelerate file's parallelism_config: drop the "
        "mapping"
    ),
    "average_tokens_across_devices": only(
        "average_tokens_across_devices",
        (True,),
        "true: the loss is normalised by the step's label tokens over all ranks, always (docs/architecture.md)",
        "shardtune always normalises the loss by the step's label tokens over all ranks and micro-batches "
        "(the same numbers at any world size): " + DROP,
    ),
    # precision, memory, speed
    "activation_checkpointing": S(
        "parallel.activation_checkpointing",
        "as --gradient_checkpointing (transformers 5's name): recompute each decoder layer in backward",
        _activation_checkpointing,
    ),
    "activation_checkpointing_kwargs": checkpointing_kwargs("activation_checkpointing_kwargs"),
    "torch_compile_backend": S(
        "model.compile", "inductor only: turns --torch_compile on", _torch_compile("torch_compile_backend", "inductor")
    ),
    "torch_compile_mode": S(
        "model.compile", "default only: turns --torch_compile on", _torch_compile("torch_compile_mode", "default")
    ),
    "tf32": only(
        "tf32",
        (False,),
        "false: fp32 matmuls stay full fp32 (torch's default)",
        "TF32 matmuls are not switched on (fp32 matmuls stay fp32; fast compute: --bf16): " + DROP,
    ),
    "bf16_full_eval": refused(
        "evaluation computes as training does (--bf16: bf16 compute, fp32 weights): " + DROP, False
    ),
    "fp16_full_eval": refused(
        "evaluation computes as training does (--fp16: fp16 compute, fp32 weights): " + DROP, False
    ),
    "use_cache": only(
        "use_cache",
        (False,),
        "false: training keeps no KV cache (generation for --log_eval_samples uses one anyway)",
        "training keeps no KV cache (generation for --log_eval_samples uses one anyway): " + DROP,
    ),
    "liger_kernel_config": refused(
        "--use_liger_kernel applies liger-kernel's RMSNorm, SwiGLU and RoPE kernels as shardtune chooses them: drop "
        "the mapping"
    ),
    "torch_empty_cache_steps": refused("the CUDA cache is not emptied during training: " + DROP),
    "auto_find_batch_size": refused(
        "the batch size is the one given; shardtune plan shows what fits a GPU before a run: " + DROP, False
    ),
    "bnb_4bit_quant_storage": refused(
        "shardtune stores 4-bit weights as sharding needs them (uint8; the compute dtype under FSDP / ZeRO-3): " + DROP
    ),
    "lora_target_parameters": refused(
        "LoRA on parameters (mixture-of-experts weights) is not built: adapt modules with --lora_target_modules, "
        "and " + DROP
    ),
    # the optimizer and the loss
    "optim_args": refused(
        "AdamW takes --weight_decay, --adam_beta1, --adam_beta2 and --adam_epsilon: drop the flag and use those"
    ),
    "optim_target_modules": refused("GaLore / APOLLO optimizers are not built (--optim): " + DROP),
    "label_smoothing_factor": refused("the SFT loss is plain cross-entropy (label smoothing is not built): " + DROP, 0),
    "neftune_noise_alpha": refused("NEFTune's noisy embeddings are not built: " + DROP),
    # data loading
    "data_seed": S(
        "-",
        "accepted equal to --seed: the data order is seeded by --seed, with init and dropout",
        _state("data_seed"),
    ),
    "dataloader_drop_last": no_effect(
        "a last partial global batch is dropped always (every step sees the whole effective batch): true is what "
        "shardtune does, false (TRL's default) is accepted as it"
    ),
    "dataloader_pin_memory": no_effect(
        "batches are copied to the device from ordinary memory (pinning is speed only: TRL's default true is "
        "accepted as it)"
    ),
    "dataloader_persistent_workers": only(
        "dataloader_persistent_workers",
        (False,),
        "false: each epoch's loader starts its workers",
        "each epoch's loader starts its own workers: " + DROP,
    ),
    "dataloader_prefetch_factor": only(
        "dataloader_prefetch_factor",
        (2,),
        "2: each worker prepares 2 optimizer steps ahead (torch's default)",
        "each data loader worker prepares 2 steps ahead (torch's default): " + DROP,
    ),
    "dataloader_multiprocessing_context": refused("data loader workers start with torch's default method: " + DROP),
    "dataloader_in_order": only(
        "dataloader_in_order",
        (True,),
        "true: batches come in the data order (part of what makes runs repeatable)",
        "batches come in the data order (what makes runs repeatable and resumable): " + DROP,
    ),
    "remove_unused_columns": no_effect(
        "only the columns of the data's format are read (docs/data-formats.md); the others are never used"
    ),
    "label_names": only(
        "label_names", (["labels"], "labels"), "labels only", "the loss reads the labels column: " + DROP
    ),
    "train_sampling_strategy": Spelling(
        "data.sampling",
        "random: a seeded shuffle every epoch (with padding, each global batch sorted by length to pad less); "
        "sequential: the data's order (TRL's KTO default); group_by_length is not built",
        _train_sampling_strategy,
    ),
    "length_column_name": no_effect("read only by the length-grouped samplers, which are not built"),
    "dataset_streaming": S(
        "data.streaming",
        "true: --dataset_name rows read, tokenised and batched as the steps need them (needs --max_steps)",
        lambda value: [("data.streaming", _bool("dataset_streaming", value))],
    ),
    # logging, trackers
    "logging_strategy": S(
        "-",
        "steps: the trackers get every --logging_steps-th step row; no: no tracker (refused with --report_to)",
        _logging_strategy,
    ),
    "logging_first_step": S(
        "-",
        "true: accepted where the trackers get step 1's row (--logging_steps 1, or no --report_to); metrics.jsonl "
        "has every step",
        _state("logging_first_step", lambda v: _bool("logging_first_step", v)),
    ),
    "logging_nan_inf_filter": no_effect(
        "metrics.jsonl records each step's loss as computed; a non-finite one stops the run or is skipped "
        "(--nan_policy), never averaged into a row"
    ),
    "log_on_each_node": no_effect("rank 0 alone writes metrics and logs (a line per node is not written)"),
    "include_num_input_tokens_seen": only(
        "include_num_input_tokens_seen",
        ("no", "non_padding", "all", True, False),
        "every metrics.jsonl row has num_tokens: the input tokens seen so far, without padding (docs/observability.md)",
        "choose no, non_padding or all",
    ),
    "log_level": only(
        "log_level",
        ("passive", "warning"),
        "passive / warning: the libraries' log level is left as it is (transformers': warning)",
        "shardtune leaves the libraries' log level as it is: set TRANSFORMERS_VERBOSITY to that level instead, "
        "and " + DROP,
    ),
    "log_level_replica": only(
        "log_level_replica",
        ("passive", "warning"),
        "passive / warning: ranks other than 0 print only what is wrong",
        "ranks other than 0 print only what is wrong (rank 0 talks): " + DROP,
    ),
    "disable_tqdm": only(
        "disable_tqdm",
        (False,),
        "false: rank 0 shows the progress bar",
        "rank 0 always shows its progress bar (on stderr): " + DROP,
    ),
    "skip_memory_metrics": no_effect("peak memory is in every metrics.jsonl row, always"),
    "run_name": refused(
        "trackio names the run after output_dir's folder, W&B generates a name (--wandb_config.group groups runs): "
        + DROP
    ),
    "project": S("logging.wandb.project", "the trackers' project (trackio and W&B)"),
    **dict.fromkeys(
        ("trackio_space_id", "trackio_bucket_id", "trackio_static_space_id"),
        refused("trackio logs locally (its dashboard: trackio show); a Space is not built: " + DROP, False),
    ),
    # evaluation
    "eval_delay": refused("evaluation runs at every evaluation step from the first: " + DROP, 0),
    "prediction_loss_only": no_effect(
        "evaluation computes the loss and perplexity (generated answers only with --log_eval_samples)"
    ),
    "eval_do_concat_batches": only(
        "eval_do_concat_batches",
        (True,),
        "true: compute_metrics and predict() get the split's predictions concatenated into whole arrays",
        "compute_metrics gets whole arrays (the split's batches concatenated, one row per example): " + DROP,
    ),
    "eval_use_gather_object": no_effect("evaluation all-reduces loss sums; no objects are gathered"),
    "eval_accumulation_steps": only(
        "eval_accumulation_steps",
        (1,),
        "1: each batch's predictions go to the host at once (none are accumulated on the device)",
        "each batch's predictions go to the host at once (eval_accumulation_steps 1): " + DROP,
    ),
    "include_for_metrics": refused(
        "compute_metrics gets predictions and label_ids only (no inputs, no losses): " + DROP
    ),
    "batch_eval_metrics": refused(
        "compute_metrics runs once on the whole split's gathered predictions (not per batch): " + DROP, False
    ),
    # checkpoints, resuming, the hub
    "save_on_each_node": refused(
        "checkpoints go once to output_dir, each rank its shard: put output_dir on storage every node sees, and "
        + DROP,
        False,
    ),
    "enable_jit_checkpoint": no_effect(
        "on SIGTERM / SIGUSR1 shardtune always finishes the step, writes a checkpoint and exits (docs/launching.md)"
    ),
    "ignore_data_skip": refused(
        "a resumed run continues the data exactly where it stopped (what makes it equal an uninterrupted one): " + DROP,
        False,
    ),
    "restore_callback_states_from_checkpoint": refused("there are no Trainer callbacks to restore: " + DROP, False),
    "full_determinism": refused(
        "torch's deterministic algorithms are not switched on (runs are seeded by --seed): " + DROP, False
    ),
    "hub_always_push": no_effect("one upload after the run (--push_to_hub): no push ever waits for another"),
    "hub_revision": refused("--push_to_hub uploads to the repo's main branch: " + DROP, "main"),
    # Trainer's script switches, not read by Trainer
    **dict.fromkeys(("do_train", "do_eval", "do_predict"), no_effect("not read by Trainer: what runs is the command")),
    "local_rank": no_effect("the launcher's LOCAL_RANK decides (torchrun sets it)"),
}


def finish(cfg: TrainConfig, state: dict[str, Any], spelled: dict[str, str]) -> None:
    """The names whose meaning depends on other flags, once all are read."""
    given = {key.removeprefix(STATE): value for key, value in state.items() if key.startswith(STATE)}
    if given.get("fsdp") and given.get("deepspeed"):
        raise ConfigError("--fsdp and --deepspeed are both given: they are two sharding strategies; drop one of them")
    if "data_seed" in given and not same(given["data_seed"], cfg.train.seed):
        raise ConfigError(
            f"--data_seed {text(given['data_seed'])}: the data order is seeded by --seed ({cfg.train.seed}), with "
            f"init and dropout: pass --seed {text(given['data_seed'])}, or drop --data_seed"
        )
    if given.get("logging_strategy") == "no" and cfg.logging.report_to:
        raise ConfigError(
            f"--logging_strategy no sends the trackers nothing, but --report_to {','.join(cfg.logging.report_to)} "
            "names some: drop one of the two"
        )
    if given.get("logging_first_step") and cfg.logging.report_to and cfg.logging.steps != 1:
        raise ConfigError(
            f"--logging_first_step: the trackers receive every --logging_steps ({cfg.logging.steps:g})th step row, "
            "not step 1 (metrics.jsonl has every step): pass --logging_steps 1, or drop the flag"
        )
