"""Nothing lost, nothing let in: checkpoints that verify, loading that runs no code, one run per output_dir, clean
publishing, closed ports, a requeueable exit status.

Real launches of the tiny preset (one process in place, or two under torchrun), real files damaged as a power cut
or an attacker would damage them, real signals; the sockets a run listens on are read from /proc.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from shardtune.runtime.preemption import EXIT_PREEMPTED
from tests.conftest import REPO, cli_env, shardtune_argv
from tests.distributed.test_checkpoint import (
    error_lines,
    run_shardtune,
    sft,
    worker_pids,
)
from tests.helpers import logged_steps, step_rows, wait_for

SHORT = ("--max_train_step", 3, "--save_steps", 1, "--save_total_limit", 0, "--run_validation", "false")


@pytest.fixture(scope="module")
def three_checkpoints(tiny_model, cache_dir, tmp_path_factory):
    """One in-place run with a checkpoint after each of 3 steps, traced with strace (fsync and rename calls)."""
    out = tmp_path_factory.mktemp("three") / "run"
    trace = out.parent / "strace.txt"
    args = [
        "sft",
        "--nproc_per_node",
        1,
        "--model_name",
        tiny_model,
        "--output_dir",
        out,
        "--batch_size_training",
        2,
        "--context_length",
        256,
        "--synthetic_dialogues.num_train",
        48,
        "--num_workers_dataloader",
        0,
        *SHORT,
    ]
    prefix = (
        ["strace", "-f", "-qq", "-y", "-e", "trace=fsync,rename,renameat,renameat2", "-o", str(trace)]
        if shutil.which("strace")
        else []
    )
    proc = subprocess.run(
        [*prefix, *shardtune_argv(*args)], capture_output=True, text=True, timeout=600, env=cli_env(cache_dir), cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, trace if prefix else None


def copy_run(run: Path, where: Path) -> Path:
    shutil.copytree(run, where, ignore=shutil.ignore_patterns(".shardtune.lock"))
    return where


def test_checkpoint_files_and_folders_are_fsynced_before_and_after_each_rename(three_checkpoints):
    out, trace = three_checkpoints
    if trace is None:
        pytest.skip("strace is not installed")
    calls = trace.read_text().splitlines()
    ckpts = out / "checkpoints"

    def first(pattern: str) -> int:
        found = [i for i, line in enumerate(calls) if re.search(pattern, line)]
        assert found, f"no call matches {pattern}:\n" + "\n".join(calls[:80])
        return found[0]

    final = re.escape(str(ckpts / "step-000003"))
    renamed = first(rf"rename.*step-000003\.tmp-0.*\"{final}\"")
    assert first(r"fsync\(\d+<[^>]*step-000003\.tmp-0/__0_0\.distcp>") < renamed  # the data
    assert first(r"fsync\(\d+<[^>]*step-000003\.tmp-0/trainer_state\.json>") < renamed
    assert first(r"fsync\(\d+<[^>]*step-000003\.tmp-0/manifest\.json>") < renamed  # the manifest, written last
    assert first(r"fsync\(\d+<[^>]*step-000003\.tmp-0>") < renamed  # the folder's entries
    after = [i for i, line in enumerate(calls) if re.search(rf"fsync\(\d+<{re.escape(str(ckpts))}>", line)]
    assert any(i > renamed for i in after)  # the rename itself
    latest = first(rf"rename.*\.latest\.tmp-\d+.*\"{re.escape(str(ckpts / 'latest'))}\"")
    assert first(r"fsync\(\d+<[^>]*\.latest\.tmp-\d+>") < latest
    manifest = json.loads((ckpts / "step-000003" / "manifest.json").read_text())
    assert manifest["hash"] == "sha256" and "__0_0.distcp" in manifest["files"]
    data = ckpts / "step-000003" / "__0_0.distcp"
    assert manifest["files"]["__0_0.distcp"] == {
        "bytes": data.stat().st_size,
        "sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
    }


def test_resume_takes_the_newest_checkpoint_that_verifies_and_says_what_it_skipped(
    three_checkpoints, tiny_model, cache_dir, tmp_path
):
    """A cut data file (step 3), an emptied trainer_state.json (step 2, what a power cut leaves) and a ``latest``
    naming another run's checkpoint: --resume auto takes step 1, in one line per skipped checkpoint."""
    out = copy_run(three_checkpoints[0], tmp_path / "run")
    ckpts = out / "checkpoints"
    other = tmp_path / "other" / "checkpoints" / "step-000009"
    shutil.copytree(ckpts / "step-000001", other)
    with open(ckpts / "step-000003" / "__0_0.distcp", "r+b") as fh:
        fh.truncate(1000)
    (ckpts / "step-000002" / "trainer_state.json").write_text("")
    (ckpts / "latest").write_text("../../other/checkpoints/step-000009\n")
    resumed = sft(cache_dir, tiny_model, out, *SHORT, "--max_train_step", 4, "--resume", "auto", nproc=1)
    assert f"resumed from {ckpts / 'step-000001'} (step 1" in resumed.stdout
    notes = [line for line in resumed.stderr.splitlines() if "checkpoint:" in line]
    assert any("latest names '../../other/checkpoints/step-000009'" in n and "ignored" in n for n in notes), notes
    assert any(
        f"skipped {ckpts / 'step-000003'}: __0_0.distcp is 1,000 bytes, the manifest says" in n for n in notes
    ), notes
    assert any(f"skipped {ckpts / 'step-000002'}: trainer_state.json is 0 bytes" in n for n in notes), notes
    assert "Traceback" not in resumed.stderr
    assert [r["step"] for r in step_rows(out)] == [1, 2, 3, 4]
    # an explicitly named checkpoint that does not verify: one line, nothing loaded
    with open(ckpts / "step-000004" / "__0_0.distcp", "r+b") as fh:
        fh.seek(100)
        fh.write(b"\0" * 64)  # same size, other bytes: only the hash sees it
    proc = sft(
        cache_dir,
        tiny_model,
        out,
        *SHORT,
        "--max_train_step",
        5,
        "--resume",
        ckpts / "step-000004",
        nproc=1,
        check=False,
    )
    assert proc.returncode != 0 and len(error_lines(proc.stderr)) == 1, proc.stderr[-3000:]
    assert "does not match its SHA-256" in error_lines(proc.stderr)[0] and "Traceback" not in proc.stderr


