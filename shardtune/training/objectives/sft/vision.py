"""SFT of a vision-language model on rows with images (shardtune.data.vision): SFT's loss, metrics, evaluation and
guarantees, with batches the model's processor makes (pixel values beside the tokens) as TRL's vision collator
makes them. Rows are padded per micro-batch (TRL refuses packing and padding-free rows with images too); the loss
is normalised by the step's labelled tokens over all ranks, so any split of a step over processes and accumulation
gives the same losses (tests/distributed/test_vision.py)."""

from __future__ import annotations

from typing import Any

import torch

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.batching import eval_shares, steps_per_epoch
from shardtune.data.formatting import IGNORE_INDEX
from shardtune.data.report import DataReport, RowFilter
from shardtune.data.trl_formats import LossOptions, RowFormat, completion_only
from shardtune.data.trl_loading import drop_absent_validation, vision_rows
from shardtune.data.vision import (
    VisionCollator,
    VisionOptions,
    VisionRows,
    check_rows,
    image_names,
    sample_prompt,
    text_of,
)
from shardtune.data.vision_custom import CollatedBatches, CollatedRows, check_collated_rows, custom_vision_rows
from shardtune.model.generation import SUMMARY_MAX_NEW_TOKENS, rouge_scores
from shardtune.model.vision import forward_keywords, generate_from_images, load_processor
from shardtune.runtime.distributed import print0
from shardtune.training.engine.objective import data_splits
from shardtune.training.objectives.sft.objective import SFT


def _refusal(cfg: TrainConfig, world_size: int) -> str:
    """What a vision run cannot do, as the flag and its fix ("" when nothing)."""
    if cfg.data.batching == "packing":
        return "--packing: rows with images are padded per micro-batch (TRL refuses packing them too): drop it"
    if cfg.data.padding_free:
        return "--padding_free: rows with images are padded per micro-batch (TRL refuses it too): drop it"
    if cfg.data.streaming:
        return "--dataset_streaming: rows with images are read from the loaded table, not streamed: drop the flag"
    if cfg.parallel.sequence_parallel_size * cfg.parallel.context_parallel_size > 1:
        return "sequence / context parallelism splits rows, which is not built for images: drop it"
    if cfg.data.trl_dataset.truncation_mode == "keep_end":
        return "--truncation_mode keep_end would cut the image tokens at the start of rows (TRL refuses it): drop it"
    return ""


