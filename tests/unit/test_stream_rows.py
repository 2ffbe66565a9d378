"""The streamed rows of every local format, and the positions that resume them without reading earlier rows; the
steps of a stream (shardtune.data.streaming), alike on every layout and across the stream's passes."""

from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardtune.config.schema import TrainConfig
from shardtune.data.stream_rows import RowStream, split_files
from shardtune.data.streaming import FIRST_POSITION, StreamSource, StreamSteps
from shardtune.model.loading import train_tokenizer

ROWS = [{"prompt": f'Question {i}?\nwith a second line, "quoted"', "completion": f" Answer {i}."} for i in range(23)]


def _config(path) -> TrainConfig:
    cfg = TrainConfig()
    cfg.data.dataset, cfg.data.trl_dataset.dataset_name = "trl_dataset", str(path)
    cfg.data.streaming, cfg.train.max_steps = True, 4
    return cfg


def _write(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=5)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_every_position_resumes_the_stream_at_its_row(tmp_path, suffix):
    path = _write(tmp_path / f"train{suffix}", ROWS)
    stream = RowStream(_config(path), "train")
    assert stream.files == [path]
    streamed = list(stream.rows())
    assert [record for (_, _, record), _ in streamed] == ROWS
    assert [row for (_, row, _), _ in streamed] == list(range(1, len(ROWS) + 1))
    for index in (1, 7, 22):
        again = list(stream.rows(streamed[index][1]))
        assert [record for (_, _, record), _ in again] == ROWS[index:]
        assert [row for (_, row, _), _ in again] == list(range(index + 1, len(ROWS) + 1))


def test_a_resumed_stream_reads_no_earlier_row(tmp_path):
    path = _write(tmp_path / "train.jsonl", ROWS)
    stream = RowStream(_config(path), "train")
    position = list(stream.rows())[10][1]
    text = path.read_bytes()
    path.write_bytes(b"\0" * position["offset"] + text[position["offset"] :])  # earlier rows unreadable
    assert [record for (_, _, record), _ in stream.rows(position)] == ROWS[10:]


def test_a_folder_streams_its_splits_files_and_a_hub_like_source_resumes_through_datasets(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    _write(folder / "train.jsonl", ROWS)
    _write(folder / "test.jsonl", ROWS[:3])
    cfg = _config(folder)
    assert split_files(cfg, "test") == [folder / "test.jsonl"]
    assert split_files(cfg, "validation") == []
    stream = RowStream(cfg, "train")
    stream.files = None  # as for a hub id: datasets' IterableDataset, its state_dict the position
    streamed = list(stream.rows())
    assert [record for (_, _, record), _ in streamed] == ROWS
    assert [record for (_, _, record), _ in stream.rows(streamed[9][1])] == ROWS[9:]


def _steps(cfg, tokenizer, dp_size, num_steps, position=FIRST_POSITION):
    """Every rank's micro-batches of ``num_steps`` steps, and the position after each step."""
    source = StreamSource(cfg, tokenizer)
    ranks = [StreamSteps(source, rank, dp_size, tokenizer.pad_token_id, position) for rank in range(dp_size)]
    iterators = [iter(r) for r in ranks]
    steps = []
    for _ in range(num_steps):
        items = [next(it) for it in iterators]
        assert all(item[1] == items[0][1] for item in items)  # every rank knows where the next step begins
        steps.append(([mb for micro_batches, _ in items for mb in micro_batches], items[0][1]))
    return steps


def _examples(micro_batches) -> list[list[int]]:
    """The examples of a step's micro-batches, as token lists, in a layout-free order."""
    found = []
    for mb in micro_batches:
        if "cu_seq_lens" in mb:
            bounds = mb["cu_seq_lens"].tolist()
            found += [mb["input_ids"][0, a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
        else:
            found += [row[mask.bool()].tolist() for row, mask in zip(mb["input_ids"], mb["attention_mask"])]
    return sorted(found)


@pytest.mark.parametrize("batching", ["packing", "padding"])
def test_stream_steps_hold_the_same_examples_on_every_layout_across_passes(tmp_path, batching):
    path = _write(tmp_path / "train.jsonl", ROWS)
    tokenizer = train_tokenizer()
    layouts = {}
    for dp_size, batch, accumulation in ((1, 4, 1), (2, 2, 1), (2, 1, 2), (1, 1, 4)):
        cfg = _config(path)
        cfg.data.batching, cfg.data.context_length = batching, 48
        cfg.train.batch_size, cfg.train.gradient_accumulation_steps = batch, accumulation
        layouts[(dp_size, batch, accumulation)] = _steps(cfg, tokenizer, dp_size, 9)
    reference = layouts[(1, 4, 1)]
    assert reference[-1][1]["pass"] >= 1  # the run went round the stream
    for layout, steps in layouts.items():
        assert [_examples(mb) for mb, _ in steps] == [_examples(mb) for mb, _ in reference], layout
        assert [p for _, p in steps] == [p for _, p in reference], layout
    # resuming at any step's position gives the uninterrupted steps
    cfg = _config(path)
    cfg.data.batching, cfg.data.context_length, cfg.train.batch_size = batching, 48, 2
    resumed = _steps(cfg, tokenizer, 2, 4, reference[4][1])
    assert [_examples(mb) for mb, _ in resumed] == [_examples(mb) for mb, _ in reference[5:9]]


def test_a_stream_too_short_for_one_step_is_one_clear_error(tmp_path):
    path = _write(tmp_path / "train.jsonl", ROWS[:3])
    cfg = _config(path)
    cfg.data.batching, cfg.train.batch_size = "padding", 4
    with pytest.raises(ValueError, match="the whole stream holds 3 examples, fewer than one effective batch"):
        next(iter(StreamSteps(StreamSource(cfg, train_tokenizer()), 0, 1, 0, FIRST_POSITION)))


def test_lora_dropout_example_ids_count_the_stream(tmp_path):
    path = _write(tmp_path / "train.jsonl", ROWS)
    cfg = _config(path)
    cfg.data.batching, cfg.train.batch_size = "padding", 2
    [(first, after_first), (second, _)] = _steps(cfg, train_tokenizer(), 1, 2)
    ids = torch.cat([mb["example_ids"].flatten() for mb in first + second])
    assert sorted(set(ids.tolist()) - {-1}) == [0, 1, 2, 3] and after_first["examples"] == 2
