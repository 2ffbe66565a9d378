"""``shardtune init-model``: write a small random-init Llama preset with its tokenizer as a Hugging Face directory."""

from __future__ import annotations

import argparse
import sys

HELP = "write a small random-init Llama preset with its tokenizer as a Hugging Face directory"


def main(argv: list[str]) -> int:
    from shardtune.model.loading import PRESETS, init_model
    from shardtune.model.vision_presets import VISION_PRESETS
    from shardtune.runtime.libraries import quiet_libraries

    quiet_libraries()
    parser = argparse.ArgumentParser(prog="shardtune init-model", description=HELP)
    parser.add_argument(
        "--preset", default="tiny", choices=sorted([*PRESETS, *VISION_PRESETS]), help="model size preset"
    )
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
