"""Memory and speed of a training configuration per GPU, from the model's config.json alone (``shardtune plan``).

Nothing is loaded or downloaded: the parameter counts come from the architecture's shapes (checked against real
models in tests/unit/test_planner.py), the training state from the formulas of shardtune.memory, and the
activations from the tensors a decoder layer saves for backward, counted tensor by tensor (see
``layer_activation_bytes``) and validated against the measured peak of live tensor bytes on this machine
(``python -m bench.plan_check``). What the planner calls *peak* is the peak of live tensor bytes, what
``torch.cuda.max_memory_allocated`` reports; a GPU also holds its CUDA context and allocator slack, which
``usable_bytes`` reserves.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from shardtune.config import ConfigError, TrainConfig
from shardtune.memory import ADAM_STATES_PER_PARAM, GIB

# -- architectures ---------------------------------------------------------------------------------------------------

_LLAMA3 = dict(model_type="llama", vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=False,
               max_position_embeddings=131072)
BUILTIN_SHAPES: dict[str, dict] = {
    "llama3.2-1b": dict(_LLAMA3, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, intermediate_size=8192, tie_word_embeddings=True),
    "llama3.2-3b": dict(_LLAMA3, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                        num_key_value_heads=8, intermediate_size=8192, tie_word_embeddings=True),
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336),
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, intermediate_size=28672),
    "llama3.1-405b": dict(_LLAMA3, hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
                          num_key_value_heads=8, intermediate_size=53248),
}
# the hub ids a recommended command line names for the built-in shapes
HUB_IDS = {"llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct", "llama3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
           "llama3-8b": "meta-llama/Llama-3.1-8B-Instruct", "llama3-70b": "meta-llama/Llama-3.1-70B-Instruct",
           "llama3.1-405b": "meta-llama/Llama-3.1-405B-Instruct"}
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Arch:
    """The shapes of a decoder-only transformer that memory and FLOPs depend on."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    sliding_window: int | None = None

    @classmethod
    def from_config(cls, config: dict, name: str = "") -> Arch:
        text = config.get("text_config") or config
        heads = text["num_attention_heads"]
        hidden = text["hidden_size"]
        return cls(name=name or text.get("_name_or_path", "") or text.get("model_type", "model"),
                   model_type=text.get("model_type", "llama"), vocab_size=text["vocab_size"], hidden_size=hidden,
                   num_layers=text["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=text.get("num_key_value_heads") or heads,
                   head_dim=text.get("head_dim") or hidden // heads, intermediate_size=text["intermediate_size"],
                   tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
                   attention_bias=bool(text.get("attention_bias", text.get("model_type") == "qwen2")),
                   sliding_window=text.get("sliding_window") if text.get("use_sliding_window", True) else None)

    # shapes (in, out) of each linear layer of one decoder layer
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        d, q, kv, f = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, f),
                "up_proj": (d, f), "down_proj": (f, d)}

    @property
    def layer_linear_params(self) -> int:
        return sum(i * o for i, o in self.linear_shapes().values())

    @property
    def layer_params(self) -> int:
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
        return self.layer_linear_params + bias + 2 * self.hidden_size  # + two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embedding, final norm, and the head when untied."""
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.embedding_params + self.hidden_size + head

    @property
    def num_params(self) -> int:
        return self.root_params + self.num_layers * self.layer_params


def read_arch(model: str) -> Arch:
    """A built-in shape name, a preset (preset:tiny), a local directory or config.json, or a hub id (its config
    only, when online)."""
    if model in BUILTIN_SHAPES:
        return Arch.from_config(BUILTIN_SHAPES[model], model)
    if model.startswith("preset:") or not model:
        from shardtune.models import PRESETS, TOKENIZER_VOCAB_SIZE

        name = model.removeprefix("preset:") or "demo"
        if name not in PRESETS:
            raise ConfigError(f"--model_name {model}: unknown preset: choose one of "
                              + ", ".join(f"preset:{p}" for p in PRESETS))
        return Arch.from_config({"vocab_size": TOKENIZER_VOCAB_SIZE, "model_type": "llama", **PRESETS[name]}, model)
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return Arch.from_config(json.loads(path.read_text()), str(model))
    if path.parent != Path(".") and not path.parent.exists() or model.startswith(("/", ".", "~")):
        raise ConfigError(f"--model_name {model}: no such directory or config.json: pass a model directory, a "
                          "hub id, or a built-in shape: " + ", ".join(BUILTIN_SHAPES))
    try:
        from transformers import AutoConfig

        return Arch.from_config(AutoConfig.from_pretrained(model).to_dict(), model)
    except Exception as e:  # offline, unknown repo, gated: the same fix for the user
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"--model_name {model}: not a local directory and its config could not be read from the "
                          f"hub ({reason}): pass a local directory with config.json or a built-in shape: "
                          + ", ".join(BUILTIN_SHAPES)) from None


# -- what is trained ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Adapter:
    """The trainable part: everything (method ""), or a PEFT adapter."""

    method: str = ""                      # "", lora, llama_adapter, prefix
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    lora_dropout: float = 0.05
    adapter_len: int = 10
    adapter_layers: int = 30
    num_virtual_tokens: int = 30

    def trainable_params(self, arch: Arch) -> int:
        if not self.method:
            return arch.num_params
        if self.method == "lora":
            shapes = arch.linear_shapes()
            per_layer = sum(self.lora_r * (shapes[t][0] + shapes[t][1]) for t in self.lora_targets if t in shapes)
            return arch.num_layers * per_layer
        if self.method == "llama_adapter":
            return min(self.adapter_layers, arch.num_layers) * (self.adapter_len * arch.hidden_size + 1)
        # prefix: a key and a value per layer and virtual token, at the key-value width (GQA)
        return self.num_virtual_tokens * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim


