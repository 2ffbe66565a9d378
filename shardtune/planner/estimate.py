"""Memory and speed of a training configuration per GPU, from the model's config.json alone (``shardtune plan``).

Nothing is loaded or downloaded: the parameter counts come from the architecture's shapes (checked against real
models in tests/unit/test_planner.py), the training state from the formulas of shardtune.accounting.memory, and the
activations from the tensors a decoder layer saves for backward, counted tensor by tensor (see
``layer_activation_bytes``) and validated against the measured peak of live tensor bytes on this machine
(``python -m bench.plan_check``). What the planner calls *peak* is the peak of live tensor bytes, what
``torch.cuda.max_memory_allocated`` reports; a GPU also holds its CUDA context and allocator slack, which
``usable_bytes`` reserves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardtune.accounting.memory import ADAM_STATES_PER_PARAM, GIB
from shardtune.planner.hardware import Device
from shardtune.planner.shapes import Adapter, Arch, frozen_params

# -- the configuration ---------------------------------------------------------------------------------------------

STRATEGIES = ("DDP", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "ZERO1", "ZERO2", "ZERO3")
FSDP_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")  # activation checkpointing: FSDP only


@dataclass(frozen=True)
class Setup:
    arch: Arch
    strategy: str = "DDP"
    num_nodes: int = 1
    gpus_per_node: int = 8
    sharding_group_size: int = 0  # HYBRID_SHARD: 0 = one node
    batch_size: int = 1  # micro-batch, in units (packed blocks or examples)
    seq_len: int = 4096  # tokens per unit
    activation_checkpointing: bool = False
    cpu_offload: bool = False  # FSDP params+grads+optimizer, or ZeRO optimizer (and params for ZeRO-3)
    pure_bf16: bool = False
    compute_bytes: int = 2  # 2: bf16/fp16 compute; 4: fp32 (CPU)
    adapter: Adapter = field(default_factory=Adapter)
    quantization: str = ""  # "", 4bit, 8bit
    sequence_parallel: int = 1
    context_parallel: int = 1
    low_cpu_fsdp: bool = False
    rows_per_unit: int = 1  # rows the model computes per unit of batch (DPO: a pair's two)
    reference_model: bool = False  # a frozen copy beside the policy (DPO's full fine-tuning reference)
    sampling_rows: int = 0  # GRPO: completions a rank samples at once (0: no sampling), each of seq_len tokens at most
    sampling_gathers_whole: bool = False  # ZeRO-3 with ds3_gather_for_generation: every weight gathered to sample
    scored_rows_per_unit: int = 0  # KTO: KL rows per unit, scored without a graph before the step's backward
    images_per_example: int = 1  # a vision-language model: images per row (their tokens are within seq_len)
    # full fine-tuning of a vision-language model: the parts kept frozen (shardtune.planner.shapes.FREEZABLE_PARTS)
    frozen_parts: frozenset[str] = frozenset()

    @property
    def trainable_params(self) -> int:
        """An adapter's parameters, or the whole model's less the parts the freezing flags keep."""
        if self.adapter.method:
            return self.adapter.trainable_params(self.arch)
        return self.arch.num_params - frozen_params(self.arch, self.frozen_parts)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.sequence_parallel * self.context_parallel)

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one rank computes per micro-batch (a long sequence is split over sp x cp ranks)."""
        return math.ceil(
            self.rows_per_unit * self.batch_size * self.seq_len / (self.sequence_parallel * self.context_parallel)
        )

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
    grads: float = 0.0  # gradient tensors: they exist from backward to the optimizer step
    optimizer: float = 0.0  # AdamW state (and ZeRO's fp32 master copy)
    buffers: float = 0.0  # communication buffers (DDP's gradient buckets, DeepSpeed's reduce bucket)
    gathered: float = 0.0  # parameters all-gathered for compute (FSDP / ZeRO-3 units, the root, autocast copies)
    activations: float = 0.0  # saved for backward at the end of the forward, one micro-batch
    loss_buffers: float = 0.0  # lean chunked cross-entropy (one chunk of fp32 logits, the head's fp32 gradient)
    backward: float = 0.0  # what a layer's backward (and its recomputation under checkpointing) adds
    host_state: float = 0.0  # per rank, CPU memory of offloaded state
    host_loading: float = 0.0  # per NODE, CPU memory to load the weights (all ranks of the node together)
    sampling: float = 0.0  # GRPO's sampling, between steps: KV cache, last logits, weights gathered beyond the step's
    scoring: float = 0.0  # KTO's KL rows, scored without a graph before a step's first forward with one

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
        step = max(self.activations + self.loss_buffers, checkpointed + self.grads + self.backward)
        # sampling runs between steps, scoring before a step's first graph: no gradients, no saved activations
        return resident + max(step, self.sampling, self.scoring)

    def rows(self) -> list[tuple[str, float]]:
        return [
            ("parameters", self.params),
            ("gradients", self.grads),
            ("optimizer state", self.optimizer),
            ("communication buffers", self.buffers),
            ("gathered parameters", self.gathered),
            ("activations", self.activations),
            ("loss buffers", self.loss_buffers),
            ("backward working memory", self.backward),
            *([("sampling (KV cache)", self.sampling)] if self.sampling else []),
            *([("KL rows (no graph)", self.scoring)] if self.scoring else []),
        ]


