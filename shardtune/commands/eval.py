"""``shardtune eval``: eval loss, perplexity and ROUGE of generated summaries on a samsum-format split.

    shardtune eval --model_name runs/chat --dataset_name chats/          # TRL's formats: loss on the test split

    shardtune eval --config recipes/demo.yaml --model_name runs/demo --max_examples 50 --report_path r.json
    shardtune eval --model_name runs/lora --dataset samsum_dataset --samsum_dataset.data_path data/samsum/

Data flags are sft's (--config, --dataset, --samsum_dataset.*, --context_length, --val_batch_size ...), so an
eval sees exactly the validation examples training saw. On the first --max_examples of them, in one process:
- eval loss (token-weighted sum over labelled tokens / their count, the training loop's loss code) and perplexity;
- ROUGE-1/2/L F-measures (rouge_score, use_stemmer=True) of greedy summaries against the references: the
  prompt is the example's own prompt tokens (bos + prompt), the reference its labelled tokens without eos.
The JSON report carries every generated text, so the numbers can be recomputed from it.
Data in TRL's formats (--dataset_name, --synthetic_dialogues.messages) is evaluated on its --dataset_test_split with
loss and perplexity only (its labelled tokens are not one reference answer).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

from shardtune import data
from shardtune.config.flags import parse_args
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.trl_loading import uses_trl_formats
from shardtune.model.generation import (
    ROUGE_TYPES,
    SUMMARY_MAX_NEW_TOKENS,
    generate_for_examples,
    load_for_inference,
    rouge_scores,
)
from shardtune.model.loss import num_label_tokens, token_loss_sum
from shardtune.model.peft import resolve_model_and_adapter
from shardtune.runtime.files import write_text_atomic
from shardtune.training.engine.metrics import perplexity

DEFAULT_MAX_EXAMPLES = 50


@torch.no_grad()
def eval_loss(model: nn.Module, examples: list[dict], cfg: TrainConfig, pad_id: int) -> tuple[float, float, int]:
    """Token-weighted loss over the examples, with the training loop's loss code: (loss, perplexity, tokens)."""
    device = next(model.parameters()).device
    loss_sum, num_tokens = 0.0, 0
    for batch in data.eval_batches(examples, cfg, dp_rank=0, dp_size=1, pad_id=pad_id):
        loss_sum += float(token_loss_sum(model, batch, device).double())
        num_tokens += num_label_tokens(batch["labels"])
    loss = loss_sum / num_tokens if num_tokens else float("nan")
    return loss, perplexity(loss), num_tokens


def evaluate_model(cfg: TrainConfig, adapter: str, max_examples: int, max_new_tokens: int) -> dict:
    model, tokenizer = load_for_inference(cfg.model.name, adapter, trust_remote_code=cfg.model.trust_remote_code)
    examples, data_report = data.load_examples(cfg, data.apply_tokenizer_options(cfg, tokenizer), "validation")
    examples = examples[:max_examples]
    if not examples:
        raise ConfigError(
            f"--dataset {cfg.data.dataset}: the validation split has no usable example ({data_report.summary()})"
        )
    loss, ppl, num_tokens = eval_loss(model, examples, cfg, tokenizer.pad_token_id)
    split = "validation"
    if uses_trl_formats(cfg):
        return {
            "model_name": cfg.model.name,
            "adapter": adapter,
            "dataset": cfg.data.dataset,
            "data": data_report.source,
            "split": cfg.data.trl_dataset.dataset_test_split if cfg.data.dataset == "trl_dataset" else split,
            "num_examples": len(examples),
            "eval_loss": loss,
            "eval_ppl": ppl,
            "eval_label_tokens": num_tokens,
        }
    rows = generate_for_examples(model, tokenizer, examples, max_new_tokens)
    scores = rouge_scores([r["reference"] for r in rows], [r["prediction"] for r in rows])
    for row, score in zip(rows, scores):
        row.update(score)
    means = {k: sum(s[k] for s in scores) / len(scores) for k in ROUGE_TYPES}
    return {
        "model_name": cfg.model.name,
        "adapter": adapter,
        "dataset": cfg.data.dataset,
        "split": split,
        "num_examples": len(rows),
        "eval_loss": loss,
        "eval_ppl": ppl,
        "eval_label_tokens": num_tokens,
        **means,
        "rouge": {"use_stemmer": True, "measure": "fmeasure"},
        "generation": {"decoding": "greedy", "max_new_tokens": max_new_tokens},
        "examples": rows,
    }