# -- hardware --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    """Peak rates the estimate assumes (data-sheet dense bf16 matmul; usable link bandwidths)."""

    name: str
    memory_bytes: float
    matmul_flops: float          # per second, dense, in the compute dtype
    intra_node_bytes_s: float    # per GPU, achievable collective bus bandwidth inside a node
    inter_node_bytes_s: float    # per GPU, across nodes
    compute_bytes: int = 2       # bf16

    def describe(self) -> str:
        return (f"{self.name}: {self.memory_bytes / GIB:.0f} GiB, {self.matmul_flops / 1e12:.0f} TFLOP/s dense "
                f"{'bf16' if self.compute_bytes == 2 else 'fp32'}, {self.intra_node_bytes_s / 1e9:.0f} GB/s in a "
                f"node, {self.inter_node_bytes_s / 1e9:.0f} GB/s across nodes")


GB = 1e9
DEVICES: dict[str, Device] = {
    # NVLink 4 (900 GB/s bidirectional) reaches ~360 GB/s of NCCL bus bandwidth; 400 Gb/s InfiniBand per GPU = 50 GB/s
    "H100": Device("H100 80GB SXM", 80 * GIB, 989e12, 360 * GB, 50 * GB),
    "H200": Device("H200 141GB SXM", 141 * GIB, 989e12, 360 * GB, 50 * GB),
    "A100": Device("A100 80GB SXM", 80 * GIB, 312e12, 230 * GB, 25 * GB),
    "L40S": Device("L40S 48GB (PCIe)", 48 * GIB, 362e12, 20 * GB, 12.5 * GB),
}
ASSUMED_MFU = 0.40
HOST_LINK_BYTES_S = 25 * GB   # PCIe gen4/5 x16, achievable: what offloaded state crosses each step
HOST_ADAM_BYTES_S = 10 * GB   # a CPU AdamW step streams its state at about this rate per rank  # fraction of the matmul peak a well-tuned fine-tuning step reaches (what MFU reports show)


def cpu_device(memory_bytes: float) -> Device:
    """This machine, measured: fp32 matmul rate, memory bandwidth-bound collectives between processes."""
    from shardtune.flops import measured_peak_flops

    return Device("this CPU (measured)", memory_bytes, measured_peak_flops("cpu"), 5 * GB, 1 * GB, compute_bytes=4)


# -- the configuration ---------------------------------------------------------------------------------------------------

STRATEGIES = ("DDP", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "ZERO1", "ZERO2", "ZERO3")
FSDP_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")  # activation checkpointing: FSDP only


