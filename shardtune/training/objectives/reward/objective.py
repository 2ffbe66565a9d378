"""Reward modelling (TRL 1.16's RewardTrainer) on the one engine: a sequence-classification head of one label on the
causal LM (the objective's Registration names the head: shardtune.model.loading.MODEL_HEADS "score"), trained with
the Bradley-Terry loss on preference pairs (shardtune.training.objectives.reward.loss).

The data is TRL's preference formats (explicit or implicit prompt, text or conversational: shardtune.data.preference),
read as whole sequences: prompt + chosen and prompt + rejected, a pair with one longer than --max_length dropped (as
TRL filters it), TRL's margin column kept; tokenised once into the cache like DPO's pairs (their own entries).

The step loss is the mean over the step's GLOBAL pairs (the engine's normaliser N is the number of pairs, all
micro-batches and ranks), the centring term's mean too, so 1 x 4, 2 x 2 and 1 x 2 x accumulation 2 (processes x
pairs x accumulation) compute the same gradients up to float rounding. The metrics are TRL's: ``accuracy`` and
``margin`` means over the step's pairs, ``mean_reward`` over its scores, ``min_reward`` / ``max_reward`` the extremes
of all its scores (TRL averages each micro-batch's extremes over its logging interval: the same at one micro-batch
per step). The output is an AutoModelForSequenceClassification directory, or a SEQ_CLS adapter carrying the head.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from shardtune import data
from shardtune.accounting.flops import (
    ModelShape,
    lean_layer_saving,
    matmul_flops_per_token,
    micro_batch_flops,
    num_input_tokens,
    palm_micro_batch_flops,
)
from shardtune.config.schema import ConfigError
from shardtune.data.batching import eval_shares
from shardtune.data.cache import load_pairs_cached
from shardtune.data.pair_store import MARGIN
from shardtune.data.preference import collate_pairs, pair_example_ids
from shardtune.model.loading import cache_dir
from shardtune.runtime.distributed import print0
from shardtune.training.engine.objective import Objective, data_splits
from shardtune.training.engine.step import StatReductions
from shardtune.training.objectives.reward.loss import (
    METRICS,
    STAT_REDUCTIONS,
    STATS,
    means,
    micro_batch_loss,
    num_pairs,
)


def collate_reward_pairs(pairs: list[Mapping], pad_id: int) -> dict[str, torch.Tensor]:
    """A micro-batch of ``n`` whole pairs (none longer than --max_length: they were filtered, not cut): the chosen
    rows then the rejected rows, right-padded (TRL's DataCollatorForPreference), with the pairs' ``margin`` (n,);
    pairs that carry their place in the training data (``index``) get LoRA dropout's per-token keys too."""
    batch = collate_pairs(pairs, pad_id, None)
    batch[MARGIN] = torch.tensor([float(pair.get(MARGIN, 0.0)) for pair in pairs], dtype=torch.float32)
    if pairs and all("index" in pair for pair in pairs):
        batch.update(pair_example_ids(batch, [pair["index"] for pair in pairs]))
    return batch


def collate_reward_units(units: list[list[Mapping]], cfg, pad_id: int) -> dict[str, torch.Tensor]:
    """The training loader's collate (one pair per unit)."""
    return collate_reward_pairs([pair for unit in units for pair in unit], pad_id)


class Reward(Objective):
    name = "reward"
    stat_names = STATS
    stat_reductions = STAT_REDUCTIONS
    step_metric_names = ("num_pairs", *METRICS)
    eval_metric_names = ("eval_loss", *(f"eval_{m}" for m in METRICS))
    collate_fn = staticmethod(collate_reward_units)

    # -- before launch --------------------------------------------------------------------------------------------
    @classmethod
    def check(cls, cfg, world_size: int) -> None:
        """What ``shardtune reward`` supports: DDP, FSDP and DeepSpeed ZeRO (with or without PEFT), pairs padded per
        micro-batch (the score is read at each row's last non-pad token), evaluation on the test split's pairs."""
        if cfg.data.padding_free:
            raise ConfigError(
                "--padding_free: a reward model reads each sequence's score at its last non-pad token of a padded "
                "row (TRL's RewardTrainer pads its batches): drop the flag"
            )
        split = cfg.parallel.sequence_parallel_size * cfg.parallel.context_parallel_size
        if split > 1:
            raise ConfigError(
                f"--sp_size {cfg.parallel.sequence_parallel_size} / --cp_size {cfg.parallel.context_parallel_size}: "
                "shardtune reward scores whole padded rows (each at its last token), not rows split over ranks: "
                "drop the flags"
            )
        if cfg.eval.log_samples:
            raise ConfigError(
                "--log_eval_samples generates summaries, an SFT evaluation: shardtune reward evaluates the test "
                "split's pairs (eval_loss, eval_accuracy, eval_margin ...); drop the flag"
            )

    @classmethod
    def prepare_data(cls, cfg, tokenizer, dp_size: int) -> None:
        loaded = {
            split: load_pairs_cached(cfg, tokenizer, split, cache_dir(), whole=True)[0] for split in data_splits(cfg)
        }
        data.steps_per_epoch(len(loaded["train"]), cfg, dp_size)

    # -- in the worker --------------------------------------------------------------------------------------------
    def load_data(self) -> tuple[list, list]:
        """One whole pair per unit, and the validation split's pairs."""
        cfg = self.cfg
        loaded = {
            split: load_pairs_cached(cfg, self.tokenizer, split, cache_dir(), whole=True) for split in data_splits(cfg)
        }
        for split, (_, report) in loaded.items():
            print0(f"data ({split}): {report.summary()}")
        pairs = loaded["train"][0]
        for index, pair in enumerate(pairs):  # its place in the data: LoRA dropout masks keyed by pair, not rank
            pair["index"] = index
        data.steps_per_epoch(len(pairs), cfg, self.strategy.dims.dp_size)
        return [[pair] for pair in pairs], loaded["validation"][0] if cfg.eval.enabled else []

    def attach(self, model: nn.Module, units: list, eval_items: list) -> None:
        self.eval_pairs = eval_items

    def counts(self, micro_batches: list[dict], shape: ModelShape | None) -> list[float]:
        """Pairs (the normaliser); every real token feeds its row's score (label and input tokens alike); FLOPs (the
        score head is one row: its matmul on every token is counted with the body's; the lean last layer's on the
        rows' read positions only)."""
        tokens = sum(num_input_tokens(mb) for mb in micro_batches)
        flops = (
            sum(
                micro_batch_flops(shape, mb)
                - matmul_flops_per_token(shape.lean_layer_params, shape.lean_layer_trainable)
                * lean_layer_saving(shape, mb, mb["input_ids"].shape[0])
                for mb in micro_batches
            )
            if shape is not None
            else 0
        )
        palm = sum(palm_micro_batch_flops(shape, mb) for mb in micro_batches) if shape is not None else 0
        return [sum(num_pairs(mb) for mb in micro_batches), tokens, tokens, flops, palm]

    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor], totals: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return micro_batch_loss(model, batch, self.cfg.reward.center_rewards_coefficient, self.env.device)

    def step_metrics(self, totals: dict[str, float], stats: list[float]) -> dict[str, float]:
        row = means(stats, totals["normaliser"])
        return {"loss": row.pop("loss"), "num_pairs": int(totals["normaliser"]), **row}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[dict[str, float], list[dict]]:
        """The test split's loss and TRL's metrics over all its pairs (all ranks), with TRL's ``eval_`` prefix; the
        pairs shared out as SFT's eval examples are (shardtune.data.batching.eval_shares), a rank short of chunks
        running a pair it does not count."""
        return reward_evaluate(model, self.strategy, self.cfg, self.env, self.eval_pairs, self.pad_id), []

    def describe_eval(self, row: dict[str, float]) -> str:
        return f"eval loss {row['eval_loss']:.4f}, accuracy {row['eval_accuracy']:.3f}"

    def report_eval(self, row: dict[str, float]) -> str:
        return f", accuracy {row['eval_accuracy']:.3f}"


@torch.no_grad()
def reward_evaluate(model: nn.Module, strategy, cfg, env, eval_pairs: list, pad_id: int) -> dict[str, float]:
    """:meth:`Reward.evaluate` (collective)."""
    mine, num_batches = eval_shares(eval_pairs, cfg, strategy.dims.dp_rank(env.rank), strategy.dims.dp_size)
    reductions = StatReductions((*STAT_REDUCTIONS, "sum"), env.device)  # the stats, then the pairs counted
    stats = reductions.start()
    model.eval()
    for i in range(num_batches):
        chunk = mine[i] if i < len(mine) else eval_pairs[:1]
        batch = collate_reward_pairs(chunk, pad_id)
        with strategy.autocast():
            _, batch_stats = micro_batch_loss(model, batch, cfg.reward.center_rewards_coefficient, env.device)
        if i < len(mine):
            count = torch.tensor([float(num_pairs(batch))], dtype=torch.float64, device=batch_stats.device)
            stats = reductions.combine(stats, torch.cat([batch_stats, count]))
    model.train()
    *totals, total = reductions.across_ranks(stats).tolist()
    row = means(totals, total)
    return {f"eval_{name}": value for name, value in row.items()} | {"eval_num_pairs": int(total)}
