"""Never lose a run: checkpoints, exact resume, restarts after a killed worker, exports, NaN stops, full disks.

Real torchrun launches of gloo processes on the tiny preset; real files, real SIGKILLs, a real full tmpfs.
The reference is one uninterrupted run per strategy; every interrupted variant must end where it ends.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardtune.runtime.preemption import EXIT_PREEMPTED
from shardtune.training.engine.checkpoint.layout import (
    checkpoint_step,
    complete_checkpoints,
    latest_checkpoint,
    read_trainer_state,
    unfinished_saves,
)
from tests.conftest import REPO, cli_env, shardtune_argv
from tests.helpers import eval_rows, logged_steps, max_relative_difference, step_rows, wait_for

# 48 dialogues pack into ~34 blocks: 8 steps per epoch at global batch 4, 16 steps in all.
COMMON = (
    "--batch_size_training",
    2,
    "--context_length",
    256,
    "--synthetic_dialogues.num_train",
    48,
    "--synthetic_dialogues.num_validation",
    8,
    "--num_epochs",
    2,
    "--lr",
    3e-3,
    "--gradient_clipping",
    "true",
    "--num_workers_dataloader",
    0,
    "--save_steps",
    2,
    "--save_total_limit",
    2,
)


STRATEGIES = [
    pytest.param((), id="ddp"),
    pytest.param(("--enable_fsdp",), id="fsdp"),
    pytest.param(("--use_peft",), id="lora"),
]


def final_tensors(out_dir: Path) -> dict[str, torch.Tensor]:
    """The model (or the adapter, for PEFT) a run wrote at its end."""
    for name in ("model.safetensors", "adapter_model.safetensors"):
        if (out_dir / name).is_file():
            return load_file(str(out_dir / name))
    raise AssertionError(f"no model or adapter in {out_dir}")


def run_shardtune(cache_dir: Path, *args, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        shardtune_argv(*args), capture_output=True, text=True, timeout=600, env=cli_env(cache_dir), cwd=REPO
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"shardtune {' '.join(map(str, args))} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def sft(cache_dir, model, out, *extra, nproc=2, check=True) -> subprocess.CompletedProcess:
    return run_shardtune(
        cache_dir,
        "sft",
        "--nproc_per_node",
        nproc,
        "--model_name",
        model,
        "--output_dir",
        out,
        *COMMON,
        *extra,
        check=check,
    )


@pytest.fixture(scope="module")
def reference(tiny_model, cache_dir, tmp_path_factory):
    """The uninterrupted run of each strategy, computed once per module."""
    done: dict[tuple, Path] = {}

    def get(strategy: tuple) -> Path:
        if strategy not in done:
            out = tmp_path_factory.mktemp("reference") / "run"
            sft(cache_dir, tiny_model, out, *strategy)
            done[strategy] = out
        return done[strategy]

    return get


def assert_same_rows(ref: Path, other: Path, rel: float = 0.0, kept_evals: tuple[int, ...] = ()) -> None:
    """``kept_evals``: the steps of evaluations an interrupted run ended with, which its resumed run keeps (the run's
    last step is checkpointed after its evaluation) besides the uninterrupted run's."""
    ref_rows, rows = step_rows(ref), step_rows(other)
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == list(range(1, 17))
    for r, o in zip(ref_rows, rows):
        assert (o["num_tokens"], o["label_tokens"], o["lr"]) == (r["num_tokens"], r["label_tokens"], r["lr"]), r["step"]
        assert o["loss"] == pytest.approx(r["loss"], rel=rel, abs=0), r["step"]
        assert o["grad_norm"] == pytest.approx(r["grad_norm"], rel=max(rel, 1e-12), abs=0), r["step"]
    assert sorted(kept_evals + tuple(r["step"] for r in eval_rows(ref))) == [r["step"] for r in eval_rows(other)]
    other_evals = [r for r in eval_rows(other) if r["step"] not in kept_evals]
    assert [r["step"] for r in other_evals] == [r["step"] for r in eval_rows(ref)] == [8, 16]
    assert [r["eval_loss"] for r in other_evals] == pytest.approx(
        [r["eval_loss"] for r in eval_rows(ref)], rel=max(rel, 1e-12)
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resumed_run_equals_uninterrupted_run(
    strategy, reference, tiny_model, cache_dir, tmp_path, capsys, cli_in_process
):
    ref = reference(strategy)
    out = tmp_path / "run"
    sft(cache_dir, tiny_model, out, *strategy, "--max_train_step", 5)  # stops mid-epoch 1, checkpoint at step 5
    assert latest_checkpoint(out).name == "step-000005"
    if strategy == ():  # resuming the finished run trains nothing and keeps every row, its final eval too
        before = (out / "metrics.jsonl").read_text()
        assert [r["step"] for r in eval_rows(out)] == [5]
        sft(cache_dir, tiny_model, out, *strategy, "--max_train_step", 5, "--resume", "latest")
        assert (out / "metrics.jsonl").read_text() == before
    # a checkpoint that does not fit the run is refused in one line before config.yaml or metrics.jsonl change
    written = [(out / name).read_text() for name in ("config.yaml", "metrics.jsonl")]
    misfit = ("--use_peft",) if strategy == () else () if strategy == ("--use_peft",) else None
    if misfit is not None:
        refused = cli_in_process(
            "sft",
            "--nproc_per_node",
            2,
            "--model_name",
            tiny_model,
            "--output_dir",
            out,
            *COMMON,
            *misfit,
            "--resume",
            "latest",
        )  # refused before launch: in this process
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert "--resume latest" in refused.stderr and ("--use_peft" in refused.stderr.strip().splitlines()[-1])
        assert [(out / name).read_text() for name in ("config.yaml", "metrics.jsonl")] == written
    resumed = sft(cache_dir, tiny_model, out, *strategy, "--resume", "latest")
    assert "data order kept" in resumed.stdout
    exact = strategy == ()
    assert_same_rows(ref, out, rel=0.0 if exact else 1e-6, kept_evals=(5,))  # the stopped run's last evaluation
    difference = max_relative_difference(final_tensors(ref), final_tensors(out))
    assert difference <= (0.0 if exact else 1e-6), difference
    # --save_total_limit 2: the last two complete checkpoints, the newest one named by latest
    assert [p.name for p in complete_checkpoints(out)] == ["step-000014", "step-000016"]
    assert latest_checkpoint(out).name == "step-000016"
    state = read_trainer_state(latest_checkpoint(out))
    assert (state["step"], state["epoch"], state["step_in_epoch"], state["world_size"]) == (16, 2, 0, 2)
    # export (one process, no process group) gives what the run wrote at its end: a model, or an adapter
    run_shardtune(cache_dir, "export", out, tmp_path / "exported")
    assert max_relative_difference(final_tensors(out), final_tensors(tmp_path / "exported")) == 0.0
    if strategy == ():  # never over files by accident: a non-empty directory (the run's own too), or a file
        from shardtune.commands.export import main as export_main

        (tmp_path / "a-file").write_text("x")
        for target, why in (
            (tmp_path / "exported", "--overwrite"),
            (out, "--overwrite"),
            (tmp_path / "a-file", "is a file"),
        ):
            assert export_main([str(out), str(target)]) == 2
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1 and str(target) in lines[0] and why in lines[0], lines
        assert (tmp_path / "a-file").read_text() == "x"
        assert export_main([str(out), str(tmp_path / "exported"), "--overwrite"]) == 0


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """{local rank: pid} of the training processes below the launcher (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {}, [launcher_pid]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            ranks = [int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"LOCAL_RANK=")]
            if ranks and b"TORCHELASTIC_RUN_ID" in b"\0".join(env):
                found[ranks[0]] = pid
    return found


def start_sft(cache_dir, model, out, *extra) -> subprocess.Popen:
    args = ["sft", "--nproc_per_node", 2, "--model_name", model, "--output_dir", out, *COMMON, *extra]
    return subprocess.Popen(
        shardtune_argv(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(cache_dir),
        cwd=REPO,
        start_new_session=True,
    )


def test_killed_worker_is_restarted_and_resumes_to_the_same_weights(reference, tiny_model, cache_dir, tmp_path):
    ref = reference(())
    out = tmp_path / "run"
    proc = start_sft(cache_dir, tiny_model, out, "--max_restarts", 1)
    try:
        wait_for(lambda: True if logged_steps(out) >= 5 else None, proc, "step 5")
        pid = wait_for(lambda: worker_pids(proc.pid).get(1), proc, "rank 1 was found")
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-4000:]
    assert "restart 1 of the worker group: resuming automatically from" in stdout
    assert_same_rows(ref, out)
    assert max_relative_difference(final_tensors(ref), final_tensors(out)) == 0.0


def test_kill_during_a_save_keeps_the_previous_checkpoint(reference, tiny_model, cache_dir, tmp_path):
    ref = reference(())
    out = tmp_path / "run"
    proc = start_sft(cache_dir, tiny_model, out, "--save_steps", 1)
    workers: dict[int, int] = {}
    try:
        wait_for(lambda: True if logged_steps(out) >= 2 else None, proc, "step 2")
        workers = wait_for(lambda: worker_pids(proc.pid) or None, proc, "the workers were found")
        # SIGKILL the whole job (launcher and workers) while a checkpoint is being written
        unfinished = wait_for(
            lambda: unfinished_saves(out) or None, proc, "a save was caught in progress", poll_s=0.0005
        )
    finally:
        for pid in [proc.pid, *workers.values()]:  # torchrun's workers do not share the launcher's group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()
    previous = latest_checkpoint(out)
    assert previous is not None and previous.name < unfinished[0].name.split(".")[0]
    assert all((p / "trainer_state.json").is_file() and (p / ".metadata").is_file() for p in complete_checkpoints(out))
    resumed = sft(cache_dir, tiny_model, out, "--resume", "latest")
    assert f"resumed from {previous}" in resumed.stdout
    assert unfinished_saves(out) == []
    assert_same_rows(ref, out)
    assert max_relative_difference(final_tensors(ref), final_tensors(out)) == 0.0


@pytest.mark.parametrize("strategy", STRATEGIES[:2])
def test_two_processes_resume_a_four_process_checkpoint(strategy, tiny_model, cache_dir, tmp_path):
    """Global batch 4 = 4 processes x 1 = 2 processes x 2: the state is resharded and the data order is kept."""
    four, two = tmp_path / "four", tmp_path / "two"
    sft(
        cache_dir,
        tiny_model,
        four,
        *strategy,
        "--batch_size_training",
        1,
        "--max_train_step",
        4,
        "--checkpoint_type",
        "FULL_STATE_DICT",
        nproc=4,
    )
    resumed = sft(
        cache_dir, tiny_model, two, *strategy, "--max_train_step", 4, "--resume", four / "checkpoints" / "step-000002"
    )
    assert "saved by 4 processes, now 2" in resumed.stdout and "data order kept" in resumed.stdout
    four_rows, two_rows = step_rows(four), step_rows(two)
    assert [r["step"] for r in two_rows] == [3, 4]
    for r, o in zip(four_rows[2:], two_rows):
        assert o["num_tokens"] == r["num_tokens"]
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-6), r["step"]
    assert max_relative_difference(final_tensors(four), final_tensors(two)) <= 1e-5
    # FULL_STATE_DICT: the gathered model inside the checkpoint is the run's final model
    gathered = load_file(str(four / "checkpoints" / "step-000004" / "hf_model" / "model.safetensors"))
    assert max_relative_difference(final_tensors(four), gathered) == 0.0


def test_export_of_a_sharded_checkpoint_equals_the_final_model(reference, cache_dir, tmp_path):
    ref = reference(())
    last = latest_checkpoint(ref)
    assert read_trainer_state(last)["checkpoint_type"] == "SHARDED_STATE_DICT" and not (last / "hf_model").exists()
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    run_shardtune(cache_dir, "export", last, tmp_path / "hf")
    exported, final = final_tensors(tmp_path / "hf"), final_tensors(ref)
    assert {t.dtype for t in exported.values()} == {torch.float32}  # the tiny preset's own dtype
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    # config.json states the dtype written: from_pretrained then loads bf16 weights as bf16, not fp32
    run_shardtune(cache_dir, "export", last, tmp_path / "hf16", "--dtype", "bfloat16")
    assert {t.dtype for t in final_tensors(tmp_path / "hf16").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf16").dtype == torch.bfloat16


def test_resume_with_another_lr_trains_with_it_and_says_so(reference, tiny_model, cache_dir, tmp_path):
    """--lr 6e-3 on a checkpoint trained at 3e-3: the restored optimizer and schedule take the new peak (the rows
    show twice the uninterrupted run's lr at the same steps), the warning says what was applied from which step, and
    config.yaml records it. A checkpoint resumed under FSDP (written by DDP) is not reported as a change."""
    ref = reference(())
    checkpoint = ref / "checkpoints" / "step-000014"
    out = tmp_path / "faster"
    proc = sft(cache_dir, tiny_model, out, "--resume", checkpoint, "--lr", 6e-3, "--enable_fsdp")
    rows, ref_rows = step_rows(out), {r["step"]: r for r in step_rows(ref)}
    assert [r["step"] for r in rows] == [15, 16]
    assert all(r["lr"] == pytest.approx(2 * ref_rows[r["step"]]["lr"], rel=1e-12) for r in rows), rows
    import yaml

    assert yaml.safe_load((out / "config.yaml").read_text())["optim"]["lr"] == 6e-3
    warning = next(line for line in proc.stderr.splitlines() if "resuming with settings that differ" in line)
    assert "(lr)" in warning and "applied from step 15 on: lr 0.003 -> 0.006" in warning, warning
    assert "enable_fsdp" not in warning


def error_lines(stderr: str) -> list[str]:
    """shardtune's one-line errors (a progress bar may precede one on its line: it writes no newline)."""
    return [line[line.index("shardtune: error:") :] for line in stderr.splitlines() if "shardtune: error:" in line]


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_model, cache_dir, tmp_path):
    out = tmp_path / "run"
    # lr 1e30: the first step is finite, it makes the weights ~1e30, and the second step's loss overflows
    proc = sft(cache_dir, tiny_model, out, "--lr", 1e30, "--save_steps", 1, "--max_train_step", 4, check=False)
    assert proc.returncode == 1
    message = error_lines(proc.stderr)
    assert len(message) == 1 and "non-finite loss" in message[0] and "at step 2" in message[0], proc.stderr[-3000:]
    assert "step-000001" in message[0]
    assert [p.name for p in complete_checkpoints(out)] == ["step-000001"] and unfinished_saves(out) == []
    assert latest_checkpoint(out).name == "step-000001"
    assert [r["step"] for r in step_rows(out)] == [1] and math.isfinite(step_rows(out)[0]["loss"])


def test_nan_policy_skip_leaves_the_weights_of_the_last_finite_step(tiny_model, cache_dir, tmp_path):
    out = tmp_path / "run"
    sft(
        cache_dir,
        tiny_model,
        out,
        "--lr",
        1e30,
        "--save_steps",
        1,
        "--save_total_limit",
        0,
        "--max_train_step",
        3,
        "--nan_policy",
        "skip",
        "--run_validation",
        "false",
    )
    rows = step_rows(out)
    assert [r.get("skipped", False) for r in rows] == [False, True, True]
    assert not math.isfinite(rows[1]["loss"])
    run_shardtune(cache_dir, "export", out / "checkpoints" / "step-000001", tmp_path / "after_step_1")
    assert max_relative_difference(final_tensors(tmp_path / "after_step_1"), final_tensors(out)) == 0.0


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real filesystem of a given size (needs root: CI runs as root)."""
    mounted: list[Path] = []

    def mount(size_kib: int) -> Path:
        path = tmp_path / f"tmpfs-{size_kib}k"
        path.mkdir()
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}): the disk-full test needs root")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_fails_the_save_cleanly_and_keeps_the_previous_checkpoint(tiny_model, cache_dir, small_tmpfs):
    # one checkpoint of the tiny model is ~2.9 MB: 4.5 MB hold one, not the second (the older one is deleted
    # only after the new one is complete)
    out = small_tmpfs(4608) / "run"
    proc = sft(cache_dir, tiny_model, out, "--save_total_limit", 1, "--run_validation", "false", nproc=1, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "checkpoints of about" in proc.stderr  # the warning before training
    message = error_lines(proc.stderr)
    assert len(message) == 1 and "checkpoint step-000004 could not be written (No space left on device" in message[0]
    assert "step-000002 is kept" in message[0]
    assert [p.name for p in complete_checkpoints(out)] == ["step-000002"] and unfinished_saves(out) == []
    assert latest_checkpoint(out).name == "step-000002"
    # a disk that cannot hold a single checkpoint is refused before the first step
    tiny_disk = small_tmpfs(1024) / "run"
    proc = sft(cache_dir, tiny_model, tiny_disk, nproc=1, check=False)
    assert proc.returncode == 1 and "less than one checkpoint" in proc.stderr
    assert not (tiny_disk / "metrics.jsonl").exists() or step_rows(tiny_disk) == []


def test_resuming_with_a_longer_cosine_schedule_says_the_learning_rate_changes(tiny_model, cache_dir, tmp_path):
    out = tmp_path / "run"
    cosine = ("--lr_scheduler", "cosine", "--warmup_steps", 1)
    sft(cache_dir, tiny_model, out, *cosine, "--max_train_step", 3, nproc=1)
    resumed = sft(cache_dir, tiny_model, out, *cosine, "--max_train_step", 6, "--resume", "latest", nproc=1)
    assert "cosine schedule now spans 6 steps instead of the checkpoint's 3" in resumed.stderr + resumed.stdout


# -- two simulated nodes: two launchers of 1 process each on this host (same world size as the reference) ---------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_nodes(cache_dir, model, out, *extra) -> list[subprocess.Popen]:
    """Both nodes write into one output_dir, as on a shared filesystem. Node 0 hosts the rendezvous store (on one
    host both launchers match the endpoint and would race for it)."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for node_rank in (0, 1):
        args = [
            "sft",
            "--nnodes",
            2,
            "--node_rank",
            node_rank,
            "--nproc_per_node",
            1,
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            endpoint,
            "--rdzv_id",
            "two-nodes",
            "--rdzv_conf",
            f"is_host={int(node_rank == 0)}",
            "--model_name",
            model,
            "--output_dir",
            out,
            *COMMON,
            *extra,
        ]
        nodes.append(
            subprocess.Popen(
                shardtune_argv(*args),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
                start_new_session=True,
                env={**cli_env(cache_dir), "OMP_NUM_THREADS": "1"},
            )
        )  # 2 processes, 2 cores
    return nodes


def finish(nodes: list[subprocess.Popen], timeout_s: float = 300) -> list[tuple[str, str]]:
    """Outputs of the launchers; on a timeout the launchers and their workers (not in their group) are killed."""
    try:
        return [p.communicate(timeout=timeout_s) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                for pid in worker_pids(p.pid).values():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                os.killpg(p.pid, signal.SIGKILL)


def test_sigusr1_to_one_node_stops_every_node_with_a_checkpoint_and_the_rerun_ends_like_no_stop(
    reference, tiny_model, cache_dir, tmp_path
):
    """SLURM's time-limit warning (or a preemption) reaching only node 1's launcher, with --save_steps 0."""
    ref = reference(())
    out = tmp_path / "run"
    nodes = start_two_nodes(cache_dir, tiny_model, out, "--save_steps", 0)
    try:
        wait_for(lambda: True if logged_steps(out) >= 3 else None, nodes[0], "step 3")
        nodes[1].send_signal(signal.SIGUSR1)
    finally:
        outputs = finish(nodes)
    assert [p.returncode for p in nodes] == [EXIT_PREEMPTED] * 2, outputs[0][1][-3000:] + outputs[1][1][-3000:]
    stopped = latest_checkpoint(out)
    step = checkpoint_step(stopped)
    assert 3 <= step < 16 and complete_checkpoints(out) == [stopped] and logged_steps(out) == step
    assert "SIGUSR1 received: every rank finishes its optimizer step" in outputs[1][1]
    for _stdout, stderr in outputs:  # node 0 got no signal: it stopped by the collective decision
        assert f"stopped by SIGUSR1 after step {step}: checkpoint {stopped} written" in stderr
    # the requeued job: the same command with --resume auto, here on one node of 2 processes
    resumed = sft(cache_dir, tiny_model, out, "--save_steps", 0, "--resume", "auto")
    assert f"resumed from {stopped}" in resumed.stdout
    assert_same_rows(ref, out, rel=1e-6)
    assert max_relative_difference(final_tensors(ref), final_tensors(out)) <= 1e-6


def test_eight_bit_adamw_checkpoints_its_8_bit_moments_and_resumes_exactly(tiny_model, cache_dir, tmp_path):
    """--optim adamw_8bit (bitsandbytes, TRL's name too) under DDP: the checkpoint holds the uint8 moments and their
    scales, and a run resumed from it (another output_dir) ends bit for bit where the uninterrupted one ends."""
    import torch.distributed.checkpoint as dcp

    eight_bit = ("--optim", "adamw_8bit", "--max_train_step", 6)  # checkpoints at 2, 4, 6 (COMMON: --save_steps 2)
    whole, part = tmp_path / "whole", tmp_path / "part"
    sft(cache_dir, tiny_model, whole, *eight_bit)
    saved = dcp.FileSystemReader(str(whole / "checkpoints" / "step-000004")).read_metadata().state_dict_metadata
    moments = {k: v.properties.dtype for k, v in saved.items() if k.endswith((".state1", ".state2"))}
    assert moments and torch.uint8 in moments.values(), sorted(saved)[:20]
    assert any(k.endswith(".absmax1") for k in saved)
    resumed = sft(cache_dir, tiny_model, part, *eight_bit, "--resume", whole / "checkpoints" / "step-000004")
    assert "resumed from" in resumed.stdout
    assert [r["loss"] for r in step_rows(part)][-2:] == [r["loss"] for r in step_rows(whole)][-2:]
    assert max_relative_difference(final_tensors(whole), final_tensors(part)) == 0.0