@dataclass(frozen=True)
class Setup:
    arch: Arch
    strategy: str = "DDP"
    num_nodes: int = 1
    gpus_per_node: int = 8
    sharding_group_size: int = 0          # HYBRID_SHARD: 0 = one node
    batch_size: int = 1                   # micro-batch, in units (packed blocks or examples)
    seq_len: int = 4096                   # tokens per unit
    activation_checkpointing: bool = False
    cpu_offload: bool = False             # FSDP params+grads+optimizer, or ZeRO optimizer (and params for ZeRO-3)
    pure_bf16: bool = False
    compute_bytes: int = 2                # 2: bf16/fp16 compute; 4: fp32 (CPU)
    adapter: Adapter = field(default_factory=Adapter)
    quantization: str = ""                # "", 4bit, 8bit
    sequence_parallel: int = 1
    context_parallel: int = 1
    low_cpu_fsdp: bool = False

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.sequence_parallel * self.context_parallel)

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one rank computes per micro-batch (a long sequence is split over sp x cp ranks)."""
        return math.ceil(self.batch_size * self.seq_len / (self.sequence_parallel * self.context_parallel))

    @property
    def shard_group(self) -> int:
        """Ranks one copy of the parameters is sharded over."""
        if self.strategy in ("DDP", "NO_SHARD"):
            return 1
        if self.strategy == "HYBRID_SHARD":
            return min(self.sharding_group_size or self.gpus_per_node, self.world_size)
        return self.world_size

    @property
    def master_bytes(self) -> int:
        """Bytes per trainable parameter of the weights the optimizer updates (fp32 master unless pure_bf16)."""
        return 2 if self.pure_bf16 else 4


@dataclass
class Breakdown:
    """Bytes per GPU (the largest rank) by what holds them, and the peak of a step; plus host memory."""

    params: float = 0.0
    grads: float = 0.0           # gradient tensors: they exist from backward to the optimizer step
    optimizer: float = 0.0       # AdamW state (and ZeRO's fp32 master copy)
    buffers: float = 0.0         # communication buffers (DDP's gradient buckets, DeepSpeed's reduce bucket)
    gathered: float = 0.0        # parameters all-gathered for compute (FSDP / ZeRO-3 units, the root, autocast copies)
    activations: float = 0.0     # saved for backward at the end of the forward, one micro-batch
    loss_buffers: float = 0.0    # lean chunked cross-entropy (one chunk of fp32 logits, the head's fp32 gradient)
    backward: float = 0.0        # what a layer's backward (and its recomputation under checkpointing) adds
    host_state: float = 0.0      # per rank, CPU memory of offloaded state
    host_loading: float = 0.0    # per NODE, CPU memory to load the weights (all ranks of the node together)

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        """The larger of the end of the forward (activations saved, the loss buffers, no gradients yet) and the
        backward (gradients formed, the loss buffers freed: the head's backward runs first). Without activation
        checkpointing backward frees the saved activations as the gradients form; with it, the layers' inputs stay
        with the gradients and the layer being recomputed (measured: bench/plan_check.py)."""
        resident = self.params + self.optimizer + self.buffers + self.gathered
        checkpointed = self.activations if self.backward else 0.0
        return resident + max(self.activations + self.loss_buffers, checkpointed + self.grads + self.backward)

    def rows(self) -> list[tuple[str, float]]:
        return [("parameters", self.params), ("gradients", self.grads), ("optimizer state", self.optimizer),
                ("communication buffers", self.buffers), ("gathered parameters", self.gathered),
                ("activations", self.activations), ("loss buffers", self.loss_buffers),
                ("backward working memory", self.backward)]


def usable_bytes(device: Device) -> float:
    """What training may allocate: the CUDA context, NCCL buffers and allocator fragmentation take the rest."""
    if device.compute_bytes == 4:  # CPU: the process and its libraries
        return device.memory_bytes - 2 * GIB
    return device.memory_bytes * 0.95 - 1.5 * GIB


# -- the estimate ----------------------------------------------------------------------------------------------------

# quantised storage per weight: NF4/FP4 half a byte, plus one absmax per block of 64 (fp32, or 8-bit + an fp32 per
# 256 blocks with double quantisation); LLM.int8: one byte plus an fp32 scale per row (negligible)
QUANT_BYTES_PER_PARAM = {"4bit": 0.5 + 4 / 64, "4bit-double": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0}
# shardtune.loss.CHUNK_ELEMENTS on CUDA: fp32 logits of one chunk of labelled rows
LOSS_CHUNK_ELEMENTS = 1 << 28
FSDP_PREFETCH_LAYERS = 2  # the layer computing and the next one being all-gathered
# DeepSpeed's defaults (shardtune does not change them; a --deepspeed_config.config_file may): the contiguous gradient
# bucket every ZeRO stage allocates whole, whatever the model's size (stages 1/2 for each backward, stage 3 at init)
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
# ZeRO-3 keeps a gathered parameter whose next use comes within stage3_max_reuse_distance (1e9) elements of fetched
# parameters: each layer is used again in backward after twice the layers above it, so about half of that stays
DEEPSPEED_ZERO3_REUSE_ELEMENTS = 1_000_000_000 // 2
# working memory of backward, in layers' worth of saved activations (measured with bench/plan_check.py)
BACKWARD_LAYERS = 0.0
BACKWARD_LAYERS_CHECKPOINTED = 1.0  # the recomputed layer's saved tensors; its backward reuses what it frees


def layer_activation_bytes(arch: Arch, compute_bytes: int, adapter: Adapter = Adapter(),
                           linear_inputs_always_saved: bool = False) -> float:
    """Bytes a decoder layer saves for backward, per token (no activation checkpointing).

    Counted tensor by tensor on Hugging Face's Llama layer (c = compute dtype bytes, d hidden, q / kv the query /
    key-value widths, f intermediate, H heads):
      2 RMSNorms    each keeps its input in fp32 (4 d) and its normalised output (c d), + an fp32 rstd   2 (4 + c) d + 8
      attention     rotated q (c q), k and v (2 c kv), the attention output and its log-sum-exp (c q + 4 H), the
                    o_proj input (c q), and the head-major copies the attention kernel works on (2 c q)     5 c q + 2 c kv + 4 H
      MLP           gate, SiLU(gate), up and their product                                                 4 c f
      LoRA          per target with dropout: the dropped input (c in) and its mask (in), the rank-r output (c r)
    A frozen base (PEFT) saves no linear's input for a weight gradient: the norms' outputs (2 c d), the o_proj
    input (c q) and the down_proj input (c f) go, unless a LoRA target without dropout reads them, or ZeRO-3's linear
    (``linear_inputs_always_saved``), which saves its input whether the weight trains or not.
    On this machine's torch (CPU SDPA, padding-free rows) the count matches the profiler's to the byte per token.
    """
    d, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    c = compute_bytes
    norms = 2 * (4 + c) * d + 8
    attention = 5 * c * q + 2 * c * kv + 4 * arch.num_heads
    mlp = 4 * c * arch.intermediate_size
    lora = 0
    if adapter.method == "lora" and adapter.lora_dropout > 0:
        shapes = arch.linear_shapes()
        lora = sum((c + 1) * shapes[t][0] + c * adapter.lora_r for t in adapter.lora_targets if t in shapes)
    frozen_inputs = 0
    if adapter.method and not linear_inputs_always_saved:
        no_dropout = adapter.method == "lora" and not adapter.lora_dropout
        no_dropout_targets = set(adapter.lora_targets) if no_dropout else set()
        for size, readers in ((c * d, ("q_proj", "k_proj", "v_proj")), (c * q, ("o_proj",)),
                              (c * d, ("gate_proj", "up_proj")), (c * arch.intermediate_size, ("down_proj",))):
            if not no_dropout_targets.intersection(readers):
                frozen_inputs += size
    return norms + attention + mlp + lora - frozen_inputs


def outside_layers_bytes(arch: Arch, compute_bytes: int) -> float:
    """Saved per token outside the decoder layers: the final RMSNorm (fp32 input, normalised output), the labelled
    rows the lean head takes and their gradient (c d each), the rotary tables (fp32 cos and sin)."""
    return (4 + compute_bytes) * arch.hidden_size + 2 * compute_bytes * arch.hidden_size + 8 * arch.head_dim


def loss_buffer_bytes(arch: Arch, num_labels: int) -> float:
    """The lean loss (shardtune.loss.ChunkedLinearCrossEntropy): the head's gradient in fp32 (4 V d), and one chunk
    of fp32 logits with its softmax (2 x 4 V per row)."""
    chunk_rows = min(num_labels, max(16, LOSS_CHUNK_ELEMENTS // arch.vocab_size))
    return 4 * arch.vocab_size * arch.hidden_size + 2 * 4 * arch.vocab_size * chunk_rows


def estimate(setup: Setup) -> Breakdown:
    arch, s = setup.arch, setup
    c, m = s.compute_bytes, s.master_bytes
    total, trainable = arch.num_params, s.adapter.trainable_params(arch)
    frozen = total - trainable if s.adapter.method else 0
    quantized_linear = arch.num_layers * arch.layer_linear_params if s.quantization else 0
    # frozen base weights: quantised linears, the rest in the compute dtype (PEFT keeps a frozen base in bf16 on GPU)
    quant_key = "4bit-double" if s.quantization == "4bit" else s.quantization
    frozen_bytes = (quantized_linear * QUANT_BYTES_PER_PARAM[quant_key] + (frozen - quantized_linear) * c
                    if s.quantization else frozen * (c if s.adapter.method and c < 4 else m))
    out = Breakdown()
    group = s.shard_group
    strategy = s.strategy
    layer_unsharded = arch.layer_params * c
    if s.quantization:  # a quantised layer is gathered packed
        layer_unsharded = (arch.layer_linear_params * QUANT_BYTES_PER_PARAM[quant_key]
                           + (arch.layer_params - arch.layer_linear_params) * c)
    if strategy.startswith("ZERO"):
        stage = int(strategy[-1])
        n = s.world_size
        out.params = (trainable * c + frozen_bytes) / (n if stage == 3 else 1)
        out.grads = trainable * c / (n if stage >= 2 else 1)
        # the fp32 master copy of the partition: stages 1/2 always clone it, stage 3 reuses fp32 weights
        master = trainable * 4 / n if c < 4 or stage < 3 else 0
        out.buffers = DEEPSPEED_REDUCE_BUCKET_ELEMENTS * c
        optimizer = ADAM_STATES_PER_PARAM * trainable * 4 / n + master
        if s.cpu_offload:
            out.host_state, optimizer = optimizer, 0.0
            if stage == 3:
                out.host_state += out.params
                out.params = 0.0
        out.optimizer = optimizer
        if stage == 3:
            # small models (under ~0.5 B parameters) stay gathered whole, also between steps
            out.gathered = min(total * c, DEEPSPEED_ZERO3_REUSE_ELEMENTS * c + FSDP_PREFETCH_LAYERS * layer_unsharded)
            # the gradient partitions live in one flat buffer allocated at init: resident, counted with the buffers
            out.buffers += out.grads
            out.grads = 0.0
    else:
        out.params = (trainable * m + frozen_bytes) / group
        out.grads = trainable * m / group
        out.optimizer = ADAM_STATES_PER_PARAM * trainable * m / group
        if strategy == "DDP":
            out.buffers = trainable * 4  # the reducer's gradient buckets (gradient_as_bucket_view is off)
            if c < m:
                out.gathered = trainable * c  # autocast's cached low-precision copy of every weight
        elif group > 1 or c < m:
            if strategy == "SHARD_GRAD_OP":
                out.gathered = total * c
            else:
                out.gathered = FSDP_PREFETCH_LAYERS * layer_unsharded + arch.root_params * c
        if s.cpu_offload and strategy != "DDP":
            out.host_state = out.state
            out.params = out.optimizer = 0.0
            # on the device in backward: a layer's unsharded gradient (and its fp32 copy for the reduction) until its
            # shard moves to the host
            out.grads = min(trainable, arch.layer_params) * (c + 4 if c < 4 else 4)
    tokens = s.tokens_per_rank
    per_layer = layer_activation_bytes(arch, c, s.adapter, linear_inputs_always_saved=strategy == "ZERO3") * tokens
    if s.activation_checkpointing:
        out.activations = arch.num_layers * c * arch.hidden_size * tokens  # each layer's input
        out.backward = BACKWARD_LAYERS_CHECKPOINTED * per_layer  # the recomputed layer and its backward
    else:
        out.activations = arch.num_layers * per_layer
        out.backward = BACKWARD_LAYERS * per_layer
    out.activations += outside_layers_bytes(arch, c) * tokens
    replicated_kv = replicated_kv_bytes(setup)
    out.activations += replicated_kv * (1 if s.activation_checkpointing else arch.num_layers)
    out.loss_buffers = loss_buffer_bytes(arch, tokens)
    out.host_loading = host_loading_bytes(setup)
    return out


def ulysses_kv_heads(arch: Arch, sequence_parallel: int) -> int:
    """KV heads one rank holds after Ulysses' all-to-all: its share, or one (repeated) when the degree exceeds them."""
    return max(arch.num_kv_heads, sequence_parallel) // sequence_parallel


