"""Memory of the training state per GPU: one formula, used by the start log (from the real local shards) and by
the table in docs/sharding.md (from parameter counts and dtypes).

Training state = parameters + gradients + AdamW state (two tensors per trainable parameter). Activations and
the parameters all-gathered during a step come on top (``gathered_bytes_per_gpu``).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def state_bytes_per_gpu(
    num_params: float,
    strategy: str,
    num_gpus: int,
    gpus_per_node: int = 8,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 4,
) -> StateBytes:
    """Bytes of params / grads / AdamW state per GPU for full fine-tuning (all parameters trainable).

    Defaults are mixed precision with fp32 master weights: bf16 is only the compute copy, all-gathered per
    layer. pure_bf16 is param_bytes = grad_bytes = optimizer_bytes = 2.
    """
    param_frac, state_frac = shard_fraction(strategy, num_gpus, gpus_per_node)
    return StateBytes(
        params=int(num_params * param_bytes * param_frac),
        grads=int(num_params * grad_bytes * state_frac),
        optimizer=int(num_params * ADAM_STATES_PER_PARAM * optimizer_bytes * state_frac),
    )


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


# -- traffic between nodes ----------------------------------------------------------------------------------------


def ring_factor(collective: str, group_size: int) -> float:
    """Bytes each rank sends per byte of the full tensor in a ring collective (nccl-tests' bus-bandwidth factor)."""
    if group_size <= 1:
        return 0.0
    share = (group_size - 1) / group_size
    return 2 * share if collective == "all_reduce" else share  # all_gather, reduce_scatter


def cross_node_bytes_per_step(
    strategy: str,
    num_params: float,
    num_trainable: float,
    num_nodes: int,
    gpus_per_node: int,
    micro_batches: int = 1,
    shard_group_size: int = 0,
    compute_bytes: int = 2,
    grad_bytes: int = 4,
) -> int:
    """Bytes each node sends to other nodes per optimizer step, for ring collectives (as NCCL runs large tensors).

    A ring ordered by node leaves each node over one link, which carries what one rank sends; a node holding
    members of k groups that span nodes sends k such shares. Gradients are reduced once per step (no sync on
    the other micro-batches); FSDP all-gathers the (compute-dtype) parameters per micro-batch, twice with
    FULL_SHARD (forward, and again for backward), once with SHARD_GRAD_OP. HYBRID_SHARD shards within groups of
    shard_group_size ranks (default: one node) and all-reduces each shard across the replicas. Divided by the
    across-nodes bus bandwidth `shardtune doctor` measures, it is the communication time of a step.
    """
    if num_nodes <= 1:
        return 0
    world = num_nodes * gpus_per_node
    params, grads = num_params * compute_bytes, num_trainable * grad_bytes
    if strategy in ("DDP", "NO_SHARD"):
        return int(ring_factor("all_reduce", world) * grads)
    gathers = {"FULL_SHARD": 2, "SHARD_GRAD_OP": 1}
    if strategy in gathers:
        return int(
            micro_batches * gathers[strategy] * ring_factor("all_gather", world) * params
            + ring_factor("reduce_scatter", world) * grads
        )
    if strategy != "HYBRID_SHARD":
        raise ValueError(f"unknown strategy {strategy!r}: choose one of " + ", ".join(STRATEGIES))
    shard = shard_group_size or gpus_per_node
    total = 0.0
    if shard > gpus_per_node:  # a shard group spans nodes: its gathers and reduce-scatters cross them
        total += (
            micro_batches * 2 * ring_factor("all_gather", shard) * params + ring_factor("reduce_scatter", shard) * grads
        )
    replicas = world // shard
    total += min(shard, gpus_per_node) * ring_factor("all_reduce", replicas) * grads / shard
    return int(total)


def cross_node_summary(chosen: str, num_nodes: int, gpus_per_node: int, **sizes) -> str:
    """Start-log line: the chosen strategy's bytes per node per step, next to the alternatives'."""

    def amount(strategy: str) -> str:
        return human_bytes(
            cross_node_bytes_per_step(strategy, num_nodes=num_nodes, gpus_per_node=gpus_per_node, **sizes)
        )

    others = ", ".join(f"{s} {amount(s)}" for s in ("DDP", "FULL_SHARD", "HYBRID_SHARD") if s != chosen)
    return (
        f"traffic between nodes: {amount(chosen)} sent by each node per optimizer step with {chosen} "
        f"({num_nodes} nodes x {gpus_per_node} processes, ring collectives; {others})"
    )


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


def memory_table(
    model_sizes: dict[str, tuple[float, int]] = MODEL_SIZES,
    gpu_counts: tuple[int, ...] = (8, 16),
    gpus_per_node: int = 8,
) -> str:
    """Markdown table: params / grads / Adam GiB per GPU for each strategy (fp32 master weights, AdamW), plus the
    bf16 parameters all-gathered at the peak of a step."""
    lines = [
        "| model | strategy | GPUs | params | grads | Adam state | sharded total | + all-gathered (bf16) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model_name, (num_params, num_layers) in model_sizes.items():
        for strategy in ("DDP", "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"):
            for num_gpus in gpu_counts:
                b = state_bytes_per_gpu(num_params, strategy, num_gpus, gpus_per_node)
                extra = gathered_bytes_per_gpu(num_params, num_layers, strategy)
                lines.append(
                    f"| {model_name} | {strategy} | {num_gpus} | {gib(b.params)} | {gib(b.grads)} | "
                    f"{gib(b.optimizer)} | {gib(b.total)} | {gib(extra)} |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    print(memory_table())
