"""A torchrun worker for tests/distributed/test_fsdp.py: wraps the model with the real FSDPStrategy, normally and
with low_cpu_fsdp, and writes what each rank really holds to OUT_DIR/rank{R}.json.

    python -m torch.distributed.run --nproc_per_node N tests/distributed/fsdp_probe.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from shardtune.config import TrainConfig
from shardtune.distributed import init_distributed, shutdown
from shardtune.models import load_model
from shardtune.parallel.fsdp import FSDPStrategy, decoder_layers
from shardtune.sft import build_model


def local_numel(model: torch.nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def logits(model: torch.nn.Module) -> torch.Tensor:
    input_ids = torch.arange(3, 35).reshape(2, 16)
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits


def main(model_dir: str, out_dir: Path) -> None:
    env = init_distributed()
    reference = load_model(model_dir)  # a plain, unsharded copy to compare with
    total_numel = sum(p.numel() for p in reference.parameters())
    layer_numel = max(sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(reference))
    ref_logits = logits(reference)

    cfg = TrainConfig(model_name=model_dir, enable_fsdp=True)
    sharded = FSDPStrategy(cfg, env).wrap(build_model(cfg, env))
    sharded_numel = local_numel(sharded)

    low_cfg = TrainConfig(model_name=model_dir, enable_fsdp=True, low_cpu_fsdp=True)
    built = build_model(low_cfg, env)
    built_on_meta = all(p.is_meta for p in built.parameters())
    low_strategy = FSDPStrategy(low_cfg, env)
    low = low_strategy.wrap(built)
    gathered = low_strategy.full_state_dict(low)
    result = {
        "rank": env.rank, "world_size": env.world_size, "total_numel": total_numel, "layer_numel": layer_numel,
        "local_numel": sharded_numel, "low_cpu_local_numel": local_numel(low), "built_on_meta": built_on_meta,
        "low_cpu_buffers_equal": all(torch.equal(a, b) for a, b in zip(low.buffers(), reference.buffers())),
        "low_cpu_logits_max_abs_diff": float((logits(low) - ref_logits).abs().max()),
        "sharded_logits_max_abs_diff": float((logits(sharded) - ref_logits).abs().max()),
    }
    if gathered is not None:
        expected = reference.state_dict()
        result["low_cpu_weights_equal"] = (gathered.keys() == expected.keys()
                                           and all(torch.equal(gathered[k], expected[k]) for k in expected))
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
