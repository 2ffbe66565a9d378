"""What a person sees of a run (one short real run, checked from every side): TensorBoard event files and an
offline W&B run carrying the same numbers as metrics.jsonl, generated eval samples, the FLOP counter's line, and
`shardtune plot` pictures of it; a tracker that is not installed is named with its install line before launch."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from shardtune.training.engine.metrics import read_metrics
from shardtune.training.engine.trackers import tracker_scalars

RUN = (
    "--model_name",
    "preset:tiny",
    "--nproc_per_node",
    "1",
    "--max_train_step",
    "3",
    "--context_length",
    "128",
    "--batch_size_training",
    "2",
    "--synthetic_dialogues.num_train",
    "64",
    "--synthetic_dialogues.num_validation",
    "8",
    "--num_workers_dataloader",
    "0",
    "--save_model",
    "false",
)


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def wandb_records(path: Path) -> list:
    """The records of an offline W&B run file: W&B's log format (a 7-byte file header, then 32 KiB blocks of
    chunks: crc32, length, type full / first / middle / last), each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos = path.read_bytes(), 32768, 7
    records, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            # a name with "/" is stored as nested_key
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.setdefault(int(items["_step"]), {}).update(
                {k: v for k, v in items.items() if not k.startswith("_") and isinstance(v, (int, float))}
            )
    return rows


def test_a_run_reports_to_tensorboard_and_wandb_writes_eval_samples_counts_flops_and_plots(run_cli, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "sft",
        *RUN,
        "--output_dir",
        out,
        "--report_to",
        "tensorboard",
        "--use_wandb",
        "--wandb_config.mode",
        "offline",
        "--wandb_config.tags",
        "a,b",
        "--log_eval_samples",
        "2",
        "--flop_counter",
        "--flop_counter_start",
        "1",
        "--debug",
    )
    rows = read_metrics(out / "metrics.jsonl")
    steps, evals = [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]
    assert len(steps) == 3 and len(evals) == 1

    # TensorBoard: every number of every row, under the tracker's name, at the row's step
    scalars = tensorboard_scalars(out / "tensorboard")
    expected: dict[str, dict[int, float]] = {}
    for row in rows:
        for name, value in tracker_scalars(row).items():
            expected.setdefault(name, {})[row["step"]] = value
    for name in (
        "train/loss",
        "train/lr",
        "train/tokens_per_s",
        "train/mfu",
        "train/peak_memory",
        "eval/loss",
        "eval/ppl",
        "eval/rouge1",
    ):
        assert name in expected
    assert scalars.keys() == expected.keys()
    for name, by_step in expected.items():
        assert scalars[name] == pytest.approx(by_step, rel=1e-6), name  # event files store float32

    # W&B, offline: the run file holds the same rows (at full precision) and the resolved config
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    for name, by_step in expected.items():
        for step, value in by_step.items():
            assert history[step][name] == pytest.approx(value, rel=1e-12), (name, step)
    (run_record,) = [r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["train"]["stop_after_steps"] == 3 and config["logging"]["wandb"]["tags"] == ["a", "b"]
    assert list(run_record.tags) == ["a", "b"]

    # eval samples: 2 greedy answers with their references at the evaluation's step, their ROUGE in the eval row
    samples = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [3, 3]
    assert all(s["prompt"].startswith("Summarize this dialog:") and s["reference"] for s in samples)
    assert all("prediction" in s and 0 <= s["rouge1"] <= 1 for s in samples)
    assert evals[0]["eval_rouge1"] == pytest.approx(sum(s["rouge1"] for s in samples) / 2)

    # the FLOP counter: step 2 measured, printed next to the analytic counts; torch counts attention as the full
    # square (with recomputation), so it is above the as-computed count, but by less than the attention share
    (measured,) = [r for r in steps if "measured_flops" in r]
    assert measured["step"] == 2 and "flop counter, step 2:" in proc.stdout + proc.stderr
    analytic = measured["model_flops_per_s"] * measured["step_time_s"]
    assert 1.0 < measured["measured_flops"] / analytic < 1.5
    assert all(0 < r["mfu"] < r["mfu_palm"] for r in steps)
    # the start log names the peak MFU divides by; each row carries it (measured on CPU, never falling)
    assert "mfu against the measured fp32 matmul peak of this CPU" in proc.stdout + proc.stderr
    peaks = [r["peak_flops_per_s"] for r in steps]
    assert peaks == sorted(peaks) and all(r["mfu"] <= 1 for r in steps)
    # --debug: where the time before the first step went, by phase; the first row carries the total
    log = proc.stdout + proc.stderr
    assert "start-up: first step at" in log and "python and imports" in log and "model " in log
    assert steps[0]["startup_s"] > 0 and all("startup_s" not in r for r in steps[1:])

    # shardtune plot: the pictures of this run
    plots = tmp_path / "plots"
    run_cli("plot", out, "--out_dir", plots)
    for name in ("loss.png", "lr.png", "tokens_per_s.png", "mfu.png", "memory.png", "overview.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_a_tracker_that_is_not_installed_is_named_with_its_install_line_before_launch(cli_in_process, tmp_path):
    missing = [name for name in ("trackio", "wandb", "tensorboard") if importlib.util.find_spec(name) is None]
    if not missing:
        pytest.skip("every tracker is installed here")
    proc = cli_in_process("sft", *RUN, "--output_dir", tmp_path / "run", "--report_to", missing[0])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"shardtune: error: --report_to {missing[0]} needs {missing[0]}, which is not installed: "
        f"pip install 'shardtune[{missing[0]}]', or drop the flag"
    ]
    assert not (tmp_path / "run").exists()
