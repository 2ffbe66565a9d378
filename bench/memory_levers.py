"""Long sequences on CPU: peak memory of one forward + backward against sequence length, for each memory lever and
for ring attention over C = 1, 2, 4 processes. Writes bench/results/memory_levers.md (and .json).

    python -m bench.memory_levers                                # the default grid, ~30 min on 2 busy cores
    python -m bench.memory_levers --lever_lengths 8192,16384 --ring_lengths 8192 --ring_sizes 1,2

Levers: a one-decoder-layer Llama (hidden 512, 8 heads on 4 KV heads, intermediate 1792, vocabulary 1024, lean
loss), so that the layer's activations dominate; modes: plain, --tiled_mlp, activation checkpointing of the layer,
both. (--activation_offloading moves saved activations from GPU to CPU memory: on CPU it changes nothing, so it
has no row here.) Ring: ``shardtune.parallel.ring.ring_attention`` alone on the same attention shape, one
document over the whole row, each of C gloo processes holding 1/C of it; the figure is the largest rank's.

Every measurement runs in a fresh process: torch's CPU allocations are invisible to tracemalloc, so the figure is
the process's peak resident set (ru_maxrss) minus its resident set just before the step, as in bench.loss_memory
(with glibc's mmap threshold fixed, see MALLOC_ENV).
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import time

import torch

from bench.common import RESULTS, free_port, machine_info, python, run_json

HIDDEN, NUM_HEADS, NUM_KV_HEADS, INTERMEDIATE, VOCAB = 512, 8, 4, 1792, 1024
# glibc's allocator raises its mmap threshold after large frees and then keeps freed buffers in its heap: the
# resident set would count memory torch has already released (more so with gloo's threads). A fixed threshold
# returns every large buffer to the system when it is freed, so the peak resident set follows live memory.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
LEVER_MODES = {
    "plain": (),
    "tiled_mlp": ("tiled_mlp",),
    "checkpoint": ("checkpoint",),
    "checkpoint + tiled_mlp": ("checkpoint", "tiled_mlp"),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def layer_step(seq_len: int, levers: tuple[str, ...]) -> dict:
    """One forward + backward of a one-decoder-layer model on a row of ``seq_len`` tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardtune.config.flags import config_from
    from shardtune.model.longseq import apply_memory_levers
    from shardtune.model.loss import token_loss_sum
    from shardtune.model.structure import decoder_layers
    from shardtune.parallel.fsdp import apply_activation_checkpointing

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    apply_memory_levers(model, config_from(tiled_mlp="tiled_mlp" in levers), torch.device("cpu"))
    if "checkpoint" in levers:
        apply_activation_checkpointing(model, decoder_layers(model))
    input_ids = torch.randint(0, VOCAB, (1, seq_len))
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}
    for p in model.parameters():  # gradients allocated before the baseline: only the step's activations count
        p.grad = torch.zeros_like(p)
    baseline = rss_bytes()
    tick = time.perf_counter()
    loss = token_loss_sum(model, batch, torch.device("cpu")) / seq_len
    loss.backward()
    return {
        "loss": float(loss.detach()),
        "step_s": time.perf_counter() - tick,
        "step_peak_bytes": peak_rss_bytes() - baseline,
    }


def ring_step(seq_len: int) -> tuple[int, dict]:
    """(rank, the largest per-rank figures) of ring attention forward + backward on one document of ``seq_len``
    tokens."""
    import torch.distributed as dist

    from shardtune.parallel.ring import load_balanced_chunk_ids, ring_attention

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    local_len, head_dim = seq_len // size, HIDDEN // NUM_HEADS
    gen = torch.Generator().manual_seed(rank)
    query = torch.randn(1, NUM_HEADS, local_len, head_dim, generator=gen, requires_grad=True)
    key, value = (
        torch.randn(1, NUM_KV_HEADS, local_len, head_dim, generator=gen, requires_grad=True) for _ in range(2)
    )
    grad_out = torch.randn(1, local_len, NUM_HEADS, head_dim, generator=gen)
    dist.barrier()
    baseline = rss_bytes()
    tick = time.perf_counter()
    out = ring_attention(
        query,
        key,
        value,
        group=None,
        cu_seq_lens=torch.tensor([0, seq_len], dtype=torch.int32),
        chunk_ids=load_balanced_chunk_ids(rank, size),
        chunk_len=local_len // 2,
    )
    out.backward(grad_out)
    result = {"rank": rank, "step_s": time.perf_counter() - tick, "step_peak_bytes": peak_rss_bytes() - baseline}
    gathered = [None] * size
    dist.all_gather_object(gathered, result)
    dist.destroy_process_group()
    return rank, {
        "max_step_peak_bytes": max(r["step_peak_bytes"] for r in gathered),
        "step_s": max(r["step_s"] for r in gathered),
        "ranks": gathered,
    }


