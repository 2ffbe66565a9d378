"""The KTO objective (TRL 1.16's KTOTrainer) on the one engine: unpaired desirable / undesirable completions
(shardtune.data.unpaired), their losses against a frozen reference (kto_loss), the KL reference point estimated from
mismatched completions (kto_kl), the reference placed or precomputed as DPO's (shardtune.training.engine.reference).

The KL estimate is a statistic of the optimizer step's GLOBAL rows: before the step's first backward every rank
scores the KL rows of all its micro-batches (each prompt with another row's completion, the pairs a function of the
step's rows alone: kto_kl) with the policy and the reference, without a graph as TRL does, and their summed
log-ratios ride the step's one all-reduce of counts (shardtune.training.engine.step); each micro-batch's loss then
uses kl = max(0, sum / rows). The step loss is the mean of the rows' weighted losses over the step's global rows. So
1 x 8, 2 x 4 and 1 x 4 x accumulation 2 (processes x rows x accumulation) compute the same KL, losses and gradients
up to float rounding. TRL estimates the KL per micro-batch, over its processes' rows (each rotating its own
per-device batch): the same number at one process with one micro-batch per step (docs/kto.md).

The metrics are TRL's: ``kl``; ``rewards/chosen`` / ``rejected``, ``logps/chosen`` / ``rejected``, means over the
step's desirable / undesirable rows (left out where it has none, as TRL), ``rewards/margins``; ``entropy``,
``logits/chosen`` / ``rejected``, means over the completion tokens of all / desirable / undesirable rows.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from shardtune import data
from shardtune.accounting.flops import ModelShape, micro_batch_flops, num_input_tokens, preference_micro_batch_flops
from shardtune.config.schema import ConfigError, DpoConfig, effective_batch_size
from shardtune.data.batching import epoch_order, eval_shares
from shardtune.data.row_cache import load_rows_cached, rows_entry
from shardtune.data.unpaired import collate_rows
from shardtune.model.loading import cache_dir
from shardtune.model.lora_dropout import keyed_masks
from shardtune.runtime.distributed import all_reduce_sum, print0
from shardtune.training.engine.completions import (
    completion_logps,
    completion_logps_and_predictions,
    num_completion_targets,
    predicted_completion,
)
from shardtune.training.engine.objective import COUNTS, Objective, data_splits
from shardtune.training.engine.reference import (
    build_reference,
    cache_reference,
    check_reference_settings,
    how_reference_was_had,
    precompute,
    prepare_reference_model,
    read_cached_reference,
    reference_key,
    with_reference,
)
from shardtune.training.objectives.kto.kl import (
    KL_STEP,
    KlRows,
    chunk_partners,
    collate_kto_units,
    kl_view,
    step_partners,
)
from shardtune.training.objectives.kto.loss import STATS, kto_losses, row_stats, step_means

METRICS = (
    "kl",
    "entropy",
    "logits/chosen",
    "logits/rejected",
    "rewards/chosen",
    "logps/chosen",
    "rewards/rejected",
    "logps/rejected",
    "rewards/margins",
)
# DPO's settings KTO does not read (beta and the reference settings it does: Registration.shares)
NOT_KTO = (
    "loss_type",
    "loss_weights",
    "label_smoothing",
    "f_divergence_type",
    "f_alpha_divergence_coef",
    "discopop_tau",
)
# the step's counts beyond the engine's: the KL rows' summed log-ratios (policy - reference), the desirable and
# undesirable rows, and their completion tokens
KTO_COUNTS = ("kl_sum", "num_chosen", "num_rejected", "chosen_tokens", "rejected_tokens")


def label_counts(batch: dict[str, torch.Tensor]) -> tuple[int, int, int, int]:
    """(desirable rows, undesirable rows, their completion targets) of a micro-batch."""
    labels = batch["label"].bool()
    targets = predicted_completion(batch).sum(dim=1)
    return int(labels.sum()), int((~labels).sum()), int(targets[labels].sum()), int(targets[~labels].sum())


def token_sums(predictions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The TOKEN_STATS sums from each row's per-token prediction sums (rows, 3: argmax hit, entropy, mean logit)."""
    return torch.stack([predictions[:, 1].sum(), predictions[labels, 2].sum(), predictions[~labels, 2].sum()])


