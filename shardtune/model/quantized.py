"""--low_cpu_fsdp for 4-bit models: global rank 0 loads and quantises, every other rank builds the same quantised
structure on the meta device and receives its shards from rank 0 (as for unquantised models).

bitsandbytes keeps what a packed 4-bit weight needs besides its bytes (absmax, the code, nested statistics: its
QuantState) as an attribute of the layer, not as a parameter or buffer, so no state-dict broadcast carries it.
Rank 0 therefore sends each layer's packed shape and QuantState once (a small object broadcast); the other ranks
put a meta Linear4bit of that shape in place of each quantised linear layer, with the QuantState on their device.
The packed bytes themselves then travel like every other parameter (FSDP's broadcast from rank 0 into shards).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardtune.config.schema import TrainConfig
from shardtune.runtime.distributed import DistEnv


def load_quantized_on_rank0(cfg: TrainConfig, env: DistEnv) -> nn.Module:
    """Rank 0: the loaded 4-bit model. Other ranks: its structure on the meta device, with rank 0's QuantStates."""
    from shardtune.model.loading import build_model_on_meta, model_head, training_model_config
    from shardtune.model.peft import compute_dtype, load_quantized_model, use_generic_cpu_kernels

    model = load_quantized_model(cfg, env.device) if env.rank == 0 else None
    layout = [quantized_layout(model) if model is not None else None]
    dist.broadcast_object_list(layout, src=0)
    if model is not None:
        return model
    model = build_model_on_meta(
        cfg.model.name,
        dtype=compute_dtype(cfg, env.device),
        config=training_model_config(cfg),
        trust_remote_code=cfg.model.trust_remote_code,
        head=model_head(cfg),
    )
    for name, (shape, storage, quant_state) in layout[0].items():
        _replace_with_meta_4bit(model, name, shape, storage, quant_state, env.device)
    model.is_loaded_in_4bit = True  # what peft reads to treat the base as quantised
    if env.device.type == "cpu":
        use_generic_cpu_kernels(model)  # as load_quantized_model does on rank 0
    return model


def quantized_layout(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype, dict]]:
    """{module name: (packed weight shape, storage dtype, QuantState as CPU tensors)} of every 4-bit linear layer."""
    import bitsandbytes as bnb

    layout = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = {
                k: v.cpu() if torch.is_tensor(v) else v
                for k, v in module.weight.quant_state.as_dict(packed=True).items()
            }
            layout[name] = (tuple(module.weight.shape), module.weight.dtype, state)
    return layout


def _replace_with_meta_4bit(
    model: nn.Module, name: str, shape: tuple[int, ...], storage: torch.dtype, quant_state: dict, device: torch.device
) -> None:
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    parent_name, _, child_name = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    linear = getattr(parent, child_name)
    state = QuantState.from_dict(quant_state, device=device)
    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=linear.weight.dtype,
        quant_type=state.quant_type,
        quant_storage=storage,
        device="meta",
    )
    layer.weight = bnb.nn.Params4bit(
        torch.empty(shape, dtype=storage, device="meta"),
        requires_grad=False,
        quant_state=state,
        blocksize=state.blocksize,
        compress_statistics=state.nested,
        quant_type=state.quant_type,
        quant_storage=storage,
        module=layer,
        bnb_quantized=True,
    )
    layer.quant_state = state
    if linear.bias is not None:
        layer.bias = linear.bias
    setattr(parent, child_name, layer)
