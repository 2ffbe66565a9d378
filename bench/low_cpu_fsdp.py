"""Peak host memory (RSS) per rank after loading and sharding, with and without --low_cpu_fsdp.

    python -m bench.low_cpu_fsdp                     # the bench-300mb preset (~76M parameters, ~300 MB fp32)
    python -m bench.low_cpu_fsdp --nproc 4 --preset bench-300mb

Reads the "fsdp: peak host memory per rank" line that every FSDP run logs at start, from real runs of the CLI
(one optimizer step each). Never part of the tests.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from bench.common import python, run

PEAK_LINE = re.compile(r"fsdp: peak host memory per rank after loading and sharding: (.*)")


def peak_rss_mib(model: str, nproc: int, low_cpu: bool, out: Path) -> list[int]:
    proc = run(
        [
            python(),
            "-m",
            "shardtune",
            "sft",
            "--nproc_per_node",
            nproc,
            "--model_name",
            model,
            "--output_dir",
            out,
            "--enable_fsdp",
            "--low_cpu_fsdp",
            str(low_cpu).lower(),
            "--max_train_step",
            1,
            "--batch_size_training",
            1,
            "--context_length",
            256,
            "--synthetic_dialogues.num_train",
            64,
            "--run_validation",
            "false",
            "--save_model",
            "false",
            "--num_workers_dataloader",
            0,
        ]
    )
    match = PEAK_LINE.search(proc.stdout)
    assert match, proc.stdout[-2000:]
    return [int(m.replace(",", "")) for m in re.findall(r"rank \d+ ([\d,]+) MiB", match.group(1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench-300mb")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    from shardtune.model.loading import resolve_model_name

    model = resolve_model_name(f"preset:{args.preset}")
    model_mib = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        rows = {low: peak_rss_mib(model, args.nproc, low, Path(tmp) / str(low)) for low in (False, True)}
    print(f"model {args.preset}: {model_mib:,.0f} MiB of weights on disk, {args.nproc} processes, FULL_SHARD")
    print("| loading | " + " | ".join(f"rank {r} peak RSS" for r in range(args.nproc)) + " |")
    print("|---|" + "---|" * args.nproc)
    for low, peaks in rows.items():
        name = "low_cpu_fsdp (rank 0 reads)" if low else "every rank reads"
        print(f"| {name} | " + " | ".join(f"{p:,} MiB" for p in peaks) + " |")


if __name__ == "__main__":
    main()
