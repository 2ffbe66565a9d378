"""GRPO's loss (TRL 1.16's GRPOTrainer._compute_loss, for the loss types dapo, grpo, dr_grpo, bnpo) as sums whose
normaliser the engine divides by once per step (shardtune.training.engine.objective), and the per-token
log-probabilities
and entropies it starts from.

Per completion token t: r = exp(logp - old) (token level; sequence level: exp of the mean of the sequence's
log-ratios), the clipped surrogate -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), plus beta x the k3 estimate
of the KL to the reference (exp(ref - logp) - (ref - logp) - 1, times r with use_bias_correction_kl). The step's loss
is the sum of those over the step's completion tokens divided by N, where N is

- dapo: the round's completion tokens / its optimizer steps (TRL: num_items_in_batch, the generation batch's tokens,
  rescaled to one step);
- bnpo: the step's completion tokens (TRL divides by each local batch's tokens, so its value changes with the layout;
  equal to TRL's at 1 process x 1 micro-batch);
- grpo: the step's completions, each contributing its own token mean;
- dr_grpo: the step's completions x max_completion_length.

Every N is global, so any split of a step over processes and accumulation gives the same loss and gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtune.config.schema import GrpoConfig
from shardtune.model.lean_layer import lean_keywords
from shardtune.model.loss import (
    IGNORE_INDEX,
    TOKEN_PREDICTIONS,
    RowwiseLinearCrossEntropy,
    default_chunk_rows,
    head_computes,
    hf_model,
    lean_head,
    model_inputs,
)
from shardtune.model.shared_prompt import shared_inputs

# Sums over a micro-batch: the loss; the KL, entropy and clip indicators summed over tokens (token level) or over
# sequences (their value per sequence at the sequence level), TRL's global masked means once divided
STATS = ("loss_sum", "kl_sum", "entropy_sum", "low_clip_sum", "high_clip_sum", "region_clip_sum", "low_min", "high_max")
ENTROPY = TOKEN_PREDICTIONS.index("entropy")  # token_predictions' column of the entropy
REDUCTIONS = ("sum",) * 6 + ("min", "max")  # how each stat combines over the step (Objective.stat_reductions)


def completion_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The next token each position predicts where it is a completion token (prompt, padding: IGNORE_INDEX)."""
    targets = batch["input_ids"][:, 1:].masked_fill(batch["completion_mask"][:, 1:] == 0, IGNORE_INDEX)
    return torch.nn.functional.pad(targets, (0, 1), value=IGNORE_INDEX)


