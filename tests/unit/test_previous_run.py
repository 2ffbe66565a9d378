"""A new run over an ended one: refused before launch (the command line's default), or, with --output.previous_run
move_aside (the Python trainers'), the earlier run renamed whole into output_dir/previous/<UTC time>/ by rank 0
before anything is written; a resumed run, --overwrite_output_dir and a live run's lock are today's rules. In this
process, on real files: the run lock, checkpoints written by the real manifest writer; the move of a real run's
output_dir is tests/e2e/test_bad_input.py's rerun."""

from __future__ import annotations

import calendar
import json
import os
from pathlib import Path

import pytest
import torch

from shardtune.config.checks import check_fields, check_previous_run
from shardtune.config.flags import config_from
from shardtune.config.schema import ConfigError
from shardtune.runtime.distributed import DistEnv
from shardtune.runtime.errors import TrainingStopped
from shardtune.runtime.run_lock import LOCK_FILE, RunLock
from shardtune.training.engine.checkpoint.files import write_manifest
from shardtune.training.engine.previous_run import move_previous_run, moves_aside, set_previous_run_aside

NOW = calendar.timegm((2026, 12, 6, 3, 45, 12))  # 2026-12-06 03:45:12 UTC
STAMP = "20261206-034512"
ONE_PROCESS = DistEnv(
    rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo"
)


def ended_run(out: Path, step: int | None = 2) -> dict[str, bytes]:
    """An ended run's output_dir as the run writes it (config.yaml first, metrics, the published model and tokenizer,
    plots, an evaluation, a checkpoint with its manifest): {relative path: bytes}."""
    files = {
        "config.yaml": b"objective: sft\n",
        "metrics.jsonl": b'{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n',
        "model.safetensors": os.urandom(64),
        "config.json": b'{"model_type": "llama"}',
        "tokenizer.json": b"{}",
        "plots/loss.png": b"png",
        "evaluations/001/metrics.jsonl": b'{"eval_loss": 2.0}\n',
    }
    if step is not None:
        folder = f"checkpoints/step-{step:06d}"
        files[f"{folder}/__0_0.distcp"] = os.urandom(32)
        files[f"{folder}/trainer_state.json"] = json.dumps({"step": step}).encode()
        files["checkpoints/latest"] = f"step-{step:06d}".encode()
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    if step is not None:
        write_manifest(out / f"checkpoints/step-{step:06d}", 0, 1)  # what makes the checkpoint complete
        files[f"checkpoints/step-{step:06d}/manifest.json"] = (
            out / f"checkpoints/step-{step:06d}/manifest.json"
        ).read_bytes()
    return files


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- before launch --------------------------------------------------------------------------------------------------


def test_refuse_names_the_three_ways_and_move_aside_passes(tmp_path):
    ended_run(tmp_path)
    refuse = config_from(output_dir=str(tmp_path))
    assert refuse.output.previous_run == "refuse"
    with pytest.raises(ConfigError) as caught:
        check_previous_run(refuse)
    assert str(caught.value).endswith(
        "already holds a run (metrics.jsonl): pass another directory, --resume latest to continue it, "
        "--output.previous_run move_aside to move it into previous/, or --overwrite_output_dir true to replace it"
    )
    check_previous_run(config_from({"output_dir": str(tmp_path), "output.previous_run": "move_aside"}))
    check_previous_run(config_from(output_dir=str(tmp_path), overwrite_output_dir=True))
    with pytest.raises(ConfigError, match="--output.previous_run 'aside' is not valid: did you mean move_aside"):
        check_fields(config_from({"output_dir": str(tmp_path), "output.previous_run": "aside"}), 1)


def test_a_live_run_is_refused_whatever_previous_run_says(tmp_path):
    ended_run(tmp_path)
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        for settings in ({"output.previous_run": "move_aside"}, {"overwrite_output_dir": True}):
            with pytest.raises(ConfigError, match="is in use by another run"):
                check_previous_run(config_from({"output_dir": str(tmp_path), **settings}))
    finally:
        lock.release()


def test_only_a_new_run_over_an_ended_one_moves_it(tmp_path):
    def aside(out: Path, **settings) -> bool:
        return moves_aside(config_from({"output_dir": str(out), "output.previous_run": "move_aside", **settings}))

    ended_run(tmp_path / "run")
    assert aside(tmp_path / "run")
    assert not moves_aside(config_from(output_dir=str(tmp_path / "run")))  # refuse: the check said no already
    assert not aside(tmp_path / "run", overwrite_output_dir=True)
    assert not aside(tmp_path / "run", **{"checkpoint.resume": "latest"})  # it continues the run
    assert not aside(tmp_path / "run", resume_from_checkpoint=True)  # TRL's spelling of the same
    assert not aside(tmp_path / "run", **{"checkpoint.resume": str(tmp_path / "run/checkpoints/step-000002")})
    assert not aside(tmp_path / "run", **{"checkpoint.resume": "auto"})  # finds the checkpoint: resumes
    ended_run(tmp_path / "failed early", step=None)
    assert aside(tmp_path / "failed early", **{"checkpoint.resume": "auto"})  # nothing to resume: a new run
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "notes.txt").write_text("mine")
    assert not aside(tmp_path / "fresh") and not aside(tmp_path / "absent")


