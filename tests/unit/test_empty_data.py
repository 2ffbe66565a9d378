"""Data without a row is said to be empty, in one line naming what the user gave and the fix, before launch: an empty
file or folder split given as --dataset_name (JSON lines, JSON, CSV, Parquet, Arrow; rows datasets reads nothing
from), streamed too, in a dataset mixture, a script's empty Dataset / list / IterableDataset by its argument's name
(refused before it is written into the cache), for shardtune sft, dpo and grpo alike. A split whose every row is
skipped says so, with the counts by reason. All in this process: nothing is launched."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardtune.config.schema import ConfigError
from shardtune.data.report import DataError

SAYS = "is empty (no rows)"
COLUMNS = {"sft": ("prompt", "completion"), "dpo": ("prompt", "chosen", "rejected"), "grpo": ("prompt",)}


def arrow_stream(path: Path, columns: tuple[str, ...]) -> None:
    table = pa.table({c: pa.array([], pa.string()) for c in columns})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


EMPTY_FILES = {  # name -> writer of a file of those columns without a row
    "empty.jsonl": lambda path, columns: path.write_text(""),
    "blank.jsonl": lambda path, columns: path.write_text("\n  \n"),
    "empty.json": lambda path, columns: path.write_text("[ ]\n"),
    "header.csv": lambda path, columns: path.write_text(",".join(columns) + "\n"),
    "empty.parquet": lambda path, columns: pq.write_table(
        pa.table({c: pa.array([], pa.string()) for c in columns}), path
    ),
    "empty.arrow": arrow_stream,
    "objects.jsonl": lambda path, columns: path.write_text("{}\n{}\n"),  # datasets reads no row (its own words)
}
ROWS = {
    "sft": {"prompt": "Q: sky?", "completion": " blue"},
    "dpo": {"prompt": "Q: sky?", "chosen": " blue", "rejected": " green"},
    "grpo": {"prompt": "Q: sky?"},
}


PADDED = ("--batching_strategy", "padding")  # rows are cut to --context_length or skipped, not split into blocks


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def run(cli_in_process, tiny_model, tmp_path):
    """``shardtune OBJECTIVE --dataset_name DATA ...`` in this process; its one error line (asserted to be the only
    one, without a traceback or datasets' own words)."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def one(completions, **kwargs):\n    return [1.0] * len(completions)\n")

    def error(objective: str, *args) -> str:
        extra = ("--reward_funcs", f"{rewards}:one", "--num_generations", 2) if objective == "grpo" else ()
        out = tmp_path / "out"
        proc = cli_in_process(objective, "--model_name", tiny_model, "--output_dir", out, *extra, *args)
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines() if line.startswith("shardtune: error: ")]
        assert len(errors) == 1, proc.stderr
        for words in ("Traceback", "StopIteration", "could not be loaded", "corresponds to no data"):
            assert words not in proc.stderr, proc.stderr
        assert not out.exists(), "a refused run creates no output dir"
        return errors[0]

    return error


@pytest.mark.parametrize("name", list(EMPTY_FILES))
def test_an_empty_data_file_is_said_empty_in_one_line(name, run, tmp_path):
    path = tmp_path / name
    EMPTY_FILES[name](path, COLUMNS["sft"])
    line = run("sft", "--dataset_name", path)
    assert f"--dataset_name {path} {SAYS}: add rows to it" in line


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_dpo_and_grpo_say_it_alike(objective, run, tmp_path):
    path = tmp_path / "data" / "empty.jsonl"
    path.parent.mkdir()
    path.write_text("")
    assert f"--dataset_name {path} {SAYS}: add rows to it" in run(objective, "--dataset_name", path)
    objects = write_jsonl(tmp_path / "objects.jsonl", [{}, {}])
    assert f"--dataset_name {objects} {SAYS}" in run(objective, "--dataset_name", objects)


@pytest.mark.parametrize("objective", ["sft", "dpo", "grpo"])
def test_an_empty_split_of_a_folder_is_named_with_its_files(objective, run, tmp_path):
    """Either split: datasets fails on a folder with an empty split file whether the run reads that split or not."""
    folder = tmp_path / "data"
    write_jsonl(folder / "train.jsonl", [ROWS[objective]] * 4)
    (folder / "test.jsonl").write_text("")
    line = run(objective, "--dataset_name", folder)
    assert f"--dataset_name {folder}: its test split (test.jsonl) {SAYS}: add rows to it, or remove it" in line
    (folder / "train.jsonl").write_text("")
    (folder / "test.jsonl").unlink()
    assert f"its train split (train.jsonl) {SAYS}" in run(objective, "--dataset_name", folder)


