"""The longest sequence per rank memory budget: Ulysses S and ring C = 1, 2, 4 on CPU (gloo), each lever on / off.

Every configuration is one launch of N real gloo processes (``torch.distributed.run``) that run shardtune's own
training step: a random-initialised Llama (hidden 512, 8 heads / 4 KV heads, so activations dominate), FSDP2
over all ranks with activation checkpointing of every decoder layer, the lean loss, AdamW, the rows split by
``split_row`` (what the data loader does) and attention through ``use_sequence_attention`` (Ulysses all-to-all
or ring attention), exactly as ``shardtune sft`` builds them; ``train_step`` is the loop's own function. A row
packs documents of DOCUMENT_TOKENS tokens (attention within documents, so compute grows linearly with the row).

Peak memory of a step, per rank: the process's peak resident set during the step above its resident set just
before it. The peak is reset before each step (``/proc/self/clear_refs`` 5, Linux), so one launch measures many
lengths; a warm-up step first allocates what every step reuses (AdamW state, FSDP and gloo buffers). What stays
out is fixed process overhead (interpreter, libraries, the sharded model and optimizer state); what counts is
everything a step allocates: the row and its slice, activations, gathered parameters, gradients, the loss's
logits chunks, communication buffers. torch's CPU allocations are invisible to tracemalloc, hence the resident
set; glibc's mmap threshold is fixed (MALLOC_ENV) so freed buffers go back to the system and the resident set
follows live memory. The figure of a configuration is its largest rank's.

Per configuration: the rows of --grid (the table of memory against length), then a search for the longest row
whose step stays within --budget_mib per rank: regula falsi on the measured peaks, to GRANULE_PER_RANK tokens per
rank. Writes bench/results/long_context.md and .json.

    python -m bench.long_context                                  # all of it, ~55 min per lever on 2 busy cores
    python -m bench.long_context --configs sp1,sp4 --levers plain --budget_mib 256 --grid 4096
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import resource
import time

from bench.common import RESULTS, free_port, machine_info, python, run_json

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 512, 2, 8, 4, 1792, 8192
DOCUMENT_TOKENS = 2048
GRANULE_PER_RANK = 256  # the search's resolution: tokens per rank
GRID_MAX_PER_RANK = 8192  # grid rows beyond this many tokens per rank are left to the search
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # as bench.memory_levers: freed buffers leave the resident set
CONFIGS = {"sp1": (1, 1), "sp2": (2, 1), "sp4": (4, 1), "cp2": (1, 2), "cp4": (1, 4)}  # name: (S, C)
LEVERS = {"plain": (), "tiled_mlp": ("tiled_mlp",)}


# -- one rank ---------------------------------------------------------------------------------------------------------


def resident_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def reset_peak() -> None:
    """Set the process's peak resident set (VmHWM) to its current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def peak_resident_bytes() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def worker(
    sp: int, cp: int, levers: tuple[str, ...], budget: int, start_per_rank: int, max_tokens: int, grid: list[int]
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardtune.config.flags import config_from
    from shardtune.data.batching import collate_flat
    from shardtune.model.longseq import apply_memory_levers
    from shardtune.model.loss import hf_model
    from shardtune.model.speed import apply_speed_features
    from shardtune.parallel import make_strategy
    from shardtune.parallel.sequence import RowSlice, SequenceGroups, split_row, use_sequence_attention
    from shardtune.runtime.distributed import all_reduce_sum, init_distributed, shutdown
    from shardtune.training.engine.step import train_step
    from shardtune.training.objectives.sft.objective import SFT

    env = init_distributed()
    cfg = config_from(
        enable_fsdp=True,
        sequence_parallel_size=sp,
        context_parallel_size=cp,
        lr=1e-5,
        tiled_mlp="tiled_mlp" in levers,
        activation_offloading="offload" in levers,
    )
    cfg.parallel.activation_checkpointing = True
    strategy = make_strategy(cfg, env)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=DOCUMENT_TOKENS,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    apply_memory_levers(model, cfg, env.device)  # the order of shardtune.training.engine.worker.fine_tune
    apply_speed_features(model, cfg, env.device)
    if strategy.dims.sequence_split:
        use_sequence_attention(hf_model(model), SequenceGroups.from_mesh(strategy.mesh, strategy.dims))
    model = strategy.wrap(model)
    optimizer = strategy.build_optimizer(model)
    row_slice = RowSlice.of_rank(strategy.dims, env.rank)
    ranks = sp * cp
    granule = GRANULE_PER_RANK * ranks  # a multiple of 2 x S x C: the split pads nothing

    def micro_batch(tokens: int) -> dict:
        gen = torch.Generator().manual_seed(tokens)
        ids = torch.randint(4, VOCAB, (tokens,), generator=gen).tolist()
        docs = [ids[i : i + DOCUMENT_TOKENS] for i in range(0, tokens, DOCUMENT_TOKENS)]
        batch = collate_flat([{"input_ids": d, "labels": d} for d in docs])
        return batch if row_slice is None else split_row(batch, row_slice, pad_id=0)

    def gathered(value: float) -> list[float]:
        per_rank = torch.zeros(env.world_size, dtype=torch.float64)
        per_rank[env.rank] = value
        return all_reduce_sum(per_rank, env.device).tolist()

    def step(tokens: int) -> dict:
        gc.collect()
        before = resident_bytes()
        reset_peak()
        tick = time.perf_counter()
        stats = train_step(model, strategy, optimizer, SFT(cfg, env, strategy, None), [micro_batch(tokens)])
        seconds = time.perf_counter() - tick
        peaks = gathered(peak_resident_bytes() - before)
        row = {
            "tokens": tokens,
            "tokens_per_rank": tokens // ranks,
            "peak_bytes": int(max(peaks)),
            "rank_peak_bytes": [int(x) for x in peaks],
            "rank_before_bytes": [int(x) for x in gathered(before)],
            "loss": stats.loss,
            "step_s": max(gathered(seconds)),
            "fits": max(peaks) <= budget,
        }
        if env.rank == 0:
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("rank_")}), flush=True)
        return row

    step(granule)  # warm-up: AdamW state, FSDP and gloo buffers
    rows = [step(tokens) for tokens in grid if tokens // ranks <= GRID_MAX_PER_RANK]
    longest, first_over = search(step, rows, budget, granule, start_per_rank * ranks, max_tokens)
    if env.rank == 0:
        print(
            json.dumps(
                {
                    "rows": sorted(rows, key=lambda r: r["tokens"]),
                    "longest_fit": longest,
                    "first_over": first_over,
                    "granule": granule,
                }
            )
        )
    shutdown()


def search(
    step, rows: list[dict], budget: int, granule: int, first: int, max_tokens: int, max_trials: int = 6
) -> tuple[int, int | None]:
    """(longest row that fits, shortest that does not) to ``granule`` tokens, by regula falsi on the measured
    peaks (``rows``, extended in place): the next row is where the straight line through the two nearest
    measurements, on both sides of the budget when there are such, meets the budget."""

    def bracket():
        fit = [r for r in rows if r["fits"]]
        over = [r for r in rows if not r["fits"]]
        return (
            max(fit, key=lambda r: r["tokens"]) if fit else None,
            min(over, key=lambda r: r["tokens"]) if over else None,
        )

    if not rows:
        rows.append(step(max(granule, first // granule * granule)))
    for _ in range(max_trials):
        low, high = bracket()
        if low and high and high["tokens"] - low["tokens"] <= granule:
            break
        if low and high:
            a, b = low, high
        else:  # extrapolate from the two measurements nearest the budget on the side we have
            side = sorted(rows, key=lambda r: r["tokens"])
            a, b = (
                (side[-2], side[-1])
                if low and len(side) > 1
                else (side[0], side[1])
                if len(side) > 1
                else (None, side[0])
            )
        if a is None:  # one measurement: proportional
            guess = b["tokens"] * budget / max(b["peak_bytes"], 1)
        else:
            slope = (b["peak_bytes"] - a["peak_bytes"]) / max(b["tokens"] - a["tokens"], 1)
            guess = a["tokens"] + (budget - a["peak_bytes"]) / slope if slope > 0 else 2 * b["tokens"]
        tokens = int(guess // granule * granule)
        lo_t = low["tokens"] + granule if low else granule
        hi_t = high["tokens"] - granule if high else max_tokens
        tokens = min(max(tokens, lo_t), hi_t)
        if tokens > max_tokens or tokens < granule or any(r["tokens"] == tokens for r in rows):
            break
        rows.append(step(tokens))
    low, high = bracket()
    return (low["tokens"] if low else 0), (high["tokens"] if high else None)


# -- the driver -------------------------------------------------------------------------------------------------------


def measure(name: str, lever: str, args) -> dict:
    sp, cp = CONFIGS[name]
    result = run_json(
        [
            python(),
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            sp * cp,
            "--master_port",
            free_port(),
            "-m",
            "bench.long_context",
            "--worker",
            name,
            "--levers",
            lever,
            "--budget_mib",
            args.budget_mib,
            "--start_per_rank",
            args.start_per_rank,
            "--max_tokens",
            args.max_tokens,
            "--grid",
            args.grid,
        ],
        timeout=args.timeout,
        OMP_NUM_THREADS="1",
        **MALLOC_ENV,
    )
    return {"config": name, "sp": sp, "cp": cp, "ranks": sp * cp, "lever": lever, **result}


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f}"


def markdown(results: dict) -> str:
    runs, budget = results["runs"], results["budget_mib"]
    machine = results["machine"]
    lines = [
        f"# The longest sequence per rank memory budget, CPU ({results['date']})",
        "",
        f"{machine['cpu']}, {machine['cpu_count']} cores, torch {machine['torch']}; shared with other jobs. "
        f"Llama-shaped model: hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads / {KV_HEADS} KV heads, "
        f"intermediate {INTERMEDIATE}, vocabulary {VOCAB:,}; fp32; FSDP2 over all ranks, activation "
        f"checkpointing, lean loss, AdamW; rows of {DOCUMENT_TOKENS:,}-token documents. Peak resident memory "
        "of one training step above the resident memory just before it, largest rank (MiB); fixed process "
        "memory (libraries, model and optimizer shards) is not in it.",
        "",
        f"## Longest row whose step fits in {budget:,} MiB per rank",
        "",
        "| lever | " + " | ".join(CONFIG_TITLES.values()) + " | 4 ranks vs 1 |",
        "|---|" + "---:|" * (len(CONFIG_TITLES) + 1),
    ]
    for lever in LEVERS:
        by = {r["config"]: r for r in runs if r["lever"] == lever}
        if not by:
            continue
        cells = [f"{by[c]['longest_fit']:,}" if c in by else "" for c in CONFIG_TITLES]
        base = by.get("sp1", {}).get("longest_fit")
        ratios = [
            f"{by[c]['longest_fit'] / base:.2f}x ({CONFIG_TITLES[c]})" for c in ("sp4", "cp4") if c in by and base
        ]
        lines.append(f"| {lever} | " + " | ".join(cells) + " | " + ", ".join(ratios) + " |")
    lines += [
        "",
        "## Peak step memory per rank (MiB) against row length",
        "",
        "| lever | tokens | " + " | ".join(CONFIG_TITLES.values()) + " |",
        "|---|---:|" + "---:|" * len(CONFIG_TITLES),
    ]
    for lever in LEVERS:
        by = {r["config"]: {row["tokens"]: row for row in r["rows"]} for r in runs if r["lever"] == lever}
        for tokens in sorted({t for rows in by.values() for t in rows}):
            cells = [mib(by[c][tokens]["peak_bytes"]) if tokens in by.get(c, {}) else "" for c in CONFIG_TITLES]
            lines.append(f"| {lever} | {tokens:,} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


CONFIG_TITLES = {"sp1": "1 rank", "sp2": "S=2", "sp4": "S=4", "cp2": "C=2", "cp4": "C=4"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=tuple(CONFIGS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--levers", default=",".join(LEVERS))
    ap.add_argument("--budget_mib", type=int, default=384, help="per-rank memory budget of a step")
    ap.add_argument(
        "--grid",
        default="8192,16384",
        help=f"rows measured in every configuration (up to {GRID_MAX_PER_RANK:,} tokens per rank)",
    )
    ap.add_argument("--start_per_rank", type=int, default=4096, help="first row of the search without a grid")
    ap.add_argument("--max_tokens", type=int, default=262_144)
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    if args.worker:
        sp, cp = CONFIGS[args.worker]
        worker(
            sp,
            cp,
            LEVERS[args.levers],
            args.budget_mib * 2**20,
            args.start_per_rank,
            args.max_tokens,
            [int(x) for x in args.grid.split(",") if x],
        )
        return
    runs = []
    for lever in args.levers.split(","):
        for name in args.configs.split(","):
            runs.append(measure(name, lever, args))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "rows"}), flush=True)
    path = RESULTS / "long_context.json"  # read only now: another run may have measured the other configurations
    previous = json.loads(path.read_text())["runs"] if path.exists() else []
    measured = {(r["config"], r["lever"]) for r in runs}
    keep = [r for r in previous if (r["config"], r["lever"]) not in measured and r.get("budget_mib") == args.budget_mib]
    for r in runs:
        r["budget_mib"] = args.budget_mib
    results = {
        "date": str(datetime.date.today()),
        "budget_mib": args.budget_mib,
        "runs": keep + runs,
        "machine": machine_info(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "long_context.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