class VisionSFT(SFT):
    """SFT on a vision-language model; its rows through the model's processor."""

    predicts = False  # compute_metrics / predict() keep text rows' logits; not built for image rows

    @classmethod
    def padding_free_by_default(cls, cfg: TrainConfig) -> bool:
        return False  # rows with images are padded per micro-batch

    @classmethod
    def check(cls, cfg: TrainConfig, world_size: int) -> None:
        super().check(cfg, world_size)
        refusal = _refusal(cfg, world_size)
        if refusal:
            raise ConfigError(f"{cfg.model.name} is a vision-language model; {refusal}")

    @classmethod
    def options(cls, cfg: TrainConfig, rows: VisionRows) -> VisionOptions:
        tc = cfg.data.trl_dataset
        columns = ("prompt", "completion") if rows.kind == "prompt_completion" else ()
        only = completion_only(
            LossOptions(completion_only_loss=tc.completion_only_loss), RowFormat(rows.kind, columns), list(columns)
        )
        return VisionOptions(
            text_field=tc.dataset_text_field,
            completion_only=only,
            assistant_only=tc.assistant_only_loss,
            max_length=cfg.data.context_length,
        )

    @classmethod
    def split(cls, cfg: TrainConfig, processor: Any, split: str) -> tuple[VisionRows | CollatedRows, list, DataReport]:
        """The split's rows: --dataset_name's, or a custom dataset file's (llama-cookbook's vision recipe: its
        function given the processor, its rows batched by its own collator where it defines one), checked."""
        if cfg.data.dataset == "custom_dataset":
            source, rows = custom_vision_rows(cfg, processor, split)
        else:
            source, rows = vision_rows(cfg, split)
        if cfg.data.trl_dataset.assistant_only_loss and rows.kind != "messages":
            raise ConfigError(f"--assistant_only_loss true needs messages rows, but {source} has {rows.kind} rows")
        if isinstance(rows, CollatedRows):
            report = DataReport(source=f"{source}: rows batched by its data collator", num_rows=len(rows))
            filt = RowFilter(report, cfg.data.strict)
            return rows, check_collated_rows(rows, forward_keywords(cfg), cfg.data.context_length, filt), report
        report = DataReport(source=f"{source}: {rows.kind} rows with images", num_rows=len(rows))
        kept = check_rows(rows, processor, RowFilter(report, cfg.data.strict))
        return rows, kept, report

    @classmethod
    def collator(cls, cfg: TrainConfig, rows: VisionRows | CollatedRows, processor: Any) -> Any:
        """What batches the rows: the custom dataset file's collator where it has one, else shardtune's."""
        if isinstance(rows, CollatedRows):
            return CollatedBatches(rows, forward_keywords(cfg))
        return VisionCollator(rows, processor, cls.options(cfg, rows))

    @classmethod
    def prepare_data(cls, cfg: TrainConfig, tokenizer, dp_size: int) -> None:
        processor = load_processor(cfg)
        drop_absent_validation(cfg, say=False)
        for split in data_splits(cfg):
            _, kept, report = cls.split(cfg, processor, split)
            if split == "train":
                steps_per_epoch(len(kept), cfg, dp_size)
            elif not kept:
                raise ConfigError(f"{report.summary()}: no evaluation row left: fix the rows or drop evaluation")

    def load_data(self) -> tuple[list, list]:
        cfg = self.cfg
        self.processor = load_processor(cfg)
        self.tokenizer = self.processor.tokenizer
        self.pad_id = self.tokenizer.pad_token_id
        loaded = {split: self.split(cfg, self.processor, split) for split in data_splits(cfg)}
        for split, (_, _, report) in loaded.items():
            print0(f"data ({split}): {report.summary()}")
        rows, kept, _ = loaded["train"]
        self.collate_fn = self.collator(cfg, rows, self.processor)
        steps_per_epoch(len(kept), cfg, self.strategy.dims.dp_size)
        if not cfg.eval.enabled:
            return [[example] for example in kept], []
        eval_rows, eval_kept, _ = loaded["validation"]
        self.eval_collate = self.collator(cfg, eval_rows, self.processor)
        if cfg.eval.log_samples:
            if isinstance(eval_rows, CollatedRows) or eval_rows.kind == "text" or not _conversational(eval_rows):
                raise ConfigError(
                    f"--log_eval_samples: the evaluation rows are {eval_rows.kind} rows; samples with images need "
                    "messages or conversational prompt / completion rows: drop the flag"
                )
            picked = [example.index for example in eval_kept[: cfg.eval.log_samples]]
            self.vision_sampler = VisionEvalSampler(eval_rows, picked, self.processor)
        return [[example] for example in kept], eval_kept

    def processing_class(self) -> Any:
        return self.processor

    def attach(self, model, units: list, eval_items: list) -> None:
        """Eval batches: this rank's chunks of the split (chunk c on data-parallel rank c % dp_size); a rank with
        fewer chunks runs its first chunk again with no label counted (a sharded model's forward is collective, and
        an image row runs the vision tower's too)."""
        cfg, dims = self.cfg, self.strategy.dims
        self.sampler, self.eval_starts, self.eval_batches = getattr(self, "vision_sampler", None), [], []
        if not cfg.eval.enabled or not eval_items:
            return
        mine, num_batches = eval_shares(eval_items, cfg, dims.dp_rank(self.env.rank), dims.dp_size)
        batches = [self.eval_collate([[example] for example in chunk]) for chunk in mine]
        while len(batches) < num_batches:
            filler = dict(self.eval_collate([[eval_items[0]]]))
            filler["labels"] = torch.full_like(filler["labels"], IGNORE_INDEX)
            batches.append(filler)
        self.eval_batches = batches[:num_batches]


def _conversational(rows: VisionRows) -> bool:
    """Messages rows, or prompt / completion rows whose prompt is a message list (what a sample's prompt is)."""
    return rows.kind == "messages" or (len(rows) > 0 and isinstance(rows.row(0)[2].get("prompt"), list))


class VisionEvalSampler:
    """--log_eval_samples N on image rows: greedy answers to the first N evaluation rows' prompts with their images,
    the images named as the rows name them, the reference answers and ROUGE. Every rank generates the same rows for
    the same number of tokens (a sharded model's forwards are collective); rank 0 writes them."""

    def __init__(
        self, rows: VisionRows, indices: list[int], processor: Any, max_new_tokens: int = SUMMARY_MAX_NEW_TOKENS
    ):
        self.rows, self.indices, self.processor, self.max_new_tokens = rows, indices, processor, max_new_tokens

    def __call__(self, model: torch.nn.Module) -> list[dict]:
        samples = []
        for index in self.indices:
            messages, reference, images = sample_prompt(self.rows, index)
            prediction = generate_from_images(
                model,
                self.processor,
                messages,
                images,
                stop_at_eos=False,
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
            )
            prompt = " ".join(text for text in (text_of(m.get("content")) for m in messages) if text)
            samples.append(
                {
                    "images": ", ".join(image_names(self.rows.row(index)[2])),
                    "prompt": prompt,
                    "reference": reference.strip(),
                    "prediction": prediction,
                }
            )
        scores = rouge_scores([s["reference"] for s in samples], [s["prediction"] for s in samples])
        for sample, score in zip(samples, scores):
            sample.update(score)
        return samples
