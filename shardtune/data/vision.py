"""Rows with images (TRL's vision formats) for vision-language models: checked before launch, processed per batch.

The formats are TRL's: an ``images`` column (a list per row; a single ``image`` column is a list of one) beside
``messages`` (content strings, or lists of ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` blocks), beside
``prompt`` + ``completion`` (strings or message lists), or beside a text column (whose text holds the processor's
image token itself). An image is a PIL image, a ``datasets`` Image feature (``{"bytes", "path"}``), raw bytes or a
path (relative to the data file's folder).

Pixels are not cached: turning images into pixel values is the processor's work per micro-batch, as TRL's collator
does it (a corpus of images never sits in memory as pixels). Before launch every row is checked (its images open, as
many image blocks as images, known roles) and gets its length in text tokens (each image counted as one token: what
batching sorts a global batch by; any fixed value would do for the equivalence of layouts, this one wastes little
padding). Labels are TRL's: the input ids with padding at -100 (image tokens stay labelled, as in TRL), and the
prompt masked for completion-only loss (prompt-completion rows) or everything but the assistant's turns with
--assistant_only_loss (a chat template with ``{% generation %}`` markers).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardtune.data.formatting import IGNORE_INDEX
from shardtune.data.report import DataError, DataReport, RowFilter

IMAGE_COLUMNS = ("images", "image")
# what processors return beside input_ids and attention_mask that the model takes (LLaVA and Gemma 3: pixel_values,
# Gemma's token_type_ids; Qwen2-VL: image_grid_thw, mm_token_type_ids; mllama: aspect ratios and the cross-attention
# mask; Idefics3 / SmolVLM: pixel_attention_mask; LLaVA-NeXT: image_sizes)
MODEL_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "image_sizes",
    "pixel_attention_mask",
    "aspect_ratio_ids",
    "aspect_ratio_mask",
    "cross_attention_mask",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGES, PROMPT_COMPLETION, TEXT = "messages", "prompt_completion", "text"


def has_images(columns: Sequence[str]) -> bool:
    return any(c in columns for c in IMAGE_COLUMNS)


def row_format(columns: Sequence[str], text_field: str) -> str:
    if "messages" in columns:
        return MESSAGES
    if "prompt" in columns and "completion" in columns:
        return PROMPT_COMPLETION
    if text_field in columns:
        return TEXT
    raise DataError(
        f"image rows need messages, prompt + completion or a {text_field!r} column beside images, but the columns "
        f"are {', '.join(columns)}: see docs/vision.md for the formats"
    )


def open_image(value: Any, base: Path | None) -> Any:
    """A PIL RGB image from what a row holds (PIL image, ``{"bytes", "path"}``, bytes, a path)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, Mapping):
        if value.get("bytes"):
            return open_image(bytes(value["bytes"]), base)
        if value.get("path"):
            return open_image(str(value["path"]), base)
        raise ValueError("an image entry with neither bytes nor path")
    if isinstance(value, (bytes, bytearray)):
        with Image.open(io.BytesIO(value)) as image:
            return image.convert("RGB")
    if isinstance(value, str):
        if value.startswith(("http://", "https://")):
            raise ValueError(f"image {value} is a URL: download the images and name local files")
        path = Path(value).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raise ValueError(f"image file {path} does not exist")
        with Image.open(path) as image:
            return image.convert("RGB")
    raise ValueError(f"an image entry of type {type(value).__name__} (expected a PIL image, bytes or a path)")


def row_images(row: Mapping, base: Path | None) -> list:
    if "images" in row:
        images = row["images"]
        if images is None:
            return []
        if not isinstance(images, (list, tuple)):
            images = [images]
    else:
        images = [row["image"]] if row.get("image") is not None else []
    return [open_image(image, base) for image in images]


def _blocks(content: Any) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if content is None:
        return []
    if not isinstance(content, list) or not all(isinstance(b, Mapping) and "type" in b for b in content):
        raise ValueError("a message content that is neither a string nor a list of {'type': ...} blocks")
    return [dict(b) for b in content]