# -- the move ---------------------------------------------------------------------------------------------------------


def test_every_entry_is_renamed_into_previous_and_the_lock_earlier_moves_and_a_live_run_stay(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    lock = RunLock(out)  # the new run's, held as the worker holds it while moving
    lock.acquire()
    live = RunLock(out / "sweep" / "trial-3")  # another run going on inside output_dir
    live.acquire()
    try:
        files = ended_run(out)
        (out / "previous" / "20250101-000000").mkdir(parents=True)
        (out / "previous" / "20250101-000000" / "metrics.jsonl").write_text("older\n")
        inodes = {name: (out / name).stat().st_ino for name in files}
        line = move_previous_run(out, out / "checkpoints", now=NOW)
    finally:
        live.release()
        lock.release()
    target = out / "previous" / STAMP
    assert tree(target) == files  # every byte, where it was relative to output_dir
    assert {name: (target / name).stat().st_ino for name in files} == inodes  # renamed, never copied
    assert sorted(os.listdir(out)) == sorted([LOCK_FILE, "previous", "sweep"])
    assert (out / "previous" / "20250101-000000" / "metrics.jsonl").read_text() == "older\n"
    assert (out / "sweep" / "trial-3" / LOCK_FILE).is_file()
    assert line == (
        f"{out} held an earlier run: moved checkpoints/, config.yaml, evaluations/, metrics.jsonl, model.safetensors, "
        f"plots/ and 2 more into {target}/ (sweep stayed: a live run holds it) (--output.previous_run move_aside)"
    )


def test_two_moves_in_one_second_get_two_folders_and_a_second_checkpoint_folder_moves_too(tmp_path):
    out, checkpoints = tmp_path / "run", tmp_path / "cookbook" / "fine-tuned-tiny"  # dist_checkpoint_root_folder's
    out.mkdir()
    first = ended_run(out)
    move_previous_run(out, checkpoints, now=NOW)
    second = ended_run(out)
    (checkpoints / "step-000004").mkdir(parents=True)
    (checkpoints / "latest").write_text("step-000004")
    line = move_previous_run(out, checkpoints, now=NOW)
    assert tree(out / "previous" / STAMP) == first and tree(out / "previous" / f"{STAMP}-2") == second
    assert sorted(os.listdir(checkpoints / "previous" / STAMP)) == ["latest", "step-000004"]
    assert os.listdir(checkpoints) == ["previous"] and sorted(os.listdir(out)) == ["previous"]
    assert f"into {out / 'previous' / (STAMP + '-2')}/; latest, step-000004/ into {checkpoints}/previous/" in line


def deep_folder(base: Path, length: int) -> Path:
    """A folder whose path is ``length`` characters long (near PATH_MAX, 4096 with its end)."""
    path = base
    while len(str(path)) < length - 250:
        path /= "d" * 200
    path /= "e" * (length - len(str(path)) - 1)
    path.mkdir(parents=True)
    return path


def test_a_rename_that_fails_puts_back_what_moved_and_stops_in_one_line_on_every_rank(tmp_path, capsys):
    """A real failure without privileges: the path in previous/<time>/ of the last entry is longer than the kernel
    takes (ENAMETOOLONG), while the entries before it move: they are renamed back, the folders made removed."""
    out = deep_folder(tmp_path, 4040)  # out/<50 chars> fits in PATH_MAX, out/previous/<stamp>/<50 chars> does not
    (out / "config.yaml").write_text("objective: sft\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / ("z" * 50)).write_text("moved last: sorted after the others")
    before = tree(out)
    cfg = config_from({"output_dir": str(out), "output.previous_run": "move_aside"})
    with pytest.raises(TrainingStopped) as caught:
        set_previous_run_aside(cfg, ONE_PROCESS)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("--output.previous_run move_aside: the earlier run in ")
    assert "File name too long); nothing was moved, and this run wrote nothing: pass another --output_dir" in message
    assert tree(out) == before and sorted(os.listdir(out)) == sorted(before)  # no previous/ left behind
    assert capsys.readouterr().out == ""


def test_the_collective_says_one_line_on_rank_0(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    ended_run(out)
    set_previous_run_aside(config_from({"output_dir": str(out), "output.previous_run": "move_aside"}), ONE_PROCESS)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith(f"shardtune: {out} held an earlier run: moved checkpoints/")
    assert os.listdir(out) == ["previous"]
