"""A trained model's card (``README.md``): the hub's metadata header (base model, library, datasets, tags) and what a
reader needs to use and reproduce it — how it was trained (objective, adapter, effective batch, schedule) and its
last figures, from the run's own config and log."""

from __future__ import annotations

from typing import Any

from shardtune.config.schema import TrainConfig


def model_card(
    cfg: TrainConfig, log_history: list[dict[str, Any]], model_name: str, dataset: str | None, tags: list[str]
) -> str:
    from shardtune.model.loading import MODEL_HEADS, model_head

    adapter = bool(cfg.peft.method)
    auto_class = MODEL_HEADS[model_head(cfg)].auto_class  # the objective's head: a reward model is a classifier
    all_tags = ["shardtune", cfg.objective, *([cfg.peft.method] if adapter else []), *tags]
    header = [
        "---",
        f"base_model: {cfg.model.name}",
        f"library_name: {'peft' if adapter else 'transformers'}",
        f"model_name: {model_name}",
        *([f"datasets:\n- {dataset}"] if dataset else []),
        "tags:",
        *(f"- {tag}" for tag in dict.fromkeys(all_tags)),
        "---",
    ]
    steps = [row for row in log_history if "loss" in row]
    evals = [row for row in log_history if "eval_loss" in row]
    figures = []
    if steps:
        figures.append(f"- training loss at step {steps[-1]['step']}: {steps[-1]['loss']:.4f}")
    if evals:
        figures.append(f"- evaluation loss at step {evals[-1].get('step', '?')}: {evals[-1]['eval_loss']:.4f}")
    t, o = cfg.train, cfg.optim
    body = [
        f"# {model_name}",
        "",
        f"A fine-tuned version of [{cfg.model.name}]({_link(cfg.model.name)})"
        + (f" on [{dataset}]({_link(dataset, 'datasets')})" if dataset else "")
        + f", trained with [shardtune](https://pypi.org/project/shardtune/) ({cfg.objective.upper()}"
        + (f", {cfg.peft.method} adapter" if adapter else ", all parameters")
        + ").",
        "",
        "## Use",
        "",
        "```python",
        *(_use_adapter(model_name, auto_class) if adapter else _use_model(model_name, auto_class)),
        "```",
        "",
        "## Training",
        "",
        f"- objective: {cfg.objective}; micro-batch {t.batch_size} per process, gradient accumulation "
        f"{t.gradient_accumulation_steps} (the same steps on any number of processes at the same effective batch)",
        f"- learning rate {o.lr:g}, {o.lr_scheduler} schedule, max_grad_norm {o.max_grad_norm or 'none'}, "
        f"seed {t.seed}",
        *figures,
    ]
    return "\n".join(header + [""] + body) + "\n"


def _link(name: str, kind: str = "") -> str:
    if "/" in name and not name.startswith(("/", ".")):
        return f"https://huggingface.co/{kind + '/' if kind else ''}{name}"
    return name


def _use_model(name: str, auto_class: str = "AutoModelForCausalLM") -> list[str]:
    return [
        f"from transformers import {auto_class}, AutoTokenizer",
        "",
        f'model = {auto_class}.from_pretrained("{name}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
    ]


def _use_adapter(name: str, auto_class: str = "AutoModelForCausalLM") -> list[str]:
    peft_class = "AutoPeft" + auto_class.removeprefix("Auto")
    # a classifier's base is a causal LM, whose config does not say the head's one label
    labels = ", num_labels=1" if auto_class == "AutoModelForSequenceClassification" else ""
    return [
        f"from peft import {peft_class}",
        "from transformers import AutoTokenizer",
        "",
        f'model = {peft_class}.from_pretrained("{name}"{labels})',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
    ]
