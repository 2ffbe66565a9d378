"""The DPO objective (TRL 1.16's DPOTrainer): per-pair log-probabilities, the preference losses, the reference, and
one optimizer step whose loss is the mean over the step's GLOBAL pairs.

A micro-batch is :func:`shardtune.data.preference.collate_pairs`' layout: ``n`` chosen rows then ``n`` rejected
rows, so chosen and rejected run through the model in ONE forward. A pair's log-probability is the sum of its
completion tokens' log-probabilities (``completion_mask``, shifted: position t predicts token t + 1).

The step loss is sum(pair losses over all micro-batches on all ranks) / P, P the global number of pairs of the
step (all-reduced, as the SFT loop does with tokens): each micro-batch contributes sum x W / P to backward, W
the ranks the strategy averages gradients over. So 1 x 4 x 1, 2 x 2 x 1 and 1 x 1 x 4 (processes x pairs x
accumulation) compute the same gradients up to float rounding.

The reference: with PEFT the policy's own base with the adapter switched off (no second copy); for full
fine-tuning a frozen copy (``ref_model``), which the caller wraps like the policy.

Rows split over ranks (--sp_size / --cp_size, :class:`SplitRows`): the ranks of a cp x sp group hold slices of the
same padding-free row of pairs (shardtune.parallel.sequence.split_row: targets shifted before the split, each token
knowing its sequence). Each rank sums its slice's log-probabilities per sequence and one all-reduce over the group
gives every rank the whole sums; the group's ranks then compute the same pair losses, and each backpropagates them
into its own slice (:class:`SummedOverSplit`: the sum's gradient is the same for every part). The group's ranks count
their pairs and metrics once (sums / group size), and the gradient average over all W ranks, undone by W as above,
adds up the slices.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardtune.config.schema import DpoConfig
from shardtune.data.formatting import IGNORE_INDEX
from shardtune.model.loss import SHIFT_LABELS, model_inputs
from shardtune.parallel.sequence import SEQUENCE_INDEX

# The metrics of a step, TRL's names; each the mean over the step's global pairs.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class SplitRows:
    """The ranks that split each row (a context x sequence parallel group): its process group, its size, and this
    rank's slice of a collated row (shardtune.parallel.sequence.RowSlice)."""
    group: dist.ProcessGroup
    size: int
    row_slice: object

    def __call__(self, batch: dict, pad_id: int) -> dict:
        return self.row_slice(batch, pad_id)


class SummedOverSplit(torch.autograd.Function):
    """Forward: the sum of every rank's partial per-sequence sums (all-reduce over the split group). Backward: the
    incoming gradient as it is. Every rank of the group computes the same losses from the same totals, so the
    gradient of a total is the same on each, and it is the gradient of each rank's part."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = partial.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def predicted_completion(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which targets (positions 1..T-1, the next token of each position) are completion tokens: (rows, T - 1). In a
    padding-free row (``cu_seq_lens``) a sequence's first token is nobody's target, as a padded row's position 0."""
    mask = batch["completion_mask"][:, 1:].clone()
    if "cu_seq_lens" in batch:
        mask[0, batch["cu_seq_lens"][1:-1].long() - 1] = 0
    return mask