def structured_messages(messages: Any, images: list) -> list[dict]:
    """The messages as content blocks with the row's images in their image blocks, in order. Rows whose contents are
    all strings get their images before the first user message's text (TRL's rule); otherwise the image blocks must
    be as many as the images."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages is not a non-empty list")
    out = []
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, Mapping) else message
            raise ValueError(f"a message with role {role!r} (known: {', '.join(ROLES)})")
        out.append({**message, "content": _blocks(message.get("content"))})
    slots = [b for m in out for b in m["content"] if b.get("type") == "image"]
    if not slots and images:
        first_user = next((m for m in out if m["role"] == "user"), None)
        if first_user is None:
            raise ValueError("images but no user message to put them in")
        first_user["content"] = [{"type": "image"} for _ in images] + first_user["content"]
        slots = first_user["content"][: len(images)]
    if len(slots) != len(images):
        raise ValueError(f"{len(slots)} image blocks in the messages but {len(images)} images in the row")
    for slot, image in zip(slots, images):
        slot["image"] = image
    return out


@dataclass(frozen=True)
class VisionExample:
    """One checked row: where it is in the split, and its length in text tokens (batching sorts by it)."""

    index: int
    length: int


@dataclass(frozen=True)
class VisionOptions:
    text_field: str = "text"
    completion_only: bool = True
    assistant_only: bool = False
    max_length: int | None = None


class VisionRows:
    """A split's rows (``(origin, line, row)`` triples, read lazily: shardtune.data.trl_loading.ArrowRows) and the
    folder relative image paths are read from."""

    def __init__(self, rows: Sequence, columns: Sequence[str], base: Path | None, text_field: str) -> None:
        self.rows, self.base = rows, base
        self.kind = row_format(columns, text_field)
        self.text_field = text_field

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> tuple[str, int, Mapping]:
        return self.rows[index]

    def rendered(self, index: int, processor: Any) -> dict:
        """Row ``index`` with its images opened: {"messages"} (blocks), {"prompt", "completion"} (texts) or
        {"text"}, and "images"."""
        _, _, row = self.rows[index]
        images = row_images(row, self.base)
        if self.kind == MESSAGES:
            return {"messages": structured_messages(row["messages"], images), "images": images}
        if self.kind == PROMPT_COMPLETION:
            prompt, completion = row["prompt"], row["completion"]
            if isinstance(prompt, list):  # conversational: rendered by the template, the completion after the prompt
                prompt_messages = structured_messages(prompt, images)
                whole = prompt_messages + structured_messages(completion, [])
                prompt_text = processor.apply_chat_template(prompt_messages, tokenize=False, add_generation_prompt=True)
                whole_text = processor.apply_chat_template(whole, tokenize=False)
                if not whole_text.startswith(prompt_text):
                    raise ValueError("the chat template renders the prompt differently inside the whole conversation")
                prompt, completion = prompt_text, whole_text[len(prompt_text) :]
            elif not isinstance(prompt, str) or not isinstance(completion, str):
                raise ValueError("prompt and completion are neither both strings nor message lists")
            return {"prompt": prompt, "completion": completion, "images": images}
        text = row[self.text_field]
        if not isinstance(text, str):
            raise ValueError(f"{self.text_field} is not a string")
        return {"text": text, "images": images}


def check_rows(rows: VisionRows, processor: Any, filt: RowFilter) -> list[VisionExample]:
    """Every row rendered once (its images opened, its blocks matched to its images); the rows kept, with their
    lengths in text tokens. A bad row is skipped and counted, or with --strict refused (naming the row)."""
    tokenizer = processor.tokenizer
    kept = []
    for index in range(len(rows)):
        origin, line, _ = rows.row(index)
        try:
            item = rows.rendered(index, processor)
            if "messages" in item:
                text = processor.apply_chat_template(_without_pixels(item["messages"]), tokenize=False)
            else:
                text = item.get("text") or item["prompt"] + item["completion"]
        except (ValueError, OSError, KeyError, TypeError) as e:
            filt.skip("bad image row", origin, line, str(e).splitlines()[0] if str(e) else type(e).__name__)
            continue
        kept.append(VisionExample(index, len(tokenizer(text, add_special_tokens=False)["input_ids"])))
    filt.report.num_examples += len(kept)
    return kept


def _without_pixels(messages: list[dict]) -> list[dict]:
    """The messages with their image blocks emptied: rendering the text alone needs no image."""
    return [
        {**m, "content": [{"type": "image"} if b.get("type") == "image" else b for b in m["content"]]} for m in messages
    ]


def describe(rows: VisionRows, source: str) -> DataReport:
    return DataReport(source=f"{source}: {rows.kind} rows with images", num_rows=len(rows))


class VisionCollator:
    """A micro-batch of image rows, as TRL's vision collator makes it: the processor renders, tokenises and turns
    images into pixel values; rows right-padded (prompt-completion: prompts left-padded, then flushed left); labels
    as the module docstring says. Called with the units of a micro-batch (each a list of one VisionExample)."""

    def __init__(self, rows: VisionRows, processor: Any, options: VisionOptions) -> None:
        self.rows, self.processor, self.options = rows, processor, options

    def __call__(self, units: list, cfg: Any = None, pad_id: int = 0) -> dict[str, torch.Tensor]:
        items = [self.rows.rendered(example.index, self.processor) for unit in units for example in unit]
        return self.collate(items)

    def collate(self, items: list[dict]) -> dict[str, torch.Tensor]:
        if "prompt" in items[0]:
            return self._prompt_completion(items)
        options = self.options
        kwargs = dict(
            padding=True,
            padding_side="right",
            truncation=options.max_length is not None,
            max_length=options.max_length,
            add_special_tokens=False,
        )
        if "messages" in items[0]:
            out = self.processor.apply_chat_template(
                [item["messages"] for item in items],
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                return_assistant_tokens_mask=options.assistant_only,
                processor_kwargs=kwargs,
            )
        else:
            out = self.processor(
                images=_batch_images(items), text=[item["text"] for item in items], return_tensors="pt", **kwargs
            )
        out = dict(out)
        labels = out["input_ids"].clone()
        labels[out["attention_mask"] == 0] = IGNORE_INDEX
        if options.assistant_only:
            labels[out.pop("assistant_masks") == 0] = IGNORE_INDEX
        out["labels"] = labels
        return out

    def _prompt_completion(self, items: list[dict]) -> dict[str, torch.Tensor]:
        prompts = self.processor(
            images=_batch_images(items),
            text=[item["prompt"] for item in items],
            padding=True,
            padding_side="left",
            return_tensors="pt",
            add_special_tokens=False,
        )
        completions = self.processor(
            text=[item["completion"] for item in items],
            padding=True,
            padding_side="right",
            return_tensors="pt",
            add_special_tokens=False,
        )
        out = dict(prompts)
        columns = {
            "input_ids": torch.cat((prompts["input_ids"], completions["input_ids"]), 1),
            "attention_mask": torch.cat((prompts["attention_mask"], completions["attention_mask"]), 1),
            "completion_mask": torch.cat(
                (torch.zeros_like(prompts["attention_mask"]), completions["attention_mask"]), 1
            ),
        }
        for key in ("token_type_ids", "mm_token_type_ids"):
            if key in prompts:  # image tokens are the prompt's; the completion's are text (0)
                columns[key] = torch.cat((prompts[key], torch.zeros_like(completions["input_ids"])), 1)
        columns = _flush_left(columns)
        if self.options.max_length is not None:
            columns = {k: v[:, : self.options.max_length] for k, v in columns.items()}
        labels = columns["input_ids"].clone()
        labels[columns["attention_mask"] == 0] = IGNORE_INDEX
        if self.options.completion_only:
            labels[columns["completion_mask"] == 0] = IGNORE_INDEX
        del columns["completion_mask"]
        out.update(columns, labels=labels)
        return out


def _batch_images(items: list[dict]) -> list | None:
    """The processor's images argument: one list per row, or None when no row has one (processors refuse empty)."""
    images = [item["images"] for item in items]
    return images if any(images) else None