class Payload:
    """What an attacker plants: unpickling it creates a file (any other call would run the same way)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def plant(checkpoint: Path, marker: Path) -> None:
    """Replace .metadata by a payload, and its manifest entry too (an attacker rewrites both)."""
    metadata = checkpoint / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][".metadata"] = {
        "bytes": metadata.stat().st_size,
        "sha256": hashlib.sha256(metadata.read_bytes()).hexdigest(),
    }
    manifest_path.write_text(json.dumps(manifest))


def test_a_pickle_planted_in_a_checkpoint_runs_neither_on_export_nor_on_resume(
    three_checkpoints, tiny_model, cache_dir, tmp_path
):
    out = copy_run(three_checkpoints[0], tmp_path / "run")
    checkpoint = out / "checkpoints" / "step-000003"
    marker = tmp_path / "payload-ran"
    plant(checkpoint, marker)
    exported = run_shardtune(cache_dir, "export", checkpoint, tmp_path / "exported", check=False)
    assert not marker.exists(), "the payload ran on export"
    assert exported.returncode != 0 and len(error_lines(exported.stderr)) == 1, exported.stderr[-3000:]
    assert "names io.open" in error_lines(exported.stderr)[0] and "Traceback" not in exported.stderr
    resumed = sft(
        cache_dir, tiny_model, out, *SHORT, "--max_train_step", 4, "--resume", checkpoint, nproc=1, check=False
    )
    assert not marker.exists(), "the payload ran on resume"
    assert resumed.returncode != 0 and len(error_lines(resumed.stderr)) == 1, resumed.stderr[-3000:]
    assert "names io.open" in error_lines(resumed.stderr)[0] and "Traceback" not in resumed.stderr


def listening_addresses(pids: list[int]) -> list[str]:
    """host:port of every TCP socket in LISTEN state owned by ``pids`` (from /proc/net/tcp and tcp6)."""
    inodes = set()
    for pid in pids:
        fd_dir = Path("/proc") / str(pid) / "fd"
        for fd in fd_dir.iterdir() if fd_dir.is_dir() else []:
            try:
                match = re.match(r"socket:\[(\d+)\]", os.readlink(fd))
            except OSError:
                continue
            if match:
                inodes.add(match.group(1))
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                if family == socket.AF_INET6:  # four little-endian 32-bit words
                    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                found.append(
                    f"{socket.inet_ntop(family, raw[::-1] if family == socket.AF_INET else raw)}:{int(hex_port, 16)}"
                )
    return found


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1")


def start(cache_dir, model, out, *extra, nproc: int) -> subprocess.Popen:
    args = [
        "sft",
        "--nproc_per_node",
        nproc,
        "--model_name",
        model,
        "--output_dir",
        out,
        "--batch_size_training",
        2,
        "--context_length",
        256,
        "--synthetic_dialogues.num_train",
        48,
        "--num_workers_dataloader",
        0,
        "--run_validation",
        "false",
        *extra,
    ]
    return subprocess.Popen(
        shardtune_argv(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(cache_dir),
        cwd=REPO,
        start_new_session=True,
    )


def kill_if_running(proc: subprocess.Popen) -> None:
    """A failed test's leftover run: its workers (which may sit in their own groups) and its process group."""
    if proc.poll() is None:
        for pid in worker_pids(proc.pid).values():
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)


