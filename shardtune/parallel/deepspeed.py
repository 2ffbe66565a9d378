"""DeepSpeed ZeRO (stages 1, 2, 3) behind the strategy face.

The engine is run in DeepSpeed's unmanaged accumulation mode (``managed_gradient_accumulation: false``):
``backward`` only accumulates locally, ``step`` is the accumulation boundary (reduction, clipping, update), which
is exactly the loop's shape. Our loss is already normalised by the global label-token count, so backward does not
divide by the accumulation steps (``scale_wrt_gas=False``) and the loop's x world size undoes ZeRO's mean over ranks.

The optimizer is the same torch AdamW as DDP's, handed to ``deepspeed.initialize``: the ZeRO optimizer keeps using
its param_groups, so the loop's LR schedulers (which act on that AdamW) set the lr DeepSpeed applies.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from shardtune.config.dialects.deepspeed import DEEPSPEED_OWNED_KEYS, deepspeed_file_config
from shardtune.config.schema import ConfigError, TrainConfig, effective_batch_size
from shardtune.model.structure import unwrapped_name
from shardtune.parallel.base import Strategy, dtype_name
from shardtune.parallel.fsdp import checkpoint_activations
from shardtune.parallel.optim import build_optimizer
from shardtune.runtime.distributed import DistEnv
from shardtune.runtime.errors import CheckpointError

DEEPSPEED_TAG = "deepspeed"  # the sub-folder of a checkpoint that DeepSpeed's save_checkpoint writes


def import_deepspeed():
    """Import DeepSpeed lazily (it is an optional extra); on CPU its accelerator must be chosen before the import."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:
        raise ConfigError(
            f"--enable_deepspeed needs DeepSpeed ({e}): pip install --no-build-isolation "
            "'shardtune[deepspeed]' (its build needs torch), or drop the flag"
        ) from None
    return deepspeed


