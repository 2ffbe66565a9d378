"""Memory of the training state per GPU: one formula, used by the start log (from the real local shards) and by
the README table (from parameter counts and dtypes).

Training state = parameters + gradients + AdamW state (two tensors per trainable parameter). Activations and
the parameters all-gathered during a step come on top (``gathered_bytes_per_gpu``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ADAM_STATES_PER_PARAM = 2  # exp_avg and exp_avg_sq
GIB = 2**30

STRATEGIES = ("DDP", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def shard_fraction(strategy: str, num_gpus: int, gpus_per_node: int) -> tuple[float, float]:
    """(fraction of the parameters, fraction of gradients and optimizer state) one GPU keeps between steps."""
    if strategy in ("DDP", "NO_SHARD"):
        return 1.0, 1.0
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return 1.0 / num_gpus, 1.0 / num_gpus
    if strategy == "HYBRID_SHARD":
        group = min(gpus_per_node, num_gpus)
        return 1.0 / group, 1.0 / group
    raise ValueError(f"unknown strategy {strategy!r}: choose one of " + ", ".join(STRATEGIES))


def state_bytes_per_gpu(num_params: float, strategy: str, num_gpus: int, gpus_per_node: int = 8,
                        param_bytes: int = 4, grad_bytes: int = 4, optimizer_bytes: int = 4) -> StateBytes:
    """Bytes of params / grads / AdamW state per GPU for full fine-tuning (all parameters trainable).

    Defaults are mixed precision with fp32 master weights: bf16 is only the compute copy, all-gathered per
    layer. pure_bf16 is param_bytes = grad_bytes = optimizer_bytes = 2.
    """
    param_frac, state_frac = shard_fraction(strategy, num_gpus, gpus_per_node)
    return StateBytes(params=int(num_params * param_bytes * param_frac),
                      grads=int(num_params * grad_bytes * state_frac),
                      optimizer=int(num_params * ADAM_STATES_PER_PARAM * optimizer_bytes * state_frac))


def local_state_bytes(model: nn.Module) -> StateBytes:
    """This rank's bytes of params, grads and AdamW state, from the tensors it really holds (local shards of
    DTensors under FSDP). Gradients and optimizer state are counted for trainable parameters, in their dtype."""
    params = grads = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        nbytes = local.numel() * local.element_size()
        params += nbytes
        if p.requires_grad:
            grads += nbytes
    return StateBytes(params=params, grads=grads, optimizer=ADAM_STATES_PER_PARAM * grads)


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def human_bytes(num_bytes: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{int(num_bytes)} B"


# (parameters, decoder layers)
MODEL_SIZES = {"Llama 3 8B": (8.03e9, 32), "Llama 3 70B": (70.55e9, 80)}
COMPUTE_BYTES = 2  # bf16 compute copy, what FSDP all-gathers under the default mixed precision


def gathered_bytes_per_gpu(num_params: float, num_layers: int, strategy: str) -> int:
    """Parameters all-gathered (bf16) at the peak of a step, on top of the sharded state (layer ~ params/layers)."""
    if strategy in ("FULL_SHARD", "HYBRID_SHARD"):
        return int(num_params / num_layers * COMPUTE_BYTES)
    if strategy == "SHARD_GRAD_OP":
        return int(num_params * COMPUTE_BYTES)
    return 0


def memory_table(model_sizes: dict[str, tuple[float, int]] = MODEL_SIZES, gpu_counts: tuple[int, ...] = (8, 16),
                 gpus_per_node: int = 8) -> str:
    """Markdown table: params / grads / Adam GiB per GPU for each strategy (fp32 master weights, AdamW), plus the
    bf16 parameters all-gathered at the peak of a step."""
    lines = ["| model | strategy | GPUs | params | grads | Adam state | sharded total | + all-gathered (bf16) |",
             "|---|---|---|---|---|---|---|---|"]
    for model_name, (num_params, num_layers) in model_sizes.items():
        for strategy in ("DDP", "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"):
            for num_gpus in gpu_counts:
                b = state_bytes_per_gpu(num_params, strategy, num_gpus, gpus_per_node)
                extra = gathered_bytes_per_gpu(num_params, num_layers, strategy)
                lines.append(f"| {model_name} | {strategy} | {num_gpus} | {gib(b.params)} | {gib(b.grads)} | "
                             f"{gib(b.optimizer)} | {gib(b.total)} | {gib(extra)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(memory_table())
