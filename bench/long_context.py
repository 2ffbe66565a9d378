"""Peak memory per rank of one forward + backward of a long packed row, split over S Ulysses ranks (CPU, gloo).

A Llama-shaped model with hidden size 512 (so activations, not weights, dominate at long lengths), the lean loss,
one row of documents of 2,048 tokens. Each (S, length) runs in fresh processes; torch's CPU allocations are
invisible to tracemalloc, so the figure is each rank's peak resident set (ru_maxrss) minus its resident set just
before the step, the largest over the ranks. Prints one JSON line per configuration and a table.

    python -m bench.long_context                       # S = 1, 2, 4 x 8k, 16k, 32k tokens
    python -m bench.long_context --sizes 1,2 --lengths 8192
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

DOCUMENT_TOKENS = 2048


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def worker(length: int, out: Path) -> None:
    """One rank: build the model, split the row, one forward + backward; write this rank's memory figure."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardtune.attention import use_varlen_attention
    from shardtune.data.batching import collate_flat
    from shardtune.loss import token_loss_sum
    from shardtune.parallel.dims import ParallelDims
    from shardtune.parallel.sequence import RowSlice, SequenceGroups, split_row, use_sequence_attention

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32_000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=DOCUMENT_TOKENS)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    examples = [{"input_ids": torch.randint(4, 32_000, (DOCUMENT_TOKENS,)).tolist()}
                for _ in range(length // DOCUMENT_TOKENS)]
    for example in examples:
        example["labels"] = example["input_ids"]
    batch = collate_flat(examples)
    if world > 1:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, sp=world)
        use_sequence_attention(model, SequenceGroups.from_mesh(dims.build_mesh("cpu"), dims))
        batch = split_row(batch, RowSlice.of_rank(dims, rank), pad_id=0)
    else:
        use_varlen_attention(model)
    dist.barrier()
    before = rss_bytes()
    token_loss_sum(model, batch, torch.device("cpu")).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (out / f"rank{rank}.json").write_text(json.dumps({"step_peak_bytes": peak - before}))
    dist.destroy_process_group()


def measure(size: int, length: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(size),
                        "-m", "bench.long_context", "--worker", str(length), tmp], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        peaks = [json.loads(p.read_text())["step_peak_bytes"] for p in sorted(Path(tmp).glob("rank*.json"))]
    return {"sp": size, "tokens": length, "tokens_per_rank": length // size, "max_rank_step_peak_mib":
            round(max(peaks) / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--worker", nargs=2, metavar=("LENGTH", "OUT"))
    args = ap.parse_args()
    if args.worker:
        worker(int(args.worker[0]), Path(args.worker[1]))
        return
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for size in (int(x) for x in args.sizes.split(",")):
            rows.append(measure(size, length))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| tokens | S | tokens per rank | peak step memory of the largest rank (MiB) | vs S=1 |")
    print("|---|---|---|---|---|")
    for row in rows:
        base = next(r for r in rows if r["tokens"] == row["tokens"] and r["sp"] == min(
            x["sp"] for x in rows if x["tokens"] == row["tokens"]))
        ratio = row["max_rank_step_peak_mib"] / base["max_rank_step_peak_mib"]
        print(f"| {row['tokens']:,} | {row['sp']} | {row['tokens_per_rank']:,} | {row['max_rank_step_peak_mib']:,} "
              f"| {ratio:.2f} |")


if __name__ == "__main__":
    main()
