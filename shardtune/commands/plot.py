"""``shardtune plot``: PNG charts of runs' metrics, several runs overlaid in each picture.

    shardtune plot runs/ddp runs/fsdp --out_dir plots/      # one line per run, labelled by its directory name

The charts are drawn by shardtune.training.engine.plots (every run also writes its own into output_dir/plots).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardtune.training.engine.plots import read_run, run_names, write_plots


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardtune plot", description=__doc__.splitlines()[0])
    p.add_argument(
        "runs",
        nargs="+",
        help="run output directories (metrics.jsonl), metrics.jsonl files, or llama-cookbook metrics_data_*.json files",
    )
    p.add_argument("--out_dir", default="", help="where the PNGs go; default: RUN_DIR/plots of the first run")
    p.add_argument("--smoothing", type=float, default=0.6, help="exponential smoothing weight of the loss, in [0, 1)")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    paths = [Path(r) for r in args.runs]
    try:
        if not 0 <= args.smoothing < 1:
            raise ValueError(f"--smoothing {args.smoothing} must be in [0, 1): e.g. 0.6")
        runs = [read_run(path, name) for path, name in zip(paths, run_names(paths))]
    except (ValueError, json.JSONDecodeError) as e:
        print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    first = paths[0] if paths[0].is_dir() else paths[0].parent
    out_dir = Path(args.out_dir) if args.out_dir else first / "plots"
    for path in write_plots(runs, out_dir, args.smoothing):
        print(f"wrote {path}")
    return 0
