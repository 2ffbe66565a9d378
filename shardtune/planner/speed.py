"""Time of one optimizer step: the bytes each collective moves (data, sequence and context parallel) and the
compute at an assumed MFU, whichever is slower.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.planner.estimate import Setup, estimate, images_per_micro_batch, tower_trains, ulysses_kv_heads
from shardtune.planner.hardware import (
    ASSUMED_MFU,
    HOST_ADAM_BYTES_S,
    HOST_LINK_BYTES_S,
    Device,
)

# -- communication and time ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Bytes one GPU sends per optimizer step, inside its node and across nodes."""

    intra_node: float
    inter_node: float


def _ring(bytes_: float, n: int) -> float:
    """Bytes each rank sends in a ring all-gather or reduce-scatter of ``bytes_`` over n ranks."""
    return bytes_ * (n - 1) / n if n > 1 else 0.0


def traffic_per_step(setup: Setup, accumulation_steps: int = 1) -> Traffic:
    """Parameter all-gathers and gradient reductions of one optimizer step (accumulated micro-batches skip the
    reduction). A group spanning nodes is charged to the inter-node link, which it is bound by."""
    s, arch = setup, setup.arch
    trainable = s.trainable_params
    frozen_sharded = arch.num_params - trainable  # gathered like the rest, never reduced
    c, grad_bytes = s.compute_bytes, 4  # gradients reduced in fp32
    spans_nodes = s.num_nodes > 1
    intra = inter = 0.0

    def add(bytes_: float, n: int, crosses: bool) -> None:
        nonlocal intra, inter
        if crosses:
            inter += bytes_
        else:
            intra += bytes_

    strategy = s.strategy
    if strategy in ("DDP", "NO_SHARD", "ZERO1", "ZERO2"):
        add(2 * _ring(trainable * grad_bytes, s.world_size), s.world_size, spans_nodes)
        if strategy in ("ZERO1", "ZERO2"):
            add(_ring(trainable * c, s.world_size), s.world_size, spans_nodes)  # updated params all-gathered
    else:
        group = s.shard_group
        gathers = 1 if strategy == "SHARD_GRAD_OP" else 2
        gathered_bytes = (trainable + frozen_sharded) * c
        group_spans = spans_nodes and group > s.gpus_per_node or (spans_nodes and strategy != "HYBRID_SHARD")
        add(gathers * accumulation_steps * _ring(gathered_bytes, group), group, group_spans)
        add(_ring(trainable * grad_bytes, group), group, group_spans)
        replicas = s.world_size // group
        if replicas > 1:  # HSDP: the shard's gradients all-reduced across replicas (one per node)
            add(2 * _ring(trainable * grad_bytes / group, replicas), replicas, spans_nodes)
    return Traffic(intra, inter)


def sequence_traffic_per_step(setup: Setup, accumulation_steps: int = 1) -> tuple[Traffic, Traffic]:
    """(Ulysses all-to-all, ring K/V) bytes one GPU sends per optimizer step for a row split over sp x cp ranks.

    Ulysses, per layer and pass: q, k, v (KV heads repeated up to the degree) to head-major and the output back,
    each rank sending (S-1)/S of its slice. Ring: the rank's K/V chunk travels C-1 hops forward; backward rotates
    K/V and their gradients (twice the forward). Activation checkpointing repeats the forward. sp is the innermost
    mesh dimension (inside a node when S <= GPUs per node); a ring of cp x sp ranks spans nodes when larger."""
    s, arch = setup, setup.arch
    sp, cp, c = s.sequence_parallel, s.context_parallel, s.compute_bytes
    passes = (3 if s.activation_checkpointing else 2) * accumulation_steps * arch.num_layers  # forward(s) + backward
    q_width = arch.num_heads * arch.head_dim
    kv_width = max(arch.num_kv_heads, sp) * arch.head_dim
    ulysses = passes * s.tokens_per_rank * c * (2 * q_width + 2 * kv_width) * (sp - 1) / sp if sp > 1 else 0.0
    ring_passes = (4 if s.activation_checkpointing else 3) * accumulation_steps * arch.num_layers
    kv_chunk = s.tokens_per_rank * c * 2 * ulysses_kv_heads(arch, sp) * arch.head_dim * sp  # before the all-to-all
    ring = ring_passes * kv_chunk * (cp - 1) if cp > 1 else 0.0
    crosses_sp = sp > s.gpus_per_node
    crosses_cp = cp * sp > s.gpus_per_node
    return (
        Traffic(0.0 if crosses_sp else ulysses, ulysses if crosses_sp else 0.0),
        Traffic(0.0 if crosses_cp else ring, ring if crosses_cp else 0.0),
    )


def image_flops(setup: Setup, accumulation_steps: int = 1) -> float:
    """The vision tower's matmul FLOPs per optimizer step: its parameters times each image's positions, forward
    (2) and, when it trains, backward (4)."""
    v = setup.arch.vision
    if v is None:
        return 0.0
    images = images_per_micro_batch(setup) * accumulation_steps * setup.data_parallel
    return (6 if tower_trains(setup) else 2) * v.num_params * v.positions_per_image * images


def step_time_s(setup: Setup, device: Device, accumulation_steps: int = 1) -> tuple[float, float, float]:
    """(step seconds, compute seconds, communication seconds): compute at ASSUMED_MFU of the peak; communication
    at the link rates, overlapped with compute (FSDP prefetch, DDP buckets), so the slower of the two bounds it."""
    from shardtune.accounting.flops import ModelShape, training_flops_per_token

    arch = setup.arch
    trainable = setup.trainable_params
    matmul = arch.matmul_params
    shape = ModelShape(arch.num_layers, arch.hidden_size, matmul, min(trainable, matmul))
    tokens = setup.batch_size * setup.seq_len * accumulation_steps * setup.data_parallel
    flops = training_flops_per_token(shape, setup.seq_len) * tokens + image_flops(setup, accumulation_steps)
    if setup.activation_checkpointing:
        flops *= 4 / 3  # the forward runs twice
    compute = flops / (setup.world_size * device.matmul_flops * ASSUMED_MFU)
    traffic = traffic_per_step(setup, accumulation_steps)

    def seconds(t: Traffic) -> float:
        return t.intra_node / device.intra_node_bytes_s + t.inter_node / device.inter_node_bytes_s

    ulysses, ring = sequence_traffic_per_step(setup, accumulation_steps)
    comm = seconds(traffic) + seconds(ring)  # overlapped with compute (prefetch, buckets, the ring's next chunk)
    blocking = seconds(ulysses)  # attention waits for its all-to-all
    offload = 0.0
    if setup.cpu_offload and device.compute_bytes < 4:  # not overlapped: the state crosses PCIe, AdamW runs on the CPU
        b = estimate(setup)
        offload = 2 * b.host_state / HOST_LINK_BYTES_S + b.host_state / HOST_ADAM_BYTES_S
    return max(compute, comm) + blocking + offload, compute, comm + blocking + offload
