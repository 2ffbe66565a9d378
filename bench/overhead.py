"""shardtune's train_step vs a 10-line PyTorch loop on identical pre-built batches, interleaved step by step.

Both models start from the same weights, both use AdamW and the token-normalised loss, one process; shardtune
runs its real step (DDP strategy, as its 1-process launch uses, lean loss, global token counting). Prints one
JSON line with per-step medians.

    python -m bench.overhead --model DIR --steps 12
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.model.attention import varlen_kwargs


def bare_step(model, optimizer, batch):
    """The 10-line loop: forward, token-summed cross-entropy / labelled tokens, backward, step (a padding-free
    packed row: the examples' boundaries go to the same varlen attention as shardtune's)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **varlen_kwargs(batch)).logits[
        :, :-1
    ]
    targets = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), reduction="sum")
    (loss / (targets != -100).sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--num_train", type=int, default=400)
    args = ap.parse_args()

    from shardtune import data
    from shardtune.accounting.flops import model_shape
    from shardtune.config.flags import config_from
    from shardtune.model.attention import use_varlen_attention
    from shardtune.model.loading import load_model, load_tokenizer
    from shardtune.parallel import make_strategy
    from shardtune.parallel.optim import build_optimizer
    from shardtune.runtime.distributed import DistEnv
    from shardtune.training.engine.step import train_step
    from shardtune.training.objectives.sft.objective import SFT

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    cfg = config_from(model_name=args.model, context_length=512, batch_size_training=2, lr=1e-4)
    cfg.data.synthetic_dialogues.num_train = args.num_train
    tokenizer = load_tokenizer(args.model)
    examples, _ = data.load_examples(cfg, tokenizer, "train")
    units = data.build_units(examples, cfg)
    loader = data.train_loader(units, cfg, 0, 1, 0, tokenizer.pad_token_id)
    steps = [mbs for _, mbs in zip(range(args.steps + 2), loader)]  # pre-built; 2 warm-up steps

    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    base = load_model(args.model)
    use_varlen_attention(base)
    bare_model = copy.deepcopy(base)
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=cfg.optim.lr)
    strategy = make_strategy(cfg, env)
    model = strategy.wrap(base)
    opt = build_optimizer(model, cfg)
    shape = model_shape(model)
    times = {"shardtune": [], "bare": []}
    for i, micro_batches in enumerate(steps):
        order = ("shardtune", "bare") if i % 2 == 0 else ("bare", "shardtune")
        for who in order:
            tick = time.perf_counter()
            if who == "shardtune":
                train_step(model, strategy, opt, SFT(cfg, env, strategy, None), micro_batches, shape=shape)
            else:
                for mb in micro_batches:
                    bare_step(bare_model, bare_opt, mb)
            if i >= 2:
                times[who].append(time.perf_counter() - tick)
    dist.destroy_process_group()
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(
        json.dumps(
            {
                "steps": args.steps,
                "tokens_per_step": int(steps[0][0]["input_ids"].numel()),
                "shardtune_step_s": med["shardtune"],
                "bare_step_s": med["bare"],
                "ratio": med["shardtune"] / med["bare"],
                "times": times,
            }
        )
    )


if __name__ == "__main__":
    main()
