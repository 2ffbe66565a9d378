"""llama-cookbook's vision recipe's custom dataset files (docs/vision.md, "llama-cookbook's vision recipe"), in process:
the function is given the processor, the file's own collator batches the rows (checked row by row before launch,
its bad rows and keys refused naming the file), and a file without one returns rows shardtune's vision collator
reads. The launched run (FSDP, 2 processes, the cookbook's flags) is in tests/distributed/test_vision.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from shardtune.config.flags import parse_args
from shardtune.data.report import DataError
from shardtune.data.vision_custom import CollatedRows
from shardtune.model.vision import load_processor
from shardtune.training.objectives.sft.vision import VisionSFT
from tests.vision_data import write_squares

OCRVQA = Path(__file__).parent.parent / "ocrvqa_squares.py"


@pytest.fixture(scope="module")
def mllama(tmp_path_factory) -> Path:
    from shardtune.model.loading import train_tokenizer
    from shardtune.model.vision_presets import build_vision_preset

    out = tmp_path_factory.mktemp("vlm") / "mllama"
    out.mkdir()
    build_vision_preset("vlm-mllama-tiny", train_tokenizer(), out, seed=0)
    return out


@pytest.fixture(scope="module")
def squares(tmp_path_factory) -> Path:
    return write_squares(tmp_path_factory.mktemp("squares"), {"train": 5, "test": 2}, seed=3)


def config(model: Path, data: Path, file: Path | str, *flags: str):
    return parse_args(
        [
            "--model_name",
            str(model),
            "--dataset",
            "custom_dataset",
            "--custom_dataset.file",
            str(file),
            "--custom_dataset.data_path",
            str(data),
            "--custom_dataset.test_split",
            "test",
            *flags,
        ]
    )


def with_collator(tmp_path: Path, body: str) -> Path:
    """The squares file with its collator's batch changed by ``body`` (Python run on ``batch`` and ``rows``)."""
    file = tmp_path / "changed.py"
    file.write_text(
        OCRVQA.read_text()
        + textwrap.dedent(
            """
            class Changed(SquaresCollator):
                def __call__(self, rows):
                    batch = super().__call__(rows)
            """
        )
        + textwrap.indent(textwrap.dedent(body).rstrip() + "\nreturn batch\n", " " * 8)
        + "\n\ndef get_data_collator(processor):\n    return Changed(processor)\n"
    )
    return file


def split(cfg, name: str = "train"):
    return VisionSFT.split(cfg, load_processor(cfg), name)


def test_the_files_collator_makes_every_batch_from_the_processor(mllama, squares):
    """The function gets the processor and the split's name; each row is checked through the collator (its length
    and labels counted); a micro-batch is exactly the collator's batch of the rows the sampler chose."""
    import importlib.util

    cfg = config(mllama, squares, OCRVQA)
    rows, kept, report = split(cfg)
    assert isinstance(rows, CollatedRows) and len(rows) == 5 and report.num_examples == 5
    assert report.summary().endswith("rows batched by its data collator: 5 of 5 rows kept")
    spec = importlib.util.spec_from_file_location("ocrvqa_squares_here", OCRVQA)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    processor = load_processor(cfg)
    dataset = module.get_custom_dataset(cfg.data.custom_dataset, processor, "train")
    theirs = module.get_data_collator(processor)([dataset[3], dataset[1]])
    ours = VisionSFT.collator(cfg, rows, processor)([[kept[3]], [kept[1]]])
    assert ours.keys() == theirs.keys() >= {"pixel_values", "cross_attention_mask", "aspect_ratio_ids", "labels"}
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    for example in kept:  # the length batching sorts by: the row's tokens
        alone = module.get_data_collator(processor)([dataset[example.index]])
        assert example.length == int(alone["attention_mask"].sum())
    eval_rows, eval_kept, _ = split(cfg, "validation")  # --custom_dataset.test_split names the function's split
    assert len(eval_rows) == len(eval_kept) == 2