def token_logps(
    model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device, temperature: float, entropies: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(token) of every scored position of the batch's completions, under logits / temperature, as TRL's:
    (rows, T) fp32 with its graph, 0 where not scored; the entropies there, without a graph, or None). The lean head
    computes them from the hidden states of the scored positions only (no rows x T x vocabulary logits), the entropy
    from the logits its cross-entropy already holds; completions that share a prompt are computed over one copy of
    it where the model can (shardtune.model.shared_prompt)."""
    targets = completion_targets(batch).to(device)
    keep = targets != IGNORE_INDEX
    shared = shared_inputs(model, batch, device)
    if shared is None:
        inputs = model_inputs(batch, device)
        read = keep.flatten().nonzero().squeeze(1)

        def pick(states: torch.Tensor) -> torch.Tensor:
            return states[keep]
    else:
        inputs, index = shared
        read = index.unique()

        def pick(states: torch.Tensor) -> torch.Tensor:
            return states.reshape(-1, states.size(-1)).index_select(0, index)

    head = lean_head(model)
    found: dict[str, torch.Tensor] = {}

    def scored(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = pick(hidden) / temperature  # logits / T = (hidden / T) @ W^T
        chunk = default_chunk_rows(rows.device.type, weight.size(0))
        predictions: list | None = [] if entropies else None
        per_token = -RowwiseLinearCrossEntropy.apply(rows, weight, targets[keep], chunk, predictions)
        if entropies:
            found["entropy"] = torch.cat([p[:, ENTROPY] for p in predictions]) if predictions else rows.new_zeros(0)
        return per_token  # its logits recomputed in backward

    if head is None:  # the model's own head: its logits
        flat = pick(model(**inputs, use_cache=False).logits).float() / temperature
        per_token = flat.gather(-1, targets[keep][:, None]).squeeze(-1) - flat.logsumexp(-1)
        if entropies:
            detached = flat.detach()
            found["entropy"] = detached.logsumexp(-1) - (detached.softmax(-1) * detached).sum(-1)
    else:
        lean = lean_keywords(hf_model(model), inputs, read)  # the last layer at the read positions only
        with head_computes(head, lambda hidden: scored(hidden, head.weight)) as result:
            model(**inputs, **lean, use_cache=False)
        per_token = result["output"]
    full = torch.zeros(keep.shape, dtype=torch.float32, device=device).masked_scatter(keep, per_token.float())
    entropy = None
    if entropies:
        entropy = torch.zeros(keep.shape, dtype=torch.float32, device=device).masked_scatter(
            keep, found["entropy"].float()
        )
    return full, entropy


def token_terms(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    grpo: GrpoConfig,
) -> dict[str, torch.Tensor]:
    """TRL's per-token loss (rows, T) and what its metrics read: ``coef_1`` ((rows, T) or (rows, 1)), ``kl`` (or
    absent with beta 0). ``old_logps`` None: the policy that sampled is this one (r = 1)."""
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if grpo.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    kl = None
    if grpo.beta != 0.0:  # weighted by the ratio before delta caps it, as TRL's
        log_ref = ref_logps - logps
        kl = torch.exp(log_ref) - log_ref - 1
        if grpo.use_bias_correction_kl:
            kl = kl * coef_1
    eps_low, eps_high = grpo.epsilon, grpo.epsilon_high or grpo.epsilon
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    if grpo.delta:  # two-sided clipping: the unclipped term's ratio capped (the clip metrics read the capped one)
        coef_1 = torch.clamp(coef_1, max=grpo.delta)
    a = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
    out = {"coef_1": coef_1, "advantages": a}
    if kl is not None:
        per_token_loss = per_token_loss + grpo.beta * kl
        out["kl"] = kl
    out["per_token_loss"] = per_token_loss
    return out


def loss_sum(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The micro-batch's part of the step's loss before the division by N (module docstring)."""
    masked = per_token_loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    return masked.sum()


def clip_indicators(coef_1: torch.Tensor, advantages: torch.Tensor, grpo: GrpoConfig) -> tuple[torch.Tensor, ...]:
    """(low, high, region) clipped indicators, TRL's definitions, as floats shaped as coef_1."""
    eps_low, eps_high = grpo.epsilon, grpo.epsilon_high or grpo.epsilon
    low = (coef_1 < 1 - eps_low) & (advantages < 0)
    high = (coef_1 > 1 + eps_high) & (advantages > 0)
    return low.float(), high.float(), (low | high).float()


def masked_total(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's global_masked_mean's numerator: over tokens, or over sequences when ``x`` has one value per sequence."""
    return x.sum() if x.shape[1] == 1 else (x * mask).sum()


def seq_means(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's masked_seq_mean: one value per sequence (NaN for a sequence without scored tokens)."""
    return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)


def micro_batch_terms(
    logps: torch.Tensor,
    entropies: torch.Tensor,
    batch: dict[str, torch.Tensor],
    grpo: GrpoConfig,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(loss sum with its graph, the sums of STATS (fp64), (the lowest per-sequence low-clip mean, the highest
    high-clip mean) of the micro-batch: TRL's clip_ratio/low_min and high_max before the global min / max)."""
    mask = completion_targets(batch).to(device).ne(IGNORE_INDEX).float()
    old = batch.get("old_logps")
    ref = batch.get("ref_logps")
    terms = token_terms(
        logps,
        None if old is None else old.to(device),
        None if ref is None else ref.to(device),
        batch["advantages"].to(device).float(),
        mask,
        grpo,
    )
    total = loss_sum(terms["per_token_loss"], mask, grpo.loss_type)
    low, high, region = clip_indicators(terms["coef_1"].detach(), terms["advantages"], grpo)
    kl = terms["kl"].detach() if "kl" in terms else torch.zeros_like(mask)
    values = (
        total.detach(),
        masked_total(kl, mask),
        (entropies * mask).sum(),
        *(masked_total(x, mask) for x in (low, high, region)),
    )
    extremes = (  # TRL's clip_ratio/low_min and high_max of the micro-batch, before the step's min / max
        seq_means(low, mask).nan_to_num(float("inf")).min(),
        seq_means(high, mask).nan_to_num(-float("inf")).max(),
    )
    return total, torch.stack([v.double() for v in (*values, *extremes)])