def replicated_kv_bytes(setup: Setup) -> float:
    """Per layer: the K and V a rank holds beyond its share when Ulysses repeats KV heads (degree > KV heads)."""
    s, arch = setup, setup.arch
    extra_heads = ulysses_kv_heads(arch, s.sequence_parallel) * s.sequence_parallel - arch.num_kv_heads
    return 2 * s.compute_bytes * arch.head_dim * extra_heads * s.tokens_per_rank


def host_loading_bytes(setup: Setup) -> float:
    """CPU memory per node to load the weights: every local rank reads a full copy, or only global rank 0 with
    --low_cpu_fsdp (other nodes read nothing)."""
    weight_bytes = setup.arch.num_params * (2 if setup.pure_bf16 or setup.quantization else 4)
    if setup.strategy == "DDP" or not setup.low_cpu_fsdp:
        return setup.gpus_per_node * weight_bytes
    return weight_bytes


# -- communication and time ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Traffic:
    """Bytes one GPU sends per optimizer step, inside its node and across nodes."""

    intra_node: float
    inter_node: float


def _ring(bytes_: float, n: int) -> float:
    """Bytes each rank sends in a ring all-gather or reduce-scatter of ``bytes_`` over n ranks."""
    return bytes_ * (n - 1) / n if n > 1 else 0.0


