"""Data sources: file formats, split detection, hold-out, label masking, bad rows, custom functions."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardtune.config.flags import config_from
from shardtune.config.schema import ConfigError, SamsumDatasetConfig, TrainConfig
from shardtune.data import DataError, check_context_length, check_data_config, load_examples
from shardtune.data.formatting import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, IGNORE_INDEX, SAMSUM_PROMPT
from shardtune.model.loading import train_tokenizer

ROWS = [
    {"id": "a1", "dialogue": "Anna: Cinema at 7?\nTom: Sure!", "summary": "Anna and Tom go to the cinema at 7."},
    {"id": "a2", "dialogue": "Kate: Lunch?\nBen: Can't today.", "summary": "Ben can't have lunch with Kate."},
    {"id": "a3", "dialogue": "Lucy: I'll bring cake.", "summary": "Lucy brings cake.", "extra": 5},
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Write rows in the format named by the file extension."""
    suffix = path.suffix
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".csv":
        columns = list(dict.fromkeys(k for r in rows for k in r))
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def samsum_cfg(data_path: Path, **overrides) -> TrainConfig:
    samsum = {f.name for f in dataclasses.fields(SamsumDatasetConfig)}
    return config_from(
        {
            "dataset": "samsum_dataset",
            "context_length": 512,
            "run_validation": False,
            "samsum_dataset.data_path": str(data_path),
            **{f"samsum_dataset.{k}" if k in samsum else k: v for k, v in overrides.items()},
        }
    )


def summaries(examples: list[dict], tokenizer) -> list[str]:
    return [tokenizer.decode([t for t in ex["labels"] if t != IGNORE_INDEX][:-1]) for ex in examples]


def test_samsum_labels_cover_summary_and_eos_only(tmp_path, tokenizer):
    cfg = samsum_cfg(write_rows(tmp_path / "train.jsonl", ROWS))
    examples, report = load_examples(cfg, tokenizer, "train")
    assert report.num_rows == report.num_examples == 3
    for row, ex in zip(ROWS, examples):
        prompt = SAMSUM_PROMPT.format(dialog=row["dialogue"])
        num_prompt = 1 + len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert len(ex["input_ids"]) == len(ex["labels"])
        assert ex["input_ids"][0] == tokenizer.bos_token_id and ex["input_ids"][-1] == tokenizer.eos_token_id
        assert ex["labels"][:num_prompt] == [IGNORE_INDEX] * num_prompt
        assert IGNORE_INDEX not in ex["labels"][num_prompt:]
        assert ex["labels"][num_prompt:] == ex["input_ids"][num_prompt:]
        assert tokenizer.decode(ex["labels"][num_prompt:]) == row["summary"] + "</s>"
        assert tokenizer.decode(ex["input_ids"]) == "<s>" + prompt + row["summary"] + "</s>"


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv", ".parquet"])
def test_every_file_format_gives_the_same_examples(tmp_path, tokenizer, suffix):
    reference, _ = load_examples(samsum_cfg(write_rows(tmp_path / "ref.jsonl", ROWS)), tokenizer, "train")
    rows = [{k: v for k, v in r.items() if k != "extra"} for r in ROWS] if suffix == ".csv" else ROWS
    examples, report = load_examples(samsum_cfg(write_rows(tmp_path / f"data{suffix}", rows)), tokenizer, "train")
    assert examples == reference
    assert report.source == f"samsum_dataset: {tmp_path / f'data{suffix}'}"


def test_json_file_may_hold_json_lines(tmp_path, tokenizer):
    path = tmp_path / "train.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    examples, _ = load_examples(samsum_cfg(path), tokenizer, "train")
    assert summaries(examples, tokenizer) == [r["summary"] for r in ROWS]


