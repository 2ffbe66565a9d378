"""A llama-cookbook style custom dataset file for a vision model (the shape of its ocrvqa recipe), written here for the
tests: ``get_custom_dataset(dataset_config, processor, split)`` returns a ``datasets.Dataset`` of rows with ``images``
(a list of one PIL image) and ``texts`` (a list of ``{"user", "assistant", "source"}`` turns), and
``get_data_collator(processor)`` a callable that turns a list of rows into a batch through the processor: the chat
template renders each dialogue, the processor tokenises it and turns its image into pixels, and the labels keep only
the assistant's answers (prompt, padding and image tokens at -100).

The rows are the coloured squares of tests/vision_data.py, read from ``dataset_config.data_path``/{split}.jsonl
(what ``write_squares`` writes). The file imports nothing from the tests: shardtune imports it by its path.
"""

from __future__ import annotations

import json
from pathlib import Path

IGNORE_INDEX = -100


def get_custom_dataset(dataset_config, processor, split):
    from datasets import Dataset
    from PIL import Image

    folder = Path(dataset_config.data_path)
    rows = []
    for line in (folder / f"{split}.jsonl").read_text().splitlines():
        row = json.loads(line)
        question, answer = (m["content"] for m in row["messages"])
        image = Image.open(folder / row["images"][0]).convert("RGB")
        rows.append({"images": [image], "texts": [{"user": question, "assistant": answer, "source": "squares"}]})
    return Dataset.from_list(rows)


def dialogue(turns: list[dict]) -> list[dict]:
    """The row's turns as chat messages, its image in the first user turn."""
    messages = []
    for turn in turns:
        user = [{"type": "text", "text": turn["user"].strip()}]
        if not messages:
            user.insert(0, {"type": "image"})
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": turn["assistant"].strip()}]})
    return messages


class SquaresCollator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, rows: list[dict]) -> dict:
        dialogues = [dialogue(row["texts"]) for row in rows]
        texts = [self.processor.apply_chat_template(d, tokenize=False) for d in dialogues]
        batch = self.processor(
            images=[[image.convert("RGB") for image in row["images"]] for row in rows],
            text=texts,
            padding=True,
            padding_side="right",
            add_special_tokens=False,
            return_tensors="pt",
        )
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = IGNORE_INDEX
        for i, d in enumerate(dialogues):  # the prompt up to the last answer masked (one turn per row here)
            prompt = self.processor.apply_chat_template(d[:-1], tokenize=False, add_generation_prompt=True)
            labels[i, : len(self.processor.tokenizer(prompt, add_special_tokens=False)["input_ids"])] = IGNORE_INDEX
        image_token = getattr(self.processor, "image_token", None)
        if image_token is not None:
            labels[batch["input_ids"] == self.processor.tokenizer.convert_tokens_to_ids(image_token)] = IGNORE_INDEX
        batch["labels"] = labels
        return dict(batch)


def get_data_collator(processor):
    return SquaresCollator(processor)
