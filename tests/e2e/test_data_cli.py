"""Datasets through the CLI: local SAMSum files with bad rows, strict mode, the tokenised-data cache, and TRL's
conversational rows through --dataset_name."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_bad_input import assert_one_line_error
from tests.helpers import assert_same_training, eval_rows, step_rows


def write_samsum(folder, num_rows=40, bad_row=None):
    folder.mkdir()
    rows = [
        {
            "id": str(i),
            "dialogue": f"Anna: hi\nTom: see you at {i % 12 + 1} pm",
            "summary": f"They meet at {i % 12 + 1}.",
        }
        for i in range(num_rows)
    ]
    if bad_row is not None:
        rows[bad_row] = {"id": "bad", "dialogue": "Anna: no summary here"}
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (folder / "validation.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:6] if "summary" in r))
    return folder


def test_samsum_folder_trains_and_reports_skipped_rows(tiny_model, run_cli, tmp_path):
    data = write_samsum(tmp_path / "samsum", bad_row=7)
    out = tmp_path / "run"
    proc = run_cli(
        "sft",
        "--model_name",
        tiny_model,
        "--dataset",
        "samsum_dataset",
        "--samsum_dataset.data_path",
        data,
        "--output_dir",
        out,
        "--batching_strategy",
        "padding",
        "--batch_size_training",
        4,
        "--num_workers_dataloader",
        0,
        "--max_train_step",
        3,
    )
    assert "39 of 40 rows kept; skipped 1 (missing_field 1)" in proc.stdout
    assert len(step_rows(out)) == 3


def test_strict_data_names_file_and_row_before_any_worker(tiny_model, cli_in_process, tmp_path):
    data = write_samsum(tmp_path / "samsum", bad_row=7)
    proc = cli_in_process(
        "sft",
        "--model_name",
        tiny_model,
        "--dataset",
        "samsum_dataset",
        "--samsum_dataset.data_path",
        data,
        "--output_dir",
        tmp_path / "run",
        "--strict_data",
    )
    assert_one_line_error(proc, f"{data / 'train.jsonl'} row 8", "summary", "--strict_data")
    assert not (tmp_path / "run").exists()


def test_edited_data_is_tokenised_again(tiny_model, run_cli, tmp_path):
    """The cache is keyed by the files' contents: fixing a row changes what the run sees."""
    data = write_samsum(tmp_path / "samsum", bad_row=7)
    args = (
        "sft",
        "--model_name",
        tiny_model,
        "--dataset",
        "samsum_dataset",
        "--samsum_dataset.data_path",
        data,
        "--batching_strategy",
        "padding",
        "--num_workers_dataloader",
        0,
        "--max_train_step",
        1,
    )
    assert "skipped 1" in run_cli(*args, "--output_dir", tmp_path / "a").stdout
    write_samsum(tmp_path / "fixed")
    (data / "train.jsonl").write_text((tmp_path / "fixed" / "train.jsonl").read_text())
    assert "40 of 40 rows kept" in run_cli(*args, "--output_dir", tmp_path / "b").stdout


def write_chat_folder(folder, num_train=48, num_test=6):
    """A folder of conversational rows (train.jsonl, test.jsonl), as a TRL user brings them."""
    folder.mkdir()
    places = ["the Odeon", "Luigi's", "the city pool", "Strike Zone"]
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Answer in one sentence."},
                {"role": "user", "content": f"Where do we meet on day {i}?"},
                {"role": "assistant", "content": f"At {places[i % 4]} at {i % 12 + 1} pm."},
                {"role": "user", "content": "Who brings snacks?"},
                {"role": "assistant", "content": f"{['Anna', 'Tom', 'Kate'][i % 3]} does."},
            ]
        }
        for i in range(num_train + num_test)
    ]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:num_train]))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[num_train:]))
    return folder


def test_messages_rows_train_alike_on_one_process_x4_and_two_processes_x2(tiny_model, run_cli, tmp_path):
    """--dataset_name with conversational rows and --assistant_only_loss: the effective-batch guarantee holds
    (1 x 4 x 1 = 2 x 2 x 1: same losses, token counts and weights); the start log names the format; the test split
    is evaluated."""
    data = write_chat_folder(tmp_path / "chat")
    common = (
        "sft",
        "--model_name",
        tiny_model,
        "--dataset_name",
        data,
        "--assistant_only_loss",
        "true",
        "--max_length",
        96,
        "--num_workers_dataloader",
        0,
        "--max_train_step",
        4,
        "--lr",
        "1e-3",
        "--gradient_clipping",
        "true",
    )
    one = run_cli(*common, "--batch_size_training", 4, "--output_dir", tmp_path / "one")
    run_cli(*common, "--nproc_per_node", 2, "--batch_size_training", 2, "--output_dir", tmp_path / "two")
    source = "conversational rows (columns messages)"
    assert f"data (train): {data} split train: {source}: 48 of 48 rows kept" in one.stdout
    assert f"data (validation): {data} split test: {source}: 6 of 6 rows kept" in one.stdout
    assert_same_training(tmp_path / "one", tmp_path / "two", "messages 1x4 vs 2x2")
    (evaluated,), (evaluated_two,) = eval_rows(tmp_path / "one"), eval_rows(tmp_path / "two")
    assert evaluated["eval_loss"] == pytest.approx(evaluated_two["eval_loss"], rel=1e-5)
    # the trained model: `shardtune eval` reports the same loss on the test split, `generate` renders messages
    report = tmp_path / "eval.json"
    run_cli(
        "eval",
        "--model_name",
        tmp_path / "one",
        "--dataset_name",
        data,
        "--assistant_only_loss",
        "true",
        "--max_length",
        96,
        "--report_path",
        report,
    )
    assert json.loads(report.read_text())["eval_loss"] == pytest.approx(evaluated["eval_loss"], rel=1e-4)
    prompt = json.dumps([{"role": "user", "content": "Where do we meet on day 3?"}])
    run_cli("generate", "--model_name", tmp_path / "one", prompt, "--max_new_tokens", 8)


def test_a_trl_recipes_datasets_mixture_trains_and_reports_each_source(tiny_model, run_cli, tmp_path):
    """TRL's datasets: list with shardtune's weights: 30 and 10 prompt-completion rows weighed 1:1 give 20 rows each
    (the small file upsampled), said in the start log's data report."""
    for name, num_rows in (("a.jsonl", 30), ("b.jsonl", 10)):
        rows = [{"prompt": f"{name} question {i}?", "completion": f" answer {i}."} for i in range(num_rows)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "model_name_or_path": str(tiny_model),
        "datasets": [{"path": str(tmp_path / "a.jsonl"), "weight": 1}, {"path": str(tmp_path / "b.jsonl")}],
        "output_dir": str(tmp_path / "run"),
        "max_steps": 2,
        "per_device_train_batch_size": 2,
        "max_length": 32,
        "dataloader_num_workers": 0,
        "save_plots": False,
    }
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))  # JSON is YAML
    proc = run_cli("sft", "--config", tmp_path / "recipe.yaml")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert (
        f"data (train): mixture of 2 datasets (by weight, seed 42): {a} 20 of 30 rows, {b} 20 rows (upsampled from "
        "10): prompt-completion" in proc.stdout
    )
    assert "40 of 40 rows kept" in proc.stdout
    assert len(step_rows(tmp_path / "run")) == 2
