"""Datasets through the CLI: local SAMSum files with bad rows, strict mode, and the tokenised-data cache."""

from __future__ import annotations

import json

from tests.e2e.test_bad_input import assert_one_line_error
from tests.helpers import step_rows


def write_samsum(folder, num_rows=40, bad_row=None):
    folder.mkdir()
    rows = [{"id": str(i), "dialogue": f"Anna: hi\nTom: see you at {i % 12 + 1} pm",
             "summary": f"They meet at {i % 12 + 1}."} for i in range(num_rows)]
    if bad_row is not None:
        rows[bad_row] = {"id": "bad", "dialogue": "Anna: no summary here"}
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (folder / "validation.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:6] if "summary" in r))
    return folder


def test_samsum_folder_trains_and_reports_skipped_rows(tiny_model, run_cli, tmp_path):
    data = write_samsum(tmp_path / "samsum", bad_row=7)
    out = tmp_path / "run"
    proc = run_cli("sft", "--model_name", tiny_model, "--dataset", "samsum_dataset", "--samsum_dataset.data_path", data,
                   "--output_dir", out, "--batching_strategy", "padding", "--batch_size_training", 4,
                   "--num_workers_dataloader", 0, "--max_train_step", 3)
    assert "39 of 40 rows kept; skipped 1 (missing_field 1)" in proc.stdout
    assert len(step_rows(out)) == 3


def test_strict_data_names_file_and_row_before_any_worker(tiny_model, run_cli, tmp_path):
    data = write_samsum(tmp_path / "samsum", bad_row=7)
    proc = run_cli("sft", "--model_name", tiny_model, "--dataset", "samsum_dataset", "--samsum_dataset.data_path", data,
                   "--output_dir", tmp_path / "run", "--strict_data", check=False)
    assert_one_line_error(proc, f"{data / 'train.jsonl'} row 8", "summary", "--strict_data")
    assert not (tmp_path / "run").exists()


def test_edited_data_is_tokenised_again(tiny_model, run_cli, tmp_path):
    """The cache is keyed by the files' contents: fixing a row changes what the run sees."""
    data = write_samsum(tmp_path / "samsum", bad_row=7)
    args = ("sft", "--model_name", tiny_model, "--dataset", "samsum_dataset", "--samsum_dataset.data_path", data,
            "--batching_strategy", "padding", "--num_workers_dataloader", 0, "--max_train_step", 1)
    assert "skipped 1" in run_cli(*args, "--output_dir", tmp_path / "a").stdout
    write_samsum(tmp_path / "fixed")
    (data / "train.jsonl").write_text((tmp_path / "fixed" / "train.jsonl").read_text())
    assert "40 of 40 rows kept" in run_cli(*args, "--output_dir", tmp_path / "b").stdout
