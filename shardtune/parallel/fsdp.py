"""Sharded data parallel with PyTorch FSDP2 (``fully_shard`` on the run's mesh: replicate x shard, where shard is
dp_shard x cp x sp of shardtune.parallel.dims).

Wrapping order (torchtitan's): activation checkpointing on each decoder layer, then ``fully_shard`` on each
decoder layer (bottom-up), then on the root. The decoder layer class comes from the model's
``_no_split_modules``, so any Hugging Face causal LM works, also inside a PEFT wrapper.

FSDP2 averages gradients over all ranks of the mesh (reduce-scatter within the shard group, all-reduce across
replicas), so ``grad_average_size`` is the world size, as for DDP.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from shardtune.accounting.memory import human_bytes, local_state_bytes
from shardtune.config.schema import TrainConfig
from shardtune.model.structure import decoder_layers
from shardtune.parallel.base import Strategy, dtype_name
from shardtune.parallel.dims import fsdp_mesh
from shardtune.runtime.distributed import DistEnv, peak_memory_bytes, print0
from shardtune.runtime.precision import bf16_compute_available

# sharding strategies whose units give their gathered parameters back after each forward
RESHARDING = ("FULL_SHARD", "HYBRID_SHARD")

PURE_BF16_COST = (
    "pure bf16: weights, gradients and AdamW state in bf16 (8 significant bits): updates smaller "
    "than ~1/256 of a weight are rounded away, so small learning rates train less well than with "
    "fp32 master weights"
)


# -- precision -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    load_dtype: torch.dtype  # dtype of the weights as loaded (and of optimizer state)
    policy: MixedPrecisionPolicy  # what FSDP2 casts to for compute and for the gradient reduction
    use_grad_scaler: bool

    def describe(self) -> str:
        compute = self.policy.param_dtype or self.load_dtype
        reduce = self.policy.reduce_dtype or compute
        text = (
            f"weights {dtype_name(self.load_dtype)}, compute {dtype_name(compute)}, "
            f"gradient reduction {dtype_name(reduce)}"
        )
        if self.use_grad_scaler:
            text += ", sharded gradient scaler"
        if self.load_dtype == torch.bfloat16:
            text += f" ({PURE_BF16_COST})"
        return text


def resolve_precision(cfg: TrainConfig, device: torch.device) -> Precision:
    """pure_bf16: everything bf16. use_fp16: fp16 compute, fp32 master weights and reduction, loss scaling.
    mixed_precision on a bf16 GPU: bf16 compute, fp32 master weights and reduction. Otherwise fp32 (CPU)."""
    if cfg.train.precision == "pure_bf16":
        return Precision(torch.bfloat16, MixedPrecisionPolicy(), False)
    if cfg.train.precision == "fp16":
        return Precision(
            torch.float32, MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32), True
        )
    if cfg.train.precision == "auto" and bf16_compute_available(device):
        return Precision(
            torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), False
        )
    return Precision(torch.float32, MixedPrecisionPolicy(), False)


def load_dtype(cfg: TrainConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.train.precision == "pure_bf16" else torch.float32


# -- units ---------------------------------------------------------------------------------------------------------


def apply_activation_checkpointing(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """Replace each decoder layer by a non-reentrant checkpoint wrapper; returns the wrappers."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    targets = {id(layer) for layer in layers}
    wrapped: list[nn.Module] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                wrapper = checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                parent.register_module(name, wrapper)
                wrapped.append(wrapper)
    return wrapped


def checkpoint_activations(model: nn.Module, cfg) -> None:
    """--fsdp_config.fsdp_activation_checkpointing (TRL: --gradient_checkpointing) under DDP and DeepSpeed: the same
    wrappers FSDP applies before sharding (their state_dict hook keeps the parameter names)."""
    if cfg.parallel.activation_checkpointing:
        apply_activation_checkpointing(model, decoder_layers(model))


# -- low_cpu_fsdp ----------------------------------------------------------------------------------------------------


def materialize_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """After sharding a model that is on the meta device on every rank but 0: allocate the local shards, fill them
    with rank 0's weights (broadcast, each rank keeps its shard), and broadcast rank 0's buffers, which covers the
    non-persistent ones no state dict carries (e.g. rotary inv_freq)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    is_rank0 = dist.get_rank() == 0
    rank0_buffers = [b.detach().clone() for b in model.buffers()] if is_rank0 else []
    model.to_empty(device=device)
    set_model_state_dict(
        model, full_state if is_rank0 else {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    with torch.no_grad():
        for i, buf in enumerate(model.buffers()):
            if is_rank0:
                buf.copy_(rank0_buffers[i])
            dist.broadcast(buf, src=0)


def tensor_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by state-dict name, as plain tensors: bitsandbytes' 4-bit layers add
    their quantisation statistics to state dicts, which are no tensors of the module (rank 0 sends those itself,
    shardtune.model.quantized)."""
    names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return {k: v.as_subclass(torch.Tensor) for k, v in model.state_dict().items() if k in names}


def gather_peak_host_memory() -> list[int]:
    """Peak RSS of every rank (process-level, so it covers loading), in rank order."""
    peaks: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_memory_bytes(torch.device("cpu")))
    return peaks


# -- the strategy ----------------------------------------------------------------------------------------------------


