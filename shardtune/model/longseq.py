"""Memory levers for long sequences (issue 10): each changes where or when activations live, never the numbers.

- ``--tiled_mlp``: each decoder layer's MLP runs over sequence tiles of ``hidden_size`` tokens (ALST's choice:
  a tile's intermediate activation is about the size of the MLP's weights). Forward keeps only the MLP's input;
  backward recomputes one tile at a time, so the (sequence x intermediate_size) activations, the largest of a
  Llama layer, never exist for the whole sequence.
- ``--activation_offloading``: the tensors autograd saves during the forward (with activation checkpointing,
  each checkpointed layer's input) are kept in CPU memory (pinned, copied asynchronously on CUDA) and brought
  back when backward needs them. Parameters (and views of them) stay where they are. On CPU they already are
  in CPU memory: the lever then changes nothing but is exercised by the same code.
- ``--rope_scaling yarn --rope_factor F``: YaRN RoPE scaling written into the model config before the model is
  built, with the model's ``max_position_embeddings`` as the original length and F times it as the new one, so
  a model trained at 8k fine-tunes at 8k x F (TRL's recipe for 1M tokens). It is saved with the model.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import AutoConfig

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.runtime.distributed import print0


def rope_config_overrides(cfg: TrainConfig, model_config=None) -> dict:
    """Model-config keywords for --rope_scaling (empty when it is off), applied to ``model_config`` (default: the
    model's config.json) by :func:`shardtune.model.loading.training_model_config`, which every loading path builds
    from."""
    if not cfg.model.rope_scaling:
        return {}
    model_config = model_config or AutoConfig.from_pretrained(
        cfg.model.name, trust_remote_code=cfg.model.trust_remote_code
    )
    original = model_config.max_position_embeddings
    rope = dict(
        model_config.rope_parameters,
        rope_type=cfg.model.rope_scaling,
        factor=float(cfg.model.rope_factor),
        original_max_position_embeddings=original,
    )
    return {"rope_parameters": rope, "max_position_embeddings": int(original * cfg.model.rope_factor)}


def check_rope_scaling(cfg: TrainConfig) -> None:
    """Before launch: YaRN is applied on top of plain RoPE only (stacking it on another scaling would change
    what the pretrained positions mean)."""
    if not cfg.model.rope_scaling:
        return
    rope = (
        AutoConfig.from_pretrained(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code).rope_parameters or {}
    )
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(
            f"--rope_scaling {cfg.model.rope_scaling}: {cfg.model.name} already uses RoPE scaling "
            f"{rope.get('rope_type')!r} (factor {rope.get('factor')}): drop --rope_scaling, or start "
            "from a model with plain RoPE"
        )


def apply_memory_levers(model: nn.Module, cfg: TrainConfig, device: torch.device) -> list[str]:
    """Apply --tiled_mlp and --activation_offloading to the bare Hugging Face model; returns the notes printed."""
    notes = []
    if cfg.parallel.tiled_mlp:
        notes.append(tile_mlps(model))
    if cfg.parallel.activation_offloading:
        notes.append(offload_activations(model, device))
    if cfg.model.rope_scaling:
        rope = model.config.rope_parameters
        notes.append(
            f"RoPE scaling {rope['rope_type']} x{rope['factor']:g}: positions up to "
            f"{model.config.max_position_embeddings:,} (trained at "
            f"{rope['original_max_position_embeddings']:,})"
        )
    for line in notes:
        print0(f"long sequences: {line}")
    return notes


# -- tiled MLP ------------------------------------------------------------------------------------------------------


def tile_mlps(model: nn.Module) -> str:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(
        isinstance(getattr(layer, "mlp", None), nn.Module) for layer in layers
    ):
        raise ConfigError(
            f"--tiled_mlp: {type(model).__name__} has no model.layers[i].mlp: drop --tiled_mlp for this model"
        )
    tile_tokens = model.config.hidden_size
    for layer in layers:
        layer.mlp.forward = functools.partial(_tiled_forward, layer.mlp, layer.mlp.forward, tile_tokens)
    return f"MLP of each of the {len(layers)} decoder layers over tiles of {tile_tokens} tokens, recomputed in backward"


@torch.compiler.disable  # a Python loop over tiles inside an autograd.Function: eager inside a compiled layer
def _tiled_forward(mlp: nn.Module, forward, tile_tokens: int, hidden: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled() or hidden.shape[1] <= tile_tokens:
        return forward(hidden)
    trainable = [p for p in mlp.parameters() if p.requires_grad]
    return _TiledMLP.apply(forward, tile_tokens, hidden, *trainable)


class _TiledMLP(torch.autograd.Function):
    """y = mlp(x) over sequence tiles; saves x only, recomputes each tile in backward (under the forward's
    autocast state), and returns the parameter gradients as ordinary outputs, so DDP / FSDP hooks fire once."""

    @staticmethod
    def forward(ctx, forward, tile_tokens: int, hidden: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        device = hidden.device.type
        ctx.forward, ctx.tile_tokens, ctx.params = forward, tile_tokens, params
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(hidden)
        return torch.cat([forward(tile) for tile in hidden.split(tile_tokens, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (hidden,) = ctx.saved_tensors
        device, autocast_on, autocast_dtype = ctx.autocast
        wants_input_grad = ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if wants_input_grad else None
        grad_params: list[torch.Tensor | None] = [None] * len(ctx.params)
        start = 0
        for tile, grad_tile in zip(hidden.split(ctx.tile_tokens, dim=1), grad_out.split(ctx.tile_tokens, dim=1)):
            tile = tile.detach().requires_grad_(wants_input_grad)
            with torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast_on):
                out = ctx.forward(tile)
            inputs = ([tile] if wants_input_grad else []) + list(ctx.params)
            grads = list(torch.autograd.grad(out, inputs, grad_tile, allow_unused=True))
            if wants_input_grad:
                grad_hidden[:, start : start + tile.shape[1]] = grads.pop(0)
            for i, grad in enumerate(grads):
                if grad is not None:
                    grad_params[i] = grad if grad_params[i] is None else grad_params[i] + grad
            start += tile.shape[1]
        return None, None, grad_hidden, *grad_params


# -- activation offloading ------------------------------------------------------------------------------------------


def offload_activations(model: nn.Module, device: torch.device) -> str:
    pin_memory = device.type == "cuda"
    forward = model.forward

    @functools.wraps(forward)
    def offloaded_forward(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(_to_host, pin_memory), _to_device):
            return forward(*args, **kwargs)

    model.forward = offloaded_forward
    if device.type != "cuda":
        return "activation offloading: saved activations are already in CPU memory on CPU (no placement change)"
    return "activation offloading: saved activations kept in pinned CPU memory, copied back in backward"


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _to_host(pin_memory: bool, tensor: torch.Tensor):
    if _is_parameter(tensor) or tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin_memory)
    host.copy_(tensor, non_blocking=pin_memory)
    return tensor.device, host


def _to_device(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)
