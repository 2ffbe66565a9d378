"""A toy for GRPO / RLOO with tools: "What is 3 plus 4?", a calculator tool ``add(a, b)``, and the tiny preset model
taught a chat format in which it sometimes calls the tool.

The tiny model cannot add, and from random weights it never writes a call. So it is first taught the format by a few
hundred plain next-token steps (here, a test's set-up, not the code under test) on conversations of which a fraction
call the tool (``<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>``, then the tool's result, then
the answer, copied) and the rest answer at once with a random digit. Its calls then come at about that fraction, and a
reward for correct answers is earned almost only through the tool: RL has something to raise.

The chat template: plain-text role headers as the preset's, the tools listed by name, a call as JSON between two
added special tokens, eos closing every assistant turn, a tool result as its own turn.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

TEMPLATE = (
    "{%- if tools %}{{ '<|tools|>' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}{% endfor %}"
    "{{ '\\n' }}{% endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{{ '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '</tool_call>' }}"
    "{%- endfor -%}"
    "{{ eos_token + '\\n' }}"
    "{%- else -%}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] | string) + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif -%}"
)
MARKUP = ["<tool_call>", "</tool_call>"]
# the role headers and the call's fixed JSON as single tokens (the preset vocabulary, trained on prose, spells each in
# several): a conversation is ~35 tokens, a call 8 (markup, the two digits and the JSON around them), eos included
PIECES = ["<|tools|>", "<|user|>", "<|assistant|>", "<|tool|>", '{"name": "add", "arguments": {"a": ', ', "b": ', "}}"]

TOOLS_PY = '''
def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def correct(completions, answer, **kwargs):
    """1 for a last reply that is the answer (only the tool knows it), else 0."""
    return [float(c[-1]["role"] == "assistant" and c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]


def called(completions, **kwargs):
    """1 for a completion that called a tool and got its result (no error), else 0."""
    return [float(any(m["role"] == "tool" and "error" not in str(m["content"]) for m in c)) for c in completions]
'''


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} plus {b}?"}]


def conversation(a: int, b: int, calls: bool, rng: random.Random) -> list[dict]:
    """A taught conversation: with ``calls`` the tool is called and its result copied, else a random digit."""
    if not calls:
        return [*question(a, b), {"role": "assistant", "content": str(rng.randrange(10))}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [
        *question(a, b),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)},
    ]


def tokenizer_with_tools():
    from shardtune.model.loading import train_tokenizer

    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": MARKUP})
    tokenizer.add_tokens(PIECES)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def build(out_dir: Path, call_fraction: float = 0.3, steps: int = 400, seed: int = 0) -> Path:
    """The tiny preset model with the toy tokenizer, taught the format: its calls come at about ``call_fraction``."""
    from shardtune.model.loading import _random_model, _save_tokenizer

    tokenizer = tokenizer_with_tools()
    model = _random_model("tiny", tokenizer, seed, torch.float32)
    rng = random.Random(seed)
    texts = []
    for _ in range(2000):
        a, b = rng.randrange(10), rng.randrange(10)
        texts.append(
            tokenizer.apply_chat_template(
                conversation(a, b, rng.random() < call_fraction, rng), tools=[add], tokenize=False
            )
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and the machine's cores are shared
    try:
        for _ in range(steps):
            batch = [texts[i] for i in torch.randint(len(texts), (32,), generator=generator).tolist()]
            encoded = tokenizer(batch, padding=True, return_tensors="pt", add_special_tokens=False)
            labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
            model(**encoded, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir)
    _save_tokenizer(tokenizer, out_dir)
    return out_dir


def write_data(folder: Path, num_train: int = 48, num_test: int = 0, seed: int = 1) -> Path:
    """Conversational prompts "What is a plus b?" with their answer column, as train.jsonl (and test.jsonl)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, count in (("train", num_train), ("test", num_test)):
        if not count:
            continue
        with open(folder / f"{split}.jsonl", "w") as f:
            for _ in range(count):
                a, b = rng.randrange(10), rng.randrange(10)
                f.write(json.dumps({"prompt": question(a, b), "answer": str(a + b)}) + "\n")
    return folder
