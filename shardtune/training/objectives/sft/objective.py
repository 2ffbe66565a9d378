"""Supervised fine-tuning: next-token cross-entropy over the labelled tokens, normalised by the step's global number
of labelled tokens (the engine's N), with TRL's SFTTrainer metrics of the same tokens: mean_token_accuracy (the
share whose argmax prediction is the label) and entropy (the mean entropy of the predicted distribution), taken from
the logits the loss computes and summed with the loss, so that they are exact over ranks and accumulation.
Evaluation: the token-weighted loss and perplexity of the validation split and the same two metrics, and with
--log_eval_samples N greedy answers to its first N prompts, scored by ROUGE."""

from __future__ import annotations

import torch
from torch import nn

from shardtune import data
from shardtune.accounting.flops import ModelShape, micro_batch_flops, num_input_tokens, palm_micro_batch_flops
from shardtune.data.batching import eval_chunk_starts, grouped_eval_batches
from shardtune.data.cache import load_examples_cached
from shardtune.data.packing import eval_examples
from shardtune.data.streaming import StreamSource, streamed_examples
from shardtune.model.generation import ROUGE_TYPES, EvalSampler, mean_rouge
from shardtune.model.loading import cache_dir
from shardtune.model.loss import PREDICTION_SUMS, batch_label_tokens, token_loss_and_prediction_sums
from shardtune.parallel.sequence import RowSlice
from shardtune.runtime.distributed import all_reduce_sum, local_gpu_count, print0
from shardtune.training.engine.metrics import perplexity
from shardtune.training.engine.objective import Objective, data_splits
from shardtune.training.engine.predictions import loss_and_logits

# TRL's SFTTrainer metrics, each the step's PREDICTION_SUMS (same order) over its label tokens
PREDICTION_METRICS = ("mean_token_accuracy", "entropy")


