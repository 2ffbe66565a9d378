"""Shared by the benchmarks: environment of child processes, timing statistics, machine description."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
NUM_THREADS = max(1, os.cpu_count() or 1)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": str(NUM_THREADS),
            **extra,
        }
    )
    return env


def run(argv: list[str], timeout: float = 1800, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, cwd=REPO, env=child_env(**env), timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def run_json(argv: list[str], timeout: float = 1800, **env: str) -> dict:
    """Run a child that prints one JSON object as its last stdout line."""
    return json.loads(run(argv, timeout, **env).stdout.strip().splitlines()[-1])


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> float:
    """(max - min) / median: how noisy repeated measurements were."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def machine_info() -> dict:
    import tokenizers
    import torch
    import transformers

    cpu = ""
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor()
    mem_kib = 0
    try:
        mem_kib = int(
            next(
                line.split()[1]
                for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")
            )
        )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "load_average_at_start": os.getloadavg(),
    }


def python() -> str:
    return sys.executable


def free_port() -> int:
    """A port nobody listens on now (a fixed one can still be held by the previous launch's store)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The TRL side's step clock, pasted into a TRL script (``LOGGED`` replaced by the key whose log rows it keeps): the
# time of every step end (``ends``, the first at train begin), of every step from on_step_begin (``inside``), and the
# logged rows with that key (``LOGS``).
TRL_STEP_TIMES = r"""
begin, ends, inside, LOGS = [0.0], [], [], []

class StepTimes(TrainerCallback):
    def on_train_begin(self, args, state, control, **kw):
        ends.append(time.perf_counter())
    def on_step_begin(self, args, state, control, **kw):
        begin[0] = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        now = time.perf_counter()
        inside.append(now - begin[0])
        ends.append(now)
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "LOGGED" in logs:
            LOGS.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})
"""


def trl_step_times(logged: str) -> str:
    """:data:`TRL_STEP_TIMES` keeping the log rows that carry ``logged``."""
    return TRL_STEP_TIMES.replace("LOGGED", logged)
