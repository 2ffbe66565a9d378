"""A script's rows with images as the run reads them (shardtune.api.inputs), without launching: every form TRL's
vision rows take (PIL images, ``datasets`` Image features, bytes, paths relative to the working directory; a list
``images`` column or a single ``image``; messages or prompt + completion) arrives with the same pixels; and what
cannot be trained is refused in one line: DPO with images (the Python face and ``shardtune dpo``), images for a text
model, a missing image file, a URL. The training itself is tests/e2e/test_vision_python.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.config.schema import ConfigError
from tests.vision_data import write_squares


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    from shardtune.model.loading import init_model

    return init_model("vlm-llava-tiny", tmp_path_factory.mktemp("llava") / "model", seed=0)


@pytest.fixture
def squares(tmp_path, monkeypatch, cache_dir) -> Path:
    """Four rows of squares; the working directory is their folder (relative image paths are read from there)."""
    monkeypatch.setenv("SHARDTUNE_CACHE", str(cache_dir))
    data = write_squares(tmp_path / "squares", {"train": 4}, seed=5)
    monkeypatch.chdir(data)
    return data


def rows(data: Path) -> list[dict]:
    return [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]


def pixels(image) -> bytes:
    return image.convert("RGB").tobytes()


def read_back(data, llava: Path) -> list[dict]:
    """``data`` handed over as a trainer hands it (shardtune.api.inputs.dataset_settings), read as the run reads it."""
    from shardtune.api.inputs import dataset_settings
    from shardtune.config.flags import parse_args
    from shardtune.data.trl_loading import vision_rows
    from shardtune.model.vision import load_processor_from

    folder = dict(dataset_settings(data, None))["dataset_name"]
    _, split = vision_rows(parse_args(["--dataset_name", folder, "--model_name", str(llava)]), "train")
    processor = load_processor_from(str(llava))
    return [split.rendered(i, processor) for i in range(len(split))]


def test_every_form_of_image_arrives_with_its_pixels(squares, llava):
    from datasets import Dataset, Image, List
    from PIL import Image as PIL

    given = rows(squares)
    expected = [pixels(PIL.open(squares / row["images"][0])) for row in given]
    forms = {
        "pil": [{**row, "images": [PIL.open(squares / p) for p in row["images"]]} for row in given],
        "bytes": [{**row, "images": [(squares / p).read_bytes() for p in row["images"]]} for row in given],
        "relative path": given,
        "absolute path": [{**row, "images": [str(squares / p) for p in row["images"]]} for row in given],
        "single image": [{"messages": row["messages"], "image": PIL.open(squares / row["images"][0])} for row in given],
        "prompt + completion": [
            {"images": row["images"], "prompt": row["messages"][:1], "completion": row["messages"][1:]} for row in given
        ],
    }
    for form, data in forms.items():
        arrived = read_back(Dataset.from_list(data), llava)
        assert [pixels(item["images"][0]) for item in arrived] == expected, form
        assert ("prompt" in arrived[0]) == (form == "prompt + completion"), form
    # an Image feature read from files holds only their paths: their bytes travel
    features = Dataset.from_list(given).cast_column("images", List(Image()))
    assert [pixels(item["images"][0]) for item in read_back(features, llava)] == expected
    assert [pixels(item["images"][0]) for item in read_back(given, llava)] == expected  # a list of dicts too


def test_a_missing_file_or_a_url_is_refused_in_one_line(squares, llava):
    from shardtune.api.inputs import dataset_settings

    missing = [{**row, "images": ["img/nowhere.png"]} for row in rows(squares)]
    with pytest.raises(ConfigError, match=r"train_dataset: image file img/nowhere.png does not exist \(relative"):
        dataset_settings(missing, None)
    url = [{**row, "images": ["https://example.com/cat.png"]} for row in rows(squares)]
    with pytest.raises(ConfigError, match="eval_dataset: image https://example.com/cat.png is a URL"):
        dataset_settings(rows(squares), url)


def preference_rows(data: Path) -> list[dict]:
    """TRL's vision DPO rows: images + prompt / chosen / rejected."""
    return [
        {
            "images": row["images"],
            "prompt": row["messages"][:1],
            "chosen": row["messages"][1:],
            "rejected": [{"role": "assistant", "content": "purple"}],
        }
        for row in rows(data)
    ]


def test_dpo_with_images_is_refused_in_one_line_by_the_trainer_and_the_command(squares, llava, tiny_model):
    from shardtune import DPOTrainer, SFTTrainer
    from tests.conftest import main_in_process

    pairs = preference_rows(squares)
    for model in (tiny_model, llava):
        with pytest.raises(ConfigError, match=r"^train_dataset has an 'images' column: DPO with images \(TRL's"):
            DPOTrainer(model=str(model), train_dataset=pairs)
    with pytest.raises(ConfigError, match=r"^eval_dataset has an 'images' column, but the model .* is a text-only"):
        SFTTrainer(model=str(tiny_model), train_dataset=[{"text": "a b c"}] * 4, eval_dataset=rows(squares))
    (squares / "pairs").mkdir()
    (squares / "pairs" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in pairs))
    (squares / "pairs" / "img").symlink_to(squares / "img")
    out = squares / "out"
    command = ("dpo", "--model_name_or_path", tiny_model, "--dataset_name", squares / "pairs", "--output_dir", out)
    run = main_in_process(*command)
    assert run.returncode == 2, run  # a configuration error
    line = "has an 'images' column: shardtune dpo with images (TRL's vision DPO rows) is not built"
    errors = [text for text in run.stderr.splitlines() if text.startswith("shardtune: error:")]
    assert len(errors) == 1 and line in errors[0], run.stderr
    sft = main_in_process(
        "sft", "--defaults", "trl", "--model_name", tiny_model, "--dataset_name", squares, "--output_dir", out
    )
    assert "has an 'images' column, but" in sft.stderr and sft.returncode == 2, sft.stderr