def micro_batch_loss(
    policy: nn.Module,
    reference: dict,
    batch: dict[str, torch.Tensor],
    kl: torch.Tensor | float,
    cfg,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the SUM of the micro-batch's weighted row losses with its graph, the sums of STATS) at the reference point
    ``kl``; ``reference``: ``ref_model`` / ``peft_model`` (shardtune.training.engine.reference), or nothing when the
    batch carries its rows' precomputed ``ref_logps``."""
    n, labels = batch["input_ids"].shape[0], batch["label"].to(device).bool()
    logps, predictions = completion_logps_and_predictions(policy, batch, n, device)
    ref = reference_logps(policy, reference, batch, device)
    beta = cfg.dpo.beta
    k = cfg.kto
    losses = kto_losses(logps, ref, labels, kl, beta, k.loss_type, k.desirable_weight, k.undesirable_weight)
    stats = torch.cat([row_stats(losses, logps, ref, labels, beta), token_sums(predictions, labels)])
    return losses.sum(), stats


def reference_logps(policy: nn.Module, reference: dict, batch: dict, device: torch.device, key: str = "ref_logps"):
    """The reference's completion log-probabilities of the batch's rows: precomputed (``key``), or computed."""
    if key in batch:
        return batch[key].to(device)
    n = batch["input_ids"].shape[0]
    return with_reference(
        policy,
        reference.get("ref_model"),
        reference.get("peft_model"),
        lambda model: completion_logps(model, batch, n, device),
    )


@torch.no_grad()
def kl_log_ratios(policy: nn.Module, reference: dict, batch: dict, device: torch.device) -> torch.Tensor:
    """Each KL row's log-ratio (policy - reference) of a micro-batch, without a graph (TRL's KL rows)."""
    view = kl_view(batch)
    n = view["input_ids"].shape[0]
    logps = completion_logps(policy, view, n, device)
    if "ref_KL_logps" in batch:
        view["ref_logps"] = batch["ref_KL_logps"]
    ref = reference_logps(policy, reference, view, device)
    return logps.double() - ref.double()


class KTO(Objective):
    name = "kto"
    count_names = (*COUNTS, *KTO_COUNTS)  # normaliser: the step's rows; label_tokens: their completion tokens
    stat_names = STATS
    step_metric_names = ("num_rows", *METRICS)
    eval_metric_names = ("eval_loss", *(f"eval_{m}" for m in METRICS))
    collate_fn = staticmethod(collate_kto_units)

    # -- before launch --------------------------------------------------------------------------------------------
    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        """What ``shardtune kto`` supports: DDP, FSDP and DeepSpeed ZeRO (with or without PEFT), rows padded per
        micro-batch (TRL's KTO has no padding-free rows; rows are not split over ranks), evaluation on the test split's
        rows; DPO's flags it reads are beta and the reference's."""
        given = [name for name in NOT_KTO if getattr(cfg.dpo, name) != getattr(DpoConfig(), name)]
        if given:
            raise ConfigError(
                f"--dpo.{given[0]} is a DPO loss setting, which shardtune kto does not read (it reads --beta and the "
                "reference settings): drop it; KTO's loss is --loss_type kto or apo_zero_unpaired"
            )
        check_reference_settings(cfg, cfg.dpo)
        if cfg.data.padding_free:
            raise ConfigError(
                "--padding_free: shardtune kto pads each micro-batch's rows (TRL's KTOTrainer has no padding-free "
                "rows): drop the flag"
            )
        if cfg.parallel.sequence_parallel_size * cfg.parallel.context_parallel_size > 1:
            raise ConfigError(
                "--sp_size / --cp_size: shardtune kto keeps each row on one rank (rows split over ranks are built for "
                "sft and dpo): drop them"
            )
        dp_size = world_size // (cfg.parallel.sequence_parallel_size * cfg.parallel.context_parallel_size)
        if cfg.kto.loss_type == "kto" and effective_batch_size(cfg, dp_size) < 2:
            raise ConfigError(
                "--loss_type kto estimates its KL term from each step's rows paired with other rows' completions: the "
                f"effective batch is {effective_batch_size(cfg, dp_size)} row, with which the KL term is the reward "
                "itself: raise --per_device_train_batch_size or --gradient_accumulation_steps to 2 or more"
            )
        if cfg.kto.loss_type == "kto" and cfg.dpo.precompute_ref_log_probs and cfg.data.sampling != "sequential":
            raise ConfigError(
                "--precompute_ref_log_probs with --loss_type kto precomputes each row's KL row once, which needs the "
                "same steps every epoch: pass --train_sampling_strategy sequential (TRL's KTO default), or drop "
                "--precompute_ref_log_probs"
            )
        if cfg.eval.log_samples:
            raise ConfigError(
                "--log_eval_samples generates summaries, an SFT evaluation: shardtune kto evaluates the test split's "
                "rows (eval_loss, eval_rewards/*); drop the flag"
            )

    @classmethod
    def prepare_data(cls, cfg, tokenizer, dp_size: int) -> None:
        prepare_reference_model(cfg, cfg.dpo, tokenizer)
        loaded = {split: load_rows_cached(cfg, tokenizer, split, cache_dir())[0] for split in data_splits(cfg)}
        data.steps_per_epoch(len(loaded["train"]), cfg, dp_size)

    # -- in the worker --------------------------------------------------------------------------------------------
    def load_data(self) -> tuple[list, list]:
        """One unpaired row per unit, and the validation split's rows."""
        cfg = self.cfg
        loaded = {split: load_rows_cached(cfg, self.tokenizer, split, cache_dir()) for split in data_splits(cfg)}
        for split, (_, report) in loaded.items():
            print0(f"data ({split}): {report.summary()}")
        rows = loaded["train"][0]
        for index, row in enumerate(rows):  # its place in the data: KL pairs and dropout masks keyed by it
            row["index"] = index
        data.steps_per_epoch(len(rows), cfg, self.strategy.dims.dp_size)
        return [[row] for row in rows], loaded["validation"][0] if cfg.eval.enabled else []

    @property
    def uses_kl(self) -> bool:
        return self.cfg.kto.loss_type == "kto"

    @property
    def step_size(self) -> int:
        return effective_batch_size(self.cfg, self.strategy.dims.dp_size)

    def attach(self, model: nn.Module, units: list, eval_items: list) -> None:
        """The reference: the adapter switched off (PEFT), a frozen copy placed like the policy, or log-probabilities
        precomputed once for each row and its KL row (read from the tokenised-data cache when an earlier run of this
        reference kept them)."""
        self.model, self.rows, self.eval_rows = model, [unit[0] for unit in units], eval_items
        self.reference: dict = {}
        if not self.cfg.dpo.precompute_ref_log_probs:
            self.reference = build_reference(model, self.strategy, self.cfg, self.env, self.cfg.dpo.ref_model)
            return
        self.precompute_reference()

    def precompute_reference(self) -> None:
        cfg, env = self.cfg, self.env
        kl = {"kl_rows_per_step": self.step_size if self.uses_kl else 0}  # the KL pairs depend on the step's rows
        key = reference_key(cfg, cfg.dpo.ref_model, self.strategy.compute_dtype, env.device, **kl)
        jobs = [
            (rows, rows_entry(cfg, self.tokenizer, name, cache_dir()) / f"reference-{key}.npy" if key else None)
            for name, rows in (("train", self.rows), ("validation", self.eval_rows))
            if rows
        ]
        reference: dict | None = None
        all_read = True
        for rows, file in jobs:
            values = read_cached_reference(len(rows), file, env)
            if values is None:
                all_read = False
                reference = reference or build_reference(self.model, self.strategy, cfg, env, cfg.dpo.ref_model)
                values = self.score_reference(rows, reference)
                cache_reference(values, file, env)
            for row, logps in zip(rows, values.tolist()):
                row["ref_logps"] = tuple(logps)
        print0(
            f"reference: log-probabilities of {len(self.rows):,} train and {len(self.eval_rows):,} test rows"
            + (" and their KL rows" if self.uses_kl else "")
            + f" {how_reference_was_had(all_read, bool(key))} (--precompute_ref_log_probs)"
        )

    def score_reference(self, rows: list, reference: dict) -> torch.Tensor:
        """Every row's reference log-probability and its KL row's (0 without KL), (rows, 2) float64."""
        partners = chunk_partners(len(rows), self.step_size)
        cfg, device = self.cfg, self.env.device

        def score(chunk: list[int]) -> torch.Tensor:
            batch = collate_rows(
                [rows[i] for i in chunk],
                self.pad_id,
                cfg.data.context_length,
                [rows[int(partners[i])]["completion_ids"] for i in chunk] if self.uses_kl else None,
            )
            main = reference_logps(self.model, reference, batch, device)
            if not self.uses_kl:
                return torch.stack([main, torch.zeros_like(main)], dim=1)
            return torch.stack([main, reference_logps(self.model, reference, kl_view(batch), device)], dim=1)

        self.model.eval()
        size = cfg.dpo.precompute_ref_batch_size or cfg.train.batch_size
        values = precompute(len(rows), 2, score, self.strategy, self.env, size)
        self.model.train()
        return values

    def batches(self, units: list, epoch: int, first: int, dp_rank: int, dp_size: int, row_slice=None):
        """The data floor's loader, its collate adding each row's KL row (kto_kl: the partners of the epoch's steps)."""
        if not self.uses_kl:
            return super().batches(units, epoch, first, dp_rank, dp_size, row_slice)
        size, num_steps = self.step_size, data.steps_per_epoch(len(units), self.cfg, dp_size)
        order = epoch_order(units, self.cfg, dp_size, epoch)
        step_of = {row: epoch * num_steps + s // size + 1 for s, row in enumerate(order)}
        kl = KlRows(self.rows, step_partners(order, size, len(units)), step_of)
        collate = functools.partial(collate_kto_units, kl=kl)
        return data.train_loader(units, self.cfg, dp_rank, dp_size, epoch, self.pad_id, first, row_slice, collate)

    def counts(self, micro_batches: list[dict], shape: ModelShape | None) -> torch.Tensor:
        """The engine's counts, the KL rows' summed log-ratios (scored here, before the step's first backward: the
        loss of every micro-batch needs the step's KL), and the label counts; a float64 tensor on the device."""
        flops = [self.flops(shape, mb) for mb in micro_batches] if shape is not None else [(0, 0)]
        labels = [label_counts(mb) for mb in micro_batches]
        host = [
            sum(mb["input_ids"].shape[0] for mb in micro_batches),
            sum(num_completion_targets(mb) for mb in micro_batches),
            sum(num_input_tokens(mb) for mb in micro_batches),
            sum(f for f, _ in flops),
            sum(p for _, p in flops),
            0.0,
            *(sum(values) for values in zip(*labels)),
        ]
        counts = torch.tensor(host, dtype=torch.float64, device=self.env.device)
        if self.uses_kl:
            counts[len(COUNTS)] = self.kl_sum(micro_batches)
        return counts

    def flops(self, shape: ModelShape, batch: dict) -> tuple[int, int]:
        """The rows trained (and their reference's forward), and the KL rows' two forwards without a graph."""
        trained = preference_micro_batch_flops(shape, batch, num_completion_targets(batch))
        if not self.uses_kl:
            return trained
        view = kl_view(batch)
        scored = num_completion_targets(view)
        both = preference_micro_batch_flops(shape, view, scored)
        forward = both[0] - micro_batch_flops(shape, view, scored if shape.lean_loss else num_input_tokens(view))
        return trained[0] + 2 * forward, trained[1] + 2 * forward

    def kl_sum(self, micro_batches: list[dict]) -> torch.Tensor:
        """This rank's KL rows' summed log-ratios over the step's micro-batches (their LoRA dropout masks keyed by
        the step and each KL row, as the rows')."""
        total = torch.zeros((), dtype=torch.float64, device=self.env.device)
        for batch in micro_batches:
            step = int(batch[KL_STEP]) if KL_STEP in batch else 0
            with self.strategy.autocast(), keyed_masks(kl_view(batch), self.cfg.train.seed, step):
                total += kl_log_ratios(self.model, self.reference, batch, self.env.device).sum()
        return total

    def kl_point(self, totals: torch.Tensor) -> torch.Tensor:
        """The step's KL reference point: max(0, the KL rows' mean log-ratio), from the global counts."""
        if not self.uses_kl:
            return torch.zeros((), dtype=torch.float64, device=totals.device)
        return (totals[len(COUNTS)] / totals[0].clamp(min=1)).clamp(min=0)

    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor], totals: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kl = self.kl_point(totals).float()
        return micro_batch_loss(model, self.reference, batch, kl, self.cfg, self.env.device)

    def step_metrics(self, totals: dict[str, float], stats: list[float]) -> dict[str, float]:
        rows = totals["normaliser"]
        kl = max(0.0, totals["kl_sum"] / max(rows, 1)) if self.uses_kl else 0.0
        tokens = (totals["label_tokens"], totals["chosen_tokens"], totals["rejected_tokens"])
        means = step_means(stats, rows, totals["num_chosen"], totals["num_rejected"], tokens, kl)
        return {"loss": means.pop("loss"), "num_rows": int(rows), **means}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[dict[str, float], list[dict]]:
        """The test split's loss and TRL's metrics over all its rows (all ranks), with TRL's ``eval_`` prefix; its KL
        pairs are its rows taken an effective batch at a time in its order (kto_kl), its KL estimate the whole
        split's."""
        return kto_evaluate(model, self.strategy, self.cfg, self.env, self.eval_rows, self.pad_id, self.reference), []


def per_row_scores(policy: nn.Module, reference: dict, batch: dict, device: torch.device, kl: bool) -> torch.Tensor:
    """(rows, 6) float64 of a micro-batch: policy and reference log-probabilities, the KL row's log-ratio (0
    without), the entropy and the mean-logit sums over the completion tokens, the completion tokens."""
    n = batch["input_ids"].shape[0]
    logps, predictions = completion_logps_and_predictions(policy, batch, n, device)
    ref = reference_logps(policy, reference, batch, device)
    zeros = torch.zeros(n, dtype=torch.float64, device=device)
    kl_ratios = kl_log_ratios(policy, reference, batch, device) if kl else zeros
    tokens = predicted_completion(batch).sum(dim=1).to(device).double()
    columns = [logps.double(), ref.double(), kl_ratios, predictions[:, 1], predictions[:, 2], tokens]
    return torch.stack(columns, dim=1)


@torch.no_grad()
def kto_evaluate(model: nn.Module, strategy, cfg, env, rows: list, pad_id: int, reference: dict) -> dict[str, float]:
    """:meth:`KTO.evaluate` with its reference given: each rank scores its chunks of the split (as SFT's eval
    examples are shared out: shardtune.data.batching.eval_shares; a rank short of chunks runs one it does not count);
    the per-row scores are all-reduced and the losses and metrics computed from the whole split's."""
    uses_kl = cfg.kto.loss_type == "kto"
    dp_rank, dp_size = strategy.dims.dp_rank(env.rank), strategy.dims.dp_size
    partners = chunk_partners(len(rows), effective_batch_size(cfg, dp_size))
    mine, num_batches = eval_shares(list(range(len(rows))), cfg, dp_rank, dp_size)
    scores = torch.zeros(len(rows), 6, dtype=torch.float64, device=env.device)
    labels = torch.tensor([bool(row["label"]) for row in rows], dtype=torch.bool, device=env.device)
    model.eval()
    for i in range(num_batches):
        chunk = mine[i] if i < len(mine) else [0]
        kl = [rows[int(partners[j])]["completion_ids"] for j in chunk] if uses_kl else None
        batch = collate_rows([rows[j] for j in chunk], pad_id, cfg.data.context_length, kl)
        with strategy.autocast():
            scored = per_row_scores(model, reference, batch, env.device, uses_kl)
        if i < len(mine):
            scores[chunk] = scored
    model.train()
    scores = all_reduce_sum(scores, env.device, to_host=False)
    logps, ref, kl_ratios, entropy, mean_logits, tokens = scores.unbind(dim=1)
    kl = max(0.0, float(kl_ratios.mean())) if uses_kl else 0.0
    k = cfg.kto
    losses = kto_losses(logps, ref, labels, kl, cfg.dpo.beta, k.loss_type, k.desirable_weight, k.undesirable_weight)
    token_totals = torch.stack([entropy.sum(), mean_logits[labels].sum(), mean_logits[~labels].sum()])
    sums = torch.cat([row_stats(losses, logps, ref, labels, cfg.dpo.beta), token_totals]).tolist()
    counts = (float(tokens.sum()), float(tokens[labels].sum()), float(tokens[~labels].sum()))
    row = step_means(sums, len(rows), float(labels.sum()), float((~labels).sum()), counts, kl)
    return {f"eval_{name}": value for name, value in row.items()} | {"eval_num_rows": len(rows)}