class SFT(Objective):
    name = "sft"
    stat_names = ("loss_sum", *PREDICTION_SUMS)
    step_metric_names = PREDICTION_METRICS
    predicts = True
    # this rank's eval chunks grouped into fewer micro-batches (shardtune.data.batching.grouped_eval_batches): what
    # evaluation runs unless it keeps predictions per chunk; None: the chunks as they are (split rows, vision)
    grouped_eval_batches: list | None = None
    eval_metric_names = (
        "eval_loss",
        "eval_ppl",
        *(f"eval_{k}" for k in PREDICTION_METRICS),
        *(f"eval_{k}" for k in ROUGE_TYPES),
    )

    @classmethod
    def padding_free_by_default(cls, cfg) -> bool:
        """Padded micro-batches computed as one row without their pad tokens on CPU: the same examples, loss and
        metrics (to float rounding: tests/distributed/test_equivalence.py), none of the padding's compute (bench/'s
        padded epoch 2.20x Trainer's before, 3.81x after: bench/results/objectives_sft.md, objectives_s4.md). On
        CUDA, padded rows unless asked (--padding_free true): the varlen kernel's speed there is not measured yet."""
        return cfg.data.batching == "padding" and local_gpu_count() == 0

    @classmethod
    def prepare_data(cls, cfg, tokenizer, dp_size: int) -> None:
        if cfg.data.streaming:  # the first row (its format) and the evaluation split; nothing else before launch
            StreamSource(cfg, tokenizer)
            if cfg.eval.enabled:
                streamed_examples(cfg, tokenizer)
            return
        loaded = {split: load_examples_cached(cfg, tokenizer, split, cache_dir()) for split in data_splits(cfg)}
        data.steps_per_epoch(len(data.build_units(loaded["train"][0], cfg)), cfg, dp_size)

    def load_data(self) -> tuple[list, list]:
        cfg = self.cfg
        if cfg.data.streaming:
            source = StreamSource(cfg, self.tokenizer)
            print0(f"data (train): {source.describe()}")
            if not cfg.eval.enabled:
                return source, []
            examples, report = streamed_examples(cfg, self.tokenizer)
            print0(f"data (validation): {report.summary()}")
            return source, examples
        loaded = {split: load_examples_cached(cfg, self.tokenizer, split, cache_dir()) for split in data_splits(cfg)}
        for split, (_, report) in loaded.items():
            print0(f"data ({split}): {report.summary()}")
        units = data.build_units(loaded["train"][0], cfg)
        data.steps_per_epoch(len(units), cfg, self.strategy.dims.dp_size)  # fails early if the data is too small
        return units, loaded["validation"][0] if cfg.eval.enabled else []

    def attach(self, model: nn.Module, units: list, eval_items: list) -> None:
        cfg, dims = self.cfg, self.strategy.dims
        row_slice = RowSlice.of_rank(dims, self.env.rank)  # eval rows are split like training rows
        dp_rank = dims.dp_rank(self.env.rank)
        self.eval_batches = (
            data.eval_batches(eval_items, cfg, dp_rank, dims.dp_size, self.pad_id, row_slice)
            if cfg.eval.enabled
            else []
        )
        if cfg.eval.enabled and row_slice is None:  # the same examples in fewer forwards, unless kept per chunk
            self.grouped_eval_batches = grouped_eval_batches(eval_items, cfg, dp_rank, dims.dp_size, self.pad_id)
        # the split index of each real eval batch's first row (the rest only join the collectives): predictions; the
        # split as evaluation computes it (packing that splits rows: its sequences, as TRL's eval_packing)
        evaluated = len(eval_examples(eval_items, cfg))
        self.eval_starts = eval_chunk_starts(evaluated, cfg, dp_rank, dims.dp_size) if row_slice is None else []
        self.sampler = EvalSampler(eval_items[: cfg.eval.log_samples], self.tokenizer) if cfg.eval.log_samples else None

    def counts(self, micro_batches: list[dict], shape: ModelShape | None) -> list[float]:
        """Labelled tokens (normaliser and label_tokens), real input tokens, FLOPs; a split row's slices hold
        disjoint tokens (shardtune.parallel.sequence), so summing over ranks counts each once."""
        tokens = sum(batch_label_tokens(mb) for mb in micro_batches)
        flops = sum(micro_batch_flops(shape, mb) for mb in micro_batches) if shape is not None else 0
        palm = sum(palm_micro_batch_flops(shape, mb) for mb in micro_batches) if shape is not None else 0
        return [tokens, tokens, sum(num_input_tokens(mb) for mb in micro_batches), flops, palm]

    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor], totals: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum, predictions = token_loss_and_prediction_sums(model, batch, self.env.device)
        return loss_sum, torch.cat([loss_sum.detach().double().reshape(1), predictions])

    def step_metrics(self, totals: dict[str, float], stats: list[float]) -> dict[str, float]:
        tokens = max(totals["normaliser"], 1)
        return {"loss": stats[0] / tokens, **dict(zip(PREDICTION_METRICS, (s / tokens for s in stats[1:])))}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[dict[str, float], list[dict]]:
        """The token-weighted loss over all ranks' shares of the validation split, and its perplexity; the samples
        of --log_eval_samples (every rank generates them, FSDP gathering weights in each forward)."""
        strategy, device = self.strategy, self.env.device
        model.eval()
        sums = torch.zeros(2 + len(PREDICTION_SUMS), dtype=torch.float64, device=device)
        grouped = self.predictions is None and self.grouped_eval_batches is not None
        for j, batch in enumerate(self.grouped_eval_batches if grouped else self.eval_batches):
            loss_sum, predictions = self._eval_batch(model, batch, j)
            sums[0] += loss_sum.double()
            sums[1] += batch_label_tokens(batch)
            sums[2:] += predictions
        loss_sum, label_tokens, *predictions = all_reduce_sum(sums, device).tolist()
        samples = []
        if self.sampler is not None:
            with strategy.autocast(), strategy.generating(model):
                samples = self.sampler(strategy.unwrap(model))
        model.train()
        loss = loss_sum / label_tokens if label_tokens else float("nan")
        return {
            "eval_loss": loss,
            "eval_ppl": perplexity(loss),
            **{f"eval_{k}": s / max(label_tokens, 1) for k, s in zip(PREDICTION_METRICS, predictions)},
            "eval_label_tokens": int(label_tokens),
            **mean_rouge(samples),
        }, samples

    def _eval_batch(
        self, model: nn.Module, batch: dict[str, torch.Tensor], j: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, prediction sums) of eval batch ``j``; while predictions are kept, from the full logits, which
        the keeper takes with the place of the batch's rows in the split."""
        device = self.env.device
        with self.strategy.autocast():
            if self.predictions is None:
                return token_loss_and_prediction_sums(model, batch, device)
            loss_sum, predictions, logits = loss_and_logits(model, batch, device)
        self.predictions.add(self.eval_starts[j] if j < len(self.eval_starts) else None, batch, logits)
        return loss_sum, predictions

    def describe_eval(self, row: dict[str, float]) -> str:
        return f"eval loss {row['eval_loss']:.4f}, perplexity {row['eval_ppl']:.2f}"

    def report_eval(self, row: dict[str, float]) -> str:
        return f", perplexity {row['eval_ppl']:.3f}"