def lock_record(out: Path) -> str:
    try:
        return (out / ".shardtune.lock").read_text()
    except OSError:
        return ""


def test_one_run_per_output_dir_loopback_only_and_a_stopped_lone_process_exits_75(tiny_model, cache_dir, tmp_path):
    """A LoRA run's outputs, then a full fine-tune over them (--overwrite_output_dir) caught while it runs: it listens
    on loopback only, a second run on the same output_dir is refused (also with --resume auto), SIGUSR1 stops it
    with status 75; the requeued run takes over a stale lock, and what it publishes has no adapter left in it."""
    out = tmp_path / "run"
    sft(
        cache_dir,
        tiny_model,
        out,
        "--use_peft",
        "--max_train_step",
        2,
        "--save_steps",
        0,
        "--run_validation",
        "false",
        nproc=1,
    )
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    first = start(
        cache_dir, tiny_model, out, "--overwrite_output_dir", "true", "--num_epochs", 1000, "--save_steps", 0, nproc=1
    )
    try:
        # the LoRA run's metrics.jsonl is still there: wait for the new run's lock (its process group is up by then)
        wait_for(lambda: True if f'"pid": {first.pid},' in lock_record(out) else None, first, "the lock was taken")
        addresses = listening_addresses([first.pid])
        assert all(is_loopback(a) for a in addresses), addresses
        second = sft(cache_dir, tiny_model, out, "--resume", "auto", nproc=1, check=False)
        assert second.returncode != 0 and len(error_lines(second.stderr)) == 1, second.stderr[-3000:]
        assert f"is in use by another run (pid {first.pid} on {socket.gethostname()}" in error_lines(second.stderr)[0]
        assert first.poll() is None
        first.send_signal(signal.SIGUSR1)
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert f"exit status {EXIT_PREEMPTED}" in stdout + stderr
    stopped_at = logged_steps(out)
    # a run that was killed (not stopped) leaves its record behind: the requeued run takes the lock over
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / ".shardtune.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "job": ""}))
    resumed = sft(
        cache_dir,
        tiny_model,
        out,
        "--resume",
        "auto",
        "--num_epochs",
        1000,
        "--save_steps",
        0,
        "--max_train_step",
        stopped_at + 1,
        nproc=1,
    )
    assert f"named pid {dead.pid} on {socket.gethostname()}, which did not end cleanly (no longer running)" in (
        resumed.stdout
    )
    assert not (out / "adapter_config.json").exists() and not (out / "adapter_model.safetensors").exists()
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert (out / ".shardtune.lock").read_text() == ""  # released cleanly
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def test_a_one_node_run_of_two_processes_listens_on_loopback_only_and_ctrl_c_stops_it_like_sigterm(
    tiny_model, cache_dir, tmp_path
):
    """Ctrl-C (SIGINT to the launcher and both workers at once, as a terminal sends it): the same stop as SIGTERM,
    a checkpoint after the step, one line and status 130, no KeyboardInterrupt traceback from any rank."""
    out = tmp_path / "run"
    proc = start(cache_dir, tiny_model, out, "--num_epochs", 1000, "--save_steps", 0, "--standalone", nproc=2)
    try:
        wait_for(lambda: True if logged_steps(out) >= 1 else None, proc, "step 1")
        launcher = listening_addresses([proc.pid])  # the rendezvous store and the store shared with the workers
        assert len(launcher) >= 2 and all(is_loopback(a) for a in launcher), launcher
        workers = listening_addresses(list(worker_pids(proc.pid).values()))  # gloo's own connections
        assert all(is_loopback(a) for a in workers), workers
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "SIGINT received: every rank finishes its optimizer step" in stderr and "Ctrl-C again" in stderr
    stopped = [line for line in stderr.splitlines() if "stopped by SIGINT after step" in line]
    assert len(stopped) == 1 and stopped[0].endswith("exit status 130"), stderr[-3000:]
    step = logged_steps(out)
    assert (out / "checkpoints" / f"step-{step:06d}").is_dir()


