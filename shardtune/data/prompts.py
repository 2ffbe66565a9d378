"""GRPO's prompts in TRL's formats: a ``prompt`` column, standard (text) or conversational (a list of messages, the
chat template applied with the generation prompt); every other column is kept and handed to the reward functions
(TRL's reward kwargs). Tokenised as TRL 1.16's GRPOTrainer does: conversations through apply_chat_template, text with
the tokenizer's own special tokens."""

from __future__ import annotations

from typing import Any

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.chat import check_chat_template
from shardtune.data.emptiness import nothing_usable
from shardtune.data.mixture import mixture_rows
from shardtune.data.report import DataError, DataReport, RowFilter
from shardtune.data.trl_loading import _dataset_rows
from shardtune.data.trl_utils import is_message_list


def check_prompt_data(cfg: TrainConfig) -> None:
    if cfg.data.dataset != "trl_dataset":
        raise ConfigError(
            f"--dataset {cfg.data.dataset}: shardtune grpo reads prompts in TRL's format (a prompt column, text or "
            "messages): pass --dataset_name with a local file or folder, or a hub id"
        )


def prompt_rows(
    cfg: TrainConfig, tokenizer: Any, split: str = "train", tools: list | None = None
) -> tuple[list[dict], DataReport]:
    """One dict per usable row of ``split`` ("train" or "validation": --dataset_test_split): ``prompt`` (as given),
    ``prompt_ids``, ``extras`` (the other columns), ``index`` (its place among the kept rows). A row without a usable
    prompt is skipped (counted) or, with --strict, refused. ``tools``: rendered into conversational prompts by the
    chat template, as TRL does (text prompts cannot hold them: refused)."""
    loader = mixture_rows if cfg.data.trl_dataset.dataset_mixture else _dataset_rows
    source, rows, columns = loader(cfg, split)
    if "prompt" not in columns:
        raise DataError(
            f"{source}: no 'prompt' column (it has: {', '.join(columns)}): GRPO samples completions of prompts; "
            "give each row a prompt (text, or a list of messages)"
        )
    conversational = any(is_message_list(row.get("prompt")) for _, _, row in rows[:1])
    if conversational:
        check_chat_template(cfg, tokenizer, f"{source} (conversational prompts)")
    elif tools:
        raise DataError(
            f"{source}: text prompts, but tools are given: the chat template renders the tools and the model's calls, "
            "so give conversational prompts (lists of messages)"
        )
    report = DataReport(
        source=f"{source}: {'conversational' if conversational else 'standard'} prompts", num_rows=len(rows)
    )
    filt = RowFilter(report, cfg.data.strict)
    out: list[dict] = []
    for origin, line, row in rows:
        prompt = row.get("prompt")
        if conversational and not is_message_list(prompt):
            filt.skip("prompt is not a list of messages", origin, line, f"prompt {str(prompt)[:40]!r}")
            continue
        if not conversational and (not isinstance(prompt, str) or not prompt):
            filt.skip("prompt is not text", origin, line, f"prompt {str(prompt)[:40]!r}")
            continue
        if conversational:
            ids = tokenizer.apply_chat_template(
                prompt, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            ids = list(ids["input_ids"])
        else:
            ids = list(tokenizer(prompt)["input_ids"])
        extras = {key: value for key, value in row.items() if key not in ("prompt", "completion", "completion_ids")}
        out.append({"prompt": prompt, "prompt_ids": ids, "extras": extras, "index": len(out)})
    report.num_examples = len(out)
    if not out:
        raise DataError(nothing_usable(report, "prompt", "give each row a prompt (text, or a list of messages)"))
    return out, report
