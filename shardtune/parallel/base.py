"""The one face every parallel strategy shows the training loop (docs/architecture.md, principle 1).

The loop never asks which strategy it runs: it wraps the model, runs each micro-batch under
``accumulating`` (no gradient sync) except the last, calls ``backward`` and ``clip_and_step`` (by default
``_grad_norm``, which measures the global gradient norm every step and clips when asked, then ``optimizer_step``), and
asks for the full state dict when the model is saved.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, ContextManager

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardtune.config.schema import TrainConfig
from shardtune.model.structure import unwrapped_name
from shardtune.parallel.dims import ParallelDims
from shardtune.runtime.distributed import DistEnv
from shardtune.runtime.precision import bf16_compute_available

# Checkpoints hold what training changes: frozen base weights (PEFT) are left out.
TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True)


class Strategy(ABC):
    name = "base"
    # the gradient norm is known only after the update (DeepSpeed's step() reduces, measures, clips and updates in one
    # call): the step can stop after it, not before
    measures_norm_after_update = False
    title = "the strategy"  # its name in messages

    @property
    def skips_overflow_itself(self) -> bool:
        """Whether a non-finite gradient norm is an overflow the strategy's loss scaler skips (fp16), not a fault."""
        return self.scaler is not None

    def __init__(self, cfg: TrainConfig, env: DistEnv):
        self.cfg = cfg
        self.env = env
        self.compute_dtype = resolve_compute_dtype(cfg, env.device)
        self.scaler = None
        self.dims = ParallelDims.from_config(cfg, env.world_size, env.local_world_size)
        self._mesh: DeviceMesh | None = None

    @property
    def mesh(self) -> DeviceMesh:
        """The run's one device mesh (shardtune.parallel.dims), built on first use: every rank uses it at the same
        point (FSDP's wrap, the sequence split's groups), as building it is a collective."""
        if self._mesh is None:
            self._mesh = self.dims.build_mesh(self.env.device.type)
        return self._mesh

    # -- the face ------------------------------------------------------------------------------------------------
    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Move / shard the model onto the device(s) and return what the loop calls forward on."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def generating(self, model: nn.Module, whole: bool = False) -> ContextManager:
        """Context for ``generate`` on ``unwrap(model)``: generation calls the inner model's forward, so a strategy
        whose wrapper gathers weights in its own forward gathers them here instead. ``whole``: a strategy that
        gathers layer by layer may gather every layer for the duration instead (DeepSpeed ZeRO-3; faster, the whole
        model's memory on every process)."""
        return contextlib.nullcontext()

    @property
    def grad_average_size(self) -> int:
        """How many ranks' gradients the strategy averages; the loss is multiplied by it to undo the mean."""
        return self.env.world_size

    def place_frozen(self, model: nn.Module) -> nn.Module:
        """A frozen model that runs beside the trained one (DPO's reference): whole, on this rank's device."""
        return model.to(self.env.device)

    def accumulating(self, model: nn.Module) -> ContextManager:
        """Context for non-final micro-batches of an optimizer step: skip the gradient reduction."""
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.env.device.type, dtype=self.compute_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def _grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
        """The global gradient norm (before clipping), on the device, clipping to max_norm unless it is None; a step
        of clip_and_step. Sharded gradients (FSDP2's DTensors, HSDP's too) give their norm over the whole mesh, as
        clip_grad_norm_ takes it."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The torch optimizer of the wrapped model (the LR schedulers act on its param_groups)."""
        from shardtune.parallel.optim import build_optimizer

        return build_optimizer(model, self.cfg)

    def clip_and_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        allow_step: Callable[[torch.Tensor | float | None], bool],
    ) -> tuple[torch.Tensor | float | None, bool]:
        """Measure the global gradient norm, clip to max_norm (None: no clipping), ask allow_step(the norm before
        clipping, a device tensor) whether to update (it raises to stop; False skips the update and drops the
        gradients), then step. Returns (grad norm, whether the weights were updated)."""
        grad_norm = self._grad_norm(model, optimizer, max_norm)
        if not allow_step(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            return grad_norm, False
        self.optimizer_step(optimizer)
        return grad_norm, True

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @abstractmethod
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict on CPU, on global rank 0 only (None elsewhere)."""

    def trainable_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Only the trainable parameters (an adapter), as full tensors on global rank 0's CPU (None elsewhere).
        Frozen parameters are dropped before anything is gathered, so sharded base weights never move."""
        inner = self.unwrap(model)
        if self._state_from_parameters():
            state = {k: v.detach().cpu() for k, v in self._trainable_parameters(model).items()}
        else:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
            state = get_model_state_dict(inner, options=options)
        trainable = {unwrapped_name(name) for name, p in inner.named_parameters() if p.requires_grad}
        return (
            {unwrapped_name(k): v for k, v in state.items() if unwrapped_name(k) in trainable}
            if self.env.rank == 0
            else None
        )

    def _state_from_parameters(self) -> bool:
        """bitsandbytes' 8-bit layers add state-dict entries that are not attributes (SCB, weight_format), which
        torch's state-dict helpers cannot map: then the (unsharded) trainable parameters are taken directly."""
        return self.cfg.model.quantization == "8bit"

    def _trainable_parameters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {name: p for name, p in self.unwrap(model).named_parameters() if p.requires_grad}

    def training_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Model and optimizer state as each rank holds it, for torch.distributed.checkpoint (nothing gathered).

        Frozen parameters are left out, so a PEFT checkpoint holds the adapter and its optimizer state only.
        """
        if self._state_from_parameters():
            model_state = {k: p.detach() for k, p in self._trainable_parameters(model).items()}
            return {
                "model": model_state,
                "optimizer": get_optimizer_state_dict(model, optimizer, options=TRAINABLE_ONLY),
            }
        model_state, optimizer_state = get_state_dict(model, optimizer, options=TRAINABLE_ONLY)
        return {"model": without_quantization_state(model_state), "optimizer": optimizer_state}

    def load_training_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Put a state filled by torch.distributed.checkpoint.load back into the model and optimizer.

        Not strict: frozen parameters keep their loaded values; every trainable one was in ``state`` (built by
        training_state_dict), and dcp.load fails when the checkpoint lacks any of them.
        """
        if self._state_from_parameters():
            with torch.no_grad():
                for name, p in self._trainable_parameters(model).items():
                    p.copy_(state["model"][name])
            set_optimizer_state_dict(model, optimizer, state["optimizer"], options=TRAINABLE_ONLY)
            return
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(ignore_frozen_params=True, strict=False),
        )

    def save_training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """Every rank writes its part of the model and optimizer state into ``directory`` (a checkpoint's staging
        folder): torch.distributed.checkpoint files, which any world size and strategy of the face can load."""
        import torch.distributed.checkpoint as dcp

        state = self.training_state_dict(model, optimizer)
        if not self.cfg.checkpoint.save_optimizer:  # llama-cookbook's default: the model only
            del state["optimizer"]
        dcp.save(state, checkpoint_id=directory)

    def load_training_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, saved: dict
    ) -> None:
        """Every rank reads back what save_training_state wrote (``saved``: the checkpoint's trainer_state; a
        DeepSpeed checkpoint never gets here, --resume refuses it before launch)."""
        import torch.distributed.checkpoint as dcp

        from shardtune.runtime.checkpoint_reader import SafeFileSystemReader

        state = self.training_state_dict(model, optimizer)
        reader = SafeFileSystemReader(str(directory))  # its .metadata unpickles no code
        # first alone: dcp.load would log a refusal as a warning and try other files
        stored = reader.read_metadata().state_dict_metadata.keys()
        unsaved = _without_unsaved_optimizer_state(state, stored)
        dcp.load(state, storage_reader=reader)
        self.load_training_state_dict(model, optimizer, state)
        _forget_optimizer_state(self.unwrap(model), optimizer, unsaved)

    def checkpoint_state(self) -> dict:
        """Extra facts a checkpoint's trainer_state records about how this strategy saved it."""
        return {}

    def describe(self) -> str:
        return (
            f"{self.name}, world size {self.env.world_size}{self.describe_split()}, compute dtype "
            f"{dtype_name(self.compute_dtype)}"
            + (", activation checkpointing" if self.cfg.parallel.activation_checkpointing else "")
        )

    def describe_split(self) -> str:
        """How rows are split (empty when they are not): part of every strategy's start line."""
        if not self.dims.sequence_split:
            return ""
        return (
            f", rows split over context parallel {self.dims.cp} x sequence parallel {self.dims.sp} "
            f"(data parallel {self.dims.dp_size})"
        )


