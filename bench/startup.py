"""Start-up: how long `shardtune --help`, `shardtune sft --help` and a 1-process run's first step take, before and
after the start-up work of issue 13, measured side by side in one run.

    python -m bench.startup [--repeats 3]        # writes bench/results/startup.md and startup.json

"before" is the earlier code path, still reachable: `sft --help` through the sft module (which imports torch,
transformers and everything it trains with), and the 1-process run through torchrun (a torchrun flag that changes
nothing, --max_restarts 0, keeps it on that path: a new interpreter that imports and checks everything again).
"after" is what a user gets now: help from config/launch alone, a 1-process run in place. The first step is
the moment its row appears in metrics.jsonl. CPU seconds (user + system, of the command and every process it
started, until it exits) are given beside the wall-clock times: on a shared machine they move far less with the
neighbours' load.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench.common import REPO, RESULTS, child_env, median

RUN = ["--model_name", "preset:tiny", "--max_train_step", "1", "--context_length", "128", "--run_validation", "false",
       "--synthetic_dialogues.num_train", "32", "--num_workers_dataloader", "0", "--save_model", "false"]
PY = [sys.executable]
CASES = {
    "shardtune --help": (PY + ["-m", "shardtune", "--help"], None),
    "shardtune sft --help (before: through the sft module)":
        (PY + ["-c", "import sys; from shardtune.commands.sft import main; sys.exit(main(['--help']))"], None),
    "shardtune sft --help (after)": (PY + ["-m", "shardtune", "sft", "--help"], None),
    "1-process run, launch to first step (before: torchrun worker)":
        (PY + ["-m", "shardtune", "sft", *RUN, "--max_restarts", "0"], "run"),
    "1-process run, launch to first step (after: in place)": (PY + ["-m", "shardtune", "sft", *RUN], "run"),
}


def cpu_seconds_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def seconds_to_first_step(argv: list[str], cache: Path) -> float:
    with tempfile.TemporaryDirectory() as out:
        metrics = Path(out) / "metrics.jsonl"
        start = time.perf_counter()
        proc = subprocess.Popen([*argv, "--output_dir", out], cwd=REPO, env=child_env(SHARDTUNE_CACHE=str(cache)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while not (metrics.is_file() and metrics.read_text().strip()):
            if proc.poll() is not None and not metrics.is_file():
                raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            time.sleep(0.01)
        elapsed = time.perf_counter() - start
        proc.communicate()  # to its exit (draining stderr), so its CPU time is counted
        return elapsed


def measured(argv: list[str], kind: str | None, cache: Path) -> tuple[float, float]:
    """(wall seconds: to the first step for a run, to exit otherwise; CPU seconds until exit)."""
    cpu_before, start = cpu_seconds_of_children(), time.perf_counter()
    if kind == "run":
        wall = seconds_to_first_step(argv, cache)
    else:
        subprocess.run(argv, cwd=REPO, env=child_env(), check=True, capture_output=True)
        wall = time.perf_counter() - start
    return wall, cpu_seconds_of_children() - cpu_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="shardtune-startup-"))
    seconds_to_first_step(CASES["1-process run, launch to first step (after: in place)"][0], cache)  # warm caches
    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.repeats):  # interleaved, so a neighbour's load hits every case alike
        for name, (argv, kind) in CASES.items():
            wall, cpu = measured(argv, kind, cache)
            results.setdefault(name, {"wall_s": [], "cpu_s": []})
            results[name]["wall_s"].append(wall)
            results[name]["cpu_s"].append(cpu)
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").is_file() else "?"
    lines = [f"Start-up, measured {datetime.now().isoformat(timespec='seconds')} ({args.repeats} interleaved "
             f"repeats, median; load average at the end {load}; `python -m bench.startup`)", "",
             "| what | wall s (median) | CPU s (median) | wall s, all runs |", "|---|---|---|---|"]
    lines += [f"| {name} | {median(v['wall_s']):.2f} | {median(v['cpu_s']):.2f} | "
              f"{', '.join(f'{x:.2f}' for x in v['wall_s'])} |" for name, v in results.items()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "startup.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "startup.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
