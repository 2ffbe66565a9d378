"""The analytic FLOPs count (shardtune/accounting/flops.py) against torch's own FlopCounterMode on a real training step:
forward + backward of the tiny preset with the lean loss, padded and padding-free."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardtune.accounting.flops import (
    causal_attention_flops,
    flop_counter,
    matmul_flops_per_token,
    micro_batch_flops,
    model_shape,
    num_input_tokens,
    palm_micro_batch_flops,
    sequence_lengths,
)
from shardtune.data.batching import collate_flat, collate_padding
from shardtune.model.attention import use_varlen_attention
from shardtune.model.loading import load_model
from shardtune.model.loss import IGNORE_INDEX, token_loss_sum

CPU = torch.device("cpu")
# both sides are exact integer counts of the same matmuls: they must agree to float rounding of the sum
TOLERANCE = 1e-9


def examples(num: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num):
        length = int(torch.randint(12, 40, (1,), generator=gen))
        ids = torch.randint(4, 1000, (length,), generator=gen).tolist()
        prompt = length // 2  # the lean loss computes the output layer on the labelled half only
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return rows


def measured_step(model, batch) -> tuple[int, int]:
    """(all FLOPs, attention FLOPs) torch counts for one forward + backward."""
    model.zero_grad(set_to_none=True)
    with flop_counter() as counter:
        token_loss_sum(model, batch, CPU).backward()
    counts = counter.get_flop_counts()["Global"]
    attention = sum(n for op, n in counts.items() if "scaled_dot_product" in str(op))
    return counter.get_total_flops(), attention


def attention_squares(batch) -> int:
    """Query-key pairs the kernels are handed: each example's n x n (padding-free), each padded row's T x T."""
    if "cu_seq_lens" in batch:
        return sum(n * n for n in sequence_lengths(batch))
    rows, length = batch["input_ids"].shape
    return rows * length * length


def last_layer_rectangles(batch, read: torch.Tensor) -> int:
    """Query-key pairs the lean last layer hands the kernel (shardtune.model.lean_layer): each example's (padded
    row's) read positions (``read``: rows x T) against all its n (T) keys."""
    if "cu_seq_lens" in batch:
        cu = batch["cu_seq_lens"].tolist()
        return sum(int(read[0, start:end].sum()) * (end - start) for start, end in zip(cu[:-1], cu[1:]))
    return int(read.sum()) * batch["input_ids"].size(1)


def pad_waste(shape, pad_tokens: int) -> int:
    """The training FLOPs the kernels spend on pad tokens: every layer's matmuls but the lean last layer's query,
    output projection and MLP, which run on read positions only."""
    return pad_tokens * matmul_flops_per_token(
        shape.num_body_params - shape.lean_layer_params,
        shape.num_trainable_body_params - shape.lean_layer_trainable,
    )


@pytest.mark.parametrize("layout", ["padding", "packing"])
def test_analytic_flops_equal_torch_flop_counter_on_a_lean_loss_step(tiny_model, layout):
    model = load_model(str(tiny_model))
    if layout == "packing":
        use_varlen_attention(model)
        batch = collate_flat(examples(3, 1) + examples(2, 2))
    else:
        batch = collate_padding(examples(3, 0), pad_id=3)
    shape = model_shape(model)
    assert shape.lean_loss and shape.lean_layer_params > 0
    total, attention = measured_step(model, batch)
    analytic = micro_batch_flops(shape, batch)
    analytic_attention = causal_attention_flops(shape, sequence_lengths(batch))
    # the layers' matmuls and the output layer (on labelled positions only): what torch counts, to rounding,
    # except the pad tokens of a padded batch, which the kernels compute and the count leaves out (wasted work)
    pad_tokens = batch["input_ids"].numel() - num_input_tokens(batch)
    assert (layout == "padding") == (pad_tokens > 0)
    assert (
        abs((analytic - analytic_attention + pad_waste(shape, pad_tokens)) - (total - attention)) <= TOLERANCE * total
    )
    # attention: torch counts the full square it hands the kernel, 4 FLOPs per pair and feature forward and 10
    # backward (5 matmuls: the scores are recomputed), the last layer's read queries against their keys; the model
    # needs 4 + 8 on the causal triangle, n (n + 1) / 2 pairs of each sequence (what causal kernels compute, without
    # the recomputation): less
    read = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX) != IGNORE_INDEX
    handed = (shape.num_layers - 1) * attention_squares(batch) + last_layer_rectangles(batch, read)
    assert attention == 14 * shape.attention_size * handed
    assert 0 < analytic_attention < attention
    assert analytic < total < palm_micro_batch_flops(shape, batch)  # PaLM: the output layer on every token too