def test_a_streamed_empty_file_is_said_empty_too(run, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    line = run("sft", "--dataset_name", path, "--dataset_streaming", "true", "--max_steps", 1)
    assert f"--dataset_name {path} {SAYS}" in line


def test_an_empty_entry_of_a_mixture_is_named(run, tmp_path):
    full = write_jsonl(tmp_path / "full.jsonl", [ROWS["sft"]] * 4)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = run("sft", "--dataset_mixture", f"{full},{empty}", "--max_steps", 1)
    assert f"entry 2 ({empty}) {SAYS}: add rows to it, or drop the entry" in line


def test_every_row_skipped_says_so_with_the_counts(run, tmp_path):
    """DPO's pairs whose prompt fills --max_length, GRPO's rows without a prompt text, SFT's (the cookbook formats)
    rows longer than --context_length (padded batches: packing splits long rows): the split is empty after
    filtering, said with the rows skipped by reason."""
    long = "word " * 200
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": long, "chosen": " yes", "rejected": " no"}] * 3)
    line = run("dpo", "--dataset_name", pairs, "--max_length", 32, "--run_validation", "false")
    assert "no usable train pair: all 3 rows were skipped (prompt_fills_max_length 3): " in line
    assert "raise --max_length" in line
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": ""}] * 3)
    line = run("grpo", "--dataset_name", prompts)
    assert "no usable prompt: all 3 rows were skipped (prompt is not text 3): give each row a prompt" in line
    dialogues = write_jsonl(tmp_path / "dialogues.jsonl", [{"dialogue": long, "summary": "yes"}] * 3)
    samsum = ("--dataset", "samsum_dataset", "--samsum_dataset.data_path", dialogues)
    line = run(
        "sft",
        *samsum,
        "--samsum_dataset.validation_fraction",
        0,
        "--run_validation",
        "false",
        "--context_length",
        64,
        *PADDED,
    )
    assert "no usable train example: all 3 rows were skipped (too_long 3): " in line
    assert "raise --context_length" in line


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SHARDTUNE_CACHE", str(cache))
    return cache


def test_the_python_face_refuses_an_empty_dataset_by_its_argument(private_cache, tiny_model):
    """A Dataset of 0 rows, an empty list, for training or evaluation, in every trainer: a ConfigError naming the
    argument, raised before the data is written into the cache (where a later error would name a folder the script
    never gave)."""
    from datasets import Dataset

    from shardtune import DPOTrainer, GRPOTrainer, SFTTrainer

    def one(completions, **kwargs):
        return [1.0] * len(completions)

    cases = [
        (lambda: SFTTrainer(model=str(tiny_model), train_dataset=Dataset.from_list([])), "train_dataset"),
        (lambda: DPOTrainer(model=str(tiny_model), train_dataset=[]), "train_dataset"),
        (
            lambda: GRPOTrainer(
                model=str(tiny_model), reward_funcs=one, train_dataset=Dataset.from_dict({"prompt": []})
            ),
            "train_dataset",
        ),
        (lambda: SFTTrainer(model=str(tiny_model), train_dataset=[ROWS["sft"]], eval_dataset=[]), "eval_dataset"),
        (
            lambda: DPOTrainer(
                model=str(tiny_model), train_dataset=[ROWS["dpo"]], eval_dataset={"test": Dataset.from_list([])}
            ),
            "eval_dataset",
        ),
    ]
    for make, argument in cases:
        with pytest.raises(ConfigError, match=rf"^{argument} is empty \(a dataset of 0 rows\): pass "):
            make()
    assert not (private_cache / "inputs").exists() or not any((private_cache / "inputs").iterdir())


def test_a_scripts_empty_iterable_dataset_is_named_when_streamed(tmp_path):
    """A script's IterableDataset cannot be counted before it is read: the stream's first row is looked for where the
    format is recognised, and none found names the trainer's argument."""
    from datasets import IterableDataset

    from shardtune.config.flags import config_from
    from shardtune.data.stream_rows import RowStream, register_in_process

    def nothing():
        yield from ()

    def some():
        yield ROWS["sft"]

    cfg = config_from(dataset="trl_dataset")
    cfg.data.trl_dataset.dataset_name = register_in_process(
        {"train": IterableDataset.from_generator(nothing), "test": IterableDataset.from_generator(some)}
    )
    with pytest.raises(DataError, match=rf"^train_dataset \(an IterableDataset\) {re.escape(SAYS)}: pass a dataset"):
        RowStream(cfg, "train").first()
    assert RowStream(cfg, "test").first()[0] == ["prompt", "completion"]
    register_in_process(
        {"train": IterableDataset.from_generator(some), "test": IterableDataset.from_generator(nothing)}
    )
    with pytest.raises(DataError, match=rf"^eval_dataset \(an IterableDataset\) {re.escape(SAYS)}"):
        RowStream(cfg, "test").first()
