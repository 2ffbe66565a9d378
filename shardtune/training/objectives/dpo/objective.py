"""The DPO objective (TRL 1.16's DPOTrainer) on the one engine: preference pairs, their losses (dpo_loss), the
log-probabilities of the policy and the reference (dpo_logps), the reference placed or precomputed (dpo_reference).

The step loss is the mean over the step's GLOBAL pairs: the engine's normaliser N is the number of pairs (all
micro-batches, all ranks), so 1 x 4 x 1, 2 x 2 x 1 and 1 x 1 x 4 (processes x pairs x accumulation) compute the same
gradients up to float rounding. The metrics are TRL's: ``rewards/*``, ``logps/*`` means over the step's global pairs;
``logits/*``, ``entropy``, ``mean_token_accuracy`` means over its global completion tokens (TRL's, per micro-batch and
then averaged, equal these at one micro-batch per step), from the logits the policy's log-probabilities are taken from.

The reference: with PEFT the policy's own base with the adapter switched off (no second copy); for full
fine-tuning a frozen copy of the starting weights, placed by the strategy like the policy (whole under DDP, sharded
under FSDP / ZeRO-3), so that the first step's policy and reference agree; with --precompute_ref_log_probs one pass
before training, kept with each pair and in the tokenised-data cache, and no reference model while training.

Rows split over ranks (--sp_size / --cp_size): the ranks of a split group hold the same pairs, so they count their
pairs and metrics once (sums / group size); the gradient average over all W ranks, undone by W, adds up the slices.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtune import data
from shardtune.accounting.flops import ModelShape, num_input_tokens, preference_micro_batch_flops
from shardtune.config.schema import ConfigError, DpoConfig
from shardtune.data.batching import eval_shares
from shardtune.data.cache import load_pairs_cached, pairs_entry
from shardtune.data.preference import collate_pair_units
from shardtune.model.loading import cache_dir
from shardtune.model.shared_prompt import computed_rows
from shardtune.parallel.sequence import RowSlice
from shardtune.runtime.distributed import all_reduce_sum, print0
from shardtune.training.engine.objective import COUNTS, Objective, data_splits
from shardtune.training.engine.reference import (
    build_reference,
    check_reference_settings,
    how_reference_was_had,
    prepare_reference_model,
)
from shardtune.training.objectives.dpo.logps import (
    TOKEN_SUMS,
    SplitRows,
    chosen_completion_targets,
    completion_lengths,
    num_completion_targets,
    num_pairs,
    policy_logps,
    reference_logps,
)
from shardtune.training.objectives.dpo.loss import check_loss_options, preference_losses, sft_weight
from shardtune.training.objectives.dpo.reference import (
    compute_and_cache_reference,
    read_cached_reference,
    reference_key,
)

# The metrics of a step, TRL's names; each the mean over the step's global pairs.
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
# TRL's names; each TOKEN_SUMS' sum over the step's global tokens of: the chosen completions (mean_token_accuracy: the
# share whose argmax is the label), all completions (entropy, in nats), the chosen / rejected completions (logits/*:
# the logits' mean over the vocabulary, averaged over those tokens)
TOKEN_METRICS = ("mean_token_accuracy", "entropy", "logits/chosen", "logits/rejected")
METRICS = (*PAIR_METRICS, *TOKEN_METRICS)
# Sums over a micro-batch's pairs: the pair losses, the metrics' numerators, the chosen completions' NLL (sft's term);
# then over its completion tokens (a split row's slices hold disjoint tokens, but the same pairs)
PAIR_STATS = ("loss_sum", *PAIR_METRICS, "chosen_nll")
STATS = (*PAIR_STATS, *TOKEN_SUMS)


def pair_stats(
    losses: torch.Tensor,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """The sums of PAIR_STATS over the pairs of a micro-batch, on the device (float64)."""
    chosen_rewards = beta * (chosen - ref_chosen).detach()
    rejected_rewards = beta * (rejected - ref_rejected).detach()
    values = (
        losses.detach(),
        chosen_rewards,
        rejected_rewards,
        (chosen_rewards > rejected_rewards).float(),
        chosen_rewards - rejected_rewards,
        chosen.detach(),
        rejected.detach(),
        -chosen.detach(),
    )
    return torch.stack([v.double().sum() for v in values])


def step_means(
    sums: list[float], num_pairs: float, chosen_tokens: float, completion_tokens: float, sft: float = 0.0
) -> dict[str, float]:
    """The loss and METRICS of ``sums`` (STATS summed over all micro-batches and ranks, each pair counted once: see
    :func:`counted_once`) and the global counts: the loss is the pair losses' mean plus ``sft`` x the NLL of the
    ``chosen_tokens`` chosen completion tokens, per token (as TRL's ``sft`` term); the token metrics' denominators are
    the chosen, all (``completion_tokens``), chosen and rejected completion tokens (0 where there are none, as TRL)."""
    n, nll = max(num_pairs, 1), sums[len(PAIR_STATS) - 1]
    loss = sums[0] / n + (sft * nll / max(chosen_tokens, 1) if sft else 0.0)
    correct, entropy, chosen_logits, rejected_logits = sums[len(PAIR_STATS) :]
    per_token = (
        (correct, chosen_tokens),
        (entropy, completion_tokens),
        (chosen_logits, chosen_tokens),
        (rejected_logits, completion_tokens - chosen_tokens),
    )
    return {
        "loss": loss,
        **{name: sums[i + 1] / n for i, name in enumerate(PAIR_METRICS)},
        **{name: total / count if count else 0.0 for name, (total, count) in zip(TOKEN_METRICS, per_token)},
    }


def counted_once(sums: list[float], copies: int) -> list[float]:
    """STATS summed over ranks whose split groups of ``copies`` ranks each hold the same pairs (and the pair sums)
    but a slice of their tokens each: the pair sums divided by ``copies``, the token sums as they are."""
    return [value / copies for value in sums[: len(PAIR_STATS)]] + list(sums[len(PAIR_STATS) :])


def micro_batch_loss(
    policy: nn.Module,
    ref_model: nn.Module | None,
    peft_model: nn.Module | None,
    batch: dict[str, torch.Tensor],
    dpo: DpoConfig,
    device: torch.device,
    split: SplitRows | None = None,
    sft_scale: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the SUM of the micro-batch's pair losses with its graph, plus with an ``sft`` term its weight x the chosen
    completions' NLL x ``sft_scale`` (pairs per chosen completion token of the step: the term is then a mean over
    tokens, not pairs, once the engine divides by the pairs; None: this micro-batch's, as TRL for one batch);
    the sums of STATS)."""
    ref_chosen, ref_rejected = reference_logps(policy, ref_model, peft_model, batch, device, split)
    chosen, rejected, token_sums = policy_logps(policy, batch, device, split)
    losses = preference_losses(chosen, rejected, ref_chosen, ref_rejected, completion_lengths(batch), dpo)
    stats = torch.cat([pair_stats(losses, chosen, rejected, ref_chosen, ref_rejected, dpo.beta), token_sums])
    weight = sft_weight(dpo)
    if not weight:
        return losses.sum(), stats
    if sft_scale is None:
        sft_scale = num_pairs(batch) / max(chosen_completion_targets(batch), 1)
    return losses.sum() - weight * sft_scale * chosen.sum(), stats


class DPO(Objective):
    name = "dpo"
    count_names = (*COUNTS, "chosen_tokens")  # normaliser: the step's pairs; label_tokens: completion tokens
    stat_names = STATS
    step_metric_names = ("num_pairs", *METRICS)
    eval_metric_names = ("eval_loss", *(f"eval_{m}" for m in METRICS))
    collate_fn = staticmethod(collate_pair_units)

    # -- before launch --------------------------------------------------------------------------------------------
    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        """What ``shardtune dpo`` supports: DDP, FSDP and DeepSpeed ZeRO (with or without PEFT), pairs padded per
        micro-batch or padding-free (--padding_free; not packed into blocks; rows split over ranks with --sp_size /
        --cp_size are always padding-free), evaluation on the test split's pairs."""
        check_loss_options(cfg.dpo)
        check_reference_settings(cfg, cfg.dpo)
        if cfg.eval.log_samples:
            raise ConfigError(
                "--log_eval_samples generates summaries, an SFT evaluation: shardtune dpo evaluates the "
                "test split's pairs (eval_loss, eval_rewards/*); drop the flag"
            )

    @classmethod
    def prepare_data(cls, cfg, tokenizer, dp_size: int) -> None:
        prepare_reference_model(cfg, cfg.dpo, tokenizer)
        loaded = {split: load_pairs_cached(cfg, tokenizer, split, cache_dir())[0] for split in data_splits(cfg)}
        data.steps_per_epoch(len(loaded["train"]), cfg, dp_size)

    # -- in the worker --------------------------------------------------------------------------------------------
    def load_data(self) -> tuple[list, list]:
        """One preference pair per unit, and the validation split's pairs."""
        cfg = self.cfg
        loaded = {split: load_pairs_cached(cfg, self.tokenizer, split, cache_dir()) for split in data_splits(cfg)}
        for split, (_, report) in loaded.items():
            print0(f"data ({split}): {report.summary()}")
        pairs = loaded["train"][0]
        for index, pair in enumerate(pairs):  # its place in the data: LoRA dropout masks keyed by pair, not rank
            pair["index"] = index
        data.steps_per_epoch(len(pairs), cfg, self.strategy.dims.dp_size)
        return [[pair] for pair in pairs], loaded["validation"][0] if cfg.eval.enabled else []

    def attach(self, model: nn.Module, units: list, eval_items: list) -> None:
        """The reference: the adapter switched off (PEFT), a frozen copy placed like the policy, or log-probabilities
        precomputed once (read from the tokenised-data cache when an earlier run of this reference kept them)."""
        self.model, self.eval_pairs = model, eval_items
        self.split = split_rows(self.strategy, self.env)
        self.reference: dict = {}
        if not self.cfg.dpo.precompute_ref_log_probs:
            self.reference = self.build_reference()
            return
        cfg, env, split = self.cfg, self.env, self.split
        train_pairs = [unit[0] for unit in units]
        key = reference_key(cfg, self.strategy.compute_dtype, env.device)
        jobs = [
            (pairs, pairs_entry(cfg, self.tokenizer, name, cache_dir()) / f"reference-{key}.npy" if key else None)
            for name, pairs in (("train", train_pairs), ("validation", eval_items))
            if pairs
        ]
        missing = [(pairs, file) for pairs, file in jobs if not read_cached_reference(pairs, file, env)]
        if missing:
            reference = self.build_reference()
            for pairs, file in missing:
                compute_and_cache_reference(
                    pairs, file, model, self.strategy, cfg, env, self.pad_id, **reference, split=split
                )
        how = how_reference_was_had(not missing, bool(key))
        print0(
            f"reference: log-probabilities of {len(train_pairs):,} train and {len(eval_items):,} test pairs "
            f"{how} (--precompute_ref_log_probs)"
        )

    def build_reference(self) -> dict:
        return build_reference(self.model, self.strategy, self.cfg, self.env, self.cfg.dpo.ref_model, bool(self.split))

    @property
    def copies(self) -> int:
        """The ranks that hold the same pairs (a split group)."""
        return self.split.size if self.split else 1

    def counts(self, micro_batches: list[dict], shape: ModelShape | None) -> list[float]:
        flops = (  # as computed (mfu): on the shared-prompt layout where the model takes it; PaLM's on the rows
            [
                (
                    preference_micro_batch_flops(shape, computed_rows(self.model, mb), num_completion_targets(mb))[0],
                    preference_micro_batch_flops(shape, mb, num_completion_targets(mb))[1],
                )
                for mb in micro_batches
            ]
            if shape is not None
            else [(0, 0)]
        )
        return [
            sum(num_pairs(mb) for mb in micro_batches) / self.copies,
            sum(num_completion_targets(mb) for mb in micro_batches),
            sum(num_input_tokens(mb) for mb in micro_batches),
            sum(f for f, _ in flops),
            sum(p for _, p in flops),
            sum(chosen_completion_targets(mb) for mb in micro_batches),
        ]

    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor], totals: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sft_scale = totals[0] / totals[-1].clamp(min=1)  # the sft term: a mean over the step's chosen tokens
        return micro_batch_loss(
            model,
            self.reference.get("ref_model"),
            self.reference.get("peft_model"),
            batch,
            self.cfg.dpo,
            self.env.device,
            self.split,
            sft_scale,
        )

    def step_metrics(self, totals: dict[str, float], stats: list[float]) -> dict[str, float]:
        means = step_means(
            counted_once(stats, self.copies),
            totals["normaliser"],
            totals["chosen_tokens"],
            totals["label_tokens"],
            sft_weight(self.cfg.dpo),
        )
        return {"loss": means.pop("loss"), "num_pairs": int(totals["normaliser"]), **means}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[dict[str, float], list[dict]]:
        """The test split's loss and TRL's metrics, each the mean over all its pairs or completion tokens (all ranks),
        with TRL's ``eval_`` prefix; the pairs shared out as SFT's eval examples are
        (shardtune.data.batching.eval_shares), a rank short of chunks running a pair it does not count."""
        return dpo_evaluate(
            model, self.strategy, self.cfg, self.env, self.eval_pairs, self.pad_id, **self.reference, split=self.split
        ), []


