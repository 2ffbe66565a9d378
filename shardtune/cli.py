"""The ``shardtune`` command: subcommands only, no training logic here."""

from __future__ import annotations

import argparse
import sys

SUBCOMMANDS = {
    "sft": "fine-tune a model (launches torchrun; see shardtune sft --help)",
    "init-model": "write a small random-init Llama preset with its tokenizer as a Hugging Face directory",
    "export": "turn a training checkpoint (any world size, any strategy) into a Hugging Face model directory",
    "generate": "generate text with a model, a model + PEFT adapter, or a merged model (prompt, file or stdin)",
    "plan": "per-GPU memory and speed of a configuration and its alternatives, from config.json alone (no GPU)",
    "eval": "eval loss, perplexity and ROUGE of generated summaries on a samsum-format split; JSON report",
    "plot": "PNG charts (loss, lr, tokens/s, MFU, memory) of one or more runs, overlaid; reads metrics.jsonl or "
            "llama-cookbook's metrics_data_*.json",
    "doctor": "check versions, devices, topology, bandwidth and the NCCL / gloo environment on every node",
}


def init_model_main(argv: list[str]) -> int:
    from shardtune.models import PRESETS, init_model

    parser = argparse.ArgumentParser(prog="shardtune init-model", description=SUBCOMMANDS["init-model"])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size preset")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    parser.add_argument("out_dir", help="directory to create (must not exist or be empty)")
    args = parser.parse_args(argv)
    try:
        path = init_model(args.preset, args.out_dir, seed=args.seed)
    except ValueError as e:
        print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote preset {args.preset!r} to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: shardtune {" + ",".join(SUBCOMMANDS) + "} ...\n")
        for name, text in SUBCOMMANDS.items():
            print(f"  {name:<12} {text}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "sft":
        if "-h" in rest or "--help" in rest:  # answered at once: torch and transformers are not imported for it
            from shardtune.launch import sft_help_text

            print(sft_help_text())
            return 0
        from shardtune.sft import main as sft_main

        return sft_main(rest)
    if command in ("init-model", "export"):
        from shardtune.runtime import quiet_libraries

        quiet_libraries()
    if command == "init-model":
        return init_model_main(rest)
    if command == "export":
        from shardtune.export import main as export_main

        return export_main(rest)
    if command == "generate":
        from shardtune.generate import main as generate_main

        return generate_main(rest)
    if command == "plan":
        from shardtune.plan import main as plan_main

        return plan_main(rest)
    if command == "plot":
        from shardtune.plot import main as plot_main

        return plot_main(rest)
    if command == "eval":
        from shardtune.evaluate import main as eval_main

        return eval_main(rest)
    if command == "doctor":
        from shardtune.doctor import main as doctor_main

        return doctor_main(rest)
    print(f"shardtune: error: unknown command {command!r}: choose one of {', '.join(SUBCOMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
