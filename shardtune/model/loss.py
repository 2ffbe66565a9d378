"""Token-level loss: a SUM over labelled tokens, so the caller can normalise by the global token count.

The default path is lean: the model's own forward runs (so DDP, FSDP2 and PEFT hooks all fire), but its output
head is asked for the loss instead of the logits. The head then takes only the positions that carry a label and
computes cross-entropy over chunks of them (:class:`ChunkedLinearCrossEntropy`), so no (sequence x vocabulary)
logits tensor ever exists: peak memory is O(chunk x vocab). Models whose forward post-processes the logits
(soft-capping, scaling) are not in LEAN_MODEL_TYPES and take the plain full-logits path.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from shardtune.data.formatting import IGNORE_INDEX
from shardtune.data.vision import MODEL_INPUT_KEYS as VISION_INPUT_KEYS
from shardtune.model.attention import varlen_kwargs
from shardtune.model.lean_layer import lean_keywords
from shardtune.runtime.distributed import warn0

# HF causal LMs whose forward is `logits = lm_head(hidden); return logits` (nothing applied to the logits after).
LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# fp32 logits per chunk: 128 MiB on CPU (256 rows at Llama 3's vocabulary of 128,256); 1 GiB on GPU (2,048 rows,
# matmuls large enough to run at full rate)
CHUNK_ELEMENTS = {"cpu": 1 << 25, "cuda": 1 << 28}


# A sequence-split micro-batch (shardtune.parallel.sequence) holds a slice of a row: its labels are shifted BEFORE
# the split (the next token of a slice's last position lives on another rank), and stored under this key.
SHIFT_LABELS = "shift_labels"
# The model keyword that carries a split micro-batch's layout to the attention function.
SEQUENCE_LAYOUT = "sequence_layout"
# A split micro-batch's real input tokens (its slice of the row, less the padding the split adds), a 0-dim tensor.
SPLIT_INPUT_TOKENS = "split_input_tokens"
# The sums behind TRL's SFT metrics, over the labelled positions, in this order: predictions whose argmax is the label
# (mean_token_accuracy = num_correct / label tokens), the entropy of the predicted distribution (entropy = entropy_sum /
# label tokens).
PREDICTION_SUMS = ("num_correct", "entropy_sum")
# Rows x vocabulary of the one fp32 temporary :func:`prediction_sums` works in (4 MiB; shardtune.planner.estimate
# counts it).
PREDICTION_BLOCK_ELEMENTS = 1 << 20
# Whether RowwiseLinearCrossEntropy keeps a one-chunk softmax from forward for backward (off: always recomputed)
KEEP_ONE_CHUNK_SOFTMAX = True
# What :func:`token_predictions` gives for each scored position, in this order (TRL's DPO metrics are sums of them over
# completion tokens): whether the argmax of the logits is the target, the entropy of the predicted distribution, the
# mean of the logits over the vocabulary.
TOKEN_PREDICTIONS = ("is_top1", "entropy", "mean_logit")


def num_label_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss: labels are aligned with input_ids, so position 0 never predicts anything."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The target of each position (the next token's label), -100 at the last position: (B, T) like labels."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def next_token_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Target of every position of the micro-batch: pre-shifted labels when it carries them, else shifted here."""
    return batch[SHIFT_LABELS] if SHIFT_LABELS in batch else shift_labels(batch["labels"])


def batch_label_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Labelled tokens of a micro-batch (of a split one: those of its slice, each counted on exactly one rank)."""
    return int((next_token_targets(batch) != IGNORE_INDEX).sum())


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict:
    """The model's keywords: tensors on ``device``, plus a padding-free row's boundaries (shardtune.model.attention)."""
    keys = ("input_ids", "attention_mask", "position_ids", *VISION_INPUT_KEYS)  # a vision model's: its pixels ...
    inputs: dict = {k: batch[k].to(device, non_blocking=True) for k in keys if k in batch}
    for key, value in varlen_kwargs(batch).items():
        inputs[key] = value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
    if SEQUENCE_LAYOUT in batch:
        inputs[SEQUENCE_LAYOUT] = batch[SEQUENCE_LAYOUT].to(device)
    return inputs


def token_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of next-token cross-entropy over labelled tokens of one micro-batch, computed in fp32.

    ``model`` is what the loop calls: a DDP-, FSDP2- or PEFT-wrapped (or bare) Hugging Face causal LM.
    """
    return _token_loss(model, batch, device, with_predictions=False)[0]