@torch.no_grad()
def dpo_evaluate(
    model: nn.Module,
    strategy,
    cfg,
    env,
    eval_pairs: list[dict],
    pad_id: int,
    *,
    ref_model: nn.Module | None = None,
    peft_model: nn.Module | None = None,
    split: SplitRows | None = None,
) -> dict[str, float]:
    """:meth:`DPO.evaluate` with its reference given."""
    mine, num_batches = eval_shares(eval_pairs, cfg, strategy.dims.dp_rank(env.rank), strategy.dims.dp_size)
    sums = torch.zeros(len(STATS), dtype=torch.float64, device=env.device)
    counted = chosen_tokens = completion_tokens = 0
    model.eval()
    for i in range(num_batches):
        chunk = mine[i] if i < len(mine) else eval_pairs[:1]
        batch = collate_pair_units([[pair] for pair in chunk], cfg, pad_id)
        batch = split(batch, pad_id) if split else batch  # eval rows are split like training rows
        with strategy.autocast():
            _, stats = micro_batch_loss(model, ref_model, peft_model, batch, cfg.dpo, env.device, split, 0.0)
        if i < len(mine):
            sums += stats
            counted += num_pairs(batch)
            chosen_tokens += chosen_completion_targets(batch)
            completion_tokens += num_completion_targets(batch)
    model.train()
    copies = split.size if split else 1  # the ranks of a split group evaluate the same pairs
    counts = torch.tensor([counted, chosen_tokens, completion_tokens], dtype=torch.float64, device=env.device)
    summed = all_reduce_sum(torch.cat([sums, counts]), env.device).tolist()
    total = int(summed[len(STATS)]) // copies  # a split row's tokens are spread over its slices: summed as they are
    sums_once = counted_once(summed[: len(STATS)], copies)
    row = step_means(sums_once, total, summed[len(STATS) + 1], summed[len(STATS) + 2], sft_weight(cfg.dpo))
    return {f"eval_{name}": value for name, value in row.items()} | {"eval_num_pairs": total}


def split_rows(strategy, env) -> SplitRows | None:
    """The context x sequence parallel group that splits each row of pairs (None when rows are whole). Collective:
    every rank creates the group's flattened process group at the same point."""
    dims = strategy.dims
    if not dims.sequence_split:
        return None
    group = strategy.mesh["cp", "sp"]._flatten("cp_sp").get_group()
    return SplitRows(group, dims.cp * dims.sp, RowSlice.of_rank(dims, env.rank))