def without_quantization_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop bitsandbytes' 4-bit statistics (``...weight.absmax``, ``.quant_map``, ``.quant_state.*``): they belong to
    the frozen base, come back with it when it is loaded, and only unsharded (DDP) layers list them, so a checkpoint
    that held them could not be read under FSDP, nor an FSDP one under DDP."""

    def is_quantization_state(key: str) -> bool:
        _, found, rest = key.rpartition(".weight.")
        return bool(found) and (rest in QUANT_STATE_KEYS or rest.startswith("quant_state."))

    return {k: v for k, v in state.items() if not is_quantization_state(k)}


# the entries bitsandbytes' QuantState.as_dict adds after "weight." (bitsandbytes.functional.QuantState.valid_qs_keys)
QUANT_STATE_KEYS = frozenset(
    {
        "absmax",
        "quant_map",
        "nested_absmax",
        "nested_quant_map",
        "quant_state",
        "quant_type",
        "blocksize",
        "dtype",
        "shape",
        "nested_blocksize",
        "nested_dtype",
        "nested_offset",
    }
)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """fp16 when asked (a CUDA device: checked before launch); bf16 autocast on GPUs that support it; fp32 on CPU,
    where bf16 matmuls are slow (shardtune.runtime.precision has the test-only switch that makes a CPU take the GPU's
    path)."""
    if cfg.train.precision == "fp16":
        return torch.float16
    if cfg.train.precision == "auto" and bf16_compute_available(device):
        return torch.bfloat16
    return torch.float32


# wrappers whose names torch's state-dict helpers leave out of a parameter's FQN
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def _without_unsaved_optimizer_state(state: dict, stored) -> set[str]:
    """Take out of a load template the optimizer state of parameters the checkpoint holds none of, and return their
    names. A trainable parameter that never had a gradient (LLaVA's vision-tower post_layernorm: the model reads the
    tower's hidden states, not its pooled output) has no optimizer state when the run saves; a fresh optimizer's
    template has state for every parameter (torch's state-dict helpers initialise it), so dcp.load would refuse the
    checkpoint."""
    optimizer_state = state.get("optimizer", {}).get("state", {})
    held = {key[len("optimizer.state.") :] for key in stored if key.startswith("optimizer.state.")}
    unsaved = {fqn for fqn in optimizer_state if not any(key.startswith(f"{fqn}.") for key in held)}
    for fqn in unsaved:
        del optimizer_state[fqn]
    return unsaved


def _forget_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, names: set[str]) -> None:
    """The parameters named had no optimizer state when the run saved: drop what the template initialised, so the
    resumed optimizer is the saved one (Adam creates a parameter's state at its first gradient, step 0)."""
    if not names:
        return
    for name, param in model.named_parameters():
        for prefix in _WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        if name in names:
            optimizer.state.pop(param, None)
