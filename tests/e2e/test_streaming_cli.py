"""--dataset_streaming (TRL's flag): rows read, tokenised and batched as the steps need them, the same steps on any
layout with the same effective batch, and a resume that opens the stream where the next step's rows begin."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardtune.data.synthetic import generate_dialogues
from tests.e2e.test_bad_input import assert_one_line_error
from tests.helpers import eval_rows, step_rows

STEPS = 7  # the 22 dialogues give 5 steps of 4 packed blocks: the stream starts again within the run


def write_messages(folder: Path, num_train: int = 22) -> Path:
    folder.mkdir(parents=True)
    for split, num, seed in (("train", num_train, 5), ("test", 6, 6)):
        with open(folder / f"{split}.jsonl", "w") as fh:
            for row in generate_dialogues(num, seed, "train"):
                messages = [
                    {"role": "system", "content": "Summarize the dialog."},
                    {"role": "user", "content": row["dialogue"]},
                    {"role": "assistant", "content": row["summary"]},
                ]
                fh.write(json.dumps({"messages": messages}) + "\n")
    return folder


def streamed(run_cli, model, data, out, *args):
    return run_cli(
        "sft",
        "--model_name",
        model,
        "--dataset_name",
        data,
        "--dataset_streaming",
        "true",
        "--max_steps",
        STEPS,
        "--context_length",
        256,
        "--eval_steps",
        4,
        "--output_dir",
        out,
        *args,
    )


def losses(out: Path) -> list[float]:
    return [row["loss"] for row in step_rows(out)]


def test_streaming_is_the_same_run_on_any_layout_and_resumes_at_the_row(tiny_model, run_cli, tmp_path):
    data = write_messages(tmp_path / "data")
    one = tmp_path / "one"
    proc = streamed(run_cli, tiny_model, data, one, "--batch_size_training", 4, "--save_steps", 2)
    assert f"data (train): {data} split train (streamed): conversational rows (columns messages)" in proc.stdout
    two = tmp_path / "two"
    streamed(run_cli, tiny_model, data, two, "--nproc_per_node", 2, "--batch_size_training", 2)
    assert len(losses(one)) == STEPS
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    assert [r["eval_loss"] for r in eval_rows(two)] == pytest.approx([r["eval_loss"] for r in eval_rows(one)], rel=1e-5)

    # resume at step 2 under another layout, from a copy of the data whose rows before step 3's are garbage (but the
    # first, which the format is recognised from):
    # the same steps 3 and 4 prove the stream was opened at the row where step 3's data begins, without reading
    # the rows before it
    state = json.loads((one / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    position = state["data_position"]
    assert position["pass"] == 0 and position["rows"]["file"] == 0 and position["rows"]["offset"] > 0
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    text = (copy / "train.jsonl").read_bytes()
    first, cut = text.index(b"\n") + 1, position["rows"]["offset"]  # the first row stays: the format is read there
    (copy / "train.jsonl").write_bytes(text[:first] + b"x" * (cut - first - 1) + b"\n" + text[cut:])
    resumed = tmp_path / "resumed"
    proc = run_cli(
        "sft",
        "--model_name",
        tiny_model,
        "--dataset_name",
        copy,
        "--dataset_streaming",
        "true",
        "--max_steps",
        4,
        "--context_length",
        256,
        "--eval_steps",
        4,
        "--output_dir",
        resumed,
        "--nproc_per_node",
        2,
        "--batch_size_training",
        1,
        "--gradient_accumulation_steps",
        2,
        "--resume",
        one / "checkpoints" / "step-000002",
    )
    assert "the stream continues at the row where step 3's data begins" in proc.stdout
    assert [r["step"] for r in step_rows(resumed)] == [3, 4]
    assert losses(resumed) == pytest.approx(losses(one)[2:4], rel=1e-5)


def test_streaming_needs_max_steps_and_sft(tiny_model, cli_in_process, tmp_path):
    data = write_messages(tmp_path / "data", num_train=4)
    proc = cli_in_process(
        "sft",
        "--model_name",
        tiny_model,
        "--dataset_name",
        data,
        "--dataset_streaming",
        "true",
        "--output_dir",
        tmp_path,
    )
    assert_one_line_error(proc, "--dataset_streaming true needs --max_steps", "pass --max_steps N")
    proc = cli_in_process("sft", "--model_name", tiny_model, "--dataset_streaming", "true", "--max_steps", 2)
    assert_one_line_error(proc, "--dataset synthetic_dialogues", "pass --dataset_name")
