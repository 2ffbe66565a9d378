"""`python -m bench`: every CPU benchmark of issue #6, side by side in one run; writes bench/results/latest.md
(the table docs/benchmarks.md quotes) and latest.json (every figure, machine info, versions).

    python -m bench                       # embedded dialogues (plain and with chatter), ~15 min on 2 CPU cores
    python -m bench --samsum data/samsum/train.json --num_train 0
    python -m bench --only trainer,overhead

Sections: trainer (shardtune packing / padding-free / padding vs transformers.Trainer and TRL's SFTTrainer, one
epoch; the peers timed in ``train()`` only, shardtune as a whole process as well), overhead
(train_step vs a bare PyTorch loop), loss_memory (lean loss vs the model's own loss at vocabulary 128,256),
model_state (DDP / FSDP per-rank bytes at 1, 2, 4 processes), mfu (from the shardtune packing runs). Never part of
the tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, free_port, machine_info, median, python, run, run_json, spread
from bench.data import OPTIMIZERS, dataset_flags
from bench.report import markdown

SECTIONS = ("trainer", "overhead", "loss_memory", "model_state")


TOOLS = ("shardtune_packing", "shardtune_padding_free", "shardtune_padding", "hf_trainer", "trl_sft")
PEERS = ("hf_trainer", "trl_sft")


def trl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def shardtune_epoch(model: str, out: Path, tool: str, variant: dict, args) -> dict:
    """One epoch through the real CLI, one process; epoch time = the logged step times (data loading included)."""
    from shardtune.training.engine.metrics import read_metrics

    shape = {
        "shardtune_packing": [
            "--batching_strategy",
            "packing",
            "--context_length",
            variant["pack_length"],
            "--batch_size_training",
            args.pack_batch,
        ],
        "shardtune_padding": [
            "--batching_strategy",
            "padding",
            "--context_length",
            1024,
            "--batch_size_training",
            args.batch,
        ],
        "shardtune_padding_free": [
            "--batching_strategy",
            "padding",
            "--padding_free",
            "true",
            "--context_length",
            1024,
            "--batch_size_training",
            args.batch,
        ],
    }[tool]
    tick = time.perf_counter()
    run(
        [
            python(),
            "-m",
            "shardtune",
            "sft",
            "--nproc_per_node",
            1,
            "--model_name",
            model,
            "--output_dir",
            out,
            *shape,
            "--lr",
            args.lr,
            "--gradient_clipping",
            "true",
            "--num_workers_dataloader",
            1,
            "--save_model",
            "false",
            "--optim.optimizer",
            args.optim,
            *dataset_flags(args.num_train, args.num_validation, args.samsum, variant["chatter"]),
        ]
    )
    process_s = time.perf_counter() - tick
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    return {
        "epoch_s": sum(r["step_time_s"] for r in steps),
        "steps": len(steps),
        "label_tokens": sum(r["label_tokens"] for r in steps),
        "eval_loss": evals[-1]["eval_loss"],
        "process_s": process_s,
        "mfu_median": median([r["mfu"] for r in steps[1:]] or [0.0]),
        "model_flops_per_s_median": median([r["model_flops_per_s"] for r in steps[1:]] or [0.0]),
    }


def peer_device(args) -> str:
    """The device the peers train on: shardtune takes the GPU when there is one, so they do too."""
    if args.device != "auto":
        return args.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def trainer_epoch(model: str, out: Path, variant: dict, args) -> dict:
    argv = [
        python(),
        "-m",
        "bench.hf_trainer",
        "--model",
        model,
        "--num_train",
        args.num_train,
        "--num_validation",
        args.num_validation,
        "--batch",
        args.batch,
        "--lr",
        args.lr,
        "--out",
        out,
        "--device",
        peer_device(args),
        "--optim",
        args.optim,
    ]
    if args.samsum:
        argv += ["--samsum", args.samsum]
    if variant["chatter"]:
        argv += ["--chatter"]
    tick = time.perf_counter()
    result = run_json(argv)
    result["process_s"] = time.perf_counter() - tick
    return result


def trl_epoch(model: str, out: Path, variant: dict, args) -> dict:
    """TRL's SFTTrainer at its fastest CPU setting, on the blocks shardtune packing uses (bench/trl_trainer.py)."""
    argv = [
        python(),
        "-m",
        "bench.trl_trainer",
        "--model",
        model,
        "--num_train",
        args.num_train,
        "--num_validation",
        args.num_validation,
        "--pack_batch",
        args.pack_batch,
        "--pack_length",
        variant["pack_length"],
        "--lr",
        args.lr,
        "--out",
        out,
        "--device",
        peer_device(args),
        "--optim",
        args.optim,
    ]
    if args.samsum:
        argv += ["--samsum", args.samsum]
    if variant["chatter"]:
        argv += ["--chatter"]
    tick = time.perf_counter()
    result = run_json(argv)
    result["process_s"] = time.perf_counter() - tick
    return result