@pytest.mark.parametrize("validation_name", ["validation.csv", "my_val.jsonl", "dev.json", "samsum-test.parquet"])
def test_folder_splits_are_picked_by_file_name(tmp_path, tokenizer, validation_name):
    write_rows(tmp_path / "samsum_train.jsonl", ROWS[:2])
    write_rows(tmp_path / validation_name, ROWS[2:])
    (tmp_path / "README.md").write_text("not data")
    cfg = samsum_cfg(tmp_path, run_validation=True)
    check_data_config(cfg)
    train, _ = load_examples(cfg, tokenizer, "train")
    validation, report = load_examples(cfg, tokenizer, "validation")
    assert summaries(train, tokenizer) == [r["summary"] for r in ROWS[:2]]
    assert summaries(validation, tokenizer) == [ROWS[2]["summary"]]
    assert validation_name in report.source


def test_folder_prefers_validation_over_test_and_concatenates_shards(tmp_path, tokenizer):
    write_rows(tmp_path / "train-00000-of-00002.parquet", ROWS[:1])
    write_rows(tmp_path / "train-00001-of-00002.parquet", ROWS[1:2])
    write_rows(tmp_path / "test.jsonl", ROWS[:1])
    write_rows(tmp_path / "validation.jsonl", ROWS[2:])
    cfg = samsum_cfg(tmp_path, run_validation=True)
    train, _ = load_examples(cfg, tokenizer, "train")
    validation, _ = load_examples(cfg, tokenizer, "validation")
    assert summaries(train, tokenizer) == [r["summary"] for r in ROWS[:2]]
    assert summaries(validation, tokenizer) == [ROWS[2]["summary"]]


def test_missing_validation_data_is_a_check_time_error(tmp_path):
    write_rows(tmp_path / "train.jsonl", ROWS)
    for path in (tmp_path, tmp_path / "train.jsonl"):
        with pytest.raises(DataError, match="validation_fraction"):
            check_data_config(samsum_cfg(path, run_validation=True))
        check_data_config(samsum_cfg(path, run_validation=True, validation_fraction=0.2))
        check_data_config(samsum_cfg(path, run_validation=False))


def test_one_file_named_validation_is_still_the_train_data_and_the_hint_says_so(tmp_path):
    """A file given alone is the train data whatever its name: the hint cannot be 'add a validation file'."""
    path = write_rows(tmp_path / "samsum_validation.json", ROWS)
    with pytest.raises(DataError) as caught:
        check_data_config(samsum_cfg(path, run_validation=True))
    assert str(caught.value) == (
        f"--samsum_dataset.data_path {path} is one file, the train data: pass a folder holding a train file and a "
        "validation file (a file whose name contains 'validation', 'val', 'dev' or 'test'), or set "
        "--samsum_dataset.validation_fraction (e.g. 0.05), or --run_validation false"
    )


def test_validation_fraction_next_to_a_validation_file_is_refused(tmp_path):
    write_rows(tmp_path / "train.jsonl", ROWS)
    write_rows(tmp_path / "validation.jsonl", ROWS)
    with pytest.raises(DataError, match=r"validation_fraction 0.1 would be ignored: .* \(validation.jsonl\)"):
        check_data_config(samsum_cfg(tmp_path, validation_fraction=0.1))


