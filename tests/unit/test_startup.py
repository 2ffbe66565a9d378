"""The start-up phase timer (shardtune/runtime/startup.py): phases in order, measured from the command's start, which
launched workers inherit. No timed asserts: only order and consistency."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from shardtune.runtime import startup


def test_this_process_started_before_now_and_a_child_inherits_the_command_start(monkeypatch):
    began = startup.process_start_time()
    assert began <= time.time()
    monkeypatch.delenv(startup.COMMAND_START_ENV, raising=False)
    start = startup.command_start()
    assert os.environ[startup.COMMAND_START_ENV] == repr(start)
    child = subprocess.run(
        [sys.executable, "-c", "from shardtune.runtime import startup; print(startup.command_start())"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ},
    )
    assert float(child.stdout) == start


def test_the_report_lists_the_phases_in_order(monkeypatch):
    monkeypatch.setattr(startup, "_marks", [])
    startup.mark("imports")
    startup.mark("data")
    line = startup.phase_report()
    assert line.startswith("start-up: first step at ") and line.index("imports") < line.index("data")


def test_publishing_a_model_does_not_import_deepspeed(tmp_path):
    """transformers' save_pretrained unwraps through accelerate, which imports DeepSpeed (~0.7 s and a warning on
    CPU) when it is installed; a run that does not use DeepSpeed publishes its model without it."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed, so nothing could import it")
    script = f"""
import sys
from pathlib import Path
from shardtune.model.loading import init_model, load_model, load_tokenizer
from shardtune.publishing.saving import save_hf_model
path = init_model("tiny", Path({str(tmp_path / "tiny")!r}))
model = load_model(str(path))
written = save_hf_model(model, dict(model.state_dict()), load_tokenizer(str(path)), Path({str(tmp_path / "out")!r}))
print("model.safetensors" in written, "deepspeed" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False"], proc.stdout + proc.stderr[-2000:]


def test_a_command_ends_without_the_interpreters_teardown_but_keeps_its_output_handlers_and_threads(tmp_path):
    """The command's last act (shardtune.cli.exit_without_teardown): the exit handlers run, buffered output is
    written, threads that are not daemons finish, the status is kept; the module teardown (and the collection of
    everything imported) does not happen. sys.exit in its place fails the first assert."""
    marker = tmp_path / "thread-finished"
    program = f"""
import atexit, sys, threading, time
from shardtune.cli import exit_without_teardown

class TornDown:
    def __del__(self):
        sys.stderr.write("torn down\\n")

kept = TornDown()
atexit.register(lambda: print("exit handler ran"))
threading.Thread(target=lambda: (time.sleep(0.3), open({str(marker)!r}, "w").close())).start()
print("buffered", end=" ")
exit_without_teardown(3)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False)
    assert "torn down" not in done.stderr, "the interpreter's teardown ran"
    assert done.returncode == 3 and done.stdout == "buffered exit handler ran\n" and marker.is_file(), done
    control = subprocess.run(
        [sys.executable, "-c", program.replace("exit_without_teardown(3)", "sys.exit(3)")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "torn down" in control.stderr and control.returncode == 3  # the check above can see a teardown
