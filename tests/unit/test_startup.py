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
    child = subprocess.run([sys.executable, "-c", "from shardtune.runtime import startup; print(startup.command_start())"],
                           capture_output=True, text=True, check=True, env={**os.environ})
    assert float(child.stdout) == start


def test_the_report_lists_the_phases_in_order(monkeypatch):
    monkeypatch.setattr(startup, "_marks", [])
    startup.mark("imports")
    startup.mark("data")
    line = startup.phase_report()
    assert line.startswith("start-up: first step at ") and line.index("imports") < line.index("data")