def test_check_data_config_rejects_missing_paths_and_unknown_formats(tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        check_data_config(samsum_cfg(tmp_path / "nope.jsonl"))
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(DataError, match="unknown format '.txt'"):
        check_data_config(samsum_cfg(tmp_path / "rows.txt"))
    write_rows(tmp_path / "val.jsonl", ROWS)
    with pytest.raises(DataError, match="no train file"):
        check_data_config(samsum_cfg(tmp_path))
    cfg = config_from(dataset="alpaca_dataset")
    with pytest.raises(DataError, match="alpaca_dataset.data_path is empty"):
        check_data_config(cfg)


def test_grammar_dataset_needs_its_test_file_only_when_the_run_evaluates(tmp_path):
    """The lesson's "other datasets" command with --run_validation false: the test CSV is never read."""
    train = tmp_path / "gtrain_10k.csv"
    train.write_text("input,target\nshe go,She goes.\n")
    split = {"grammar_dataset.train_split": str(train)}
    check_data_config(config_from(dataset="grammar_dataset", run_validation=False, **split))
    with pytest.raises(DataError, match="--grammar_dataset.test_split .*no such CSV file"):
        check_data_config(config_from(dataset="grammar_dataset", run_validation=True, **split))


def test_validation_fraction_hold_out_is_deterministic_and_disjoint(tmp_path, tokenizer):
    rows = [{"dialogue": f"A: message {i}", "summary": f"Summary number {i}."} for i in range(20)]
    path = write_rows(tmp_path / "all.jsonl", rows)

    def split(seed: int, name: str) -> list[str]:
        return summaries(
            load_examples(samsum_cfg(path, validation_fraction=0.25, seed=seed), tokenizer, name)[0], tokenizer
        )

    train, validation = split(7, "train"), split(7, "validation")
    assert len(validation) == 5 and len(train) == 15
    assert set(train).isdisjoint(validation)
    assert sorted(train + validation) == sorted(r["summary"] for r in rows)
    assert (split(7, "train"), split(7, "validation")) == (train, validation)
    assert split(8, "validation") != validation


BAD_ROWS = [
    ROWS[0],
    {"dialogue": "A: hi"},
    {"dialogue": "A: hi", "summary": 3},
    {"dialogue": "  ", "summary": "x"},
    {"dialogue": "A: hi", "summary": ""},
    {"dialogue": "A: " + "very long " * 200, "summary": "long"},
    ["not", "an", "object"],
    ROWS[1],
]


def test_bad_rows_are_counted_and_skipped(tmp_path, tokenizer):
    cfg = samsum_cfg(write_rows(tmp_path / "train.json", BAD_ROWS), context_length=128)
    examples, report = load_examples(cfg, tokenizer, "train")
    assert summaries(examples, tokenizer) == [ROWS[0]["summary"], ROWS[1]["summary"]]
    assert (report.num_rows, report.num_examples) == (8, 2)
    assert report.skipped == {
        "missing_field": 1,
        "not_a_string": 1,
        "empty_dialogue": 1,
        "empty_summary": 1,
        "too_long": 1,
        "not_an_object": 1,
    }
    assert "2 of 8 rows kept; skipped 6" in report.summary()


def test_strict_data_names_file_and_row(tmp_path, tokenizer):
    path = write_rows(tmp_path / "train.jsonl", BAD_ROWS)
    with pytest.raises(DataError, match=rf"^{path} row 2: field 'summary' is missing: .*--strict_data"):
        load_examples(samsum_cfg(path, strict_data=True), tokenizer, "train")
    path = write_rows(tmp_path / "long.jsonl", [ROWS[0], BAD_ROWS[5]])
    with pytest.raises(DataError, match=rf"^{path} row 2: \d+ tokens > --context_length 128: raise --context_length"):
        load_examples(samsum_cfg(path, strict_data=True, context_length=128), tokenizer, "train")


def test_no_usable_example_is_an_error(tmp_path, tokenizer):
    path = write_rows(tmp_path / "train.jsonl", BAD_ROWS[1:3])
    with pytest.raises(DataError, match=r"no usable train example: all 2 rows were skipped \(missing_field 1, "):
        load_examples(samsum_cfg(path), tokenizer, "train")


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("train.json", '[{"dialogue": "a", "summary": "b"},', "not valid JSON"),
        ("train.json", '{"rows": 3} 7', "not valid JSON"),
        ("train.jsonl", '{"dialogue": "a", "summary": "b"}\n{"dialogue": \n', "line 2: not valid JSON"),
        ("train.csv", "dialogue,text\nhi,there\n", "no column 'summary' \\(found: dialogue, text\\)"),
        ("train.parquet", "not parquet at all", "not a readable Parquet file"),
    ],
)
def test_malformed_file_is_one_error_naming_the_file(tmp_path, tokenizer, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=rf"^{path}.*{message}"):
        load_examples(samsum_cfg(path), tokenizer, "train")


def test_parquet_without_the_columns_is_an_error(tmp_path, tokenizer):
    path = write_rows(tmp_path / "train.parquet", [{"dialogue": "a", "text": "b"}])
    with pytest.raises(DataError, match="no column 'summary'"):
        load_examples(samsum_cfg(path), tokenizer, "train")


