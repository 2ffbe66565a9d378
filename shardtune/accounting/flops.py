"""Training FLOPs: the one place the numerator of MFU is computed from.

MFU = achieved model FLOP/s / peak FLOP/s; the peak is shardtune.accounting.peak_flops's: the data-sheet dense peak of a
known GPU in the compute dtype (as published MFU figures use), a measured matmul rate on CPU and unknown GPUs.

Two counts are kept. ``mfu`` counts what the step computes (:func:`micro_batch_flops`): the output layer only on
the positions the lean loss computes it for, and causal attention as the triangle the kernels compute (each token
attends to itself and the tokens before it), so it cannot exceed 100%. ``mfu_palm`` is the usual published
convention (:func:`palm_micro_batch_flops`, 6 N + 12 L d T per token), for comparison with other reports.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.model.loss import SEQUENCE_LAYOUT, SPLIT_INPUT_TOKENS


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_matmul_params: int  # every weight a token is multiplied by: all matrices but the input embedding
    num_trainable_params: int  # the trainable ones among those (all of them in full fine-tuning)
    attention_size: int = 0  # query heads x head dimension (= hidden_size in Llama); 0: hidden_size
    num_head_params: int = 0  # the output layer's weight (vocabulary x hidden), part of num_matmul_params
    head_trainable: bool = False
    lean_loss: bool = False  # the output layer runs only on labelled positions (shardtune.model.loss lean path)
    # the last layer's weights that run only on the positions a loss reads (its query and output projections and its
    # MLP, adapters included: shardtune.model.lean_layer), and the trainable ones among them; 0 without the lean layer
    lean_layer_params: int = 0
    lean_layer_trainable: int = 0

    @property
    def num_body_params(self) -> int:
        return self.num_matmul_params - self.num_head_params

    @property
    def num_trainable_body_params(self) -> int:
        return self.num_trainable_params - (self.num_head_params if self.head_trainable else 0)


def model_shape(model: nn.Module) -> ModelShape:
    """Read the shape from the Hugging Face model inside any DDP / FSDP2 / PEFT wrapping."""
    from shardtune.model.lean_layer import lean_last_layer
    from shardtune.model.loss import hf_model, lean_head

    inner = hf_model(model)
    lean_loss = lean_head(model) is not None
    head = inner.get_output_embeddings()
    # the lean last layer: under the lean loss, or in a score model (read at one position a row: the reward objective)
    layer = lean_last_layer(inner, {}) if lean_loss or head is None else None
    lean = (
        [p for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp) for p in m.parameters() if is_matrix(p)]
        if layer is not None
        else []
    )
    config = inner.config.get_text_config()  # a vision-language model's: its language model's (tokens x weights)
    embedding = inner.get_input_embeddings().weight
    tied = head is not None and head.weight is embedding
    matmul = [p for p in model.parameters() if (tied or p is not embedding) and is_matrix(p)]

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_matmul_params=sum(numel(p) for p in matmul),
        num_trainable_params=sum(numel(p) for p in matmul if p.requires_grad),
        attention_size=config.num_attention_heads * head_dim,
        num_head_params=numel(head.weight) if head is not None else 0,
        head_trainable=head is not None and head.weight.requires_grad,
        lean_loss=lean_loss,
        lean_layer_params=sum(numel(p) for p in lean),
        lean_layer_trainable=sum(numel(p) for p in lean if p.requires_grad),
    )


def is_matrix(p: torch.Tensor) -> bool:
    """A weight tokens are multiplied by; norm scales and biases (1-D) cost one FLOP per token, not counted."""
    return len(getattr(p, "ds_shape", None) or p.shape) >= 2


def numel(p: torch.Tensor) -> int:
    """Elements of the weight as the model uses it: DeepSpeed ZeRO-3 partitions in place (ds_numel is its size);
    a bitsandbytes 4-bit weight is stored packed (its quant_state has the real shape)."""
    quant_state = getattr(p, "quant_state", None)
    if quant_state is not None and getattr(quant_state, "shape", None) is not None:
        return math.prod(quant_state.shape)
    return getattr(p, "ds_numel", None) or p.numel()


def matmul_flops_per_token(num_params: int, num_trainable: int) -> int:
    """Each matmul parameter costs 2 FLOPs forward, 2 backward for the activation gradient, and 2 more for its own
    gradient when it is trained."""
    return 4 * num_params + 2 * num_trainable


def training_flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """PaLM-convention model FLOPs of one training token (forward + backward) at sequence length ``seq_len``.

    flops = 6 N + 12 L d T   (all parameters trainable)
          = 4 N + 2 N_trainable + 12 L d T   (in general)

    N: parameters a token is multiplied by (the input embedding is a lookup, not a matmul; a tied head counts),
    L: layers, d: hidden size, T: sequence length. Attention scores and their weighted sum cost 4 L d T forward
    and twice that backward. This is the formula of PaLM (Chowdhery et al. 2022, appendix B: 6N + 12 L H Q T with
    H Q = d), which counts the output layer on every token and the full T x T attention even under a causal mask,
    as do the usual MFU reports; frozen weights (PEFT) skip their weight-gradient 2 N.
    """
    attention = 12 * shape.num_layers * shape.hidden_size * seq_len
    return matmul_flops_per_token(shape.num_matmul_params, shape.num_trainable_params) + attention


def num_input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Real tokens the model computes on: every token of a padding-free row, the non-pad tokens of a padded batch, a
    split row's slice less the split's padding (each real token of the row counted on one rank of its group)."""
    if SPLIT_INPUT_TOKENS in batch:
        return int(batch[SPLIT_INPUT_TOKENS])
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return int(mask.sum())
    return int(batch["input_ids"].numel())