def traffic_per_step(setup: Setup, accumulation_steps: int = 1) -> Traffic:
    """Parameter all-gathers and gradient reductions of one optimizer step (accumulated micro-batches skip the
    reduction). A group spanning nodes is charged to the inter-node link, which it is bound by."""
    s, arch = setup, setup.arch
    trainable = s.adapter.trainable_params(arch)
    frozen_sharded = arch.num_params - trainable if s.adapter.method else 0
    c, grad_bytes = s.compute_bytes, 4  # gradients reduced in fp32
    spans_nodes = s.num_nodes > 1
    intra = inter = 0.0

    def add(bytes_: float, n: int, crosses: bool) -> None:
        nonlocal intra, inter
        if crosses:
            inter += bytes_
        else:
            intra += bytes_

    strategy = s.strategy
    if strategy in ("DDP", "NO_SHARD", "ZERO1", "ZERO2"):
        add(2 * _ring(trainable * grad_bytes, s.world_size), s.world_size, spans_nodes)
        if strategy in ("ZERO1", "ZERO2"):
            add(_ring(trainable * c, s.world_size), s.world_size, spans_nodes)  # updated params all-gathered
    else:
        group = s.shard_group
        gathers = 1 if strategy == "SHARD_GRAD_OP" else 2
        gathered_bytes = (trainable + frozen_sharded) * c
        group_spans = spans_nodes and group > s.gpus_per_node or (spans_nodes and strategy != "HYBRID_SHARD")
        add(gathers * accumulation_steps * _ring(gathered_bytes, group), group, group_spans)
        add(_ring(trainable * grad_bytes, group), group, group_spans)
        replicas = s.world_size // group
        if replicas > 1:  # HSDP: the shard's gradients all-reduced across replicas (one per node)
            add(2 * _ring(trainable * grad_bytes / group, replicas), replicas, spans_nodes)
    return Traffic(intra, inter)


def sequence_traffic_per_step(setup: Setup, accumulation_steps: int = 1) -> tuple[Traffic, Traffic]:
    """(Ulysses all-to-all, ring K/V) bytes one GPU sends per optimizer step for a row split over sp x cp ranks.

    Ulysses, per layer and pass: q, k, v (KV heads repeated up to the degree) to head-major and the output back,
    each rank sending (S-1)/S of its slice. Ring: the rank's K/V chunk travels C-1 hops forward; backward rotates
    K/V and their gradients (twice the forward). Activation checkpointing repeats the forward. sp is the innermost
    mesh dimension (inside a node when S <= GPUs per node); a ring of cp x sp ranks spans nodes when larger."""
    s, arch = setup, setup.arch
    sp, cp, c = s.sequence_parallel, s.context_parallel, s.compute_bytes
    passes = (3 if s.activation_checkpointing else 2) * accumulation_steps * arch.num_layers  # forward(s) + backward
    q_width = arch.num_heads * arch.head_dim
    kv_width = max(arch.num_kv_heads, sp) * arch.head_dim
    ulysses = passes * s.tokens_per_rank * c * (2 * q_width + 2 * kv_width) * (sp - 1) / sp if sp > 1 else 0.0
    ring_passes = (4 if s.activation_checkpointing else 3) * accumulation_steps * arch.num_layers
    kv_chunk = s.tokens_per_rank * c * 2 * ulysses_kv_heads(arch, sp) * arch.head_dim * sp  # before the all-to-all
    ring = ring_passes * kv_chunk * (cp - 1) if cp > 1 else 0.0
    crosses_sp = sp > s.gpus_per_node
    crosses_cp = cp * sp > s.gpus_per_node
    return (Traffic(0.0 if crosses_sp else ulysses, ulysses if crosses_sp else 0.0),
            Traffic(0.0 if crosses_cp else ring, ring if crosses_cp else 0.0))


def step_time_s(setup: Setup, device: Device, accumulation_steps: int = 1) -> tuple[float, float, float]:
    """(step seconds, compute seconds, communication seconds): compute at ASSUMED_MFU of the peak; communication
    at the link rates, overlapped with compute (FSDP prefetch, DDP buckets), so the slower of the two bounds it."""
    from shardtune.flops import ModelShape, training_flops_per_token

    arch = setup.arch
    trainable = setup.adapter.trainable_params(arch)
    matmul = arch.num_params - (0 if arch.tie_word_embeddings else arch.embedding_params)
    shape = ModelShape(arch.num_layers, arch.hidden_size, matmul, min(trainable, matmul))
    tokens = setup.batch_size * setup.seq_len * accumulation_steps * setup.data_parallel
    flops = training_flops_per_token(shape, setup.seq_len) * tokens
    if setup.activation_checkpointing:
        flops *= 4 / 3  # the forward runs twice
    compute = flops / (setup.world_size * device.matmul_flops * ASSUMED_MFU)
    traffic = traffic_per_step(setup, accumulation_steps)

    def seconds(t: Traffic) -> float:
        return t.intra_node / device.intra_node_bytes_s + t.inter_node / device.inter_node_bytes_s

    ulysses, ring = sequence_traffic_per_step(setup, accumulation_steps)
    comm = seconds(traffic) + seconds(ring)  # overlapped with compute (prefetch, buckets, the ring's next chunk)
    blocking = seconds(ulysses)  # attention waits for its all-to-all
    offload = 0.0
    if setup.cpu_offload and device.compute_bytes < 4:  # not overlapped: the state crosses PCIe, AdamW runs on the CPU
        b = estimate(setup)
        offload = 2 * b.host_state / HOST_LINK_BYTES_S + b.host_state / HOST_ADAM_BYTES_S
    return max(compute, comm) + blocking + offload, compute, comm + blocking + offload