class FSDPStrategy(Strategy):
    name = "fsdp"

    def __init__(self, cfg: TrainConfig, env: DistEnv):
        super().__init__(cfg, env)
        self.precision = resolve_precision(cfg, env.device)
        self.compute_dtype = self.precision.policy.param_dtype or self.precision.load_dtype
        self.fsdp_mesh: DeviceMesh | None = None

    @property
    def offload(self) -> bool:
        return self.cfg.parallel.cpu_offload

    def shard(self, model: nn.Module) -> nn.Module:
        """Activation checkpointing on each decoder layer, then fully_shard on each layer and the root, on the run's
        mesh. Moves no data: a model on the meta device stays there (``shardtune sft --dry_run`` shards one)."""
        fc = self.cfg.parallel
        self.fsdp_mesh = fsdp_mesh(self.mesh, self.dims)
        layers = decoder_layers(model)
        if fc.activation_checkpointing:
            layers = apply_activation_checkpointing(model, layers)
        reshard = fc.sharding_strategy in RESHARDING
        kwargs = dict(
            mesh=self.fsdp_mesh,
            mp_policy=self.precision.policy,
            offload_policy=CPUOffloadPolicy(pin_memory=self.env.device.type == "cuda")
            if self.offload
            else OffloadPolicy(),
        )
        for layer in layers:
            fully_shard(layer, reshard_after_forward=reshard, **kwargs)
        fully_shard(model, reshard_after_forward=reshard, **kwargs)
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        on_meta = any(p.is_meta for p in model.parameters())
        if self.cfg.parallel.low_cpu_fsdp:
            # rank 0 keeps references to the loaded tensors (no copy) until they are broadcast into the shards
            full_state = None if on_meta else tensor_state_dict(model)
        elif not self.offload:
            model.to(self.env.device)
        self.shard(model)
        if self.cfg.parallel.low_cpu_fsdp:
            materialize_from_rank0(model, full_state, torch.device("cpu") if self.offload else self.env.device)
            del full_state
        peaks = gather_peak_host_memory()
        print0(
            "fsdp: peak host memory per rank after loading and sharding: "
            + ", ".join(f"rank {r} {b / 2**20:,.0f} MiB" for r, b in enumerate(peaks))
        )
        if self.precision.use_grad_scaler:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.env.device.type)
        print0(per_rank_state_line(model))
        return model

    def place_frozen(self, model: nn.Module) -> nn.Module:
        """Sharded like the trained model (same mesh and precision; left on the host under CPU offload). With
        --low_cpu_fsdp as the trained model is: rank 0 read the weights, the others built it on the meta device, and
        each rank's shards are filled from rank 0's after sharding."""
        if self.cfg.parallel.low_cpu_fsdp:
            full_state = None if any(p.is_meta for p in model.parameters()) else tensor_state_dict(model)
            self.shard(model)
            materialize_from_rank0(model, full_state, torch.device("cpu") if self.offload else self.env.device)
            return model
        if not self.offload:
            model.to(self.env.device)
        return self.shard(model)

    def accumulating(self, model: nn.Module) -> ContextManager:
        return _no_gradient_sync(model)

    def generating(self, model: nn.Module, whole: bool = False) -> ContextManager:
        # each layer gathers its own in its forward, whole or not
        return _root_unsharded(model, reshard=self.cfg.parallel.sharding_strategy in RESHARDING)

    def autocast(self) -> ContextManager:
        return contextlib.nullcontext()  # MixedPrecisionPolicy casts parameters and inputs itself

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Gathered tensor by tensor onto rank 0's CPU; the other ranks never hold more than their shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.env.rank == 0 else None

    def describe(self) -> str:
        fc = self.cfg.parallel
        assert self.fsdp_mesh is not None, "describe() after wrap()"
        shape = f"replicate {self.dims.dp_replicate} x shard {self.fsdp_mesh.shape[-1]}"
        extras = [
            x
            for x, on in (
                ("activation checkpointing", fc.activation_checkpointing),
                ("CPU offload", self.offload),
                ("low_cpu_fsdp", self.cfg.parallel.low_cpu_fsdp),
            )
            if on
        ]
        return (
            f"fsdp2 {fc.sharding_strategy}, world size {self.env.world_size}, mesh ({shape})"
            f"{self.describe_split()}, "
            f"{self.precision.describe()}" + "".join(f", {x}" for x in extras)
        )


def per_rank_state_line(model: nn.Module) -> str:
    """The start log's line: this rank's training state, from the local shards it holds
    (shardtune.accounting.memory)."""
    state = local_state_bytes(model)
    return (
        f"fsdp: per-rank training state (rank 0's local shards): params {human_bytes(state.params)}, "
        f"grads {human_bytes(state.grads)}, AdamW state {human_bytes(state.optimizer)}"
    )


@contextlib.contextmanager
def _root_unsharded(model: nn.Module, reshard: bool):
    """The root's own parameters (embeddings, final norm, output layer, a vision tower's norms) gathered for the
    duration: ``generate`` (a PeftModel's too) calls the inner model's forward, never the root's, whose hook would
    gather them, and a vision-language model's generate runs its image encoder outside any forward; each decoder
    layer still gathers its own in its forward. The root keeps them after its own forwards meanwhile (a second
    generate's image encoder would meet them sharded); ``reshard``: what the root does after a forward otherwise."""
    assert isinstance(model, FSDPModule), "generating() needs the wrapped root"
    model.set_reshard_after_forward(False, recurse=False)
    model.unshard()
    try:
        yield
    finally:
        model.set_reshard_after_forward(reshard, recurse=False)
        model.reshard()


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module):
    assert isinstance(model, FSDPModule), "accumulating() needs the wrapped root"
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