def usable_bytes(device: Device) -> float:
    """What training may allocate: the CUDA context, NCCL buffers and allocator fragmentation take the rest."""
    if device.compute_bytes == 4:  # CPU: the process and its libraries
        return device.memory_bytes - 2 * GIB
    return device.memory_bytes * 0.95 - 1.5 * GIB


def usable_host_bytes(device: Device) -> float:
    """What the processes of one node may hold in host memory: the OS, page cache and libraries take the rest."""
    return device.host_memory_bytes * 0.9


def host_bytes_per_node(setup: Setup) -> float:
    """Host memory one node needs: its ranks' offloaded state during training, or loading the weights before it,
    whichever is larger."""
    b = estimate(setup)
    return max(b.host_state * setup.gpus_per_node, b.host_loading)


# -- the estimate ----------------------------------------------------------------------------------------------------

# quantised storage per weight: NF4/FP4 half a byte, plus one absmax per block of 64 (fp32, or 8-bit + an fp32 per
# 256 blocks with double quantisation); LLM.int8: one byte plus an fp32 scale per row (negligible)
QUANT_BYTES_PER_PARAM = {"4bit": 0.5 + 4 / 64, "4bit-double": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0}
# shardtune.model.loss.CHUNK_ELEMENTS on CUDA: fp32 logits of one chunk of labelled rows
LOSS_CHUNK_ELEMENTS = 1 << 28
# shardtune.model.loss.PREDICTION_BLOCK_ELEMENTS: the fp32 block SFT's accuracy / entropy sums work in, beside a chunk
PREDICTION_BLOCK_ELEMENTS = 1 << 20
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


