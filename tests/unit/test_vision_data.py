"""Rows with images, without launching: shardtune's vision batches are the tensors TRL's own vision collator makes
from the same rows (TRL is the oracle: trl.trainer.sft_trainer.DataCollatorForVisionLanguageModeling), for each of
TRL's vision formats and loss options, on tiny random models of four families with their processors; every way a
row may hold an image gives the same pixels; bad rows are skipped and counted, or refused naming the row."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest
import torch

from shardtune.data.report import DataError, DataReport, RowFilter
from shardtune.data.vision import VisionCollator, VisionExample, VisionOptions, VisionRows, check_rows
from tests.vision_data import write_squares

FAMILIES = ("vlm-llava-tiny", "vlm-mllama-tiny", "vlm-idefics3-tiny", "vlm-qwen2vl-tiny")


@pytest.fixture(scope="module", params=FAMILIES)
def vision_model(request, tmp_path_factory) -> Path:
    from shardtune.model.loading import train_tokenizer
    from shardtune.model.vision_presets import build_vision_preset

    out = tmp_path_factory.mktemp("vlm") / request.param
    out.mkdir()
    build_vision_preset(request.param, train_tokenizer(), out, seed=0)
    return out


def processor_of(model_dir: Path):
    from shardtune.model.vision import load_processor_from  # AutoProcessor's (Qwen2-VL's without torchvision)

    return load_processor_from(str(model_dir))


def rows_of(folder: Path, split: str = "train") -> tuple[list, list[str]]:
    lines = [json.loads(line) for line in (folder / f"{split}.jsonl").read_text().splitlines()]
    return [(str(folder / f"{split}.jsonl"), i + 1, row) for i, row in enumerate(lines)], list(lines[0])


def trl_batch(processor, rows: list[dict], folder: Path, **options) -> dict:
    """TRL's collator on the same rows, images opened as PIL images (what a `datasets` Image column gives it)."""
    from PIL import Image
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    examples = copy.deepcopy(rows)
    for example in examples:
        example["images"] = [Image.open(folder / p).convert("RGB") for p in example["images"]]
    return DataCollatorForVisionLanguageModeling(processor=processor, **options)(examples)