def dataset_variants(model: str, args) -> list[dict]:
    """The data each vs-Trainer table runs on; packed blocks hold ~4 mean examples, so 2 blocks ~ 8 examples."""
    from bench.data import bench_config, mean_example_length

    names = ["samsum"] if args.samsum else [n for n in args.datasets.split(",") if n]
    variants = []
    for name in names:
        chatter = name == "chatter"
        mean = mean_example_length(bench_config(model, args.num_train, args.num_validation, args.samsum, 1024, chatter))
        pack_length = args.pack_length or max(64, round(4 * mean / 64) * 64)
        variants.append({"name": name, "chatter": chatter, "mean_example_tokens": mean, "pack_length": pack_length})
    return variants


def bench_trainer(model: str, variant: dict, args) -> dict:
    tools = [t for t in args.tools.split(",") if t and (t != "trl_sft" or trl_available())]
    runs: dict[str, list[dict]] = {name: [] for name in tools}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            names = list(runs)
            names = names[rep % len(names) :] + names[: rep % len(names)]  # rotate: drifting load hits every tool
            for name in names:
                out = Path(tmp) / f"{name}-{rep}"
                print(f"  trainer [{variant['name']}]: {name} (repeat {rep + 1}/{args.repeats})", flush=True)
                if name == "hf_trainer":
                    runs[name].append(trainer_epoch(model, out, variant, args))
                elif name == "trl_sft":
                    runs[name].append(trl_epoch(model, out, variant, args))
                else:
                    runs[name].append(shardtune_epoch(model, out, name, variant, args))
    summary: dict = {}
    for name, results in runs.items():
        epoch = [r["epoch_s"] for r in results]
        summary[name] = {
            "epoch_s": median(epoch),
            "epoch_s_spread": spread(epoch),
            "steps": results[0]["steps"],
            "process_s": median([r["process_s"] for r in results]),
            "label_tokens": results[0]["label_tokens"],
            "label_tokens_per_s": results[0]["label_tokens"] / median(epoch),
            "eval_loss": median([r["eval_loss"] for r in results]),
            "runs": results,
        }
    compare_with_peers(summary)
    trainer_run = runs["hf_trainer"][0] if "hf_trainer" in runs else {"computed_tokens": 0, "real_tokens": 1}
    dataset = args.samsum or ("synthetic_dialogues" + (" --synthetic_dialogues.chatter" if variant["chatter"] else ""))
    summary["setup"] = {
        "preset": args.preset,
        "dataset": dataset,
        "variant": variant["name"],
        "mean_example_tokens": variant["mean_example_tokens"],
        "trainer_padding_ratio": trainer_run["computed_tokens"] / trainer_run["real_tokens"],
        "num_train": args.num_train,
        "num_validation": args.num_validation,
        "lr": args.lr,
        "optim": args.optim,
        "optimizer": "AdamW (torch), betas 0.9/0.999, eps 1e-8, weight decay 0",
        "schedule": "constant lr (shardtune StepLR steps after the epoch; Trainer 'constant')",
        "clipping": "global grad norm 1.0",
        "padding_batch_examples": args.batch,
        "packing": f"{args.pack_batch} blocks of {variant['pack_length']} tokens",
        "repeats": args.repeats,
        "tools": list(runs),
    }
    return summary


def compare_with_peers(summary: dict) -> None:
    """Each shardtune tool against the faster peer: the peer's ``train()`` time over shardtune's step time
    (``speedup_vs_fastest_peer``) and over shardtune's whole process, start-up and evaluation included
    (``process_speedup_vs_fastest_peer``: this favours the peer)."""
    peers = [name for name in PEERS if name in summary]
    if not peers:
        return
    fastest = min(peers, key=lambda name: summary[name]["epoch_s"])
    summary["fastest_peer"] = fastest
    base = summary[fastest]["epoch_s"]
    for name, x in summary.items():
        if name.startswith("shardtune_"):
            x["speedup_vs_fastest_peer"] = base / x["epoch_s"]
            x["process_speedup_vs_fastest_peer"] = base / x["process_s"]
            if "hf_trainer" in summary:
                x["speedup_vs_trainer"] = summary["hf_trainer"]["epoch_s"] / x["epoch_s"]


def bench_loss_memory(args) -> dict:
    out: dict[str, list[dict]] = {"default": [], "lean": []}
    for _ in range(args.memory_repeats):
        for mode in ("default", "lean"):
            out[mode].append(
                run_json([python(), "-m", "bench.loss_memory", "--mode", mode, "--seq_len", args.memory_seq_len])
            )
    summary = {
        mode: {
            "step_peak_bytes": median([r["step_peak_bytes"] for r in rs]),
            "step_s": median([r["step_s"] for r in rs]),
            "loss": rs[0]["loss"],
            "runs": rs,
        }
        for mode, rs in out.items()
    }
    summary["ratio_lean_over_default"] = summary["lean"]["step_peak_bytes"] / summary["default"]["step_peak_bytes"]
    summary["setup"] = {
        "vocab": 128256,
        "seq_len": args.memory_seq_len,
        "hidden": 256,
        "layers": 2,
        "batch": 1,
        "labelled": "every position",
        "full_logits_fp32_bytes": out["lean"][0]["full_logits_fp32_bytes"],
    }
    return summary