def layer_activation_bytes(
    arch: Arch, compute_bytes: int, adapter: Adapter = Adapter(), linear_inputs_always_saved: bool = False
) -> float:
    """Bytes a decoder layer saves for backward, per token (no activation checkpointing).

    Counted tensor by tensor on Hugging Face's Llama layer (c = compute dtype bytes, d hidden, q / kv the query /
    key-value widths, f intermediate, H heads):
      2 RMSNorms    each keeps its input in fp32 (4 d) and its normalised output (c d),
                    + an fp32 rstd                                                          2 (4 + c) d + 8
      attention     rotated q (c q), k and v (2 c kv), the attention output and its
                    log-sum-exp (c q + 4 H), the o_proj input (c q), and the head-major
                    copies the attention kernel works on (2 c q)                            5 c q + 2 c kv + 4 H
      MLP           gate, SiLU(gate), up and their product                                  4 c f
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
        for size, readers in (
            (c * d, ("q_proj", "k_proj", "v_proj")),
            (c * q, ("o_proj",)),
            (c * d, ("gate_proj", "up_proj")),
            (c * arch.intermediate_size, ("down_proj",)),
        ):
            if not no_dropout_targets.intersection(readers):
                frozen_inputs += size
    return norms + attention + mlp + lora - frozen_inputs


def outside_layers_bytes(arch: Arch, compute_bytes: int) -> float:
    """Saved per token outside the decoder layers: the final RMSNorm (fp32 input, normalised output), the labelled
    rows the lean head takes and their gradient (c d each), the rotary tables (fp32 cos and sin)."""
    return (4 + compute_bytes) * arch.hidden_size + 2 * compute_bytes * arch.hidden_size + 8 * arch.head_dim


def loss_buffer_bytes(arch: Arch, num_labels: int) -> float:
    """The lean loss (shardtune.model.loss.ChunkedLinearCrossEntropy): the head's gradient in fp32 (4 V d), one
    chunk of fp32 logits with its softmax (2 x 4 V per row), and the block of TRL's accuracy / entropy sums. A score
    head (a reward model's) has no output layer over the vocabulary: its few fp32 outputs at every position."""
    if arch.score_outputs:
        return 4 * arch.score_outputs * num_labels
    chunk_rows = min(num_labels, max(16, LOSS_CHUNK_ELEMENTS // arch.vocab_size))
    block_rows = min(chunk_rows, max(1, PREDICTION_BLOCK_ELEMENTS // arch.vocab_size))
    return (
        4 * arch.vocab_size * arch.hidden_size + 2 * 4 * arch.vocab_size * chunk_rows + 4 * arch.vocab_size * block_rows
    )


def estimate(setup: Setup) -> Breakdown:
    arch, s = setup.arch, setup
    c, m = s.compute_bytes, s.master_bytes
    total, trainable = arch.num_params, s.trainable_params
    frozen = total - trainable  # weights without a gradient or optimizer state (an adapter's base, frozen parts)
    quantized_linear = arch.num_layers * arch.layer_linear_params if s.quantization else 0
    # frozen base weights: quantised linears, the rest in the compute dtype (PEFT keeps a frozen base in bf16 on GPU,
    # DeepSpeed casts the whole module to it); parts frozen in full fine-tuning under FSDP / DDP at the weights' dtype
    quant_key = "4bit-double" if s.quantization == "4bit" else s.quantization
    low_precision_frozen = (s.adapter.method or s.strategy.startswith("ZERO")) and c < 4
    frozen_bytes = (
        quantized_linear * QUANT_BYTES_PER_PARAM[quant_key] + (frozen - quantized_linear) * c
        if s.quantization
        else frozen * (c if low_precision_frozen else m)
    )
    out = Breakdown()
    group = s.shard_group
    strategy = s.strategy
    layer_unsharded = arch.layer_params * c
    if s.quantization:  # a quantised layer is gathered packed
        layer_unsharded = (
            arch.layer_linear_params * QUANT_BYTES_PER_PARAM[quant_key]
            + (arch.layer_params - arch.layer_linear_params) * c
        )
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
    add_activations(out, s)
    add_objective_terms(out, s)
    out.host_loading = host_loading_bytes(setup)
    return out


def add_activations(out: Breakdown, setup: Setup) -> None:
    """What a micro-batch saves for backward (the text layers, outside them, the images), the loss buffers and
    backward's working memory."""
    s, arch, c = setup, setup.arch, setup.compute_bytes
    tokens = s.tokens_per_rank
    per_layer = layer_activation_bytes(arch, c, s.adapter, linear_inputs_always_saved=s.strategy == "ZERO3") * tokens
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
    if arch.vision:
        images, backward = image_activation_bytes(setup)
        out.activations += images
        out.backward = max(out.backward, backward)


def images_per_micro_batch(setup: Setup) -> int:
    """Images one rank's micro-batch holds (rows with images are not split over sequence ranks)."""
    return setup.rows_per_unit * setup.batch_size * setup.images_per_example


def tower_trains(setup: Setup) -> bool:
    """Whether anything in the vision tower takes a gradient: full fine-tuning trains it unless --freeze_vision_tower;
    an adapter on the language model leaves it frozen; with nothing trainable before it (the tower comes first)
    autograd saves none of its activations."""
    return not setup.adapter.method and "vision_tower" not in setup.frozen_parts


def projector_trains(setup: Setup) -> bool:
    """Whether the projector takes a gradient (then it saves its input, the tower's features, even from a frozen
    tower)."""
    return not setup.adapter.method and "multi_modal_projector" not in setup.frozen_parts


def image_activation_bytes(setup: Setup) -> tuple[float, float]:
    """(saved for backward, backward's working memory) of a micro-batch's images, counted as the text layers are:
    each tower layer's tensors per position (shardtune.planner.vision.vit_layer_activation_bytes), or under
    activation checkpointing its input alone (the tower's layers are checkpointed units too) and one layer recomputed
    in backward; beside them each image's pixels, a LayerNorm's input, and the projector's input and hidden and
    output per image token (measured against the tensors autograd saves in tests/unit/test_planner.py). The image
    tokens' rows of the text sequence are in seq_len already (--context_length counts them). mllama's
    cross-attention layers keep their keys and values over every tile's features (rotated to head-major copies,
    the key norm's fp32 input), and the projected features once."""
    s, arch, c = setup, setup.arch, setup.compute_bytes
    v = arch.vision
    images = images_per_micro_batch(s)
    kv_width = arch.num_kv_heads * arch.head_dim
    cross_tokens = images * v.cross_tokens_per_image
    cross = cross_tokens * c * arch.hidden_size
    if not s.activation_checkpointing:
        cross += arch.cross_attention_layers * cross_tokens * (4 * c + 4) * kv_width
    projector = images * v.image_tokens * c * (v.hidden_size * v.positions_per_token + 2 * arch.hidden_size)
    if not tower_trains(s):
        return cross + (projector if projector_trains(s) else 0.0), 0.0
    from shardtune.planner.vision import vit_layer_activation_bytes

    positions = images * v.positions_per_image
    per_layer = vit_layer_activation_bytes(v, c) * positions
    pixels = positions * c * v.pixels_per_position  # the patch convolution's input
    # the LayerNorm between the embeddings and the layers (or after them): its input, its fp32 copy under autocast
    norm = positions * ((c + (4 if c < 4 else 0)) * v.hidden_size + 8)
    outside = pixels + norm + projector
    if s.activation_checkpointing:
        return cross + v.num_layers * c * v.hidden_size * positions + outside, BACKWARD_LAYERS_CHECKPOINTED * per_layer
    return cross + v.num_layers * per_layer + outside, BACKWARD_LAYERS * per_layer


def add_objective_terms(out: Breakdown, setup: Setup) -> None:
    """What an objective holds beside the step (its Registration's planner terms): a frozen reference, sampling
    between steps, rows scored without a graph before the step."""
    if setup.reference_model:
        add_reference(out, setup)
    if setup.sampling_rows:
        add_sampling(out, setup)
    if setup.scored_rows_per_unit:
        add_scoring(out, setup)


def add_reference(out: Breakdown, setup: Setup) -> None:
    """DPO's reference for full fine-tuning, a frozen copy placed by the strategy (Strategy.place_frozen): under DDP
    and FSDP in the policy's parameter dtype, sharded like it (left on the host under FSDP's CPU offload); under ZeRO
    in the engine's compute dtype, whole (ZeRO-1 / 2) or partitioned over all ranks (ZeRO-3, offloaded with the
    policy's parameters)."""
    s, total = setup, setup.arch.num_params
    if s.strategy.startswith("ZERO"):
        stage3 = s.strategy == "ZERO3"
        reference = total * s.compute_bytes / (s.world_size if stage3 else 1)
        offloaded = stage3 and s.cpu_offload
    else:
        reference = total * s.master_bytes / s.shard_group
        offloaded = s.cpu_offload and s.strategy != "DDP"
    if offloaded:
        out.host_state += reference
    else:
        out.params += reference


def add_scoring(out: Breakdown, setup: Setup) -> None:
    """KTO's KL rows (shardtune.training.objectives.kto), scored by the policy and then the reference without a graph
    before the step's first backward, a micro-batch at a time: each layer's activations live only while it runs (one
    layer's at a time, as the backward of a layer needs them), the rows' hidden states between layers, and the
    head's chunk of fp32 logits (counted as the lean loss's buffers: an upper bound); nothing is kept but a
    number per row."""
    s, arch, c = setup, setup.arch, setup.compute_bytes
    tokens = math.ceil(s.scored_rows_per_unit * s.batch_size * s.seq_len)
    one_layer = layer_activation_bytes(arch, c, s.adapter, linear_inputs_always_saved=False) * tokens
    out.scoring = one_layer + outside_layers_bytes(arch, c) * tokens + loss_buffer_bytes(arch, tokens)


def add_sampling(out: Breakdown, setup: Setup) -> None:
    """GRPO's sampling (shardtune.training.objectives.grpo.generate), after a step's gradients are freed: the KV cache
    of the rows
    a rank samples at once (seq_len tokens each at most: prompt and completion; every layer's keys and values in the
    compute dtype), the last position's logits (fp32, their warped copy, the float64 Gumbel noise and its logarithm:
    the prompts' logits are never formed), and, under ZeRO-3 with ds3_gather_for_generation, the whole model
    gathered in place of the layers the step gathers (FSDP and ZeRO-3 without it gather layer by layer, as a step)."""
    arch, s = setup.arch, setup
    per_token = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * s.compute_bytes
    logits = arch.vocab_size * (4 + 4 + 8 + 8)
    whole = (
        arch.num_params * s.compute_bytes - out.gathered if s.strategy == "ZERO3" and s.sampling_gathers_whole else 0
    )
    out.sampling = s.sampling_rows * (s.seq_len * per_token + logits) + max(whole, 0.0)


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
