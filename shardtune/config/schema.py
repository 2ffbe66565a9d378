"""The training configuration's schema: typed dataclasses with llama-cookbook's names, their choices, and the
facts derived from them (effective batch size, trackers). Every field has a ``help`` string in its metadata;
``shardtune sft --help`` is generated from it.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass, field, is_dataclass
from typing import Any


class ConfigError(ValueError):
    """A user-facing configuration error: one line naming the value and the fix."""


def _f(default: Any, help: str, **kwargs: Any) -> Any:
    if isinstance(default, (list, dict)) or is_dataclass(default):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


DATASETS = ("synthetic_dialogues", "samsum_dataset", "alpaca_dataset", "custom_dataset", "grammar_dataset",
            "trl_dataset")
BATCHING_STRATEGIES = ("packing", "padding")
LR_SCHEDULERS = ("step", "cosine", "linear", "cosine_with_min_lr", "constant", "constant_with_warmup")
ATTN_IMPLEMENTATIONS = ("", "sdpa", "eager", "flash_attention_2")
OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit")


@dataclass
class SyntheticDialoguesConfig:
    num_train: int = _f(4000, "number of generated training dialogues")
    num_validation: int = _f(200, "number of generated validation dialogues")
    seed: int = _f(1234, "seed of the dialogue generator (independent of the training seed)")
    chatter: bool = _f(False, "mix off-topic talk into about half of the dialogues: 3 to 30 turns with a long tail "
                              "of long chats, like SAMSum (the summaries do not change)")
    messages: bool = _f(False, "write each dialogue as conversational `messages` (system, user: the dialogue, "
                               "assistant: the summary), rendered by the chat template with the --dataset_name "
                               "options (--assistant_only_loss ...)")


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


COMPLETION_ONLY_LOSS = ("auto", "true", "false")
TRUNCATION_MODES = ("keep_start", "keep_end")
_BOOL_SPELLINGS = {"True": "true", "False": "false", "TRUE": "true", "FALSE": "false"}


@dataclass
class TrlDatasetConfig:
    """TRL's SFT data flags, under TRL's names (--dataset_name selects this dataset); see docs/data-formats.md."""

    dataset_name: str = _f("", "a local JSON / JSONL / CSV / Parquet / Arrow file or folder of such files, or a hub "
                               "dataset id; its format (text, prompt-completion, messages, ShareGPT conversations, "
                               "input_ids) is recognised from its columns, as TRL does")
    dataset_config: str = _f("", "the dataset configuration (subset) name, for hub datasets that have several")
    dataset_train_split: str = _f("train", "split used for training")
    dataset_test_split: str = _f("test", "split used for evaluation; absent: no evaluation")
    dataset_text_field: str = _f("text", "column of language-modelling rows")
    completion_only_loss: str = _f("auto", "prompt-completion rows: loss on the completion only; auto: true for "
                                           "prompt-completion data (TRL's None)", choices=COMPLETION_ONLY_LOSS,
                                   spellings=_BOOL_SPELLINGS)
    assistant_only_loss: bool = _f(False, "conversational rows: loss on the assistant turns only, through the chat "
                                          "template's {% generation %} markers")
    chat_template_path: str = _f("", "a Jinja chat template file, or a tokenizer directory whose template to use")
    eos_token: str = _f("", "the token that ends a sequence / turn; empty: the tokenizer's")
    truncation_mode: str = _f("keep_start", "rows longer than --max_length (= --context_length) are cut: keep_start "
                                            "or keep_end", choices=TRUNCATION_MODES)


# TRL 1.16's per-pair losses, and sft (the NLL of the chosen completions, RPO's term; with others: --loss_weights)
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "discopop", "sigmoid_norm", "sft")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@dataclass
class DpoConfig:
    """TRL's DPO flags, under TRL's names (read by shardtune dpo); see docs/dpo.md."""

    beta: float = _f(0.1, "how far the policy may move from the reference (sigmoid, hinge, robust); ipo: the "
                          "regularisation parameter tau")
    loss_type: list[str] = _f(["sigmoid"], "the preference loss, or several summed with --loss_weights (TRL 1.16's "
                                           "names: sigmoid (DPO), ipo, hinge, robust, exo_pair, nca_pair, bco_pair, "
                                           "sppo_hard, apo_zero, apo_down, discopop, sigmoid_norm, sft)",
                              choices=DPO_LOSS_TYPES)
    loss_weights: list[float] = _f([], "one weight per --loss_type (default: 1 each)")
    label_smoothing: float = _f(0.0, "robust: the probability that a preference label is flipped, in [0, 0.5); "
                                     "exo_pair: the epsilon of its target distribution, in (0, 0.5)")
    f_divergence_type: str = _f("reverse_kl", "the divergence the log-ratios go through: reverse_kl (DPO), "
                                              "forward_kl, js_divergence, alpha_divergence", choices=F_DIVERGENCES)
    f_alpha_divergence_coef: float = _f(0.5, "alpha_divergence: its alpha")
    discopop_tau: float = _f(0.05, "discopop: the temperature of its mixing of the logistic and exponential losses")
    precompute_ref_log_probs: bool = _f(False, "one reference pass over the train and test pairs before training, "
                                               "kept with each pair; the reference model is then freed (full "
                                               "fine-tuning: no second copy in memory while training)")
    precompute_ref_batch_size: int = _f(0, "pairs per forward of the --precompute_ref_log_probs pass, per device "
                                           "(0: --batch_size_training)")


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
    fsdp_activation_checkpointing: bool = _f(False, "recompute each decoder layer's activations in backward (under "
                                                     "DDP and DeepSpeed too; TRL: --gradient_checkpointing)")
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
    use_rslora: bool = _f(False, "rank-stabilised LoRA: scale lora_alpha / sqrt(r) instead of lora_alpha / r")
    modules_to_save: list[str] = _f([], "modules trained in full and saved with the adapter (e.g. lm_head)")


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
    model_revision: str = _f("", "a revision (branch, tag or commit) of the hub id --model_name: its snapshot is "
                                 "fetched before launch (from the Hugging Face cache when offline) and every rank "
                                 "reads it; empty: the hub's main")
    tokenizer_name: str = _f("", "tokenizer directory or hub id; empty: same as model_name")
    trust_remote_code: bool = _f(False, "run the model's own Python code (the files its config.json's auto_map "
                                        "names) to load its config, tokenizer and model: it runs with your rights "
                                        "(docs/security.md); off: only architectures transformers ships")
    dataset: str = _f("synthetic_dialogues", "one of: " + ", ".join(DATASETS), choices=DATASETS)
    batch_size_training: int = _f(4, "micro-batch size per device (TRL: per_device_train_batch_size)")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step; effective batch = "
                                             "batch_size_training x data-parallel processes (processes / "
                                             "(sequence_parallel_size x context_parallel_size)) x "
                                             "gradient_accumulation_steps")
    num_epochs: int = _f(1, "passes over the training data")
    fractional_epochs: float = _f(0.0, "a fraction of epochs (TRL: --num_train_epochs 2.5): train ceil(N x optimizer "
                                       "steps per epoch) steps over --num_epochs = ceil(N) epochs' data order, the "
                                       "schedule ending there (as Trainer does); 0: whole --num_epochs")
    max_train_step: int = _f(0, "stop after this many OPTIMIZER steps (llama-cookbook counts micro-batches); 0: no limit")
    max_eval_step: int = _f(0, "evaluate on at most this many eval batches per rank; 0: all")
    lr: float = _f(1e-4, "peak learning rate (AdamW)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    gamma: float = _f(0.85, "StepLR decay applied once per epoch (lr_scheduler=step)")
    lr_scheduler: str = _f("step", "step (llama-cookbook: x gamma per epoch), linear (to 0), cosine (to 0), "
                                   "cosine_with_min_lr (to --min_lr_rate x lr), constant, constant_with_warmup; "
                                   "each after --warmup_steps (constant: none)", choices=LR_SCHEDULERS)
    warmup_steps: int = _f(0, "linear warm-up optimizer steps, under every scheduler but constant")
    # TRL's training settings (issue 21; shardtune/config/trl.py maps TRL's names onto them)
    warmup_ratio: float = _f(0.0, "warm-up as a fraction of the run's optimizer steps (rounded up); not with "
                                  "--warmup_steps")
    min_lr_rate: float = _f(0.0, "cosine_with_min_lr: the lr decays to this fraction of --lr")
    min_lr: float = _f(0.0, "cosine_with_min_lr: the lr decays to this value (instead of --min_lr_rate)")
    optim: str = _f("adamw_torch", "adamw_torch, adamw_torch_fused (torch's fused AdamW kernel), adamw_8bit or "
                                   "paged_adamw_8bit (bitsandbytes: moments in 8 bits, 1/4 of the state; DDP only; "
                                   "paged pages the state to CPU memory on CUDA); weight decay skips biases and "
                                   "norm weights", choices=OPTIMS)
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon")
    logging_steps: int = _f(1, "the trackers (--report_to) receive every Nth step row (eval rows: all); metrics.jsonl "
                               "keeps every step")
    logging_fraction: float = _f(0.0, "the trackers receive every ceil(F x the run's optimizer steps)th step row "
                                      "(TRL: --logging_steps 0.1); instead of --logging_steps")
    eval_steps: int = _f(0, "also evaluate every N optimizer steps (with run_validation); 0: at epoch ends only")
    eval_fraction: float = _f(0.0, "evaluate every ceil(F x the run's optimizer steps) steps (TRL: --eval_steps 0.25); "
                                   "not with --eval_steps")
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
    push_to_hub: bool = _f(False, "after the run, upload the published model (or adapter) folder to the Hugging "
                                  "Face Hub repo --hub_model_id (rank 0, through huggingface_hub); refused before "
                                  "launch when offline or without a token")
    hub_model_id: str = _f("", "the hub repo of --push_to_hub (user/name or name); empty: output_dir's folder name, "
                               "in your namespace (as Trainer)")
    hub_private_repo: bool = _f(False, "create the --push_to_hub repo private (an existing repo keeps its visibility)")
    hub_token: str = _f("", "the token of --push_to_hub; empty: huggingface_hub's (HF_TOKEN or hf auth login); "
                            "never written to config.yaml", secret=True)
    save_plots: bool = _f(True, "at the end of the run, write PNG charts of metrics.jsonl to output_dir/plots (what "
                                "shardtune plot draws)")
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
    attn_implementation: str = _f("", "attention kernel (TRL's name): sdpa, eager (the eager formula, softmax(q k^T) "
                                      "v, on every path, packed rows too), flash_attention_2 (CUDA with flash-attn "
                                      "installed); empty: shardtune's choice (SDPA; FlashAttention varlen for packed "
                                      "rows on CUDA; eager where the model needs it)", choices=ATTN_IMPLEMENTATIONS)
    compile: bool = _f(False, "torch.compile each decoder layer (first steps are slower while it compiles)")
    save_steps: int = _f(0, "write a sharded checkpoint to output_dir/checkpoints/ every N optimizer steps, at each "
                            "epoch end and after the last step; 0: none, unless --checkpoint_type is set (then at "
                            "epoch ends and after the last step)")
    save_fraction: float = _f(0.0, "checkpoint every ceil(F x the run's optimizer steps) steps (TRL: --save_steps "
                                   "0.25); not with --save_steps")
    save_total_limit: int = _f(0, "keep the last K checkpoints (and, with --load_best_model_at_end, the best); 0: "
                                  "keep all")
    load_best_model_at_end: bool = _f(False, "publish the model of the checkpoint with the best evaluation "
                                             "(--metric_for_best_model) instead of the last step's; needs "
                                             "evaluation at every checkpoint (checkpoint steps a multiple of "
                                             "--eval_steps, or epoch ends)")
    metric_for_best_model: str = _f("eval_loss", "the eval row's metric that --load_best_model_at_end compares "
                                                 "(eval_loss, eval_ppl, eval_rouge1, ...; the eval_ prefix may be "
                                                 "left out)")
    greater_is_better: str = _f("auto", "true / false: whether a higher --metric_for_best_model is better; auto: "
                                        "lower for a name ending in loss or ppl, else higher (as Trainer)",
                                choices=("auto", "true", "false"))
    resume: str = _f("", "latest (newest complete checkpoint of output_dir), a checkpoint folder, or another run's "
                         "output dir: continue exactly where it stopped (any number of processes); auto: latest if "
                         "output_dir has a checkpoint, else start (for jobs that requeue themselves); a worker group "
                         "restarted by torchrun (--max_restarts) resumes from latest by itself")
    nan_policy: str = _f("stop", "on a non-finite (NaN/Inf) loss or gradient norm on any rank: stop (before the "
                                 "optimizer step; the last checkpoint stays latest) or skip (no weight or optimizer "
                                 "update; the step still counts: its data is used up and the LR schedule advances)",
                         choices=NAN_POLICIES)

    # llama-cookbook train_config flags (shardtune/model/cookbook.py gives them the cookbook's meaning)
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

    # long sequences: memory levers (issue 10, shardtune.model.longseq)
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
                                "extra: pip install 'shardtune[tensorboard]'); several: comma-separated")
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
    trl_dataset: TrlDatasetConfig = _f(TrlDatasetConfig(), "TRL's dataset flags (--dataset_name ...)")
    dpo: DpoConfig = _f(DpoConfig(), "TRL's DPO flags (--beta, --loss_type, --label_smoothing): shardtune dpo")
    fsdp_config: FsdpConfig = _f(FsdpConfig(), "FSDP settings")
    deepspeed_config: DeepSpeedConfig = _f(DeepSpeedConfig(), "DeepSpeed ZeRO settings")
    lora_config: LoraConfig = _f(LoraConfig(), "LoRA settings")
    llama_adapter_config: LlamaAdapterConfig = _f(LlamaAdapterConfig(), "llama-adapter settings")
    prefix_config: PrefixConfig = _f(PrefixConfig(), "prefix tuning settings")
    quantization_config: QuantizationConfig = _f(QuantizationConfig(), "4-bit quantisation settings")

    @property
    def dataset_config(self) -> Any:
        return getattr(self, self.dataset)


def effective_batch_size(cfg: TrainConfig, dp_size: int) -> int:
    """Examples (or packed blocks) per optimizer step: per-device batch x data-parallel processes (the world size
    without sequence / context parallelism; shardtune.parallel.dims) x accumulation steps."""
    return cfg.batch_size_training * dp_size * cfg.gradient_accumulation_steps


# Trackers: --report_to name -> (module to import, the optional extra that installs it)
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "trackio": ("trackio", "trackio")}
PROFILER_SCHEDULE = {"wait": 1, "warmup": 2, "active": 3}  # llama-cookbook's torch.profiler schedule


def trackers(cfg: TrainConfig) -> list[str]:
    """The trackers a run reports to: --report_to (all: every one) plus --use_wandb."""
    given = [n.strip() for n in cfg.report_to.split(",") if n.strip()]
    for name in given:
        if name not in REPORT_TO:
            close = difflib.get_close_matches(name, REPORT_TO, n=1)
            raise ConfigError(f"--report_to {name!r} is not valid: " + (f"did you mean {close[0]}?" if close else
                                                                        "choose from " + ", ".join(REPORT_TO)))
    names = list(TRACKER_PACKAGES) if "all" in given else [n for n in given if n != "none"]
    if cfg.use_wandb and "wandb" not in names:
        names.append("wandb")
    return names