def measure_levers(lengths: list[int]) -> list[dict]:
    rows = []
    for seq_len in lengths:
        for mode, levers in LEVER_MODES.items():
            result = run_json(
                [
                    python(),
                    "-m",
                    "bench.memory_levers",
                    "--worker",
                    "layer",
                    "--seq_len",
                    seq_len,
                    "--levers",
                    ",".join(levers),
                ],
                **MALLOC_ENV,
            )
            rows.append({"seq_len": seq_len, "mode": mode, **result})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def measure_ring(lengths: list[int], sizes: list[int]) -> list[dict]:
    rows = []
    for seq_len in lengths:
        for size in sizes:
            result = run_json(
                [
                    python(),
                    "-m",
                    "torch.distributed.run",
                    "--nproc_per_node",
                    size,
                    "--master_port",
                    free_port(),
                    "-m",
                    "bench.memory_levers",
                    "--worker",
                    "ring",
                    "--seq_len",
                    seq_len,
                ],
                OMP_NUM_THREADS="1",
                **MALLOC_ENV,
            )
            rows.append({"seq_len": seq_len, "cp_size": size, **result})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "ranks"}), flush=True)
    return rows


def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f}"


def markdown(lever_rows: list[dict], ring_rows: list[dict], machine: dict) -> str:
    lines = [
        f"# Long sequences on CPU ({datetime.date.today()})",
        "",
        f"{machine['cpu']}, {machine['cpu_count']} cores, torch {machine['torch']}. Peak resident memory of "
        "one forward + backward above the process's memory just before it (MiB), each in a fresh process. "
        "Step times are in the JSON file only: this machine is shared, they do not compare.",
        "",
    ]
    if lever_rows:
        modes = list(LEVER_MODES)
        lines += [
            f"## Memory levers: one decoder layer (hidden {HIDDEN}, intermediate {INTERMEDIATE}, "
            f"{NUM_HEADS} heads / {NUM_KV_HEADS} KV heads), lean loss",
            "",
            "| tokens | " + " | ".join(modes) + " |",
            "|---:|" + "---:|" * len(modes),
        ]
        for seq_len in sorted({r["seq_len"] for r in lever_rows}):
            by_mode = {r["mode"]: r for r in lever_rows if r["seq_len"] == seq_len}
            lines.append(f"| {seq_len:,} | " + " | ".join(mib(by_mode[m]["step_peak_bytes"]) for m in modes) + " |")
        lines.append("")
    if ring_rows:
        sizes = sorted({r["cp_size"] for r in ring_rows})
        lines += [
            f"## Ring attention alone ({NUM_HEADS} heads / {NUM_KV_HEADS} KV heads x {HIDDEN // NUM_HEADS}, "
            "one causal document): largest per-rank peak (MiB)",
            "",
            "| tokens | " + " | ".join(f"C={c}" for c in sizes) + " |",
            "|---:|" + "---:|" * len(sizes),
        ]
        for seq_len in sorted({r["seq_len"] for r in ring_rows}):
            by_size = {r["cp_size"]: r for r in ring_rows if r["seq_len"] == seq_len}
            lines.append(f"| {seq_len:,} | " + " | ".join(mib(by_size[c]["max_step_peak_bytes"]) for c in sizes) + " |")
        lines.append("")
    return "\n".join(lines)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=("layer", "ring"))
    ap.add_argument("--seq_len", type=int)
    ap.add_argument("--levers", default="")
    ap.add_argument("--lever_lengths", default="4096,8192,16384")
    ap.add_argument("--ring_lengths", default="4096,8192,16384")
    ap.add_argument("--ring_sizes", default="1,2,4")
    ap.add_argument(
        "--sections",
        default="levers,ring",
        help="levers, ring or both; a section not measured keeps its rows from the previous results file",
    )
    args = ap.parse_args()
    if args.worker == "layer":
        print(json.dumps(layer_step(args.seq_len, tuple(x for x in args.levers.split(",") if x))))
        return
    if args.worker == "ring":
        rank, result = ring_step(args.seq_len)
        if rank == 0:
            print(json.dumps(result))
        return
    measured = {}
    if "levers" in args.sections:
        measured["levers"] = measure_levers(ints(args.lever_lengths))
    if "ring" in args.sections:
        measured["ring"] = measure_ring(ints(args.ring_lengths), ints(args.ring_sizes))
    path = RESULTS / "memory_levers.json"  # read only now: another run may have written the other section
    results = {
        "levers": [],
        "ring": [],
        **(json.loads(path.read_text()) if path.exists() else {}),
        **measured,
        "machine": machine_info(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results["levers"], results["ring"], results["machine"])
    (RESULTS / "memory_levers.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
