"""Image datasets for the vision tests, drawn here (no download): a coloured square at a random place on a white
image, and the question "What colour is the square?" answered by the colour's name; TRL's vision formats."""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 190, 30), "blue": (30, 30, 220)}
QUESTION = "What colour is the square?"


def square(colour: str, rng: random.Random, size: int = 40, side: int = 16):
    from PIL import Image

    image = Image.new("RGB", (size, size), (255, 255, 255))
    x, y = rng.randrange(0, size - side), rng.randrange(0, size - side)
    image.paste(COLOURS[colour], (x, y, x + side, y + side))
    return image


def write_squares(folder: Path, counts: dict[str, int], seed: int = 0, kind: str = "messages") -> Path:
    """``folder``/{split}.jsonl (e.g. counts {"train": 16, "test": 6}) with images under ``folder``/img, named by
    relative path. kind: messages (string contents: the image goes before the user's text), blocks (content lists
    with an image block), prompt_completion (conversational)."""
    rng = random.Random(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for split, n in counts.items():
        rows = []
        for i in range(n):
            colour = rng.choice(sorted(COLOURS))
            path = f"img/{split}-{i}.png"
            square(colour, rng).save(folder / path)
            rows.append({"images": [path], **_text(kind, colour)})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _text(kind: str, colour: str) -> dict:
    if kind == "messages":
        return {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": colour}]}
    if kind == "blocks":
        user = [{"type": "text", "text": "Look."}, {"type": "image"}, {"type": "text", "text": QUESTION}]
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": colour}]}
    if kind == "prompt_completion":
        return {
            "prompt": [{"role": "user", "content": QUESTION}],
            "completion": [{"role": "assistant", "content": colour}],
        }
    raise ValueError(kind)