def summary(report: dict) -> str:
    loss = (
        f"eval ({report['num_examples']} examples): loss {report['eval_loss']:.4f}, perplexity {report['eval_ppl']:.3f}"
    )
    if "rouge1" not in report:
        return f"{loss} on {report['data']}"
    return (
        f"{loss}, ROUGE-1 {100 * report['rouge1']:.2f}, ROUGE-2 {100 * report['rouge2']:.2f}, "
        f"ROUGE-L {100 * report['rougeL']:.2f}"
    )


def print_examples(report: dict, num: int) -> None:
    for i, row in enumerate(report.get("examples", [])[:num], start=1):
        prompt = row["prompt"] if len(row["prompt"]) <= 400 else row["prompt"][:400] + " ..."
        print(f"--- example {i}\n{prompt}\n[reference] {row['reference']}\n[generated] {row['prediction']}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardtune eval",
        description=__doc__.splitlines()[0],
        epilog="Any other flag is a data / model flag of shardtune sft (see its --help).",
    )
    p.add_argument(
        "--adapter",
        default="",
        help="PEFT adapter directory applied on --model_name (or give the adapter directory as --model_name)",
    )
    p.add_argument(
        "--max_examples", type=int, default=DEFAULT_MAX_EXAMPLES, help="evaluate the first N validation examples"
    )
    p.add_argument("--max_new_tokens", type=int, default=SUMMARY_MAX_NEW_TOKENS, help="summary length limit")
    p.add_argument("--report_path", default="", help="write the JSON report here (default: print only)")
    p.add_argument("--num_print", type=int, default=3, help="examples printed")
    return p


def check_flag_names(rest: list[str], own: list[str]) -> None:
    """An unknown flag is one line whose suggestion also considers eval's own flags (--max_examples ...)."""
    import difflib

    from shardtune.config.spellings import resolve, usable_names

    for arg in rest:
        if not arg.startswith("--"):
            continue
        name = arg[2:].partition("=")[0]
        if name == "config":  # the recipe: parse_args reads it (sft's --config)
            continue
        try:
            resolve(name)
        except ConfigError:
            close = difflib.get_close_matches(name.replace("-", "_"), [*own, *usable_names()], n=1, cutoff=0.5)
            hint = f"did you mean --{close[0]}?" if close else "see shardtune eval --help"
            raise ConfigError(f"unknown flag --{name}: {hint}") from None


def main(argv: list[str]) -> int:
    from shardtune.runtime.libraries import quiet_libraries

    args, rest = parser().parse_known_args(argv)
    quiet_libraries()
    try:
        if args.max_examples <= 0 or args.max_new_tokens <= 0:
            raise ConfigError("--max_examples and --max_new_tokens must be positive")
        check_flag_names(rest, [a.dest for a in parser()._actions if a.dest != "help"])
        cfg = parse_args(rest)
        cfg.model.name, args.adapter = resolve_model_and_adapter(
            cfg.model.name, args.adapter, cfg.model.trust_remote_code
        )
        data.check_data_config(cfg)
        report = evaluate_model(cfg, args.adapter, args.max_examples, args.max_new_tokens)
    except ConfigError as e:
        print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    print_examples(report, args.num_print)
    print(summary(report))
    if args.report_path:
        path = Path(args.report_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(report, indent=2) + "\n")
        print(f"report written to {path.resolve()}")
    return 0
