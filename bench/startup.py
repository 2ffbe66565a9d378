"""Start-up: how long `shardtune --help`, `shardtune sft --help` and a 1-process run's first step take, before and
after the start-up work of issue 13, measured side by side in one run.

    python -m bench.startup [--repeats 3]        # writes bench/results/startup.md and startup.json
    python -m bench.startup --demo --before /work/main   # the demo model, cached data: this tree vs another

``--demo`` times the demo model's first step (cached data, one process, in place) from the command's start, in
this checkout and, with ``--before DIR``, in another checkout side by side (interleaved), and records this
checkout's per-phase start-up line (``--debug``: shardtune/runtime/startup.py) and the heaviest imports of the worker
(``python -X importtime``); written to bench/results/startup_demo.md and startup_demo.json.

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

RUN = [
    "--model_name",
    "preset:tiny",
    "--max_train_step",
    "1",
    "--context_length",
    "128",
    "--run_validation",
    "false",
    "--synthetic_dialogues.num_train",
    "32",
    "--num_workers_dataloader",
    "0",
    "--save_model",
    "false",
]
PY = [sys.executable]
CASES = {
    "shardtune --help": (PY + ["-m", "shardtune", "--help"], None),
    "shardtune sft --help (before: through the sft module)": (
        PY + ["-c", "import sys; from shardtune.commands.sft import main; sys.exit(main(['--help']))"],
        None,
    ),
    "shardtune sft --help (after)": (PY + ["-m", "shardtune", "sft", "--help"], None),
    "1-process run, launch to first step (before: torchrun worker)": (
        PY + ["-m", "shardtune", "sft", *RUN, "--max_restarts", "0"],
        "run",
    ),
    "1-process run, launch to first step (after: in place)": (PY + ["-m", "shardtune", "sft", *RUN], "run"),
}


def cpu_seconds_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def seconds_to_first_step(argv: list[str], cache: Path) -> float:
    with tempfile.TemporaryDirectory() as out:
        metrics = Path(out) / "metrics.jsonl"
        start = time.perf_counter()
        proc = subprocess.Popen(
            [*argv, "--output_dir", out],
            cwd=REPO,
            env=child_env(SHARDTUNE_CACHE=str(cache)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
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


DEMO_RUN = [
    "--model_name",
    "preset:demo",
    "--max_train_step",
    "1",
    "--run_validation",
    "false",
    "--synthetic_dialogues.num_train",
    "200",
    "--num_workers_dataloader",
    "0",
    "--save_model",
    "false",
]


def demo_first_step(repo: Path, cache: Path) -> tuple[float, str]:
    """(seconds from launch to the first metrics row, the --debug start-up line if the checkout prints one)."""
    with tempfile.TemporaryDirectory() as out:
        metrics = Path(out) / "metrics.jsonl"
        log = Path(out) / "log.txt"
        start = time.perf_counter()
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                PY + ["-m", "shardtune", "sft", *DEMO_RUN, "--debug", "--output_dir", out],
                cwd=repo,
                env=child_env(SHARDTUNE_CACHE=str(cache), PYTHONPATH=str(repo)),
                stdout=fh,
                stderr=subprocess.STDOUT,
                text=True,
            )
            while not (metrics.is_file() and metrics.read_text().strip()):
                if proc.poll() is not None:
                    raise RuntimeError(f"demo run in {repo} exited {proc.returncode}: {log.read_text()[-2000:]}")
                time.sleep(0.01)
            elapsed = time.perf_counter() - start
            proc.wait()
        phases = next(
            (
                line[line.index("start-up:") :]
                for line in log.read_text().splitlines()
                if "start-up: first step" in line
            ),
            "",
        )
        return elapsed, phases


def heaviest_imports(cache: Path, top: int = 12) -> list[tuple[str, float]]:
    """Cumulative import seconds of the worker's top-level modules and their heaviest children."""
    proc = subprocess.run(
        PY + ["-X", "importtime", "-c", "import shardtune.sft"],
        cwd=REPO,
        env=child_env(SHARDTUNE_CACHE=str(cache)),
        capture_output=True,
        text=True,
        check=True,
    )
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
            name = parts[2].rstrip()
            depth = (len(name) - len(name.lstrip())) // 2
            if depth <= 2:
                rows.append((name.strip(), int(parts[1]) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:top]


def demo_main(args) -> None:
    cache = Path(tempfile.mkdtemp(prefix="shardtune-startup-demo-"))
    repos = {"this checkout": REPO, **({"before": Path(args.before)} if args.before else {})}
    for repo in repos.values():
        demo_first_step(repo, cache)  # builds the preset and the data cache: later runs find them cached
    walls: dict[str, list[float]] = {name: [] for name in repos}
    phase_lines = []
    for _ in range(args.repeats):
        for name, repo in repos.items():
            wall, phases = demo_first_step(repo, cache)
            walls[name].append(wall)
            if name == "this checkout":
                phase_lines.append(phases)
    imports = heaviest_imports(cache)
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").is_file() else "?"
    lines = [
        f"Start-up of the demo model (cached data, one process), measured "
        f"{datetime.now().isoformat(timespec='seconds')} ({args.repeats} interleaved repeats; load average at "
        f"the end {load}; `python -m bench.startup --demo`)",
        "",
        "| checkout | launch to first step, s (median) | all runs |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} ({repos[name]}) | {median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |"
        for name, v in walls.items()
    ]
    lines += ["", "Per phase (this checkout, `--debug`):", ""] + [f"    {line}" for line in phase_lines]
    lines += [
        "",
        "Heaviest imports of the worker (`python -X importtime -c 'import shardtune.sft'`, cumulative):",
        "",
        "| module | s |",
        "|---|---|",
    ] + [f"| {name} | {s:.2f} |" for name, s in imports]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "startup_demo.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "startup_demo.json").write_text(
        json.dumps({"wall_s": walls, "phases": phase_lines, "imports": imports}, indent=2) + "\n"
    )
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--demo", action="store_true", help="the demo model's first step, by phase")
    parser.add_argument("--before", default="", help="with --demo: another checkout to time side by side")
    args = parser.parse_args()
    if args.demo:
        demo_main(args)
        return
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
    lines = [
        f"Start-up, measured {datetime.now().isoformat(timespec='seconds')} ({args.repeats} interleaved "
        f"repeats, median; load average at the end {load}; `python -m bench.startup`)",
        "",
        "| what | wall s (median) | CPU s (median) | wall s, all runs |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {median(v['wall_s']):.2f} | {median(v['cpu_s']):.2f} | "
        f"{', '.join(f'{x:.2f}' for x in v['wall_s'])} |"
        for name, v in results.items()
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "startup.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "startup.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