def bench_model_state(model: str) -> dict:
    import shardtune.parallel as parallel_pkg

    have_fsdp = (Path(parallel_pkg.__file__).parent / "fsdp.py").is_file()
    rows = []
    for strategy in ("ddp", "fsdp") if have_fsdp else ("ddp",):
        for nproc in (1, 2, 4):
            argv = [
                python(),
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                nproc,
                "--master_port",
                free_port(),
                "-m",
                "bench.model_state",
                "--model",
                model,
            ] + (["--fsdp"] if strategy == "fsdp" else [])
            print(f"  model_state: {strategy} x {nproc}", flush=True)
            rows.append(run_json(argv, timeout=600, OMP_NUM_THREADS="1"))
    return {"rows": rows, "fsdp_available": have_fsdp}


def save(result: dict) -> None:
    """Written after every section, so an interrupted run keeps what it measured."""
    results = Path(result["args"]["results_dir"])
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{result['args']['name']}.json").write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections: " + ", ".join(SECTIONS))
    ap.add_argument("--samsum", default="", help="a samsum-format file or folder instead of the embedded dialogues")
    ap.add_argument("--num_train", type=int, default=600)
    ap.add_argument("--num_validation", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8, help="examples per optimizer step (padding, Trainer)")
    ap.add_argument(
        "--datasets",
        default="plain,chatter",
        help="vs-Trainer tables: plain (the embedded dialogues), chatter (the same with "
        "--synthetic_dialogues.chatter: SAMSum-like spread of lengths)",
    )
    ap.add_argument("--pack_length", type=int, default=0, help="tokens per packed block (0: 4 x mean example)")
    ap.add_argument("--pack_batch", type=int, default=2, help="packed blocks per step (2 x 512 ~ 8 examples)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--optim",
        default="adamw_torch_fused",
        choices=OPTIMIZERS,
        help="every tool's AdamW: torch's fused kernel (Trainer's and TRL's default, the fastest on CPU too), or "
        "torch's per-tensor loop (shardtune's llama-cookbook default)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="epochs per tool (medians reported)")
    ap.add_argument(
        "--tools",
        default=",".join(TOOLS),
        help="comma-separated tools of the trainer section: "
        + ", ".join(TOOLS)
        + " (trl_sft is left out when trl is not installed: pip install shardtune[bench])",
    )
    ap.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the peers train (auto: the GPU when there is one, as shardtune)",
    )
    ap.add_argument("--preset", default="demo", help="the model of the trainer section (tiny: a functional check)")
    ap.add_argument("--name", default="latest", help="RESULTS_DIR/NAME.md and NAME.json")
    ap.add_argument("--results_dir", default=str(RESULTS))
    ap.add_argument("--overhead_steps", type=int, default=12)
    ap.add_argument("--memory_seq_len", type=int, default=4096)
    ap.add_argument("--memory_repeats", type=int, default=1)
    args = ap.parse_args()
    sections = [s for s in args.only.split(",") if s]

    from shardtune.accounting.flops import measured_peak_flops
    from shardtune.model.loading import resolve_model_name

    model = resolve_model_name(f"preset:{args.preset}")
    started = time.perf_counter()
    result: dict = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "peak_fp32_flops_per_s": measured_peak_flops("cpu"),
        "args": vars(args),
    }
    save(result)
    if "trainer" in sections:
        print("trainer: shardtune vs transformers.Trainer, one epoch each", flush=True)
        result["trainer"] = {}
        for variant in dataset_variants(model, args):
            result["trainer"][variant["name"]] = bench_trainer(model, variant, args)
            save(result)
        first = next(iter(result["trainer"].values()))
        packing = first.get("shardtune_packing", {}).get("runs") or [
            {"mfu_median": 0.0, "model_flops_per_s_median": 0.0}
        ]
        result["mfu"] = {
            "shardtune_packing_median": median([r["mfu_median"] for r in packing]),
            "model_flops_per_s_median": median([r["model_flops_per_s_median"] for r in packing]),
            "dataset": first["setup"]["dataset"],
            "preset": args.preset,
            "hidden_size": json.loads((Path(model) / "config.json").read_text())["hidden_size"],
        }
        save(result)
    if "overhead" in sections:
        print("overhead: train_step vs a bare PyTorch loop", flush=True)
        result["overhead"] = run_json(
            [python(), "-m", "bench.overhead", "--model", model, "--steps", args.overhead_steps]
        )
        save(result)
    if "loss_memory" in sections:
        print("loss_memory: lean loss vs the model's own loss, vocabulary 128,256", flush=True)
        result["loss_memory"] = bench_loss_memory(args)
        save(result)
    if "model_state" in sections:
        print("model_state: per-rank bytes, DDP / FSDP at 1, 2, 4 processes", flush=True)
        result["model_state"] = bench_model_state(model)
    result["bench_wall_s"] = time.perf_counter() - started
    result["machine"]["load_average_at_end"] = __import__("os").getloadavg()
    save(result)
    table = markdown(result)
    (Path(args.results_dir) / f"{args.name}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