def token_loss_and_prediction_sums(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`token_loss_sum`, the micro-batch's :data:`PREDICTION_SUMS` in fp64 without a graph), from the logits
    the loss computes (the lean path's chunks, or the full logits): one forward."""
    return _token_loss(model, batch, device, with_predictions=True)


def _token_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device, with_predictions: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    targets = next_token_targets(batch).to(device, non_blocking=True)
    head = lean_head(model)
    if head is None:
        return _full_logits_loss(model, batch, device, with_predictions)
    sums: dict[str, torch.Tensor | None] = {}

    def compute(hidden: torch.Tensor) -> torch.Tensor:
        loss, sums["predictions"] = linear_cross_entropy_sums(hidden, head.weight, targets, None, with_predictions)
        return loss

    inputs = model_inputs(batch, device)
    read = (targets != IGNORE_INDEX).flatten().nonzero().squeeze(1)
    with head_computes(head, compute) as result:  # the last layer at the read positions only
        model(**inputs, **lean_keywords(hf_model(model), inputs, read), use_cache=False)
    return result["output"], sums["predictions"]


def sequence_log_prob_sums(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    targets: torch.Tensor,
    segments: torch.Tensor,
    num_segments: int,
    device: torch.device,
    shared: tuple[dict, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per segment (a sequence of the micro-batch), the sum of log p(target) over its positions that have a target:
    (num_segments,) in fp32, with its graph. ``targets`` (rows, T) holds each position's next token (IGNORE_INDEX
    where none is scored), ``segments`` (rows, T) the segment of each position (padded rows: the row). The lean path
    as :func:`token_loss_sum`'s (no sequence x vocabulary logits: :class:`RowwiseLinearCrossEntropy`), the full
    logits where the model needs them. Padded rows are summed along the row, as a (rows, T) tensor of
    log-probabilities is (TRL's order of summation), in fp64. ``shared``: (the model's keywords, the index of each
    target's predicting state in its flattened output), where the model computes another layout of the same rows
    (shardtune.model.shared_prompt.shared_inputs: rows that share a prompt over one copy of it)."""
    return _sequence_sums(model, batch, targets, segments, num_segments, device, False, shared)[0]


def sequence_log_prob_and_prediction_sums(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    targets: torch.Tensor,
    segments: torch.Tensor,
    num_segments: int,
    device: torch.device,
    shared: tuple[dict, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`sequence_log_prob_sums`, per segment the sums of :data:`TOKEN_PREDICTIONS` over its scored positions:
    (num_segments, 3) fp64 without a graph), from the logits the log-probabilities are taken from: one forward, no
    second pass over the vocabulary."""
    return _sequence_sums(model, batch, targets, segments, num_segments, device, True, shared)


def _sequence_sums(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    targets: torch.Tensor,
    segments: torch.Tensor,
    num_segments: int,
    device: torch.device,
    with_predictions: bool,
    shared: tuple[dict, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    targets = targets.to(device, non_blocking=True)
    segments = segments.to(device, non_blocking=True)
    keep = targets != IGNORE_INDEX
    inputs = model_inputs(batch, device) if shared is None else shared[0]

    def scored(states: torch.Tensor) -> torch.Tensor:  # the states (or logits) that predict the targets, in order
        return states[keep] if shared is None else states.reshape(-1, states.size(-1)).index_select(0, shared[1])

    head = lean_head(model)
    found: list[torch.Tensor] = []
    if head is None:
        logits = scored(model(**inputs, use_cache=False).logits).float()
        per_token = logits.log_softmax(-1).gather(-1, targets[keep][:, None]).squeeze(-1)
        if with_predictions:
            found.append(token_predictions(logits, targets[keep]))
    else:

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            chunk_rows = default_chunk_rows(hidden.device.type, head.weight.size(0))
            sink = found if with_predictions else None
            return RowwiseLinearCrossEntropy.apply(scored(hidden), head.weight, targets[keep], chunk_rows, sink)

        read = keep.flatten().nonzero().squeeze(1) if shared is None else shared[1].unique()
        with head_computes(head, forward) as result:  # the last layer at the read positions only
            model(**inputs, **lean_keywords(hf_model(model), inputs, read), use_cache=False)
        per_token = -result["output"]
    predictions = None
    if with_predictions:  # the chunks' rows, summed per segment (in fp64: the same whatever the micro-batch's shape)
        rows = torch.cat(found) if found else torch.zeros(0, len(TOKEN_PREDICTIONS), dtype=torch.float64, device=device)
        predictions = rows.new_zeros(num_segments, len(TOKEN_PREDICTIONS)).index_add(0, segments[keep], rows)
    # summed in fp64: a sequence's sum then does not depend on the micro-batch it shares (its padded length, where it
    # sits), which would move it by an fp32 ulp of the sum from one layout to another; returned in fp32
    per_token = per_token.double()
    if num_segments == targets.shape[0] and bool(
        (segments == torch.arange(num_segments, device=device)[:, None]).all()
    ):
        sums = torch.zeros(targets.shape, dtype=per_token.dtype, device=device).masked_scatter(keep, per_token).sum(1)
    else:
        sums = torch.zeros(num_segments, dtype=per_token.dtype, device=device).index_add(0, segments[keep], per_token)
    return sums.float(), predictions


def full_logits_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The plain path: full-sequence logits, then cross-entropy. The reference the lean path is tested against."""
    return _full_logits_loss(model, batch, device, with_predictions=False)[0]


def _full_logits_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device, with_predictions: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = model(**model_inputs(batch, device), use_cache=False)
    logits = out.logits.reshape(-1, out.logits.size(-1))
    targets = next_token_targets(batch).to(device, non_blocking=True).reshape(-1)
    loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    keep = targets != IGNORE_INDEX
    return loss, prediction_sums(logits[keep], targets[keep]) if with_predictions else None


@torch.no_grad()
def prediction_sums(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """:data:`PREDICTION_SUMS` of rows of logits (n, V) and their targets (n,), in fp64: the rows whose argmax (the
    first of equal maxima) is the target, and the sum of the entropies, logsumexp - sum(softmax x logits) per row
    (TRL's formula); ``lse``: the rows' logsumexp when known. Worked in row blocks of PREDICTION_BLOCK_ELEMENTS, so the
    one temporary stays small beside the logits."""
    logits = logits.float()
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
    correct = (logits.argmax(dim=-1) == targets).sum()
    entropy = torch.zeros((), dtype=torch.float64, device=logits.device)
    for _, z_lse, expected in _expected_logits(logits, lse):
        entropy += (z_lse.sum() - expected.sum()).double()
    return torch.stack([correct.double(), entropy])


@torch.no_grad()
def token_predictions(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor | None = None, into_softmax: bool = False
) -> torch.Tensor:
    """:data:`TOKEN_PREDICTIONS` of each row of logits (n, V) with its target (n,): (n, 3) fp64, worked in fp32 as
    :func:`prediction_sums` (the first of equal maxima is the argmax; entropy = logsumexp - sum(softmax x logits)),
    for callers that sum them per sequence (DPO's chosen and rejected completions). ``into_softmax`` (fp32 logits
    and their ``lse``): the logits are left holding their softmax, each block's computed once for the entropy."""
    logits = logits.float()
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
    out = torch.empty(logits.size(0), len(TOKEN_PREDICTIONS), dtype=torch.float64, device=logits.device)
    out[:, 0] = logits.argmax(dim=-1) == targets
    out[:, 2] = logits.mean(dim=-1)
    for start, z_lse, expected in _expected_logits(logits, lse, keep_softmax=into_softmax):
        out[start : start + z_lse.size(0), 1] = z_lse - expected.reshape(-1)
    return out


def _expected_logits(
    logits: torch.Tensor, lse: torch.Tensor, keep_softmax: bool = False
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(first row, the rows' logsumexp, sum(softmax x logits) per row) of fp32 ``logits``, in row blocks of
    PREDICTION_BLOCK_ELEMENTS: the block's softmax is the one temporary, small beside the logits (and in cache when
    ``keep_softmax`` copies it over the block's logits)."""
    block = max(1, PREDICTION_BLOCK_ELEMENTS // max(1, logits.size(-1)))
    for start in range(0, logits.size(0), block):
        z, z_lse = logits[start : start + block], lse[start : start + block]
        probs = (z - z_lse[:, None]).exp_()
        yield start, z_lse, torch.bmm(probs.unsqueeze(1), z.unsqueeze(2))  # without a second softmax-sized product
        if keep_softmax:
            z.copy_(probs)


@torch.no_grad()
def _prediction_sums_into_softmax(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """:func:`prediction_sums` of fp32 ``logits``, which it leaves holding their softmax (what the gradient needs):
    each block's softmax is computed once, for the entropy and then copied over the block's logits, where the
    gradient would exponentiate the chunk a second time. The same operations on the same values as
    :func:`prediction_sums` and the in-place softmax: the same sums and the same softmax, bit for bit."""
    correct = torch.zeros((), dtype=torch.int64, device=logits.device)
    entropy = torch.zeros((), dtype=torch.float64, device=logits.device)
    for start, z_lse, expected in _expected_logits(logits, lse, keep_softmax=True):
        block = slice(start, start + z_lse.size(0))  # its logits still in cache, before the softmax replaces them
        correct += (logits[block].argmax(dim=-1) == targets[block]).sum()
        entropy += (z_lse.sum() - expected.sum()).double()
    return torch.stack([correct.double(), entropy])


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside the DDP / PEFT wrappers (FSDP2 shards in place, it adds no wrapper)."""
    while True:
        if hasattr(model, "get_base_model"):  # peft.PeftModel
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):  # DistributedDataParallel
            model = model.module
        else:
            return model


_fallback_noted: set[str] = set()


def lean_head(model: nn.Module) -> nn.Linear | None:
    """The output head the lean path can take over, or None (with a one-time note saying why)."""
    inner = hf_model(model)
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    reason = None
    if head is None:  # no output layer over the vocabulary (a sequence-classification head): nothing to take over
        return None
    if model_type not in LEAN_MODEL_TYPES:
        reason = f"model type {model_type!r} may transform its logits after the head"
    elif type(head) is not nn.Linear or head.bias is not None:
        reason = f"its output head is a {type(head).__name__}, not a bias-free nn.Linear"
    if reason is None:
        return head
    if reason not in _fallback_noted:
        _fallback_noted.add(reason)
        warn0(f"full-logits loss (more memory): {reason}")
    return None


@contextlib.contextmanager
def head_computes(head: nn.Linear, compute) -> Iterator[dict[str, torch.Tensor]]:
    """While active, ``head(hidden)`` returns ``compute(hidden)`` (a loss of the hidden states) instead of logits.

    The head is still *called* by the model's own forward, so wrappers' hooks (FSDP2 unshard, DDP, PEFT prefix
    injection) run as usual; only the head's computation changes. Its output is also returned as the model's
    ``logits``; it is read from ``result["output"]`` so that nothing relies on that. ``result`` holds the head's
    output as its callers see it, after the other forward hooks (DeepSpeed ZeRO-3 returns a new tensor from its
    hook, whose backward re-gathers the head's partitioned weight).
    """
    result: dict[str, torch.Tensor] = {}

    def keep_output(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        result["output"] = output

    head.forward = compute
    hook = head.register_forward_hook(keep_output)
    try:
        yield result
    finally:
        hook.remove()
        del head.forward


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """sum over labelled positions of cross_entropy(hidden @ weight.T, target), without full logits.

    hidden (B, T, H), targets (B, T) with IGNORE_INDEX where no loss is taken; weight (V, H).
    """
    return linear_cross_entropy_sums(hidden, weight, targets, chunk_rows)[0]


def linear_cross_entropy_sums(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int | None = None,
    with_predictions: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(:func:`linear_cross_entropy_sum`, with ``with_predictions`` the labelled positions' :data:`PREDICTION_SUMS`
    taken from the same chunks of logits, else None)."""
    keep = targets != IGNORE_INDEX
    rows = hidden[keep]
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(hidden.device.type, weight.size(0))
    loss, sums = ChunkedLinearCrossEntropy.apply(rows, weight, targets[keep], chunk_rows, with_predictions)
    return loss, sums if with_predictions else None


def default_chunk_rows(device_type: str, vocab_size: int) -> int:
    """Rows per chunk: CHUNK_ELEMENTS fp32 logits on this kind of device (at least 16 rows)."""
    return max(16, CHUNK_ELEMENTS.get(device_type, CHUNK_ELEMENTS["cpu"]) // vocab_size)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy of a linear layer's output, chunk by chunk over rows, gradients computed in forward.

    For each chunk of rows: logits = rows @ W^T (in the rows' dtype, fp32 for the softmax), loss += logsumexp
    - logit[target], and, when gradients are needed, dlogits = softmax - onehot gives d rows = dlogits @ W
    and dW += dlogits^T @ rows. The chunk's logits are then freed. Backward only scales the stored
    gradients by the incoming gradient of the (scalar) loss. Same matmul count as the plain path, and
    eval (no gradients needed) skips the gradient work. Its second output, without a gradient, holds the chunks'
    :func:`prediction_sums` when ``with_predictions`` (zeros otherwise).
    """

    @staticmethod
    def forward(
        ctx, rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int, with_predictions: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        need_rows_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        compute_dtype = rows.dtype
        w = weight.to(compute_dtype)
        loss = torch.zeros((), dtype=torch.float32, device=rows.device)
        predictions = torch.zeros(len(PREDICTION_SUMS), dtype=torch.float64, device=rows.device)
        grad_rows = torch.empty_like(rows) if need_rows_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight_grad else None
        for start in range(0, rows.size(0), chunk_rows):
            chunk = rows[start : start + chunk_rows]
            target = targets[start : start + chunk_rows]
            logits = (chunk @ w.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            loss += (lse - logits.gather(1, target[:, None]).squeeze(1)).sum()
            need_grad = need_rows_grad or need_weight_grad
            if with_predictions and need_grad:  # the softmax the gradient needs, and the entropy from it: one exp
                predictions += _prediction_sums_into_softmax(logits, target, lse)
            elif with_predictions:
                predictions += prediction_sums(logits, target, lse)
            if need_grad:
                dlogits = logits if with_predictions else logits.sub_(lse[:, None]).exp_()  # softmax, in place
                dlogits[torch.arange(chunk.size(0), device=chunk.device), target] -= 1.0
                if need_rows_grad:
                    grad_rows[start : start + chunk_rows] = (dlogits.to(compute_dtype) @ w).to(rows.dtype)
                if need_weight_grad and compute_dtype == torch.float32:
                    grad_weight.addmm_(dlogits.t(), chunk)
                elif need_weight_grad:  # bf16 / fp16 matmul, accumulated across chunks in fp32
                    grad_weight += dlogits.t().to(compute_dtype) @ chunk
            del logits
        # kept on ctx, not saved: backward scales them in place (one graph, one backward, no second copy)
        ctx.grad_rows, ctx.grad_weight, ctx.weight_dtype = grad_rows, grad_weight, weight.dtype
        ctx.mark_non_differentiable(predictions)
        return loss, predictions

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_predictions: torch.Tensor | None = None):
        grad_rows, grad_weight = ctx.grad_rows, ctx.grad_weight
        ctx.grad_rows = ctx.grad_weight = None
        d_rows = grad_rows.mul_(grad_loss.to(grad_rows.dtype)) if grad_rows is not None else None
        d_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype) if grad_weight is not None else None
        return d_rows, d_weight, None, None, None


class RowwiseLinearCrossEntropy(torch.autograd.Function):
    """Each row's cross-entropy of a linear layer's output, chunk by chunk: an (n,) result whose gradient differs per
    row (DPO's per-sequence log-probabilities go through a non-linear loss), so the gradients cannot be taken in
    forward as :class:`ChunkedLinearCrossEntropy` does. When all the rows fit one chunk (GRPO's and DPO's usual
    micro-batches on a CPU: n x vocabulary <= CHUNK_ELEMENTS) and a gradient is needed, forward keeps that chunk's
    softmax for backward (the memory the chunk's logits take in forward anyway, freed by the first step of
    backward); otherwise it keeps no logits and backward recomputes each chunk's. The gradient is the same bit for
    bit either way (the same operations on the same values), the kept softmax spares backward a matmul over the
    vocabulary and its exponentials. ``predictions``: a list that each chunk's :func:`token_predictions` is appended
    to (or None), from the chunk's logits at hand (and its one softmax when kept)."""

    @staticmethod
    def forward(
        ctx,
        rows: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_rows: int,
        predictions: list | None = None,
    ) -> torch.Tensor:
        w = weight.to(rows.dtype)
        losses = torch.empty(rows.size(0), dtype=torch.float32, device=rows.device)
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        keep = KEEP_ONE_CHUNK_SOFTMAX and needs_grad and rows.size(0) <= chunk_rows
        ctx.softmax = None
        for start in range(0, rows.size(0), chunk_rows):
            logits = (rows[start : start + chunk_rows] @ w.t()).float()
            target = targets[start : start + chunk_rows]
            lse = torch.logsumexp(logits, dim=-1)
            losses[start : start + chunk_rows] = lse - logits.gather(1, target[:, None]).squeeze(1)
            if predictions is not None:  # from the chunk's logits at hand: no second pass over the vocabulary
                predictions.append(token_predictions(logits, target, lse, into_softmax=keep))
            elif keep:
                logits.sub_(lse[:, None]).exp_()
            if keep:  # logits now hold their softmax
                ctx.softmax = logits
            del logits
        ctx.save_for_backward(rows, targets)
        ctx.weight, ctx.chunk_rows = weight, chunk_rows  # the parameter itself: re-gathered by its wrapper's hooks
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        rows, targets = ctx.saved_tensors
        weight, chunk_rows, kept = ctx.weight, ctx.chunk_rows, ctx.softmax
        ctx.softmax = None
        need_rows_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        compute_dtype = rows.dtype
        w = weight.to(compute_dtype)
        grad_rows = torch.empty_like(rows) if need_rows_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight_grad else None
        for start in range(0, rows.size(0), chunk_rows):
            chunk = rows[start : start + chunk_rows]
            if kept is not None:  # forward's softmax (one chunk)
                dlogits = kept
            else:
                logits = (chunk @ w.t()).float()
                dlogits = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_()
            dlogits[torch.arange(chunk.size(0), device=chunk.device), targets[start : start + chunk_rows]] -= 1.0
            dlogits.mul_(grad_losses[start : start + chunk_rows, None].float())
            if need_rows_grad:
                grad_rows[start : start + chunk_rows] = (dlogits.to(compute_dtype) @ w).to(rows.dtype)
            if need_weight_grad and compute_dtype == torch.float32:
                grad_weight.addmm_(dlogits.t(), chunk)
            elif need_weight_grad:
                grad_weight += dlogits.t().to(compute_dtype) @ chunk
            del dlogits
        ctx.weight = kept = None
        d_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_rows, d_weight, None, None, None