def test_dpo_flops_count_the_policy_step_and_the_reference_forward_on_the_lean_head(tiny_model):
    """A DPO micro-batch (padded rows, chosen and rejected alike) through the objective's own log-probabilities: the
    policy trains with the lean head (the output layer on the completion targets only), the reference runs forward
    only; the analytic count equals torch's to rounding, less the pad tokens, the attention squares the kernels
    compute beyond the causal triangle, and the lean head's recomputation of its logits in backward where it
    recomputes them (as activation checkpointing's recomputation, not model FLOPs; one chunk's softmax is kept)."""
    from shardtune.accounting.flops import preference_micro_batch_flops
    from shardtune.data.preference import collate_pairs
    from shardtune.model.loss import default_chunk_rows
    from shardtune.training.objectives.dpo.logps import completion_targets, num_completion_targets, pair_logps

    policy, reference = load_model(str(tiny_model)), load_model(str(tiny_model))
    reference.requires_grad_(False)
    gen = torch.Generator().manual_seed(3)
    pairs = [
        {
            "prompt_ids": torch.randint(4, 1000, (int(n),), generator=gen).tolist(),
            "chosen_ids": torch.randint(4, 1000, (int(c),), generator=gen).tolist(),
            "rejected_ids": torch.randint(4, 1000, (int(r),), generator=gen).tolist(),
        }
        for n, c, r in ((9, 5, 7), (14, 3, 6), (6, 8, 4))
    ]
    batch = collate_pairs(pairs, pad_id=3, max_length=None)
    shape = model_shape(policy)
    assert shape.lean_loss
    scored = num_completion_targets(batch)
    with flop_counter() as counter:
        torch.cat(pair_logps(policy, batch, CPU)).sum().backward()
        with torch.no_grad():
            pair_logps(reference, batch, CPU)
    counts = counter.get_flop_counts()["Global"]
    attention = sum(n for op, n in counts.items() if "scaled_dot_product" in str(op))
    total = counter.get_total_flops()
    flops, palm = preference_micro_batch_flops(shape, batch, scored)
    causal = causal_attention_flops(shape, sequence_lengths(batch))
    pad = batch["input_ids"].numel() - num_input_tokens(batch)
    wasted = pad_waste(shape, pad) + pad * 2 * (shape.num_body_params - shape.lean_layer_params)  # + the reference's
    # the lean head's logits, recomputed in backward (as activation checkpointing's) unless they fit one chunk, whose
    # softmax forward keeps (shardtune.model.loss.RowwiseLinearCrossEntropy): these rows do
    kept = scored <= default_chunk_rows(CPU.type, policy.config.vocab_size)
    recomputed = 0 if kept else 2 * shape.num_head_params * scored
    assert (
        pad > 0 and abs((flops - causal - causal // 3 + wasted + recomputed) - (total - attention)) <= TOLERANCE * total
    )
    # torch: 14 per pair and feature for the policy (forward, recomputed scores, backward), 4 for the reference; the
    # last layer's read queries against their row
    read = completion_targets(batch)[0] != IGNORE_INDEX
    handed = (shape.num_layers - 1) * attention_squares(batch) + last_layer_rectangles(batch, read)
    assert attention == 18 * shape.attention_size * handed
    assert 0 < flops < total and flops < palm