def test_a_file_without_a_collator_returns_rows_shardtune_reads(mllama, squares, tmp_path):
    """TRL's vision formats from the function (images + messages): shardtune's own collator; other rows are
    refused in one line that says to define get_data_collator."""
    file = tmp_path / "messages.py"
    file.write_text(
        textwrap.dedent(
            """
            import json
            from pathlib import Path

            def get_custom_dataset(dataset_config, processor, split):
                folder = Path(dataset_config.data_path)
                rows = [json.loads(line) for line in (folder / f"{split}.jsonl").read_text().splitlines()]
                return [{**row, "images": [str(folder / path) for path in row["images"]]} for row in rows]
            """
        )
    )
    rows, kept, _ = split(config(mllama, squares, file))
    assert rows.kind == "messages" and len(kept) == 5
    batch = VisionSFT.collator(config(mllama, squares, file), rows, load_processor(config(mllama, squares, file)))(
        [[kept[0]]]
    )
    assert batch["pixel_values"].shape[0] == 1
    ocr_rows = tmp_path / "no_collator.py"
    ocr_rows.write_text(OCRVQA.read_text().replace("def get_data_collator", "def not_a_collator"))
    with pytest.raises(DataError, match=r"columns are images, texts.*or define get_data_collator\(processor\)"):
        split(config(mllama, squares, ocr_rows))


@pytest.mark.parametrize(
    "body,message",
    [
        (
            "if rows[0]['texts'][0]['assistant'] == 'blue':\n    raise KeyError('no answer')",
            r"its data collator failed \(KeyError: 'no answer'\): fix the collator or the data$",
        ),
        (
            "batch['loss_weights'] = batch['labels'].float()",
            r"the data collator's batch has 'loss_weights', which shardtune does not pass",
        ),
        (
            "batch['token_type_ids'] = batch['input_ids'] * 0",
            r"the data collator's batch has 'token_type_ids', which the model's forward does not",
        ),
        (
            "batch['labels'] = batch['labels'].tolist()",
            r"the data collator's batch has no labels as a \(rows, tokens\) tensor",
        ),
        (
            "batch['labels'] = batch['labels'][:, 1:]",
            r"the data collator's batch has labels of shape \(1, \d+\) beside input_ids",
        ),
        (
            "batch['pixel_values'] = batch['pixel_values'].tolist()",
            r"the data collator's batch has 'pixel_values' as a list, not a tensor",
        ),
    ],
)
def test_a_bad_batch_is_refused_naming_the_file_and_the_row(mllama, squares, tmp_path, body, message):
    file = with_collator(tmp_path, body)
    with pytest.raises(DataError, match=rf"^custom_dataset: {file} split train row \d+: " + message):
        split(config(mllama, squares, file))


def test_rows_without_labels_or_too_long_are_skipped_and_counted(mllama, squares, tmp_path):
    """As the cookbook's custom text rows: counted in the data report, refused with --strict."""
    file = with_collator(tmp_path, "if rows[0]['texts'][0]['assistant'] == 'blue':\n    batch['labels'][:] = -100")
    blue = sum('"blue"' in line for line in (squares / "train.jsonl").read_text().splitlines())
    assert 0 < blue < 5
    _, kept, report = split(config(mllama, squares, file))
    assert len(kept) == 5 - blue and report.skipped == {"no_labels": blue}
    with pytest.raises(DataError, match=r"row \d+: the collator's labels are all -100"):
        split(config(mllama, squares, file, "--strict_data", "true"))
    _, kept, report = split(config(mllama, squares, OCRVQA, "--context_length", "8"))
    assert not kept and report.skipped == {"too_long": 5}


def test_the_functions_failure_is_one_line_naming_the_file(mllama, squares, tmp_path):
    file = tmp_path / "fails.py"
    file.write_text("def get_custom_dataset(config, processor, split):\n    return processor.no_such_thing\n")
    with pytest.raises(DataError, match=f"split train: the dataset file failed .*AttributeError.*fix {file}"):
        split(config(mllama, squares, file))