def sequence_lengths(batch: dict[str, torch.Tensor]) -> list[int]:
    """Length of each sequence the model attends within: the examples of a padding-free row, or each padded row's
    non-pad tokens."""
    if "cu_seq_lens" in batch:
        return batch["cu_seq_lens"].diff().tolist()
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return mask.sum(dim=1).tolist()
    return [batch["input_ids"].size(1)] * batch["input_ids"].size(0)


def causal_attention_flops(shape: ModelShape, lengths: list[int]) -> int:
    """Attention of a causal model as computed: token t of a sequence attends to t + 1 tokens, so a sequence of n
    tokens has n (n + 1) / 2 query-key pairs; each costs 4 a FLOPs forward (scores, weighted sum) and 8 a backward
    per layer (a: query heads x head dimension)."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 12 * shape.num_layers * (shape.attention_size or shape.hidden_size) * pairs


def output_layer_tokens(shape: ModelShape, batch: dict[str, torch.Tensor]) -> int:
    """Positions the output layer computes: the labelled ones under the lean loss, every input token otherwise."""
    from shardtune.model.loss import batch_label_tokens

    return batch_label_tokens(batch) if shape.lean_loss else num_input_tokens(batch)


def micro_batch_flops(shape: ModelShape, batch: dict[str, torch.Tensor], head_tokens: int | None = None) -> int:
    """Model FLOPs of training on one micro-batch as computed (the ``mfu`` convention).

    Body matmuls on every input token (the lean last layer's query, output projection and MLP on the positions the
    output layer reads only: :func:`lean_layer_saving`), the output layer on :func:`output_layer_tokens` (or
    ``head_tokens``: the positions an objective scores, under the lean loss), causal attention within each sequence
    (:func:`causal_attention_flops`; the last layer's counted whole). Pad tokens are not counted: it is the work the
    model needs.
    """
    body = matmul_flops_per_token(shape.num_body_params, shape.num_trainable_body_params) * num_input_tokens(batch)
    head = matmul_flops_per_token(shape.num_head_params, shape.num_head_params if shape.head_trainable else 0)
    if SEQUENCE_LAYOUT in batch:  # a slice of a row split over ranks: its share of the whole row's attention
        boundaries = batch[SEQUENCE_LAYOUT].cu_seq_lens
        whole = causal_attention_flops(shape, boundaries.diff().tolist())
        attention = whole * batch["input_ids"].size(1) // int(boundaries[-1])
    else:
        attention = causal_attention_flops(shape, sequence_lengths(batch))
    if head_tokens is None or not shape.lean_loss:
        head_tokens = output_layer_tokens(shape, batch)
    saved = lean_layer_saving(shape, batch, head_tokens)
    return (
        body
        - matmul_flops_per_token(shape.lean_layer_params, shape.lean_layer_trainable) * saved
        + (head * head_tokens + attention)
    )


def lean_layer_saving(shape: ModelShape, batch: dict[str, torch.Tensor], read: int) -> int:
    """Input tokens whose last-layer query, output projection and MLP the lean layer skips: those the output layer
    does not read (none without the lean layer, or for a split row's slice, which computes its layer whole)."""
    if not shape.lean_layer_params or SEQUENCE_LAYOUT in batch:
        return 0
    return max(num_input_tokens(batch) - read, 0)


def palm_micro_batch_flops(shape: ModelShape, batch: dict[str, torch.Tensor]) -> int:
    """Model FLOPs of one micro-batch in the PaLM convention (the ``mfu_palm`` column): 6 N + 12 L d T per token.

    A padding-free row counts each example at its own length (its attention never spans the row); a padded
    batch counts its non-pad tokens at the padded length.
    """
    if "cu_seq_lens" in batch:
        lengths = batch["cu_seq_lens"].diff().tolist()
        return sum(training_flops_per_token(shape, n) * n for n in lengths)
    if SEQUENCE_LAYOUT in batch:  # a slice of a row split over ranks: its share of the whole row's FLOPs
        boundaries = batch[SEQUENCE_LAYOUT].cu_seq_lens
        whole = sum(training_flops_per_token(shape, n) * n for n in boundaries.diff().tolist())
        return whole * batch["input_ids"].size(1) // int(boundaries[-1])
    return training_flops_per_token(shape, batch["input_ids"].size(1)) * num_input_tokens(batch)


def preference_micro_batch_flops(
    shape: ModelShape, batch: dict[str, torch.Tensor], scored_tokens: int
) -> tuple[int, int]:
    """Model FLOPs (``mfu``, PaLM) of one DPO micro-batch: the policy trains on every row (chosen and rejected; under
    the lean loss the output layer runs on the ``scored_tokens`` completion targets only, else on every input
    token), and the reference model runs forward only (a third of the training FLOPs of a frozen weight: 2 per
    parameter per token, and attention's forward third). The reference is the policy's own shape (the same model,
    or the base with the adapter off). PaLM's convention counts the output layer on every token."""
    tokens = num_input_tokens(batch)
    head_tokens = scored_tokens if shape.lean_loss else tokens
    forward = 2 * shape.num_body_params * tokens + 2 * shape.num_head_params * head_tokens
    forward -= 2 * shape.lean_layer_params * lean_layer_saving(shape, batch, head_tokens)
    if SEQUENCE_LAYOUT in batch:  # a slice of a row split over ranks: its share of the whole row's attention
        boundaries = batch[SEQUENCE_LAYOUT].cu_seq_lens
        lengths = boundaries.diff().tolist()
        attention_forward = causal_attention_flops(shape, lengths) * tokens // int(boundaries[-1]) // 3
        attended = sum(n * n for n in lengths) * tokens // int(boundaries[-1])
    else:
        attention_forward = causal_attention_flops(shape, sequence_lengths(batch)) // 3
        # PaLM's attention term at each sequence's length: a padded row's width, a padding-free row's sequences
        attended = (
            sum(n * n for n in sequence_lengths(batch))
            if "cu_seq_lens" in batch
            else batch["input_ids"].size(1) * tokens
        )
    palm_forward = 2 * shape.num_matmul_params * tokens + 4 * shape.num_layers * shape.hidden_size * attended
    return (
        micro_batch_flops(shape, batch, head_tokens) + forward + attention_forward,
        palm_micro_batch_flops(shape, batch) + palm_forward,
    )


def flop_counter():
    """torch's FlopCounterMode (what ``--flop_counter`` and the tests measure with), completed with formulas torch
    lacks: the in-place ``addmm_`` (the lean loss accumulates the output layer's gradient with it) and the CPU SDPA
    kernel, counted with torch's own attention formulas (the full n x n square per sequence, as torch counts the
    CUDA kernels: "we aren't accounting for causal attention"; its backward includes recomputing the scores)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def accumulate(out, a, b, *args, out_shape=None, **kwargs) -> int:  # out += a @ b
        return 2 * a[0] * a[1] * b[1]

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out, query, key, value)

    return fc.FlopCounterMode(
        display=False,
        custom_mapping={
            aten.addmm_: accumulate,
            aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
        },
    )


PEAK_DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}


@functools.cache
def measured_peak_flops(device_str: str) -> float:
    """The matmul FLOP/s this process reaches on ``device`` in its usual compute dtype (fp32 on CPU, bf16 on GPU),
    measured once per process: what the planner assumes of this machine. MFU divides by
    shardtune.accounting.peak_flops instead (the data sheet of a known GPU)."""
    from shardtune.accounting.peak_flops import measure_matmul_flops

    device = torch.device(device_str)
    return measure_matmul_flops(device, PEAK_DTYPES.get(device.type, torch.float32), num_bursts=8)