def sequence_sums(per_target: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per sequence (2n,): the sum over its targets of (rows, T - 1) values, rows padded or one padding-free row."""
    if "cu_seq_lens" not in batch:
        return per_target.sum(dim=1)
    lengths = batch["cu_seq_lens"].diff().long().to(per_target.device)
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=per_target.device), lengths)[1:]
    return torch.zeros(len(lengths), dtype=per_target.dtype, device=per_target.device).index_add(
        0, sequence, per_target[0])


def pair_logps(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device,
               split: SplitRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) log-probabilities of the micro-batch's pairs, each (n,) in fp32, from one forward (of
    2n padded rows, or of one padding-free row, or of this rank's slice of it: ``split``)."""
    inputs = model_inputs(batch, device)
    if SHIFT_LABELS in batch:  # a slice of a split row: its sums are partial, all-reduced over the split group
        partial = slice_sequence_sums(model(**inputs, use_cache=False).logits, batch, device)
        return SummedOverSplit.apply(partial, split.group).chunk(2, dim=0)
    logits = model(**inputs, use_cache=False).logits[:, :-1].float()
    targets = inputs["input_ids"][:, 1:]
    mask = predicted_completion(batch).to(device)
    per_token = torch.gather(logits.log_softmax(-1), 2, targets.unsqueeze(-1)).squeeze(-1)
    return sequence_sums(per_token * mask, batch).chunk(2, dim=0)


def slice_sequence_sums(logits: torch.Tensor, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """Per sequence of the whole row (2n,), the sum of its completion log-probabilities that fall in this slice of a
    split row: targets come shifted (``shift_labels``: the next token of the slice's last position lives elsewhere),
    each token knows its sequence (``sequence_index``; the split's padding, index 2n, is dropped)."""
    targets = batch[SHIFT_LABELS].to(device)
    keep = targets != IGNORE_INDEX
    per_token = torch.gather(logits.float().log_softmax(-1), 2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    num = batch["completion_lengths"].numel()
    index = batch[SEQUENCE_INDEX].to(device)[0].clamp(max=num)
    return torch.zeros(num + 1, dtype=per_token.dtype, device=device).index_add(0, index, (per_token * keep)[0])[:num]


def completion_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Completion tokens of each sequence (2n,), as TRL counts them for ipo (the unshifted completion mask)."""
    if "completion_lengths" in batch:  # counted at collation (a split row's slices keep them)
        return batch["completion_lengths"].float()
    mask = batch["completion_mask"].float()
    if "cu_seq_lens" not in batch:
        return mask.sum(dim=1)
    return torch.stack([part.sum() for part in mask[0].split(batch["cu_seq_lens"].diff().tolist())])


def adapter_disabled(model: nn.Module) -> contextlib.AbstractContextManager:
    """The PEFT model's base (its adapter switched off) for the duration of the block."""
    return model.disable_adapter()


@torch.no_grad()
def reference_logps(policy: nn.Module, ref_model: nn.Module | None, peft_model: nn.Module | None,
                    batch: dict[str, torch.Tensor], device: torch.device, split: SplitRows | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's (chosen, rejected) log-probabilities: those the batch carries (--precompute_ref_log_probs),
    else ``ref_model``'s when given, else the policy's with the adapter of ``peft_model`` (the unwrapped PEFT model)
    switched off."""
    if "ref_logps" in batch:
        ref = batch["ref_logps"].to(device)
        return ref[:, 0], ref[:, 1]
    if ref_model is not None:
        return pair_logps(ref_model, batch, device, split)
    if peft_model is None:
        raise ValueError("a reference needs ref_model (full fine-tuning) or peft_model (the adapter switched off)")
    with adapter_disabled(peft_model):
        return pair_logps(policy, batch, device, split)


def loss_types(dpo: DpoConfig) -> list[str]:
    """--loss_type as a list (a single name, as code and older configs write it, is a list of one)."""
    return [dpo.loss_type] if isinstance(dpo.loss_type, str) else list(dpo.loss_type)


def loss_terms(dpo: DpoConfig) -> list[tuple[str, float]]:
    """(loss type, weight) of each --loss_type, weighted by --loss_weights (1 each when not given), as TRL sums them."""
    types = loss_types(dpo)
    return list(zip(types, list(dpo.loss_weights) or [1.0] * len(types)))


def sft_weight(dpo: DpoConfig) -> float:
    """The weight of the ``sft`` term (the NLL of the chosen completions, a mean over their tokens; 0: none)."""
    return sum(weight for loss_type, weight in loss_terms(dpo) if loss_type == "sft")


def divergence_scores(logratios: torch.Tensor, dpo: DpoConfig) -> torch.Tensor:
    """The log-ratios through --f_divergence_type's f'(t), t = pi / pi_ref (f-DPO; reverse_kl: the log-ratios)."""
    kind = dpo.f_divergence_type
    if kind == "forward_kl":  # f'(t) = 1 - 1 / t
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":  # f'(t) = log(2 t / (t + 1))
        return math.log(2) + F.logsigmoid(logratios)
    if kind == "alpha_divergence" and abs(dpo.f_alpha_divergence_coef - 1.0) >= 1e-6:  # (t^(a - 1) - 1) / (a - 1)
        a = dpo.f_alpha_divergence_coef
        return (torch.exp(((a - 1.0) * logratios).clamp(max=80.0)) - 1.0) / (a - 1.0)
    return logratios  # reverse_kl, and alpha_divergence's limit at alpha = 1


# the losses that are functions of the divergence scores' difference (TRL: the others have no f-DPO form)
F_DIVERGENCE_LOSSES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}


def preference_losses(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
                      ref_rejected: torch.Tensor, lengths: torch.Tensor, dpo: DpoConfig) -> torch.Tensor:
    """Per-pair losses (n,), as TRL 1.16 computes them: each --loss_type's term times its weight, summed (``sft``,
    a mean over tokens rather than pairs, is added by the caller: :func:`sft_weight`). ``lengths``: the micro-batch's
    completion lengths (2n,) (:func:`completion_lengths`), for ipo's and sigmoid_norm's per-token normalisation."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    chosen_score, rejected_score = divergence_scores(chosen_ratio, dpo), divergence_scores(rejected_ratio, dpo)
    beta, eps = dpo.beta, dpo.label_smoothing
    margin = beta * (chosen_score - rejected_score)
    chosen_len, rejected_len = lengths.to(chosen.device).float().clamp(min=1.0).chunk(2, dim=0)
    per_token = chosen_score / chosen_len - rejected_score / rejected_len
    total = torch.zeros_like(chosen)
    for loss_type, weight in loss_terms(dpo):
        if loss_type == "sigmoid":
            loss = -F.logsigmoid(margin)
        elif loss_type == "hinge":
            loss = torch.relu(1 - margin)
        elif loss_type == "ipo":  # per completion token (TRL, with the IPO authors)
            loss = (per_token - 1 / (2 * beta)) ** 2
        elif loss_type == "sigmoid_norm":
            loss = -F.logsigmoid(beta * per_token)
        elif loss_type == "robust":
            loss = (-(1 - eps) * F.logsigmoid(margin) + eps * F.logsigmoid(-margin)) / (1 - 2 * eps)
        elif loss_type == "exo_pair":  # KL(p_theta || p_target) over {chosen, rejected}, target (1 - eps, eps)
            loss = (torch.sigmoid(margin) * (F.logsigmoid(margin) - math.log1p(-eps))
                    + torch.sigmoid(-margin) * (F.logsigmoid(-margin) - math.log(eps)))
        elif loss_type == "nca_pair":
            loss = (-F.logsigmoid(beta * chosen_ratio) - 0.5 * F.logsigmoid(-beta * chosen_ratio)
                    - 0.5 * F.logsigmoid(-beta * rejected_ratio))
        elif loss_type == "bco_pair":
            loss = -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
        elif loss_type == "sppo_hard":  # the winner's log-ratio pulled to 1 / (2 beta), the loser's to -1 / (2 beta)
            loss = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
        elif loss_type == "apo_zero":
            loss = (1 - torch.sigmoid(beta * chosen_ratio)) + torch.sigmoid(beta * rejected_ratio)
        elif loss_type == "apo_down":
            loss = torch.sigmoid(beta * chosen_ratio) + (1 - torch.sigmoid(beta * (chosen_ratio - rejected_ratio)))
        elif loss_type == "discopop":  # logistic and exponential losses, mixed by the margin
            mix = torch.sigmoid(margin / dpo.discopop_tau)
            loss = -F.logsigmoid(margin) * (1 - mix) + torch.exp(-margin) * mix
        elif loss_type == "sft":
            continue
        else:
            raise ValueError(f"unknown --loss_type {loss_type}")
        total = total + weight * loss
    return total


@dataclass
class PairStats:
    """Sums over pairs (float64, on the CPU): the pair losses, the metrics' numerators, and the chosen completions'
    NLL (the ``sft`` term's numerator)."""

    sums: torch.Tensor

    @classmethod
    def zero(cls) -> PairStats:
        return cls(torch.zeros(2 + len(METRICS), dtype=torch.float64))

    def add(self, losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
            ref_rejected: torch.Tensor, beta: float) -> None:
        chosen_rewards = beta * (chosen - ref_chosen).detach()
        rejected_rewards = beta * (rejected - ref_rejected).detach()
        values = (losses.detach(), chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).float(),
                  chosen_rewards - rejected_rewards, chosen.detach(), rejected.detach(), -chosen.detach())
        self.sums += torch.stack([v.double().sum().cpu() for v in values])

    def means(self, summed: torch.Tensor, num_pairs: int, chosen_tokens: int = 0, sft: float = 0.0
              ) -> dict[str, float]:
        """``summed``: these sums all-reduced over ranks; the loss is the pair losses' mean plus ``sft`` x the NLL of
        the ``chosen_tokens`` chosen completion tokens, per token (as TRL's ``sft`` term)."""
        n = max(num_pairs, 1)
        loss = float(summed[0]) / n + (sft * float(summed[-1]) / max(chosen_tokens, 1) if sft else 0.0)
        return {"loss": loss, **{name: float(summed[i + 1]) / n for i, name in enumerate(METRICS)}}


def micro_batch_loss(policy: nn.Module, ref_model: nn.Module | None, peft_model: nn.Module | None,
                     batch: dict[str, torch.Tensor], dpo: DpoConfig, device: torch.device, stats: PairStats,
                     split: SplitRows | None = None, sft_scale: float | None = None) -> torch.Tensor:
    """The SUM of the micro-batch's pair losses (with its graph), plus with an ``sft`` term its weight x the chosen
    completions' NLL x ``sft_scale`` (pairs per chosen completion token of the step: the term is then a mean over
    tokens, not pairs, once the caller divides by the pairs; None: this micro-batch's, as TRL for one batch); the
    metrics' sums go into ``stats``."""
    ref_chosen, ref_rejected = reference_logps(policy, ref_model, peft_model, batch, device, split)
    chosen, rejected = pair_logps(policy, batch, device, split)
    losses = preference_losses(chosen, rejected, ref_chosen, ref_rejected, completion_lengths(batch), dpo)
    stats.add(losses, chosen, rejected, ref_chosen, ref_rejected, dpo.beta)
    weight = sft_weight(dpo)
    if not weight:
        return losses.sum()
    if sft_scale is None:
        sft_scale = num_pairs(batch) / max(chosen_completion_targets(batch), 1)
    return losses.sum() - weight * sft_scale * chosen.sum()


def num_pairs(batch: dict[str, torch.Tensor]) -> int:
    if "completion_lengths" in batch:
        return batch["completion_lengths"].numel() // 2
    sequences = len(batch["cu_seq_lens"]) - 1 if "cu_seq_lens" in batch else batch["input_ids"].shape[0]
    return sequences // 2


def chosen_completion_targets(batch: dict[str, torch.Tensor]) -> int:
    """Completion tokens of the chosen sequences predicted in this micro-batch (of this slice, for a split row): the
    tokens of TRL's ``sft`` term."""
    n = num_pairs(batch)
    if SHIFT_LABELS in batch:
        return int(((batch[SHIFT_LABELS] != IGNORE_INDEX) & (batch[SEQUENCE_INDEX] < n)).sum())
    mask = predicted_completion(batch)
    if "cu_seq_lens" not in batch:
        return int(mask[:n].sum())
    return int(mask[0, :int(batch["cu_seq_lens"][n]) - 1].sum())  # targets of the row's first n sequences


def num_completion_targets(batch: dict[str, torch.Tensor]) -> int:
    """Completion tokens predicted in this micro-batch (of this slice, for a split row)."""
    if SHIFT_LABELS in batch:
        return int((batch[SHIFT_LABELS] != IGNORE_INDEX).sum())
    return int(predicted_completion(batch).sum())


def check_loss_options(dpo: DpoConfig) -> None:
    """The loss flags as TRL 1.16 takes them, and nothing accepted and ignored: --label_smoothing only where a loss
    reads it (robust, exo_pair), --discopop_tau with discopop, --f_alpha_divergence_coef with alpha_divergence."""
    from shardtune.config.schema import ConfigError

    types = loss_types(dpo)
    eps = dpo.label_smoothing
    if dpo.beta <= 0 or not math.isfinite(dpo.beta):
        raise ConfigError(f"--beta {dpo.beta}: must be a positive number (TRL's default: 0.1)")
    if not types:
        raise ConfigError("--loss_type is empty: name at least one loss (TRL's default: sigmoid)")
    for loss_type in {"aot", "aot_unpaired"} & set(types):
        raise ConfigError(f"--loss_type {loss_type} sorts the log-ratios within a device's batch, so its loss would "
                          "change with the number of processes (the guarantee of docs/dpo.md): not built; use "
                          "sigmoid, or another of TRL's per-pair losses")
    if dpo.loss_weights and len(dpo.loss_weights) != len(types):
        raise ConfigError(f"--loss_weights has {len(dpo.loss_weights)} weights for {len(types)} loss types "
                          f"({', '.join(types)}): give one weight per --loss_type")
    if not all(math.isfinite(w) for w in dpo.loss_weights):
        raise ConfigError(f"--loss_weights {dpo.loss_weights}: every weight must be a finite number")
    if "robust" in types and not 0 <= eps < 0.5:
        raise ConfigError(f"--label_smoothing {eps}: robust needs it in [0, 0.5)")
    if "exo_pair" in types and not 0 < eps < 1:
        raise ConfigError(f"--label_smoothing {eps}: exo_pair needs it above 0 (the EXO paper recommends 1e-3)")
    if eps and not {"robust", "exo_pair"} & set(types):
        raise ConfigError(f"--label_smoothing {eps} has no effect with --loss_type {','.join(types)} (TRL 1.16 "
                          "smooths labels in robust and exo_pair only): pass one of them, or drop the flag")
    if dpo.f_divergence_type != "reverse_kl" and not set(types) <= F_DIVERGENCE_LOSSES:
        raise ConfigError(f"--f_divergence_type {dpo.f_divergence_type} applies to "
                          f"{', '.join(sorted(F_DIVERGENCE_LOSSES))} only (the others have no f-DPO form), not to "
                          f"{', '.join(sorted(set(types) - F_DIVERGENCE_LOSSES))}: use reverse_kl with them")
    if dpo.f_alpha_divergence_coef != 0.5 and dpo.f_divergence_type != "alpha_divergence":
        raise ConfigError(f"--f_alpha_divergence_coef {dpo.f_alpha_divergence_coef} has no effect with "
                          f"--f_divergence_type {dpo.f_divergence_type}: pass alpha_divergence, or drop the flag")
    if "discopop" in types and not dpo.discopop_tau > 0:
        raise ConfigError(f"--discopop_tau {dpo.discopop_tau}: must be positive (TRL's default: 0.05)")
    if dpo.discopop_tau != 0.05 and "discopop" not in types:
        raise ConfigError(f"--discopop_tau {dpo.discopop_tau} has no effect without --loss_type discopop: drop it")


def dpo_train_step(model: nn.Module, strategy, optimizer: torch.optim.Optimizer,
                   micro_batches: list[dict[str, torch.Tensor]], cfg, env, shape=None, step: int | None = None, *,
                   ref_model: nn.Module | None = None, peft_model: nn.Module | None = None,
                   split: SplitRows | None = None) -> dict:
    """One optimizer step over this rank's micro-batches of pairs (the loop's ``step_fn``): the loss and metrics are
    means over the step's global pairs (all micro-batches, all ranks). ``num_tokens`` counts completion tokens
    (policy forward only); model FLOPs: the policy's training and the reference's forward
    (shardtune.model.flops.preference_micro_batch_flops)."""
    from shardtune.runtime.distributed import all_reduce_sum

    from shardtune.model.flops import num_input_tokens, preference_micro_batch_flops
    from shardtune.model.lora_dropout import keyed_masks

    counted = [preference_micro_batch_flops(shape, mb) for mb in micro_batches] if shape is not None else [(0, 0)]
    local = torch.tensor([sum(num_pairs(mb) for mb in micro_batches),
                          sum(num_completion_targets(mb) for mb in micro_batches),
                          sum(num_input_tokens(mb) for mb in micro_batches),
                          sum(f for f, _ in counted), sum(p for _, p in counted),
                          sum(chosen_completion_targets(mb) for mb in micro_batches)], dtype=torch.float64)
    pairs, num_tokens, input_tokens, flops, palm_flops, chosen_tokens = (
        int(x) for x in all_reduce_sum(local, env.device))
    copies = split.size if split else 1  # the ranks of a split group hold the same pairs
    pairs //= copies
    scale = strategy.grad_average_size / max(pairs, 1)  # the strategy's average over W ranks, undone
    sft_scale = pairs / max(chosen_tokens, 1)  # the sft term: a mean over the step's chosen completion tokens
    stats = PairStats.zero()
    last = len(micro_batches) - 1
    for i, mb in enumerate(micro_batches):
        sync = strategy.accumulating(model) if i < last else contextlib.nullcontext()
        # LoRA dropout's masks keyed by pair and step (backward too: activation checkpointing recomputes them)
        with sync, keyed_masks(mb, cfg.seed, step if step is not None else 0):
            with strategy.autocast():
                loss_sum = micro_batch_loss(model, ref_model, peft_model, mb, cfg.dpo, env.device, stats, split,
                                            sft_scale)
            strategy.backward(loss_sum * scale)
    row = stats.means(all_reduce_sum(stats.sums, env.device) / copies, pairs, chosen_tokens, sft_weight(cfg.dpo))
    max_norm = cfg.gradient_clipping_threshold if cfg.gradient_clipping else None
    grad_norm, stepped = strategy.clip_and_step(model, optimizer, max_norm,
                                                lambda norm: math.isfinite(row["loss"]))
    return {**row, "num_pairs": pairs, "num_tokens": num_tokens, "input_tokens": input_tokens, "flops": flops,
            "palm_flops": palm_flops, "grad_norm": grad_norm, "metrics": ("num_pairs", *METRICS),
            **({} if stepped else {"skipped": True})}


@torch.no_grad()
def precompute_reference(pairs: list[dict], policy: nn.Module, strategy, cfg, env, pad_id: int, *,
                         ref_model: nn.Module | None = None, peft_model: nn.Module | None = None,
                         split: SplitRows | None = None) -> torch.Tensor:
    """--precompute_ref_log_probs: every pair's reference (chosen, rejected) log-probabilities, computed once before
    training and stored in the pair (``ref_logps``), which :func:`collate_pairs` carries into each batch; returned
    as (pairs, 2) float64, the same on every rank. Data-parallel rank r of D takes pairs r, r + D, ... in chunks of
    --precompute_ref_batch_size (or --batch_size_training; the ranks of a split group each their slice of the same
    chunk); every rank runs the same number of forwards (a rank short of pairs repeats the first, not kept), as
    FSDP's collectives need; one all-reduce shares them."""
    from shardtune.data.preference import collate_pair_units
    from shardtune.runtime.distributed import all_reduce_sum

    dp_rank, dp_size = strategy.dims.dp_rank(env.rank), strategy.dims.dp_size
    mine = list(range(dp_rank, len(pairs), dp_size))
    size = cfg.dpo.precompute_ref_batch_size or cfg.batch_size_training
    num_chunks = math.ceil(math.ceil(len(pairs) / dp_size) / size)
    values = torch.zeros(len(pairs), 2, dtype=torch.float64)
    policy.eval()
    for c in range(num_chunks):
        chunk = mine[c * size:(c + 1) * size]
        batch = collate_pair_units([[pairs[i]] for i in chunk or [0]], cfg, pad_id)
        batch = split(batch, pad_id) if split else batch
        with strategy.autocast():
            chosen, rejected = reference_logps(policy, ref_model, peft_model, batch, env.device, split)
        if chunk:
            values[chunk] = torch.stack([chosen, rejected], dim=1).double().cpu()
    policy.train()
    values = all_reduce_sum(values, env.device).cpu() / (split.size if split else 1)
    store_reference(pairs, values)
    return values


def store_reference(pairs: list[dict], values: torch.Tensor) -> None:
    for pair, logps in zip(pairs, values.tolist()):
        pair["ref_logps"] = tuple(logps)


def reference_key(cfg, compute_dtype: torch.dtype, device: torch.device) -> str | None:
    """What a pair's reference log-probabilities depend on besides the pair: the weights (their files), how the
    reference is built and computed (quantisation, RoPE scaling, dtype, attention kernel, padding-free rows, device)
    and the library versions. None when the weights cannot be named (a hub id not in the local cache): then they are
    computed every run. The batch layout (processes, pairs per forward) is not in it: it changes float rounding
    only, as between any two layouts of the guarantee."""
    import hashlib
    import json
    from dataclasses import asdict

    import transformers

    from shardtune.model.loading import weights_identity

    weights = weights_identity(cfg.model_name, cfg.model_revision)
    if weights is None:
        return None
    return hashlib.sha256(json.dumps({
        "weights": weights, "quantization": [cfg.quantization, asdict(cfg.quantization_config)],
        "rope": [cfg.rope_scaling, cfg.rope_factor], "dtype": str(compute_dtype),
        "pure_bf16": cfg.enable_fsdp and cfg.fsdp_config.pure_bf16,
        "attention": [cfg.attn_implementation, cfg.use_fast_kernels, cfg.padding_free], "device": device.type,
        "torch": torch.__version__, "transformers": transformers.__version__}, sort_keys=True).encode()).hexdigest()[:24]


def read_cached_reference(pairs: list[dict], cache_file, env) -> bool:
    """Collective. The pairs' reference log-probabilities from the tokenised-data cache (``<pairs' entry>/
    reference-<key>.npy``, see :func:`reference_key`) when every rank finds the file whole; True when read.
    ``cache_file`` None (no key): False."""
    from shardtune.data.cache import read_reference_log_probs
    from shardtune.runtime.distributed import all_reduce_sum

    found = read_reference_log_probs(cache_file, len(pairs)) if cache_file is not None else None
    hits = all_reduce_sum(torch.tensor([float(found is not None)], dtype=torch.float64), env.device)
    if int(hits[0]) != env.world_size:
        return False
    store_reference(pairs, torch.from_numpy(found))
    return True


def compute_and_cache_reference(pairs: list[dict], cache_file, policy: nn.Module, strategy, cfg, env, pad_id: int,
                                **reference) -> None:
    """:func:`precompute_reference`, then each node's first rank writes the values to ``cache_file`` (when not
    None); a failed write is a note: the run goes on with the values in memory."""
    from shardtune.data.cache import write_reference_log_probs

    values = precompute_reference(pairs, policy, strategy, cfg, env, pad_id, **reference)
    if cache_file is not None and env.local_rank == 0:
        try:
            write_reference_log_probs(cache_file, values.numpy())
        except OSError as e:
            print(f"shardtune: note: the reference's log-probabilities could not be cached in {cache_file.parent} "
                  f"({e}); this run goes on with them in memory, the next computes them again", file=sys.stderr,
                  flush=True)


@torch.no_grad()
def dpo_evaluate(model: nn.Module, strategy, cfg, env, eval_pairs: list[dict], pad_id: int, *,
                 ref_model: nn.Module | None = None, peft_model: nn.Module | None = None,
                 split: SplitRows | None = None) -> dict[str, float]:
    """The test split's loss and TRL's reward metrics, each the mean over all its pairs (all ranks), with TRL's
    ``eval_`` prefix (``eval_loss``, ``eval_rewards/margins``, ...); the pairs shared out as SFT's eval examples are
    (shardtune.data.batching.eval_shares), a rank short of chunks running a pair it does not count."""
    from shardtune.data.batching import eval_shares
    from shardtune.data.preference import collate_pair_units
    from shardtune.runtime.distributed import all_reduce_sum

    mine, num_batches = eval_shares(eval_pairs, cfg, strategy.dims.dp_rank(env.rank), strategy.dims.dp_size)
    stats, counted, chosen_tokens = PairStats.zero(), 0, 0
    model.eval()
    for i in range(num_batches):
        chunk = mine[i] if i < len(mine) else eval_pairs[:1]
        batch = collate_pair_units([[pair] for pair in chunk], cfg, pad_id)
        batch = split(batch, pad_id) if split else batch  # eval rows are split like training rows
        with strategy.autocast():
            micro_batch_loss(model, ref_model, peft_model, batch, cfg.dpo, env.device,
                             stats if i < len(mine) else PairStats.zero(), split, sft_scale=0.0)
        counted += num_pairs(batch) if i < len(mine) else 0
        chosen_tokens += chosen_completion_targets(batch) if i < len(mine) else 0
    model.train()
    copies = split.size if split else 1  # the ranks of a split group evaluate the same pairs
    counts = all_reduce_sum(torch.tensor([counted, chosen_tokens], dtype=torch.float64), env.device)
    total = int(counts[0]) // copies  # a split row's chosen tokens are spread over its slices: summed as they are
    row = stats.means(all_reduce_sum(stats.sums, env.device) / copies, total, int(counts[1]), sft_weight(cfg.dpo))
    return {f"eval_{name}": value for name, value in row.items()} | {"eval_num_pairs": total}


def check_dpo_config(cfg, world_size: int) -> None:
    """What ``shardtune dpo`` supports (before launch; run by ``prepare``): DDP, FSDP and DeepSpeed ZeRO (with or
    without PEFT), pairs padded per micro-batch or padding-free (--padding_free; not packed into blocks; rows split
    over ranks with --sp_size / --cp_size are always padding-free), evaluation on the test split's pairs."""
    from shardtune.config.schema import ConfigError

    check_loss_options(cfg.dpo)
    if cfg.dpo.precompute_ref_batch_size and not cfg.dpo.precompute_ref_log_probs:
        raise ConfigError(f"--precompute_ref_batch_size {cfg.dpo.precompute_ref_batch_size} has no effect without "
                          "--precompute_ref_log_probs: add it, or drop the flag")
    if cfg.dpo.precompute_ref_batch_size < 0:
        raise ConfigError(f"--precompute_ref_batch_size {cfg.dpo.precompute_ref_batch_size}: pass a positive number "
                          "(0: --batch_size_training)")
    # a micro-batch's pairs are collated chosen-then-rejected, never packed into blocks: padded rows, or one
    # padding-free row with --padding_free
    cfg.batching_strategy = "padding"
    if cfg.log_eval_samples:
        raise ConfigError("--log_eval_samples generates summaries, an SFT evaluation: shardtune dpo evaluates the "
                          "test split's pairs (eval_loss, eval_rewards/*); drop the flag")