def test_unreachable_hub_points_to_data_path(tmp_path):
    script = textwrap.dedent("""
        from shardtune.config.flags import config_from
        from shardtune.data import DataError, load_examples
        cfg = config_from(dataset="samsum_dataset")
        cfg.data.samsum_dataset.hub_name = "shardtune-tests/no-such-dataset"
        try:
            load_examples(cfg, None, "train")
        except DataError as e:
            print(e)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "could not be loaded from the Hugging Face hub" in out.stdout, out.stderr
    assert "pass --samsum_dataset.data_path" in out.stdout


def test_synthetic_dialogues_load_both_splits(tokenizer):
    cfg = config_from(context_length=512)
    cfg.data.synthetic_dialogues.num_train, cfg.data.synthetic_dialogues.num_validation = 30, 10
    check_data_config(cfg)
    train, report = load_examples(cfg, tokenizer, "train")
    validation, _ = load_examples(cfg, tokenizer, "validation")
    assert (len(train), len(validation), report.num_rows) == (30, 10, 30)
    assert train == load_examples(cfg, tokenizer, "train")[0]
    assert all(tokenizer.decode(ex["input_ids"]).startswith("<s>Summarize this dialog:\n") for ex in train)


def test_context_length_must_hold_the_prompt_template(tokenizer):
    cfg = config_from(context_length=8)
    with pytest.raises(ConfigError, match=r"--context_length 8 is shorter .* pass --context_length (\d+)"):
        check_context_length(cfg, tokenizer)
    needed = 2 + len(tokenizer(SAMSUM_PROMPT.format(dialog=""), add_special_tokens=False)["input_ids"]) + 1
    check_context_length(config_from(context_length=needed), tokenizer)
    with pytest.raises(ConfigError):
        check_context_length(config_from(context_length=needed - 1), tokenizer)


def test_alpaca_masks_the_prompt_with_and_without_input(tmp_path, tokenizer):
    rows = [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "Name a colour.", "input": "", "output": "Blue."},
        {"instruction": "Say hi.", "output": "Hi!"},
        {"instruction": "", "output": "nothing"},
    ]
    path = write_rows(tmp_path / "alpaca.json", rows * 5)
    cfg = config_from(dataset="alpaca_dataset", context_length=256)
    cfg.data.alpaca_dataset.data_path, cfg.data.alpaca_dataset.validation_fraction = str(path), 0.2
    check_data_config(cfg)
    examples, report = load_examples(cfg, tokenizer, "train")
    assert report.skipped == {"empty_instruction": report.num_rows - len(examples)}
    prompts = {
        r["output"]: (ALPACA_PROMPT.format(**r) if r.get("input") else ALPACA_PROMPT_NO_INPUT.format(**r))
        for r in rows[:3]
    }
    for ex in examples:
        labelled = [t for t in ex["labels"] if t != IGNORE_INDEX]
        output = tokenizer.decode(labelled[:-1])
        num_masked = len(ex["labels"]) - len(labelled)
        assert tokenizer.decode(ex["input_ids"][:num_masked]) == "<s>" + prompts[output]
        assert labelled[-1] == tokenizer.eos_token_id


CUSTOM_DATASET = """
import torch

def get_custom_dataset(dataset_config, tokenizer, split):
    ids = tokenizer(f"{split} from {dataset_config.data_path}", add_special_tokens=False)["input_ids"]
    yield {"input_ids": ids, "labels": [-100] + ids[1:], "attention_mask": [1] * len(ids)}
    yield {"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)}
    yield {"input_ids": ids, "labels": ids[:-1]}
    yield {"input_ids": ids}
    yield {"input_ids": ids, "labels": [-100] * len(ids)}
    yield {"input_ids": [10**9], "labels": [5]}
    yield "not a dict"

def other(dataset_config, tokenizer, split):
    return [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}]
"""


def custom_cfg(spec: str, **overrides) -> TrainConfig:
    cfg = config_from(dataset="custom_dataset", context_length=64, **overrides)
    cfg.data.custom_dataset.file, cfg.data.custom_dataset.data_path = spec, "somewhere"
    return cfg


def test_custom_dataset_default_function_rows_are_validated(tmp_path, tokenizer):
    (tmp_path / "my_data.py").write_text(CUSTOM_DATASET)
    cfg = custom_cfg(str(tmp_path / "my_data.py"))
    check_data_config(cfg)
    examples, report = load_examples(cfg, tokenizer, "validation")
    ids = tokenizer("validation from somewhere", add_special_tokens=False)["input_ids"]
    assert examples == [{"input_ids": ids, "labels": [-100] + ids[1:]}, {"input_ids": ids, "labels": ids}]
    assert report.num_rows == 7
    assert report.skipped == {
        "length_mismatch": 1,
        "missing_field": 1,
        "no_labels": 1,
        "bad_token_id": 1,
        "not_an_object": 1,
    }
    with pytest.raises(DataError, match=rf"split validation row 3: {len(ids)} input_ids but {len(ids) - 1} labels"):
        load_examples(custom_cfg(str(tmp_path / "my_data.py"), strict_data=True), tokenizer, "validation")


def test_custom_dataset_named_function(tmp_path, tokenizer):
    (tmp_path / "my_data.py").write_text(CUSTOM_DATASET)
    examples, report = load_examples(custom_cfg(f"{tmp_path / 'my_data.py'}:other"), tokenizer, "train")
    assert examples == [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}]
    assert report.source.endswith("my_data.py:other split train")


def test_custom_dataset_errors_name_the_file(tmp_path):
    (tmp_path / "my_data.py").write_text(CUSTOM_DATASET)
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    with pytest.raises(ConfigError, match="defines no function 'missing'"):
        check_data_config(custom_cfg(f"{tmp_path / 'my_data.py'}:missing"))
    with pytest.raises(ConfigError, match="importing .*broken.py failed \\(ModuleNotFoundError"):
        check_data_config(custom_cfg(str(tmp_path / "broken.py")))
    with pytest.raises(ConfigError, match="is not a .py file"):
        check_data_config(custom_cfg(str(tmp_path / "absent.py")))
    (tmp_path / "fails.py").write_text("def get_custom_dataset(c, t, s):\n    raise KeyError('text')\n")
    with pytest.raises(DataError, match="fails.py split train: the dataset function failed \\(KeyError"):
        load_examples(custom_cfg(str(tmp_path / "fails.py")), None, "train")
    # a vision recipe's collator is not silently left unused on a text model
    (tmp_path / "vision.py").write_text(CUSTOM_DATASET + "\ndef get_data_collator(processor):\n    return None\n")
    with pytest.raises(ConfigError, match="defines get_data_collator, which batches the rows of a vision-language"):
        load_examples(custom_cfg(str(tmp_path / "vision.py")), None, "train")


def test_tensor_rows_from_custom_function_become_lists(tmp_path, tokenizer):
    (tmp_path / "t.py").write_text(
        "import torch\ndef f(c, t, s):\n    return [{'input_ids': torch.arange(3, 9), 'labels': torch.arange(3, 9)}]\n"
    )
    examples, _ = load_examples(custom_cfg(f"{tmp_path / 't.py'}:f"), tokenizer, "train")
    assert examples == [{"input_ids": list(range(3, 9)), "labels": list(range(3, 9))}]
    assert isinstance(examples[0]["input_ids"][0], int) and not isinstance(examples[0]["input_ids"], torch.Tensor)


def test_synthetic_chatter_flag_lengthens_the_loaded_dialogues_not_their_labels(tokenizer):
    cfg = config_from(context_length=1024)
    cfg.data.synthetic_dialogues.num_train = 200
    plain, _ = load_examples(cfg, tokenizer, "train")
    cfg.data.synthetic_dialogues.chatter = True
    chatty, report = load_examples(cfg, tokenizer, "train")
    assert len(chatty) == len(plain) == 200 and "chatter" in report.source
    assert sum(len(e["input_ids"]) for e in chatty) > 1.2 * sum(len(e["input_ids"]) for e in plain)
    assert [[t for t in e["labels"] if t != IGNORE_INDEX] for e in chatty] == [
        [t for t in e["labels"] if t != IGNORE_INDEX] for e in plain
    ]
