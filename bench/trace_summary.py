"""Summarise a torch.profiler trace that `shardtune sft --use_profiler` wrote: the profiled steps' durations, the
CPU operators, CUDA runtime calls and GPU kernels that took the most time. For a step that is slower than its
compute explains (host-bound launches, synchronisations, per-shape kernel set-up) without opening a trace viewer.

    python -m bench.trace_summary OUTPUT_DIR/profiler/rank0.*.json [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def summarise(trace: dict, top: int) -> str:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep")]
    lines = [f"steps (ms): {[round(e['dur'] / 1000, 1) for e in steps]}"]
    for category in ("cpu_op", "cuda_runtime", "kernel"):
        total: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for e in events:
            if e.get("cat") == category:
                total[e["name"]] += e.get("dur", 0)
                count[e["name"]] += 1
        if not total:
            continue
        lines.append(f"{category}: {sum(count.values())} events, {sum(total.values()) / 1000:.1f} ms in all")
        for name, dur in total.most_common(top):
            lines.append(f"  {dur / 1000:9.1f} ms  {count[name]:6d}x  {name[:110]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    for path in args.traces:
        print(f"== {path}\n{summarise(json.loads(path.read_text()), args.top)}")


if __name__ == "__main__":
    main()