def _flush_left(columns: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each row's tokens moved left past its leading padding (left-padded prompts before right-padded completions),
    and columns no row uses any more cut off."""
    mask = columns["attention_mask"]
    width = int(mask.sum(1).max())
    shifted = {k: torch.zeros((mask.size(0), width), dtype=v.dtype) for k, v in columns.items()}
    for row in range(mask.size(0)):
        first = int(mask[row].nonzero()[0]) if mask[row].any() else 0
        n = min(width, mask.size(1) - first)
        for key, value in columns.items():
            shifted[key][row, :n] = value[row, first : first + n]
    return shifted


def text_of(content: Any) -> str:
    """A message content's text (its text blocks joined)."""
    return content if isinstance(content, str) else "".join(b.get("text", "") for b in _blocks(content))


def image_names(row: Mapping) -> list[str]:
    """How a row names its images, for a log: the path where the row gives one, else "image N"."""
    images = row.get("images", [row.get("image")] if row.get("image") is not None else [])
    images = images if isinstance(images, (list, tuple)) else [images]
    names = []
    for i, image in enumerate(images):
        path = image if isinstance(image, str) else image.get("path") if isinstance(image, Mapping) else None
        names.append(str(path) if path else f"image {i}")
    return names


def sample_prompt(rows: VisionRows, index: int) -> tuple[list[dict], str, list]:
    """(the prompt's messages, the reference answer, the images) of row ``index``: a messages row up to its last
    assistant turn, a conversational prompt / completion row's prompt; what an evaluation sample asks the model."""
    _, _, row = rows.row(index)
    images = row_images(row, rows.base)
    if rows.kind == MESSAGES:
        messages = list(row["messages"])
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None:
            raise ValueError("a messages row without an assistant turn")
        return messages[:last], text_of(messages[last].get("content")), images
    if rows.kind == PROMPT_COMPLETION and isinstance(row["prompt"], list):
        return list(row["prompt"]), "".join(text_of(m.get("content")) for m in row["completion"]), images
    raise ValueError("evaluation samples need messages or conversational prompt / completion rows")
