"""The tiny vision-language presets (shardtune.model.vision_presets): each builds offline into a directory that the
Auto classes load with its processor, renders TRL's vision format, trains (every weight gets a gradient) and
generates from an image."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from PIL import Image

from shardtune.model.loading import init_model
from shardtune.model.vision_presets import VISION_PRESETS

QUESTION = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}
# weights a family legitimately leaves out of the loss: llava reads the tower's hidden states, not its pooled output
UNUSED = {"vlm-llava-tiny": ("model.vision_tower.post_layernorm.",)}


def _example(answer: str) -> dict:
    return {
        "images": [Image.new("RGB", (40, 30), (255, 0, 0))],
        "messages": [QUESTION, {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
    }


def _render(processor, examples: list[dict], **kwargs) -> dict:
    """As TRL's vision collator calls the processor (trl/trainer/sft_trainer.py)."""
    from trl.data_utils import prepare_multimodal_messages

    messages = [prepare_multimodal_messages(e["messages"], images=e["images"]) for e in examples]
    return processor.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"padding": True, "padding_side": "right", "add_special_tokens": False},
        **kwargs,
    )


@pytest.fixture(scope="module", params=sorted(VISION_PRESETS))
def built(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, init_model(request.param, tmp_path_factory.mktemp("vlm") / request.param, seed=0)


def _load(path: Path):
    from transformers import AutoModelForImageTextToText

    from shardtune.model.vision import load_processor_from  # AutoProcessor's (Qwen2-VL's without torchvision)

    return AutoModelForImageTextToText.from_pretrained(path), load_processor_from(str(path))


def test_preset_trains_on_trl_vision_format_and_generates(built):
    name, path = built
    model, processor = _load(path)
    batch = _render(processor, [_example("red")], return_assistant_tokens_mask=True)
    answer = processor.tokenizer.decode(batch["input_ids"][0][batch["assistant_masks"][0].bool()])
    assert answer == "red" + processor.tokenizer.eos_token
    inputs = {k: v for k, v in batch.items() if k != "assistant_masks"}
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    assert torch.isfinite(loss)
    loss.backward()
    missing = [
        n
        for n, p in model.named_parameters()
        if (p.grad is None or not p.grad.abs().sum()) and not n.startswith(UNUSED.get(name, ("-",)))
    ]
    assert missing == []
    prompt = _render(
        processor, [{"images": _example("")["images"], "messages": [QUESTION]}], add_generation_prompt=True
    )
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]


def test_preset_pads_a_batch_of_two_lengths(built):
    _, path = built
    model, processor = _load(path)
    batch = _render(processor, [_example("red"), _example("a bright red square")])
    lengths = batch["attention_mask"].sum(1)
    assert lengths[0] < lengths[1]
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    assert torch.isfinite(model(**batch, labels=labels).loss)


def test_preset_head_is_a_bias_free_linear(built):
    _, path = built
    model, _ = _load(path)
    head = model.get_output_embeddings()
    assert type(head) is torch.nn.Linear and head.bias is None
    assert model._no_split_modules


def test_vision_build_is_byte_identical_per_seed(tmp_path):
    name = "vlm-idefics3-tiny"
    digests = []
    for seed in (0, 0, 1):
        out = init_model(name, tmp_path / f"{seed}-{len(digests)}", seed=seed)
        digests.append(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1] != digests[2]


def test_qwen2vl_processor_without_torchvision_renders_images_as_the_model_expects(tmp_path):
    """Where torchvision is absent transformers cannot build Qwen2-VL's processor (its video part needs it):
    shardtune builds the same class without videos. Its image rows are what the model reads (<|image_pad|> repeated
    grid.prod() / merge_size**2 times, the image processor's pixels, 1 on image tokens in mm_token_type_ids), and
    what it saves loads again as a Qwen2VLProcessor."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardtune.model.vision import load_processor_from

    path = init_model("vlm-qwen2vl-tiny", tmp_path / "q", seed=0)
    processor = load_processor_from(str(path))
    images = AutoImageProcessor.from_pretrained(path)(_example("")["images"], return_tensors="pt")
    tokenizer = AutoTokenizer.from_pretrained(path)
    num_tokens = int(images["image_grid_thw"][0].prod()) // 4
    assert num_tokens == 4
    messages = [QUESTION, {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    input_ids = tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * num_tokens), return_tensors="pt")["input_ids"]
    batch = _render(processor, [_example("red")])
    assert torch.equal(batch["input_ids"], input_ids)
    assert torch.equal(batch["pixel_values"], images["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], images["image_grid_thw"])
    assert torch.equal(
        batch["mm_token_type_ids"], (input_ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).long()
    )
    processor.save_pretrained(tmp_path / "saved")
    (tmp_path / "saved" / "config.json").write_bytes((path / "config.json").read_bytes())
    assert type(load_processor_from(str(tmp_path / "saved"))).__name__ == "Qwen2VLProcessor"