def _drop_auto(value: Any) -> Any:
    """HF Trainer configs say "auto" for what the trainer fills in: here ours is kept, so "auto" entries go."""
    if isinstance(value, dict):
        return {k: _drop_auto(v) for k, v in value.items() if v != "auto"}
    return value


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def deepspeed_config(cfg: TrainConfig, world_size: int, compute_dtype: torch.dtype) -> dict:
    """The DeepSpeed config dict built from ours, with --deepspeed_config.config_file merged over it (the
    validator has refused every key of the file that would change batch sizes, accumulation or the optimizer)."""
    dc = cfg.parallel
    zero: dict[str, Any] = {"stage": dc.zero_stage}
    if dc.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if dc.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.train.batch_size,
        "gradient_accumulation_steps": cfg.train.gradient_accumulation_steps,
        "train_batch_size": effective_batch_size(cfg, world_size),
        "managed_gradient_accumulation": False,
        "zero_optimization": zero,
        "gradient_clipping": cfg.optim.max_grad_norm or 0.0,
        "bf16": {"enabled": compute_dtype == torch.bfloat16},
        "fp16": {"enabled": compute_dtype == torch.float16},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
        # ZeRO's client AdamW is a torch optimizer, not one of DeepSpeed's fused ones
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    extra = {k: v for k, v in _drop_auto(deepspeed_file_config(cfg)).items() if k not in DEEPSPEED_OWNED_KEYS}
    return _merge(config, extra)


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    measures_norm_after_update = True
    title = "DeepSpeed"

    @property
    def skips_overflow_itself(self) -> bool:
        return self.compute_dtype == torch.float16  # DeepSpeed's loss scaler skips overflowing steps itself

    def __init__(self, cfg: TrainConfig, env: DistEnv):
        super().__init__(cfg, env)
        self.zero_stage = cfg.parallel.zero_stage
        self.optimizer: torch.optim.Optimizer | None = None
        self.engine = None

    def wrap(self, model: nn.Module) -> nn.Module:
        deepspeed = import_deepspeed()
        import torch.distributed as dist

        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend=self.env.backend)
        if not getattr(model, "is_quantized", False):  # a bitsandbytes model is loaded onto its device already
            model.to(self.env.device)
        checkpoint_activations(model, self.cfg)
        self.optimizer = build_optimizer(model, self.cfg)
        config = deepspeed_config(self.cfg, self.env.world_size, self.compute_dtype)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=self.optimizer, config=config, dist_init_required=False
        )
        return self.engine

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def place_frozen(self, model: nn.Module) -> nn.Module:
        """A frozen model beside the trained one (DPO's reference), in an engine of its own without an optimizer (as
        TRL's prepare_deepspeed): ZeRO-1 / 2 whole on the device (stage 0), ZeRO-3 partitioned like the trained
        model (its forward gathers each layer's weights and frees them after, as the policy's does). The engine
        casts it as the policy's engine casts the policy (bf16 / fp16 parameters, buffers kept as DeepSpeed keeps
        them), so the first step's policy and reference agree."""
        config = deepspeed_config(self.cfg, self.env.world_size, self.compute_dtype)
        config["zero_optimization"].pop("offload_optimizer", None)  # nothing to optimise
        if self.zero_stage < 3:
            config["zero_optimization"] = {"stage": 0}
        model.to(self.env.device)
        engine, _, _, _ = import_deepspeed().initialize(model=model, config=config, dist_init_required=False)
        engine.eval()  # DeepSpeedEngine.eval returns None
        return engine

    def generating(self, model: nn.Module, whole: bool = False) -> contextlib.AbstractContextManager:
        """ZeRO-3's hooks gather each module's partitions in its forward, the inner model's forward too (layer by
        layer, every decoding step); ``whole`` gathers all of them once for the duration (TRL's
        ds3_gather_for_generation). ZeRO-1 / 2 keep whole parameters on every process."""
        if self.zero_stage < 3 or not whole:
            return contextlib.nullcontext()
        return import_deepspeed().zero.GatheredParameters(list(self.unwrap(model).parameters()))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The client AdamW handed to DeepSpeed in wrap: its param_groups carry the lr the ZeRO optimizer uses."""
        assert self.optimizer is not None, "wrap() builds the optimizer"
        return self.optimizer

    def autocast(self) -> contextlib.AbstractContextManager:
        # the engine casts for bf16 / fp16 itself (its own precision sections), fp32 on CPU
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def clip_and_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        allow_step: Callable[[float | None], bool],
    ) -> tuple[float | None, bool]:
        """DeepSpeed reduces, measures, clips and updates in one step(): the loss is checked before it, the grad norm
        (the engine's, over all partitions, before clipping; ZeRO measures it with clipping off too) after it, by
        the step (measures_norm_after_update)."""
        if not allow_step(None):  # a non-finite loss: stop raised before the update (nan_policy skip is refused)
            raise AssertionError("DeepSpeed steps cannot be skipped (refused by the config check)")
        self.engine.step()
        norm = self.engine.get_global_grad_norm()  # None only with a config file's compute_grad_norm false
        return (float(norm) if norm is not None else None), True

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.engine.step()

    def save_training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """DeepSpeed's own checkpoint (each rank its ZeRO partitions) under ``directory/deepspeed``; frozen base
        weights (PEFT) are left out, as in the other strategies' checkpoints."""
        self.engine.save_checkpoint(
            str(directory), tag=DEEPSPEED_TAG, save_latest=False, exclude_frozen_parameters=bool(self.cfg.peft.method)
        )

    def load_training_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, saved: dict
    ) -> None:
        """--resume was checked before launch; this catches a torchrun restart on another number of nodes."""
        problem = deepspeed_resume_problem(directory, saved, self.env.world_size, self.zero_stage)
        if problem:
            raise CheckpointError(problem)
        loaded, _ = self.engine.load_checkpoint(
            str(directory),
            tag=DEEPSPEED_TAG,
            load_module_strict=not bool(self.cfg.peft.method),
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if loaded is None:
            raise CheckpointError(
                f"DeepSpeed found no checkpoint in {directory / DEEPSPEED_TAG}: the checkpoint is "
                "incomplete; resume from an earlier one (--resume PATH)"
            )

    def checkpoint_state(self) -> dict:
        return {"zero_stage": self.zero_stage}

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        return self._gathered_state(model, trainable_only=False)

    def trainable_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        return self._gathered_state(model, trainable_only=True)

    def _gathered_state(self, model: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor] | None:
        """Rank 0's CPU copy of the module's state. ZeRO-3 gathers one parameter at a time, so no rank holds more
        than one whole parameter beyond its shard."""
        inner = self.unwrap(model)
        main = self.env.rank == 0
        if self.zero_stage < 3:
            if not main:
                return None
            state = {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()}
            if trainable_only:
                trainable = {unwrapped_name(name) for name, p in inner.named_parameters() if p.requires_grad}
                state = {k: v for k, v in state.items() if k in trainable}
            return state
        deepspeed = import_deepspeed()
        state: dict[str, torch.Tensor] = {}
        for name, param in inner.named_parameters(remove_duplicate=False):
            if trainable_only and not param.requires_grad:
                continue
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if main:
                    state[unwrapped_name(name)] = param.detach().cpu().clone()
        if not trainable_only and main:
            keys = set(inner.state_dict())  # persistent buffers only
            state.update({name: b.detach().cpu().clone() for name, b in inner.named_buffers() if name in keys})
        return state if main else None

    def describe(self) -> str:
        dc = self.cfg.parallel
        offload = [what for what, on in (("optimizer", dc.offload_optimizer), ("parameters", dc.offload_param)) if on]
        text = (
            f"deepspeed ZeRO-{self.zero_stage}, world size {self.env.world_size}{self.describe_split()}, "
            f"compute dtype {dtype_name(self.compute_dtype)}"
        )
        text += f", {' and '.join(offload)} offloaded to CPU" if offload else ""
        return text + (", activation checkpointing" if self.cfg.parallel.activation_checkpointing else "")


def deepspeed_resume_problem(path: Path, saved: dict, world_size: int, zero_stage: int) -> str | None:
    """Why a DeepSpeed checkpoint cannot be loaded by this run (its partitions are DeepSpeed's own), or None."""
    stage = saved.get("zero_stage")
    if saved["world_size"] == world_size and stage == zero_stage:
        return None
    return (
        f"{path} holds DeepSpeed ZeRO-{stage} partitions of {saved['world_size']} processes, and this run is "
        f"ZeRO-{zero_stage} on {world_size}: resume with --nproc_per_node {saved['world_size']} (x nodes) and "
        f"--deepspeed_config.zero_stage {stage}, or start a new run from its export (shardtune export)"
    )
