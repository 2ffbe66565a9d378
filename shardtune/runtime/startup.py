"""Where the time before the first training step goes: seconds since the command started, by phase.

The command's start is this process's own start (``/proc/self/stat``), or the start of the ``shardtune`` command
that launched it (torchrun workers inherit ``SHARDTUNE_COMMAND_START``). Rank 0 prints the phases at ``--debug``
when the first step begins, and the first step's metrics row carries ``startup_s``. Imports nothing heavy.
"""

from __future__ import annotations

import os
import time

COMMAND_START_ENV = "SHARDTUNE_COMMAND_START"
_marks: list[tuple[str, float]] = []


def process_start_time() -> float:
    """Wall-clock time this process started (Linux: /proc; elsewhere: now, which leaves the interpreter out)."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def command_start() -> float:
    """Wall-clock start of the command; set once in the environment, so that launched workers inherit it."""
    if COMMAND_START_ENV not in os.environ:
        os.environ[COMMAND_START_ENV] = repr(process_start_time())
    return float(os.environ[COMMAND_START_ENV])


def mark(phase: str) -> None:
    """``phase`` has ended now."""
    _marks.append((phase, time.time()))


def seconds_since_command() -> float:
    return time.time() - command_start()


def phase_report() -> str:
    """One line: each phase's seconds, in order, and the total since the command started."""
    start = previous = command_start()
    parts = []
    for phase, at in _marks:
        parts.append(f"{phase} {max(at - previous, 0.0):.2f}")
        previous = at
    return f"start-up: first step at {time.time() - start:.2f} s since the command (" + ", ".join(parts) + " s)"