CASES = {  # kind of rows -> (shardtune's options, TRL's)
    "messages": (VisionOptions(max_length=1024), dict(max_length=1024)),
    "blocks": (VisionOptions(max_length=1024), dict(max_length=1024)),
    "assistant_only": (
        VisionOptions(assistant_only=True, max_length=1024),
        dict(assistant_only_loss=True, max_length=1024),
    ),
    "prompt_completion": (
        VisionOptions(completion_only=True, max_length=1024),
        dict(completion_only_loss=True, max_length=1024),
    ),
    "truncated": (VisionOptions(max_length=30), dict(max_length=30)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_batches_are_trls_vision_collator_batches(case, vision_model, tmp_path):
    """Five rows of each format (different answer lengths, so rows pad) collated as one micro-batch: every tensor
    equal to TRL's, labels included (padding -100; image tokens labelled as TRL labels them; the prompt masked for
    completion-only, all but the assistant's turn for assistant-only loss), so labelled-token counts are TRL's."""
    kind = {"assistant_only": "messages", "truncated": "blocks"}.get(case, case)
    if case == "truncated" and "qwen2vl" in vision_model.name:
        pytest.skip("a row cut inside its image tokens cannot be embedded (its image features no longer fit)")
    folder = write_squares(tmp_path / "data", {"train": 5}, seed=3, kind=kind)
    processor = processor_of(vision_model)
    raw, columns = rows_of(folder)
    rows = VisionRows(raw, columns, folder, "text")
    ours_options, trl_options = CASES[case]
    ours = VisionCollator(rows, processor, ours_options)([[VisionExample(i, 0)] for i in range(5)])
    theirs = trl_batch(processor, [r for _, _, r in raw], folder, **trl_options)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    labelled, real = int((ours["labels"] != -100).sum()), int(ours["attention_mask"].sum())
    if case in ("assistant_only", "prompt_completion"):
        assert 0 < labelled < real  # the prompt masked, the answer learned
    else:
        assert labelled == real  # every real token, image tokens too (TRL's labels)


def test_an_image_is_the_same_pixels_however_a_row_holds_it(vision_model, tmp_path):
    """A PIL image, PNG bytes, a datasets Image feature's {"bytes"} or {"path"}, a path relative to the data file's
    folder or an absolute one: the same pixel values."""
    from PIL import Image

    folder = write_squares(tmp_path / "data", {"train": 1}, seed=5)
    _, _, row = rows_of(folder)[0][0]
    relative = row["images"][0]
    image = Image.open(folder / relative).convert("RGB")
    png = io.BytesIO()
    image.save(png, format="PNG")
    holders = {
        "pil": image,
        "bytes": png.getvalue(),
        "feature bytes": {"bytes": png.getvalue(), "path": None},
        "feature path": {"bytes": None, "path": str(folder / relative)},
        "relative": relative,
        "absolute": str(folder / relative),
    }
    processor = processor_of(vision_model)
    pixels = {}
    for name, holder in holders.items():
        rows = VisionRows([("x", 1, {**row, "images": [holder]})], ["images", "messages"], folder, "text")
        pixels[name] = VisionCollator(rows, processor, VisionOptions())([[VisionExample(0, 0)]])["pixel_values"]
    for name, value in pixels.items():
        assert torch.equal(value, pixels["pil"]), name


def test_bad_rows_are_skipped_and_counted_or_refused_naming_the_row(vision_model, tmp_path):
    folder = write_squares(tmp_path / "data", {"train": 4}, seed=7, kind="blocks")
    raw, columns = rows_of(folder)
    raw[1][2]["images"] = ["img/missing.png"]
    raw[2][2]["images"] = raw[2][2]["images"] * 2  # two images, one image block
    raw[3][2]["images"] = ["https://example.com/cat.png"]
    rows = VisionRows(raw, columns, folder, "text")
    processor = processor_of(vision_model)
    report = DataReport(source="squares", num_rows=4)
    kept = check_rows(rows, processor, RowFilter(report, strict=False))
    assert [example.index for example in kept] == [0]
    assert kept[0].length > 0 and report.skipped == {"bad image row": 3} and report.num_examples == 1
    with pytest.raises(DataError, match=r"train.jsonl row 2: image file .*missing.png does not exist"):
        check_rows(rows, processor, RowFilter(DataReport(source="squares", num_rows=4), strict=True))
    with pytest.raises(DataError, match="row 3: 1 image blocks in the messages but 2 images in the row"):
        check_rows(
            VisionRows([raw[0], raw[2]], columns, folder, "text"),
            processor,
            RowFilter(DataReport("squares"), strict=True),
        )


def test_lora_targets_the_language_model_only(vision_model):
    """q_proj / v_proj (or all-linear) name layers of the vision tower too; the adapter goes on the language
    model's alone, and the tower and projector stay untouched."""
    from transformers import AutoModelForImageTextToText

    from shardtune.model.vision import language_model_targets

    model = AutoModelForImageTextToText.from_pretrained(vision_model)
    for targets in (["q_proj", "v_proj"], "all-linear"):
        names = language_model_targets(model, targets)
        in_decoder = {id(m) for m in model.get_decoder().modules()}
        assert names and all(id(model.get_submodule(name)) in in_decoder for name in names), names
        assert not any("vision" in name or "projector" in name or "lm_head" in name for name in names), names
    layers = model.config.get_text_config().num_hidden_layers
    assert sum(name.endswith(".q_proj") for name in language_model_targets(model, ["q_proj"])) == layers
    assert {n.rsplit(".", 1)[-1] for n in language_model_targets(model, ["q_proj", "v_proj"])} == {"q_proj", "v_proj"}


@pytest.mark.parametrize("kind", ["messages", "blocks", "prompt_completion"])
def test_an_evaluation_sample_asks_the_prompt_and_names_its_images(kind, tmp_path):
    """--log_eval_samples on image rows: the prompt is the row without its answer, the reference the answer's text,
    the images opened and named as the row names them."""
    from shardtune.data.vision import image_names, sample_prompt

    folder = write_squares(tmp_path / "data", {"train": 2}, seed=4, kind=kind)
    raw, columns = rows_of(folder)
    rows = VisionRows(raw, columns, folder, "text")
    messages, reference, images = sample_prompt(rows, 1)
    row = raw[1][2]
    answer = row["messages"][-1]["content"] if "messages" in row else row["completion"][0]["content"]
    assert reference == answer and reference in ("red", "green", "blue")
    assert [m["role"] for m in messages] == ["user"] and len(images) == 1 and images[0].size == (40, 40)
    assert image_names(row) == ["img/train-1.png"]
    assert image_names({"images": [{"bytes": b"..", "path": None}, "a.png"]}) == ["image 0", "a.png"]
    text_rows = VisionRows(
        [("x", 1, {"images": ["img/train-0.png"], "text": "<image> red"})], ["images", "text"], folder, "text"
    )
    with pytest.raises(ValueError, match="evaluation samples need messages"):
        sample_prompt(text_rows, 0)