# -- alternatives, limits and the recommendation ---------------------------------------------------------------------

def fits(setup: Setup, device: Device) -> bool:
    return estimate(setup).peak <= usable_bytes(device)


# from this many tokens per micro-batch on, the alternatives include rows split over sequence / context parallel ranks
LONG_CONTEXT_TOKENS = 32768


def sequence_splits(arch: Arch, world_size: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """(sp, cp) pairs worth comparing for a split row: for each product P > 1 that divides the world, the most
    Ulysses ranks that divide the query heads and stay in a node, the ring for the rest; and the pure ring."""
    pairs: list[tuple[int, int]] = []
    for product in range(2, world_size + 1):
        if world_size % product:
            continue
        sp = max(d for d in range(1, product + 1)
                 if product % d == 0 and arch.num_heads % d == 0 and d <= gpus_per_node)
        for pair in ((sp, product // sp), (1, product)):
            if pair not in pairs and (pair[1] == 1 or arch.sliding_window is None):
                pairs.append(pair)
    return pairs


def alternatives(setup: Setup) -> list[Setup]:
    """The given setup and the others worth comparing: each strategy, with activation checkpointing and offload;
    for long rows, FSDP with each sequence / context parallel split (FSDP shards over the split ranks too)."""
    out = [setup]
    split = setup.sequence_parallel * setup.context_parallel > 1
    for strategy in STRATEGIES:
        if strategy == "HYBRID_SHARD" and setup.num_nodes == 1:
            continue
        if setup.quantization == "8bit" and strategy not in ("DDP", "ZERO1", "ZERO2"):
            continue
        if split and strategy.startswith("ZERO"):  # DeepSpeed counts every rank as data parallel (config.py)
            continue
        for ac in ((False, True) if strategy in FSDP_STRATEGIES else (False,)):
            offloads = (False, True) if strategy in ("FULL_SHARD", "ZERO2", "ZERO3") else (False,)
            for offload in offloads:
                candidate = replace(setup, strategy=strategy, activation_checkpointing=ac, cpu_offload=offload)
                if candidate not in out:
                    out.append(candidate)
    if setup.batch_size * setup.seq_len >= LONG_CONTEXT_TOKENS and setup.quantization != "8bit" \
            and setup.adapter.method in ("", "lora"):
        for sp, cp in sequence_splits(setup.arch, setup.world_size, setup.gpus_per_node):
            for ac in (False, True):
                candidate = replace(setup, strategy="FULL_SHARD", activation_checkpointing=ac, cpu_offload=False,
                                    sequence_parallel=sp, context_parallel=cp)
                if candidate not in out:
                    out.append(candidate)
    return out


def largest_batch(setup: Setup, device: Device, limit: int = 1024) -> int:
    """The largest micro-batch (units of seq_len tokens) that fits, 0 if none."""
    best, lo, hi = 0, 1, limit
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(replace(setup, batch_size=mid), device):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def longest_sequence(setup: Setup, device: Device, limit: int = 1 << 24) -> int:
    """The longest sequence (tokens, multiple of 256) that fits with the setup's micro-batch of 1, 0 if none."""
    best, lo, hi = 0, 1, limit // 256
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(replace(setup, batch_size=1, seq_len=mid * 256), device):
            best, lo = mid * 256, mid + 1
        else:
            hi = mid - 1
    return best


def describe_setup(setup: Setup) -> str:
    parts = [setup.strategy]
    if setup.activation_checkpointing:
        parts.append("+AC")
    if setup.cpu_offload:
        parts.append("+offload")
    if setup.sequence_parallel > 1:
        parts.append(f"sp {setup.sequence_parallel}")
    if setup.context_parallel > 1:
        parts.append(f"cp {setup.context_parallel}")
    return " ".join(parts)


def command_flags(setup: Setup) -> list[str]:
    """The sft flags that select this setup's strategy and memory levers."""
    s = setup
    flags: list[str] = []
    if s.strategy.startswith("ZERO"):
        flags += ["--enable_deepspeed", "--deepspeed_config.zero_stage", s.strategy[-1]]
        if s.cpu_offload:
            flags += ["--deepspeed_config.offload_optimizer", "true"]
            if s.strategy == "ZERO3":
                flags += ["--deepspeed_config.offload_param", "true"]
    elif s.strategy != "DDP":
        flags += ["--enable_fsdp", "--fsdp_config.sharding_strategy", s.strategy,  # explicit: a --config may set them
                  "--fsdp_config.fsdp_activation_checkpointing", str(s.activation_checkpointing).lower(),
                  "--fsdp_config.fsdp_cpu_offload", str(s.cpu_offload).lower()]
    if s.sequence_parallel > 1:
        flags += ["--sp_size", str(s.sequence_parallel)]
    if s.context_parallel > 1:
        flags += ["--cp_size", str(s.context_parallel)]
    return flags


# -- the plan of one configuration: what `shardtune plan` and `shardtune sft --dry_run` print ----------------------

def parse_memory(text: str) -> float:
    units = {"TB": 1e12, "GB": 1e9, "TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "MB": 1e6}
    upper = text.strip().upper()
    for unit, size in units.items():
        if upper.endswith(unit):
            number = upper[:-len(unit)]
            break
    else:
        number, size = upper, 2**30
    try:
        return float(number) * size
    except ValueError:
        raise ConfigError(f"--gpu_memory {text!r} is not a size: pass e.g. 80GB or 141GiB") from None


def resolve_device(values: dict[str, str]) -> Device:
    name = values["gpu"]
    if name.lower() == "cpu":
        memory = parse_memory(values["gpu_memory"] or "24GiB")
        return cpu_device(memory)
    if name not in DEVICES:
        raise ConfigError(f"--gpu {name!r} is unknown: choose one of {', '.join(DEVICES)}, cpu")
    device = DEVICES[name]
    return replace(device, memory_bytes=parse_memory(values["gpu_memory"])) if values["gpu_memory"] else device


def setup_from_config(cfg: TrainConfig, values: dict[str, str], device: Device) -> Setup:
    try:
        nnodes, per_node = int(values["nnodes"]), int(values["gpus_per_node"])
    except ValueError:
        raise ConfigError("--nnodes and --gpus_per_node must be whole numbers") from None
    if nnodes <= 0 or per_node <= 0:
        raise ConfigError("--nnodes and --gpus_per_node must be positive")
    fc, dc = cfg.fsdp_config, cfg.deepspeed_config
    if cfg.enable_fsdp:
        strategy = fc.sharding_strategy
    elif cfg.enable_deepspeed:
        strategy = f"ZERO{dc.zero_stage}"
    else:
        strategy = "DDP"
    adapter = Adapter()
    if cfg.use_peft:
        adapter = Adapter(method=cfg.peft_method, lora_r=cfg.lora_config.r,
                          lora_targets=tuple(cfg.lora_config.target_modules),
                          lora_dropout=cfg.lora_config.lora_dropout,
                          adapter_len=cfg.llama_adapter_config.adapter_len,
                          adapter_layers=cfg.llama_adapter_config.adapter_layers,
                          num_virtual_tokens=cfg.prefix_config.num_virtual_tokens)
    quantization = {"int4": "4bit", "int8": "8bit"}.get(cfg.quantization, cfg.quantization)
    return Setup(arch=read_arch(cfg.model_name or "preset:demo"), strategy=strategy, num_nodes=nnodes,
                 gpus_per_node=per_node, sharding_group_size=fc.sharding_group_size,
                 batch_size=cfg.batch_size_training, seq_len=cfg.context_length,
                 activation_checkpointing=fc.fsdp_activation_checkpointing,
                 cpu_offload=fc.fsdp_cpu_offload or dc.offload_optimizer, pure_bf16=fc.pure_bf16,
                 compute_bytes=device.compute_bytes, adapter=adapter, quantization=quantization,
                 sequence_parallel=cfg.sequence_parallel_size, context_parallel=cfg.context_parallel_size,
                 low_cpu_fsdp=cfg.low_cpu_fsdp)


def check_split(cfg: TrainConfig, setup: Setup) -> None:
    """The sequence / context parallel sizes against the world and the model's heads: sft's own checks and
    messages (shardtune.parallel.dims, shardtune.parallel.sequence)."""
    from types import SimpleNamespace

    from shardtune.parallel.dims import ParallelDims, check_parallel_dims
    from shardtune.parallel.sequence import check_sequence_split

    check_parallel_dims(cfg, setup.world_size)
    ParallelDims.from_config(cfg, setup.world_size, setup.gpus_per_node)
    arch = setup.arch
    check_sequence_split(cfg, SimpleNamespace(num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
                                              sliding_window=arch.sliding_window))


def plan(setup: Setup, device: Device, accumulation: int) -> dict:
    """Everything the command prints, as data (``--json``)."""
    rows = []
    for candidate in alternatives(setup):
        b = estimate(candidate)
        seconds, compute_s, comm_s = step_time_s(candidate, device, accumulation)
        tokens = candidate.batch_size * candidate.seq_len * accumulation * candidate.data_parallel
        rows.append({"setup": describe_setup(candidate), "flags": command_flags(candidate),
                     "peak_bytes": b.peak, "fits": b.peak <= usable_bytes(device), "step_s": seconds,
                     "compute_s": compute_s, "communication_s": comm_s, "tokens_per_s_per_gpu":
                     tokens / seconds / candidate.world_size, "host_state_bytes": b.host_state,
                     "_setup": candidate})
    fitting = [r for r in rows if r["fits"]]
    # by tokens/s: a row split over sp x cp ranks trains fewer rows per step, so its step time is not comparable
    best = max(fitting, key=lambda r: r["tokens_per_s_per_gpu"]) if fitting else None
    smallest = min(rows, key=lambda r: r["peak_bytes"])
    given = estimate(setup)
    return {"model": setup.arch.name, "parameters": setup.arch.num_params,
            "trainable_parameters": setup.adapter.trainable_params(setup.arch), "device": device.describe(),
            "usable_bytes": usable_bytes(device), "world_size": setup.world_size,
            "given": {"setup": describe_setup(setup), "breakdown": dict(given.rows()), "peak_bytes": given.peak,
                      "fits": fits(setup, device), "host_loading_bytes_per_node": given.host_loading,
                      "host_state_bytes_per_rank": given.host_state},
            "alternatives": rows, "recommended": best, "smallest": None if best else smallest,
            "would_fit": None if best else would_fit(setup, device),
            "largest_micro_batch": largest_batch(best["_setup"] if best else setup, device),
            "longest_sequence": longest_sequence(best["_setup"] if best else setup, device)}


def would_fit(setup: Setup, device: Device, max_nodes: int = 128) -> dict:
    """When nothing fits: the fewest GPUs (this many per node, up to 8, then more nodes) on which an alternative
    fits, and the GPU memory on which the smallest alternative of this world size would fit."""
    smallest = min((estimate(c).peak for c in alternatives(setup)))
    memory = 1.0
    while not smallest <= usable_bytes(replace(device, memory_bytes=memory * GIB)):  # the inverse of usable_bytes
        memory += 1.0
    result = {"gpu_memory_bytes": memory * GIB, "gpus": None}
    per_node = [(1, g) for g in range(setup.gpus_per_node + 1, 9)] if setup.num_nodes == 1 else []
    per_node += [(n, max(setup.gpus_per_node, 8)) for n in range(setup.num_nodes + 1, max_nodes + 1)]
    for nodes, gpus in per_node:
        grown = replace(setup, num_nodes=nodes, gpus_per_node=gpus)
        if grown.world_size % (grown.sequence_parallel * grown.context_parallel):
            continue
        fitting = [c for c in alternatives(grown) if fits(c, device)]
        if fitting:  # the fastest of them, by tokens per second
            fastest = min(fitting, key=lambda c: step_time_s(c, device)[0] / (c.batch_size * c.data_parallel))
            result["gpus"] = {"nnodes": nodes, "gpus_per_node": gpus, "setup": describe_setup(fastest)}
            break
    return result


def render(result: dict, base_argv: list[str]) -> str:
    g = lambda b: f"{b / GIB:,.1f} GiB"  # noqa: E731
    lines = [f"model: {result['model']} ({result['parameters'] / 1e9:.2f} B parameters, "
             f"{result['trainable_parameters'] / 1e6:,.1f} M trainable); {result['world_size']} GPUs of "
             f"{result['device']}; usable per GPU: {g(result['usable_bytes'])}", "",
             f"per GPU, {result['given']['setup']} (as given):"]
    for name, value in result["given"]["breakdown"].items():
        lines.append(f"  {name:<26} {g(value):>12}")
    lines.append(f"  {'peak':<26} {g(result['given']['peak_bytes']):>12}  "
                 f"{'fits' if result['given']['fits'] else 'DOES NOT FIT'}")
    lines.append(f"  host memory to load the weights: {g(result['given']['host_loading_bytes_per_node'])} per node")
    lines += ["", "alternatives (peak per GPU, estimated step time at "
              "40% of the matmul peak, communication overlapped):",
              f"  {'setup':<30} {'peak':>12}  {'fits':<4} {'step':>9} {'tokens/s/GPU':>13}"]
    for r in sorted(result["alternatives"], key=lambda r: (not r["fits"], -r["tokens_per_s_per_gpu"])):
        lines.append(f"  {r['setup']:<30} {g(r['peak_bytes']):>12}  {'yes' if r['fits'] else 'no':<4} "
                     f"{r['step_s']:>8.2f}s {r['tokens_per_s_per_gpu']:>13,.0f}")
    best = result["recommended"]
    if best:
        command = " ".join(["shardtune sft", *base_argv, *best["flags"]])
        lines += ["", f"recommended: {best['setup']}", f"  {command}",
                  f"largest micro-batch that fits: {result['largest_micro_batch']}; longest sequence (micro-batch "
                  f"1): {result['longest_sequence']:,} tokens"]
    else:
        s, given, usable = result["smallest"], result["given"], result["usable_bytes"]
        lines += ["", f"nothing fits: {given['setup']} (as given) misses by {g(given['peak_bytes'] - usable)}; the "
                  f"smallest is {s['setup']} at {g(s['peak_bytes'])} per GPU, {g(s['peak_bytes'] - usable)} over "
                  f"what a GPU can use ({g(usable)})"]
        grow, where = result["would_fit"], []
        if grow["gpus"]:
            gpus = grow["gpus"]
            where.append(f"{gpus['setup']} on {gpus['nnodes'] * gpus['gpus_per_node']} GPUs (--nnodes "
                         f"{gpus['nnodes']} --gpus_per_node {gpus['gpus_per_node']})")
        where.append(f"{s['setup']} on GPUs of {grow['gpu_memory_bytes'] / GIB:,.0f} GiB (--gpu_memory)")
        lines.append("  would fit: " + ", or ".join(where) + "; else shorten --context_length, lower "
                     "--batch_size_training, or use --use_peft / --quantization 4bit")
    return "\n".join(lines)


STRATEGY_FLAGS = ("enable_fsdp", "enable_deepspeed", "fsdp_config.sharding_strategy", "fsdp_config.fsdp_cpu_offload",
                  "fsdp_config.fsdp_activation_checkpointing", "deepspeed_config.zero_stage",
                  "deepspeed_config.offload_optimizer", "deepspeed_config.offload_param", "sequence_parallel_size",
                  "context_parallel_size", "sp_size", "cp_size")


def without_strategy_flags(argv: list[str]) -> list[str]:
    """The user's sft flags minus those the recommendation replaces; a built-in shape becomes its hub id."""
    out, i = [], 0
    while i < len(argv):
        name = argv[i][2:].partition("=")[0]
        takes_value = "=" not in argv[i] and i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if name in STRATEGY_FLAGS:
            i += 2 if takes_value else 1
            continue
        out.append(argv[i])
        if name == "model_name" and takes_value:
            out.append(HUB_IDS.get(argv[i + 1], argv[i + 1]))
            i += 1
        i += 1
    return out


def split_named_flags(argv: list[str], names) -> tuple[dict[str, str], list[str]]:
    """The flags of ``names`` (``--name value`` or ``--name=value``) taken out of ``argv``, and the rest: the hardware
    flags that `shardtune plan` and `shardtune sft --dry_run` take besides sft's own."""
    values: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        if name in names:
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"--{name} needs a value")
                i += 1
                value = argv[i]
            values[name] = value
        else:
            rest.append(argv[i])
        i += 1
    return values, rest
