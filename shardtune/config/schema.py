"""The canonical training configuration: one typed field per knob, grouped by the component that owns it (model,
data, optim, train, parallel, checkpoint, eval, logging, peft, output, run, and each objective's own section).

Every field declares, in its metadata, what ``--help`` says (``help``), its choices and range (checked before
launch by shardtune.config.checks), and what it affects, from which the lists that decide what a setting means are
derived instead of kept by hand:

- ``affects``: ``"training"`` (the trained numbers; the default), ``"optimizer"`` (a hyperparameter a resumed run
  applies to the restored optimizer), or ``"run"`` (run control: where, when and how things are written, how the
  state is sharded and the rows split; a resumed run may change it without changing what is trained);
- ``data_cache``: part of the tokenised-data cache's key (shardtune.data.cache);
- ``reference``: part of the key of DPO's precomputed reference log-probabilities.

Fields are declared with shardtune.config.setting; the data, adapter, output, DPO and GRPO groups live in
data_settings, peft_settings, output_settings, dpo_settings and grpo_settings, gathered here: a group's class is
imported from this module, its other names (choices, tables) from the group's own module.

Other tools' spellings (llama-cookbook's, TRL's, Accelerate's, DeepSpeed's) are dialects, translated into these
fields at the edge (shardtune.config.dialects, shardtune.config.flags); nothing here knows them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# the groups declared in their own modules; the few other names re-exported are those other modules import from here
from shardtune.config.data_settings import DataSettings, SamsumDatasetConfig, TrlDatasetConfig  # noqa: F401
from shardtune.config.dpo_settings import DpoConfig
from shardtune.config.grpo_settings import GRPO_LOSS_TYPES, GRPO_LOSS_TYPES_NOT_BUILT, GrpoConfig  # noqa: F401
from shardtune.config.kto_settings import KtoConfig
from shardtune.config.objectives import OBJECTIVES
from shardtune.config.output_settings import PREVIOUS_FOLDER, OutputSettings  # noqa: F401
from shardtune.config.peft_settings import PeftSettings
from shardtune.config.reward_settings import RewardModelConfig
from shardtune.config.rloo_settings import RlooConfig
from shardtune.config.setting import (  # noqa: F401 (re-exported: what every floor imports from here)
    CACHE,
    OPTIMIZER,
    REFERENCE,
    RUN,
    ConfigError,
    interval_steps,
    setting,
)

# -- model ---------------------------------------------------------------------------------------------------------

ATTN_IMPLEMENTATIONS = ("", "sdpa", "eager", "flash_attention_2")
QUANTIZATIONS = ("", "4bit", "8bit")
ROPE_SCALINGS = ("", "yarn")


@dataclass
class ModelSettings:
    name: str = setting(
        "",
        "local Hugging Face directory, hub id, or preset:NAME (tiny, demo); empty: the demo "
        "preset, built once and cached",
        reference=True,
    )
    revision: str = setting(
        "",
        "a revision (branch, tag or commit) of the hub id model.name: its snapshot is fetched "
        "before launch (from the Hugging Face cache when offline) and every rank reads it; "
        "empty: the hub's main",
    )
    tokenizer: str = setting("", "tokenizer directory or hub id; empty: the model's")
    trust_remote_code: bool = setting(
        False,
        "run the model's own Python code (the files its config.json's auto_map "
        "names) to load its config, tokenizer and model: it runs with your "
        "rights (docs/security.md); off: only architectures transformers ships",
    )
    attn_implementation: str = setting(
        "",
        "attention kernel: sdpa, eager (the eager formula, softmax(q k^T) v, on "
        "every path, packed rows too), flash_attention_2 (CUDA with flash-attn "
        "installed); empty: shardtune's choice (SDPA; FlashAttention varlen for "
        "packed rows on CUDA; eager where the model needs it)",
        choices=ATTN_IMPLEMENTATIONS,
        **REFERENCE,
    )
    fast_kernels: bool = setting(
        False,
        "fastest attention / fused kernels the install supports: flash-attention 2 "
        "(if installed, CUDA), else SDPA; liger-kernel fused RMSNorm / SwiGLU / RoPE on "
        "CUDA (pip install 'shardtune[fast]')",
        **REFERENCE,
    )
    compile: bool = setting(False, "torch.compile each decoder layer (first steps are slower while it compiles)")
    rope_scaling: str = setting(
        "",
        "yarn: YaRN RoPE scaling by rope_factor, set in the model config before the model "
        "is built (a model trained at N tokens fine-tunes at N x factor); empty: the "
        "model's own",
        choices=ROPE_SCALINGS,
        **REFERENCE,
    )
    rope_factor: float = setting(
        1.0, "context extension factor of rope_scaling (> 1): max_position_embeddings grows by it", above=0, **REFERENCE
    )
    quantization: str = setting(
        "",
        "frozen base weights in 4bit (QLoRA, bitsandbytes) or 8bit (not with FSDP); empty: none",
        choices=QUANTIZATIONS,
        **REFERENCE,
    )
    quant_type: str = setting("nf4", "4-bit data type: nf4 or fp4", choices=("nf4", "fp4"), **REFERENCE)
    double_quant: bool = setting(True, "4-bit: quantise the quantisation constants too", **REFERENCE)
    quant_compute_dtype: str = setting("", "matmul dtype of 4-bit layers; empty: bf16 on GPU, fp32 on CPU", **REFERENCE)
    freeze_layers: int = setting(
        0,
        "full fine-tuning: freeze the first N decoder layers, counted from the embeddings "
        "(llama-cookbook's freeze_transformer_layers); 0: none",
        at_least=0,
    )
    freeze_vision_tower: bool = setting(
        False,
        "vision-language models, full fine-tuning: the vision tower keeps its weights (LLaMA-Factory's name)",
    )
    freeze_multi_modal_projector: bool = setting(
        False,
        "vision-language models, full fine-tuning: the projector from the tower into the language model keeps its "
        "weights (LLaMA-Factory's name)",
    )
    freeze_language_model: bool = setting(
        False,
        "vision-language models, full fine-tuning: the language model (decoder and output head) keeps its weights "
        "(LLaMA-Factory's name)",
    )
    freeze_llm_only: bool = setting(
        False,
        "vision-language models, full fine-tuning: the language model keeps its weights except mllama's "
        "cross-attention layers; the tower and projector train (llama-cookbook's freeze_LLM_only)",
    )


# -- optimizer and schedule ----------------------------------------------------------------------------------------

LR_SCHEDULERS = ("step", "cosine", "linear", "cosine_with_min_lr", "constant", "constant_with_warmup")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit")


@dataclass
class OptimSettings:
    lr: float = setting(1e-4, "peak learning rate (AdamW)", above=0, **OPTIMIZER)
    weight_decay: float = setting(0.0, "AdamW weight decay (not on biases and norm weights)", at_least=0, **OPTIMIZER)
    optimizer: str = setting(
        "adamw_torch",
        "adamw_torch, adamw_torch_fused (torch's fused AdamW kernel), adamw_8bit "
        "or paged_adamw_8bit (bitsandbytes: moments in 8 bits, 1/4 of the state; "
        "DDP only; paged pages the state to CPU memory on CUDA)",
        choices=OPTIMIZERS,
    )
    adam_beta1: float = setting(0.9, "AdamW beta1", at_least=0, below=1, **OPTIMIZER)
    adam_beta2: float = setting(0.999, "AdamW beta2", at_least=0, below=1, **OPTIMIZER)
    adam_epsilon: float = setting(1e-8, "AdamW epsilon", above=0, **OPTIMIZER)
    lr_scheduler: str = setting(
        "step",
        "step (llama-cookbook: x gamma per epoch), linear (to 0), cosine (to 0), "
        "cosine_with_min_lr (to min_lr_rate x lr), constant, constant_with_warmup; "
        "each after warmup_steps (constant: none)",
        choices=LR_SCHEDULERS,
    )
    gamma: float = setting(
        0.85, "StepLR decay applied once per epoch (lr_scheduler step), in (0, 1]", above=0, at_most=1
    )
    warmup_steps: float = setting(
        0.0,
        "linear warm-up, under every scheduler but constant: N optimizer steps, or a "
        "fraction in (0, 1) of the run's (rounded up)",
        interval=True,
    )
    min_lr_rate: float = setting(0.0, "cosine_with_min_lr: the lr decays to this fraction of lr", at_least=0, below=1)
    min_lr: float = setting(0.0, "cosine_with_min_lr: the lr decays to this value (instead of min_lr_rate)", at_least=0)
    max_grad_norm: float | None = setting(
        None, "clip the global gradient norm at this value; none: no clipping", above=0
    )


# -- the steps of a run --------------------------------------------------------------------------------------------

NAN_POLICIES = ("stop", "skip")
PRECISIONS = ("auto", "fp32", "fp16", "pure_bf16")


@dataclass
class TrainSettings:
    batch_size: int = setting(
        4,
        "micro-batch size per device (TRL: per_device_train_batch_size; llama-cookbook: batch_size_training)",
        at_least=1,
        **RUN,
    )
    gradient_accumulation_steps: int = setting(
        1,
        "micro-batches per optimizer step; effective batch = batch_size x "
        "data-parallel processes (processes / (sequence_parallel_size x "
        "context_parallel_size)) x gradient_accumulation_steps",
        at_least=1,
        **RUN,
    )
    num_epochs: float = setting(
        1.0,
        "passes over the training data; a fraction (2.5) trains ceil(N x optimizer steps "
        "per epoch) steps over ceil(N) epochs' data order, the schedule ending there (as "
        "Trainer does)",
        above=0,
    )
    max_steps: int = setting(
        0,
        "train exactly this many optimizer steps, passing over the data as often as they need (overrides "
        "num_epochs, as TRL's --max_steps); 0: num_epochs decides",
        at_least=0,
    )
    stop_after_steps: int = setting(
        0,
        "stop after this many optimizer steps if the epochs have not ended before (llama-cookbook's "
        "max_train_step, counted in optimizer steps); 0: none",
        at_least=0,
        **RUN,
    )
    seed: int = setting(42, "seed of model init, data order and dropout", **CACHE)
    precision: str = setting(
        "auto",
        "auto (bf16 compute where the device supports it fast, CUDA; fp32 on CPU), fp32, "
        "fp16 (with a gradient scaler, for CUDA GPUs without bf16) or pure_bf16 (FSDP: "
        "parameters, gradients and optimizer state in bf16)",
        choices=PRECISIONS,
        **REFERENCE,
    )
    nan_policy: str = setting(
        "stop",
        "on a non-finite (NaN/Inf) loss or gradient norm on any rank: stop (before the "
        "optimizer step; the last checkpoint stays latest) or skip (no weight or "
        "optimizer update; the step still counts: its data is used up and the LR "
        "schedule advances)",
        choices=NAN_POLICIES,
        **RUN,
    )


# -- parallelism and memory ----------------------------------------------------------------------------------------

STRATEGIES = ("ddp", "fsdp", "deepspeed")
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


@dataclass
class ParallelSettings:
    strategy: str = setting(
        "ddp",
        "ddp (a whole model per process), fsdp (PyTorch FSDP2, fully_shard) or deepspeed "
        "(ZeRO stage zero_stage; pip install 'shardtune[deepspeed]')",
        choices=STRATEGIES,
        **RUN,
    )
    sharding_strategy: str = setting(
        "FULL_SHARD",
        "fsdp: FULL_SHARD (params, grads, optimizer state sharded), "
        "SHARD_GRAD_OP (params kept after forward), NO_SHARD (like DDP), "
        "HYBRID_SHARD (shard within a group, replicate across groups)",
        choices=SHARDING_STRATEGIES,
        **RUN,
    )
    sharding_group_size: int = setting(
        0, "HYBRID_SHARD: ranks that shard one replica; 0: the processes of one node", at_least=0, **RUN
    )
    replica_group_size: int = setting(
        0, "HYBRID_SHARD: number of replicas; 0: world size / sharding_group_size", at_least=0, **RUN
    )
    cpu_offload: bool = setting(
        False, "fsdp: keep sharded parameters, gradients and optimizer state in CPU memory", **RUN
    )
    low_cpu_fsdp: bool = setting(
        False, "fsdp: only global rank 0 reads the weights; the others build on the meta device", **RUN
    )
    zero_stage: int = setting(
        2,
        "deepspeed: ZeRO stage 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters)",
        choices=(1, 2, 3),
        **RUN,
    )
    offload_optimizer: bool = setting(
        False, "deepspeed: keep the optimizer state (and its step) in CPU memory (ZeRO-Offload)", **RUN
    )
    offload_param: bool = setting(False, "deepspeed: keep the sharded parameters in CPU memory (ZeRO-3 only)", **RUN)
    deepspeed_config_file: str = setting(
        "",
        "deepspeed: a DeepSpeed JSON config merged over the one built from these "
        "settings (e.g. a TRL / HF Trainer ds_config.json); batch sizes and "
        'accumulation must agree with ours or be "auto"',
    )
    activation_checkpointing: bool = setting(
        False,
        "recompute each decoder layer's activations in backward (every strategy; TRL: --gradient_checkpointing)",
        **RUN,
    )
    activation_offloading: bool = setting(
        False,
        "keep the activations saved for backward (with activation "
        "checkpointing: each checkpointed layer's input) in pinned CPU memory "
        "until backward (CUDA; on CPU they are in CPU memory anyway); same "
        "results",
        **RUN,
    )
    tiled_mlp: bool = setting(
        False,
        "run each decoder layer's MLP over sequence tiles of hidden_size tokens, "
        "recomputed in backward (ALST): its (sequence x intermediate) activations never "
        "exist for the whole sequence; same results",
        **RUN,
    )
    sequence_parallel_size: int = setting(
        1,
        "Ulysses sequence parallelism: each row of a micro-batch is split over "
        "this many processes, which swap sequence slices for attention heads "
        "around attention (must divide the attention heads); these processes "
        "share their micro-batches, so they count once in the effective batch",
        at_least=1,
        **RUN,
    )
    context_parallel_size: int = setting(
        1,
        "ring attention: each row is split over this many processes "
        "(load-balanced causal chunks), K/V rotate around the ring; no head "
        "limit; these processes share their micro-batches, so they count once in "
        "the effective batch",
        at_least=1,
        **RUN,
    )
    one_gpu: bool = setting(
        False, "train in one process (llama-cookbook's single-GPU run); refused with more processes", **RUN
    )
    dist_timeout: int = setting(
        1800,
        "seconds a collective (all-reduce, barrier, checkpoint exchange) waits for the "
        "other ranks before the job fails with a timeout error instead of hanging",
        above=0,
        **RUN,
    )


# -- checkpoints ---------------------------------------------------------------------------------------------------

CHECKPOINT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


@dataclass
class CheckpointSettings:
    save_steps: float = setting(
        0.0,
        "write a sharded checkpoint to output.dir/checkpoints/ every N optimizer steps (a "
        "fraction in (0, 1): of the run's steps) and after the last step (as Trainer); 0: none, unless "
        "checkpoint_type is set (then at epoch ends and after the last step)",
        interval=True,
        **RUN,
    )
    save_total_limit: int = setting(
        0, "keep the last K checkpoints (and, with load_best_model_at_end, the best); 0: keep all", at_least=0, **RUN
    )
    save_optimizer: bool = setting(
        True,
        "checkpoints hold the optimizer state (resuming needs it); false: the model "
        "only (smaller; such a checkpoint exports but does not resume)",
        **RUN,
    )
    checkpoint_type: str = setting(
        "",
        "SHARDED_STATE_DICT (each rank writes its shard) or FULL_STATE_DICT (also a "
        "gathered HF model in the checkpoint); setting it turns checkpoints on (at "
        "epoch ends); empty: SHARDED_STATE_DICT when save_steps > 0, else no "
        "checkpoints",
        choices=("", *CHECKPOINT_TYPES),
        **RUN,
    )
    resume: str = setting(
        "",
        "latest (newest complete checkpoint of output.dir), a checkpoint folder, or another "
        "run's output dir: continue exactly where it stopped (any number of processes); auto: "
        "latest if output.dir has a checkpoint, else start (for jobs that requeue themselves); a "
        "worker group restarted by torchrun (--max_restarts) resumes from latest by itself",
        **RUN,
    )
    dist_checkpoint_root_folder: str = setting(
        "",
        "write checkpoints to <root>/<dist_checkpoint_folder>-<model name> "
        "(llama-cookbook's FSDP layout; turns on epoch-end checkpoints) "
        "instead of output.dir/checkpoints; shardtune export reads it",
        **RUN,
    )
    dist_checkpoint_folder: str = setting("fine-tuned", "see dist_checkpoint_root_folder", **RUN)


# -- evaluation ----------------------------------------------------------------------------------------------------


@dataclass
class EvalSettings:
    enabled: bool = setting(True, "evaluate at the end of each epoch (and every eval.steps)", **RUN)
    steps: float = setting(
        0.0,
        "also evaluate every N optimizer steps (a fraction in (0, 1): of the run's steps); 0: at epoch ends only",
        interval=True,
        **RUN,
    )
    at_epoch_ends: bool = setting(
        True,
        "evaluate at the end of each epoch too; false (TRL's --eval_strategy steps): only every eval.steps, as "
        "Trainer does (the run's last step included only when it falls on that interval)",
        **RUN,
    )
    on_start: bool = setting(
        False,
        "also evaluate the model before the first step of a run (a metrics row at step "
        "0: the baseline; a resumed run has it already)",
        needs="eval.enabled",
        **RUN,
    )
    only: bool = setting(
        False,
        "evaluate the model once on the test split, as a run's evaluations do (every rank, exact across layouts), "
        "and stop: no training step, nothing written but metrics.jsonl's row (trainer.evaluate())",
        needs="eval.enabled",
        **RUN,
    )
    batch_size: int = setting(1, "eval micro-batch size per device", at_least=1, **RUN)
    max_batches: int = setting(0, "evaluate on at most this many eval batches per rank; 0: all", at_least=0, **RUN)
    log_samples: int = setting(
        0,
        "at each evaluation, write N greedy generated answers with their references to "
        "output.dir/eval_samples.jsonl (and to the tracker); 0: none",
        at_least=0,
        **RUN,
    )
    load_best_model_at_end: bool = setting(
        False,
        "publish the model of the checkpoint with the best evaluation "
        "(metric_for_best_model) instead of the last step's; needs an "
        "evaluation at every checkpoint (checkpoint steps a multiple of "
        "eval.steps, or epoch ends)",
        **RUN,
    )
    metric_for_best_model: str = setting(
        "eval_loss",
        "the eval row's metric that load_best_model_at_end compares "
        "(eval_loss, eval_ppl, eval_rouge1, ...; the eval_ prefix may "
        "be left out)",
        **RUN,
    )
    greater_is_better: bool | None = setting(
        None,
        "whether a higher metric_for_best_model is better; none: lower for "
        "a name ending in loss or ppl, else higher (as Trainer)",
        **RUN,
    )


# -- logging, observability ----------------------------------------------------------------------------------------

REPORT_TO = ("tensorboard", "wandb", "trackio")


@dataclass
class WandbConfig:
    project: str = setting("shardtune", "W&B project", **RUN)
    entity: str = setting("", "W&B team or user; empty: your default entity", **RUN)
    job_type: str = setting("", "W&B job type (e.g. train)", **RUN)
    tags: list[str] = setting([], "W&B tags", **RUN)
    group: str = setting("", "W&B group, to see related runs together", **RUN)
    notes: str = setting("", "W&B notes: a longer description of the run", **RUN)
    mode: str = setting(
        "",
        "online, offline or disabled; empty: online when api.wandb.ai answers and you are logged "
        "in, else offline (sync later with wandb sync)",
        choices=("", "online", "offline", "disabled"),
        **RUN,
    )


@dataclass
class LoggingSettings:
    report_to: list[str] = setting(
        [],
        "where rank 0 also sends the metrics.jsonl rows: tensorboard (event files in "
        "output.dir/tensorboard), wandb, trackio (each an optional extra: pip install "
        "'shardtune[tensorboard]'); empty: none",
        choices=REPORT_TO,
        **RUN,
    )
    steps: float = setting(
        1.0,
        "the trackers (report_to) receive every Nth step row (a fraction in (0, 1): every "
        "ceil(F x the run's steps)th; eval rows: all); metrics.jsonl keeps every step",
        interval=True,
        above=0,
        **RUN,
    )
    wandb: WandbConfig = setting(WandbConfig(), "Weights & Biases settings")
    profiler: bool = setting(
        False,
        "torch.profiler traces per rank in profiler_dir: steps 4-6 after 1 wait and 2 "
        "warm-up steps (llama-cookbook's schedule); open in TensorBoard or "
        "ui.perfetto.dev",
        **RUN,
    )
    profiler_dir: str = setting("", "where the profiler traces go; empty: output.dir/profiler", **RUN)
    flop_counter: bool = setting(
        False,
        "measure the FLOPs of one optimizer step with torch's FlopCounterMode and "
        "print them next to the analytic count (not with the profiler)",
        **RUN,
    )
    flop_counter_start: int = setting(
        3, "warm-up optimizer steps before the measured one (the measured step is the next one)", at_least=0, **RUN
    )
    save_metrics: bool = setting(True, "write metrics.jsonl to output.dir", **RUN)
    save_plots: bool = setting(
        True,
        "at the end of the run, write PNG charts of metrics.jsonl to output.dir/plots (what shardtune plot draws)",
        **RUN,
    )


# -- the run itself (the output group: output_settings) ----------------------------------------------------------------


DEFAULTS = ("", "cookbook", "trl")


@dataclass
class RunSettings:
    defaults: str = setting(
        "",
        "whose defaults the settings not given take: trl (TRL 1.16's SFTConfig / DPOConfig / ModelConfig: lr "
        "2e-5 (DPO 1e-6), linear, max_grad_norm 1, 3 epochs, batch 8, padding, a checkpoint every 500 steps, "
        "gradient checkpointing, LoRA r 16 / alpha 32) or cookbook (llama-cookbook's: the values --help shows); "
        "empty: the names used decide (docs/flags.md), else sft's are the cookbook's and dpo's TRL's",
        choices=DEFAULTS,
        **RUN,
    )
    debug: bool = setting(False, "print tracebacks with errors, and where the start-up time went", **RUN)
    dry_run: bool = setting(
        False,
        "build the model on the meta device, resolve the mesh for the world size (no GPU, "
        "no process started, no weights or data read, nothing written), print the "
        "per-rank shard sizes and the plan (shardtune plan; its --gpu / --gpu_memory / "
        "--gpus_per_node flags too), and exit",
        **RUN,
    )


# -- the whole ----------------------------------------------------------------------------------------------------


@dataclass
class Provenance:
    """How a config's settings were given, for messages and the start log: not settings (no flag sets them,
    config.yaml does not hold them, two configs compare without them)."""

    spelled: dict[str, str] = field(default_factory=dict)  # canonical key -> the flag name that set it, as given
    defaults_reason: str = ""  # why the defaults are whose they are ("--learning_rate is TRL's"); "": not said


@dataclass
class TrainConfig:
    objective: str = setting(
        "sft",
        "what is trained: " + ", ".join(OBJECTIVES) + " (set by the command: shardtune "
        "sft, shardtune dpo, shardtune grpo), or a plug-in's Registration as module:attribute "
        "(shardtune.config.objectives)",
        **REFERENCE,
    )
    model: ModelSettings = setting(ModelSettings(), "the model and how it is loaded")
    data: DataSettings = setting(DataSettings(), "the data and how it is batched")
    optim: OptimSettings = setting(OptimSettings(), "the optimizer and the learning-rate schedule")
    train: TrainSettings = setting(TrainSettings(), "the steps of the run")
    parallel: ParallelSettings = setting(ParallelSettings(), "sharding, sequence splits and memory levers")
    checkpoint: CheckpointSettings = setting(CheckpointSettings(), "checkpoints and resuming")
    eval: EvalSettings = setting(EvalSettings(), "evaluation")
    logging: LoggingSettings = setting(LoggingSettings(), "metrics, trackers, profiles")
    peft: PeftSettings = setting(PeftSettings(), "adapters")
    output: OutputSettings = setting(OutputSettings(), "what the run writes and uploads")
    run: RunSettings = setting(RunSettings(), "how the command runs")
    dpo: DpoConfig = setting(DpoConfig(), "TRL's DPO settings (--beta, --loss_type, ...): shardtune dpo")
    grpo: GrpoConfig = setting(GrpoConfig(), "TRL's GRPO settings (--reward_funcs, --num_generations ...)")
    reward: RewardModelConfig = setting(
        RewardModelConfig(), "TRL's reward-model settings (--center_rewards_coefficient): shardtune reward"
    )
    rloo: RlooConfig = setting(
        RlooConfig(), "TRL's RLOO-only settings (--normalize_advantages, --reward_clip_range): shardtune rloo"
    )
    kto: KtoConfig = setting(
        KtoConfig(), "TRL's KTO-only settings (--desirable_weight, --undesirable_weight): shardtune kto"
    )
    provenance: Provenance = field(default_factory=Provenance, compare=False, repr=False, metadata={"setting": False})


def effective_batch_size(cfg: TrainConfig, dp_size: int) -> int:
    """Examples (or packed blocks) per optimizer step: per-device batch x data-parallel processes (the world size
    without sequence / context parallelism; shardtune.parallel.dims) x accumulation steps."""
    return cfg.train.batch_size * dp_size * cfg.train.gradient_accumulation_steps


# Trackers: --report_to name -> (module to import, the optional extra that installs it)
TRACKER_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
}
PROFILER_SCHEDULE = {"wait": 1, "warmup": 2, "active": 3}  # llama-cookbook's torch.profiler schedule
