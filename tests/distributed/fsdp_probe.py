"""A torchrun worker for tests/distributed/test_fsdp.py: wraps the model with the real FSDPStrategy, normally, with
low_cpu_fsdp and with CPU offload, and writes what each rank really holds to OUT_DIR/rank{R}.json.

    python -m torch.distributed.run --nproc_per_node N tests/distributed/fsdp_probe.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor

from shardtune.config.flags import config_from
from shardtune.model.loading import load_model
from shardtune.model.structure import decoder_layers
from shardtune.parallel.fsdp import FSDPStrategy
from shardtune.runtime.distributed import init_distributed, shutdown
from shardtune.training.engine.building import build_model


def local_numel(model: torch.nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def logits(model: torch.nn.Module) -> torch.Tensor:
    input_ids = torch.arange(3, 35).reshape(2, 16)
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits


def offload_facts(model: torch.nn.Module) -> dict:
    """What --fsdp_config.fsdp_cpu_offload sets up, read from FSDP2's own per-module state (torch internals: the
    policy each fully_shard call received, and whether each sharded parameter is kept on the CPU), plus where the
    local shards, their gradients and AdamW's state live after one optimizer step."""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [g for g in groups if g is not None]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.arange(3, 35).reshape(2, 16), use_cache=False).logits.pow(2).mean().backward()
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    params = list(model.parameters())
    return {
        "num_units": len(groups),
        "units_with_cpu_offload_policy": sum(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups),
        "all_params_offloaded": all(fp.offload_to_cpu for g in groups for fp in g.fsdp_params),
        "local_shards_on_cpu": all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in params),
        "grads_on_cpu": all(p.grad is not None and p.grad.to_local().device.type == "cpu" for p in params),
        "optimizer_state_on_cpu": bool(state) and all(t.device.type == "cpu" for t in state),
    }


def main(model_dir: str, out_dir: Path) -> None:
    env = init_distributed()
    reference = load_model(model_dir)  # a plain, unsharded copy to compare with
    total_numel = sum(p.numel() for p in reference.parameters())
    layer_numel = max(sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(reference))
    ref_logits = logits(reference)

    cfg = config_from(model_name=model_dir, enable_fsdp=True)
    sharded = FSDPStrategy(cfg, env).wrap(build_model(cfg, env))
    sharded_numel = local_numel(sharded)

    low_cfg = config_from(model_name=model_dir, enable_fsdp=True, low_cpu_fsdp=True)
    built = build_model(low_cfg, env)
    built_on_meta = all(p.is_meta for p in built.parameters())
    low_strategy = FSDPStrategy(low_cfg, env)
    low = low_strategy.wrap(built)
    gathered = low_strategy.full_state_dict(low)

    offload_cfg = config_from(
        {
            "model_name": model_dir,
            "enable_fsdp": True,
            "fsdp_config.sharding_strategy": "SHARD_GRAD_OP",
            "fsdp_config.fsdp_cpu_offload": True,
        }
    )
    offloaded = offload_facts(FSDPStrategy(offload_cfg, env).wrap(build_model(offload_cfg, env)))
    result = {
        "rank": env.rank,
        "world_size": env.world_size,
        "total_numel": total_numel,
        "layer_numel": layer_numel,
        "local_numel": sharded_numel,
        "low_cpu_local_numel": local_numel(low),
        "built_on_meta": built_on_meta,
        "low_cpu_buffers_equal": all(torch.equal(a, b) for a, b in zip(low.buffers(), reference.buffers())),
        "low_cpu_logits_max_abs_diff": float((logits(low) - ref_logits).abs().max()),
        "sharded_logits_max_abs_diff": float((logits(sharded) - ref_logits).abs().max()),
    }
    result.update(offloaded=offloaded, not_offloaded=offload_facts(sharded))  # trains them: after their logits
    if gathered is not None:
        expected = reference.state_dict()
        result["low_cpu_weights_equal"] = gathered.keys() == expected.keys() and all(
            torch.equal(gathered[k], expected[k]) for k in expected
        )
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
