"""Generation with a trained model, shared by the commands (generate, eval) and the training loop's eval samples:
loading for inference, encoding a prompt as training does, greedy / sampled continuation, ROUGE."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shardtune.data.formatting import special_ids
from shardtune.model.loss import IGNORE_INDEX
from shardtune.model.peft import resolve_model_and_adapter

DEFAULT_MAX_NEW_TOKENS = 128
SUMMARY_MAX_NEW_TOKENS = 96  # summaries: shardtune eval and the training loop's eval samples
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def inference_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def inference_dtype(device: torch.device) -> torch.dtype:
    """bf16 where training computes in bf16 (CUDA GPUs with bf16), else fp32 (shardtune.runtime.precision decides)."""
    from shardtune.runtime.precision import bf16_compute_available

    return torch.bfloat16 if bf16_compute_available(device) else torch.float32


def load_for_inference(
    model_name: str, adapter: str = "", device: torch.device | None = None, trust_remote_code: bool = False
):
    """(model in eval mode, tokenizer): ``model_name`` + optional ``adapter`` (peft loads it; nothing merged).
    ``trust_remote_code``: the model's own code (auto_map) may run."""
    from shardtune.model.loading import load_model, load_tokenizer
    from shardtune.model.peft import adapter_base_config

    model_name, adapter = resolve_model_and_adapter(model_name, adapter, trust_remote_code)
    device = device or inference_device()
    model = load_model(
        model_name,
        dtype=inference_dtype(device),
        device=device,
        config=adapter_base_config(model_name, adapter, trust_remote_code),
        trust_remote_code=trust_remote_code,
    )
    tokenizer_dir = adapter if adapter and (Path(adapter) / "tokenizer_config.json").is_file() else model_name
    if adapter:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter)
    return model.eval(), load_tokenizer(tokenizer_dir, trust_remote_code)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """As the training data encodes a prompt: bos + tokens(text), no other special tokens."""
    bos, _ = special_ids(tokenizer)
    return bos + tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def generate_ids(
    model: nn.Module,
    tokenizer,
    prompt_ids: list[int],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_at_eos: bool = True,
) -> list[int]:
    """The generated continuation (prompt stripped) up to eos (not included) or max_new_tokens.

    ``stop_at_eos=False`` runs all max_new_tokens steps (the text is still cut at the first eos): sharded models
    (FSDP2, ZeRO-3) need every rank to run the same number of forwards.
    """
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids], device=device)
    sampling = (
        dict(do_sample=True, temperature=temperature, top_p=top_p)
        if do_sample
        else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    )
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id if stop_at_eos else None,
        pad_token_id=tokenizer.pad_token_id,
        **sampling,
    )
    new = out[0, len(prompt_ids) :].tolist()
    return new[: new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new


def rouge_scores(references: list[str], predictions: list[str]) -> list[dict[str, float]]:
    """Per-example ROUGE-1/2/L F-measures, with Porter stemming (as the SAMSum papers report them)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    return [{k: s.fmeasure for k, s in scorer.score(ref, pred).items()} for ref, pred in zip(references, predictions)]


def split_example(example: dict) -> tuple[list[int], list[int]]:
    """(prompt ids: bos + prompt, reference ids: the labelled tokens without the final eos)."""
    labels = [int(label) for label in example["labels"]]  # a list, or a cached example's array slice
    num_prompt = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    prompt = [int(token) for token in example["input_ids"][:num_prompt]]
    return prompt, [t for t in labels[num_prompt:-1] if t != IGNORE_INDEX]


def generate_for_examples(
    model: nn.Module, tokenizer, examples: list[dict], max_new_tokens: int, stop_at_eos: bool = True
) -> list[dict[str, str]]:
    """Greedy continuations of tokenised examples' prompts: {prompt, reference, prediction} per example."""
    rows = []
    for example in examples:
        prompt_ids, reference_ids = split_example(example)
        generated = generate_ids(model, tokenizer, prompt_ids, max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos)
        rows.append(
            {
                "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=True),
                "reference": tokenizer.decode(reference_ids, skip_special_tokens=True).strip(),
                "prediction": tokenizer.decode(generated, skip_special_tokens=True).strip(),
            }
        )
    return rows


class EvalSampler:
    """--log_eval_samples N: greedy answers to the first N validation prompts, with their references and ROUGE.

    Called on every rank with the same examples (FSDP2 / ZeRO-3 gather weights in each forward, so all ranks run
    the same forwards: generation never stops early, the text is cut at the first eos); rank 0 writes them.
    """

    def __init__(self, examples: list[dict], tokenizer, max_new_tokens: int = SUMMARY_MAX_NEW_TOKENS):
        self.examples, self.tokenizer, self.max_new_tokens = examples, tokenizer, max_new_tokens

    def __call__(self, model: nn.Module) -> list[dict]:
        rows = generate_for_examples(model, self.tokenizer, self.examples, self.max_new_tokens, stop_at_eos=False)
        for row, scores in zip(rows, rouge_scores([r["reference"] for r in rows], [r["prediction"] for r in rows])):
            row.update(scores)
        return rows


def mean_rouge(rows: list[dict]) -> dict[str, float]:
    """{eval_rouge1: mean, ...} over rows that carry ROUGE scores (empty when there are none)."""
    if not rows:
        return {}
    return {f"eval_{k}": sum(r[k] for r in rows) / len(rows) for k in ROUGE_TYPES}
