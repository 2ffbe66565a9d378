"""Per-rank model-state bytes (parameters + gradients + AdamW state, the local shards each rank really holds)
after one real optimizer step, for DDP or FSDP2. A torchrun worker; rank 0 prints one JSON line.

    torchrun --nproc_per_node 4 -m bench.model_state --model DIR [--fsdp]
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from shardtune.config.flags import config_from


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--fsdp", action="store_true")
    args = ap.parse_args()

    from shardtune.data.batching import collate_padding
    from shardtune.model.loading import load_model
    from shardtune.parallel import make_strategy
    from shardtune.parallel.optim import build_optimizer
    from shardtune.runtime.distributed import all_reduce_sum, init_distributed, shutdown
    from shardtune.training.engine.step import train_step
    from shardtune.training.objectives.sft.objective import SFT

    env = init_distributed()
    cfg = config_from(model_name=args.model, enable_fsdp=args.fsdp)
    strategy = make_strategy(cfg, env)
    model = strategy.wrap(load_model(args.model))
    optimizer = build_optimizer(model, cfg)
    ids = list(range(4, 68))
    train_step(
        model,
        strategy,
        optimizer,
        SFT(cfg, env, strategy, None),
        [collate_padding([{"input_ids": ids, "labels": ids}], 3)],
    )
    params = [p for p in model.parameters()]
    grads_bytes = sum(local_bytes([p]) for p in params if p.requires_grad)  # grads are freed by the step (set_to_none)
    optim_bytes = local_bytes(
        t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0
    )
    mine = torch.tensor([local_bytes(params), grads_bytes, optim_bytes], dtype=torch.float64)
    worst = mine.clone()
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    total = all_reduce_sum(mine, env.device)
    if env.is_main:
        print(
            json.dumps(
                {
                    "strategy": "fsdp" if args.fsdp else "ddp",
                    "world_size": env.world_size,
                    "param_bytes": int(worst[0]),
                    "grad_bytes": int(worst[1]),
                    "optimizer_bytes": int(worst[2]),
                    "per_rank_bytes": int(worst.sum()),
                    "all_ranks_bytes": int(total.sum()),
                }
            )
        )
    # free DDP's reducer before the process group: the other order can deadlock gloo's destructor
    del model, optimizer, strategy
    gc.collect()
    shutdown()


if __name__ == "__main__":
    main()