def test_a_second_signal_terminates_at_once_without_a_checkpoint(tiny_model, cache_dir, tmp_path):
    """The workers are held (SIGSTOP) while the launcher gets SIGTERM twice, then let go: they must die of the
    SIGTERM torchrun's agent sends them rather than finish their step and write the checkpoint of a stop."""
    out = tmp_path / "run"
    proc = start(cache_dir, tiny_model, out, "--num_epochs", 1000, "--save_steps", 0, nproc=2)
    try:
        wait_for(lambda: True if logged_steps(out) >= 1 else None, proc, "step 1")
        workers = list(worker_pids(proc.pid).values())
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        time.sleep(2)  # the agent sends the (held) workers SIGTERM
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "workers terminated by SIGTERM" in stderr and "stopped by" not in stderr, stderr[-3000:]
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def test_weights_that_are_not_finite_are_not_published(tiny_model, cache_dir, tmp_path):
    """A base model with a NaN in an embedding row the data never reaches (the <unk> token of a byte-level BPE): the
    loss and gradients stay finite, the NaN stays where it is, and must not be published."""
    from safetensors.torch import load_file, save_file

    damaged = shutil.copytree(tiny_model, tmp_path / "damaged")
    weights = load_file(str(damaged / "model.safetensors"))
    weights["model.embed_tokens.weight"][0] = float("nan")  # token 0: <unk>
    save_file(weights, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "run"
    proc = sft(
        cache_dir,
        damaged,
        out,
        "--max_train_step",
        2,
        "--save_steps",
        0,
        "--run_validation",
        "false",
        nproc=1,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    message = error_lines(proc.stderr)
    assert len(message) == 1 and "not all finite, so no model was written" in message[0], proc.stderr[-3000:]
    assert "the loss was finite at every step (1-2)" in message[0]
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
