"""``shardtune generate``: text from a fine-tuned model (base + adapter, a merged model, or any HF model).

    shardtune generate --model_name runs/lora "Summarize this dialog: ..."          # adapter dir: base from its config
    shardtune generate --model_name BASE --adapter runs/lora --prompt_file p.txt
    echo "Anna: lunch at 1?\nBen: sure" | shardtune generate --model_name runs/merged --dialogue

    shardtune generate --model_name runs/chat '[{"role": "user", "content": "Anna: lunch at 1?"}]'
    shardtune generate --model_name runs/chat --chat "Anna: lunch at 1?"

The prompt is encoded as in training: bos (when the tokenizer has one) + the prompt's tokens, no other special
tokens; ``--dialogue`` wraps the text in the training prompt (data.formatting.SAMSUM_PROMPT). A prompt that is a
JSON list of ``{role, content}`` messages (or an object with such a ``messages`` or ``prompt`` list), or any text
with ``--chat`` (one user message), is rendered by the model's chat template with the generation prompt, as
conversational training data is. Greedy by default; generation stops at eos or after --max_new_tokens; the
printed text is the continuation only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

from shardtune.config.schema import ConfigError
from shardtune.data.formatting import SAMSUM_PROMPT
from shardtune.model.generation import DEFAULT_MAX_NEW_TOKENS, encode_prompt, generate_ids, load_for_inference


def generate_text(model: nn.Module, tokenizer, prompt: str | list[dict], **kwargs) -> str:
    prompt_ids = encode_prompt(tokenizer, prompt) if isinstance(prompt, str) else encode_messages(tokenizer, prompt)
    ids = generate_ids(model, tokenizer, prompt_ids, **kwargs)
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def prompt_messages(text: str) -> list[dict] | None:
    """The messages of a JSON prompt (a list of {role, content}, or an object with a messages / prompt list)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(value, dict):
        value = value.get("messages", value.get("prompt"))
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return value
    return None


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's rendering of ``messages`` plus the generation prompt (what the assistant continues)."""
    if not tokenizer.chat_template:
        raise ConfigError(
            "the prompt is a list of messages, but the model's tokenizer has no chat template: pass "
            "the text alone, or a model trained with one (shardtune sft --chat_template_path)"
        )
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file:
        raise ConfigError("give the prompt as an argument or with --prompt_file, not both")
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise ConfigError(f"--prompt_file {args.prompt_file}: no such file")
        text = path.read_text(encoding="utf-8")
    elif args.prompt is not None:
        text = args.prompt
    elif not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        raise ConfigError("no prompt: pass it as an argument, with --prompt_file FILE, or on stdin")
    if not text.strip():
        raise ConfigError("the prompt is empty")
    return text.strip("\n")


def answer_about_images(args: argparse.Namespace, model: nn.Module, prompt: str | list[dict]) -> str:
    """--image: the prompt (a text is one user message) and the images through the model's processor."""
    from shardtune.data.vision import open_image
    from shardtune.model.vision import generate_from_images, load_processor_from, processor_source

    if getattr(model.config, "vision_config", None) is None:
        raise ConfigError(f"--image: {args.model_name} is a text model: drop --image, or use a vision-language model")
    try:
        images = [open_image(path, None) for path in args.image]
    except (ValueError, OSError) as e:
        raise ConfigError(f"--image: {e}: name an image file") from None
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    processor = load_processor_from(processor_source(args.model_name, args.adapter), args.trust_remote_code)
    sampling = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample)
    if args.do_sample:
        sampling.update(temperature=args.temperature, top_p=args.top_p)
    return generate_from_images(model, processor, messages, images, **sampling)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardtune generate", description=__doc__.splitlines()[0])
    p.add_argument("prompt", nargs="?", help="the prompt (else --prompt_file, else stdin)")
    p.add_argument("--prompt_file", default="", help="read the prompt from this file")
    p.add_argument(
        "--model_name",
        default="",
        help="a model directory, hub id or preset:NAME; or a PEFT adapter "
        "directory (its base model is read from its config)",
    )
    p.add_argument("--adapter", default="", help="PEFT adapter directory applied on --model_name")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        help="an image file the prompt asks about (repeat for several; a vision-language model: docs/vision.md)",
    )
    p.add_argument(
        "--dialogue", action="store_true", help="the input is a dialogue: wrap it in the training summarisation prompt"
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="the input is one user message: render it with the model's "
        "chat template (a JSON list of messages is rendered anyway)",
    )
    p.add_argument("--max_new_tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="generate at most this many")
    p.add_argument("--do_sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --do_sample)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (with --do_sample)")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling")
    p.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="run the model's own Python code (its config.json's auto_map): docs/security.md",
    )
    return p


def main(argv: list[str]) -> int:
    from shardtune.runtime.libraries import quiet_libraries

    args = parser().parse_args(argv)
    quiet_libraries()
    try:
        if args.max_new_tokens <= 0:
            raise ConfigError(f"--max_new_tokens {args.max_new_tokens} must be positive")
        if not args.do_sample and (args.temperature != 1.0 or args.top_p != 1.0):
            raise ConfigError("--temperature / --top_p only apply with --do_sample: add it, or drop them")
        if args.do_sample and not args.temperature > 0:
            raise ConfigError(
                f"--temperature {args.temperature} with --do_sample: sampling needs a positive "
                "temperature (e.g. 0.7); for greedy decoding drop --do_sample"
            )
        if not 0 < args.top_p <= 1:
            raise ConfigError(f"--top_p {args.top_p} must be in (0, 1]: the probability mass sampled from")
        prompt = read_prompt(args)
        if args.dialogue:
            prompt = SAMSUM_PROMPT.format(dialog=prompt)
        prompt = [{"role": "user", "content": prompt}] if args.chat else prompt_messages(prompt) or prompt
        model, tokenizer = load_for_inference(args.model_name, args.adapter, trust_remote_code=args.trust_remote_code)
    except ConfigError as e:
        print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    try:
        if args.image:
            print(answer_about_images(args, model, prompt))
            return 0
        text = generate_text(
            model,
            tokenizer,
            prompt,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_p=args.top_p,
        )
    except ConfigError as e:
        print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0
