"""Start-up: how long `shardtune --help`, `shardtune sft --help` and a 1-process run's first step take, before and
after the start-up work of issue 13, measured side by side in one run.

    python -m bench.startup [--repeats 3]        # writes bench/results/startup.md and startup.json

"before" is the earlier code path, still reachable: `sft --help` through the sft module (which imports torch,
transformers and everything it trains with), and the 1-process run through torchrun (a torchrun flag that changes
nothing, --max_restarts 0, keeps it on that path: a new interpreter that imports and checks everything again).
"after" is what a user gets now: help from config/launch alone, a 1-process run in place. The first step is
the moment its row appears in metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
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
        (PY + ["-c", "import sys; from shardtune.sft import main; sys.exit(main(['--help']))"], None),
    "shardtune sft --help (after)": (PY + ["-m", "shardtune", "sft", "--help"], None),
    "1-process run, launch to first step (before: torchrun worker)":
        (PY + ["-m", "shardtune", "sft", *RUN, "--max_restarts", "0"], "run"),
    "1-process run, launch to first step (after: in place)": (PY + ["-m", "shardtune", "sft", *RUN], "run"),
}


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
        proc.wait()
        return elapsed


def seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=REPO, env=child_env(), check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="shardtune-startup-"))
    seconds_to_first_step(CASES["1-process run, launch to first step (after: in place)"][0], cache)  # warm caches
    results = {}
    for _ in range(args.repeats):  # interleaved, so a neighbour's load hits every case alike
        for name, (argv, kind) in CASES.items():
            value = seconds_to_first_step(argv, cache) if kind == "run" else seconds(argv)
            results.setdefault(name, []).append(value)
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").is_file() else "?"
    lines = [f"Start-up, measured {datetime.now().isoformat(timespec='seconds')} ({args.repeats} interleaved "
             f"repeats, median; load average at the end {load}; `python -m bench.startup`)", "",
             "| what | seconds (median) | all runs |", "|---|---|---|"]
    lines += [f"| {name} | {median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |" for name, v in results.items()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "startup.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "startup.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
