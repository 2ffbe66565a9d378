"""Checks of the model's structure before launch: what FSDP and --compile need to find in it.

Both wrap the model's decoder layers, which they find from its class (FSDP: the classes in ``_no_split_modules``;
--compile: the ``model.layers`` list). The model is built on the meta device (no memory, no weights read), so a
model they cannot handle is reported in one line before any process starts, not by a traceback on every rank.
"""

from __future__ import annotations

from torch import nn

from shardtune.config.schema import ConfigError, TrainConfig


def no_split_class_names(model: nn.Module) -> set[str]:
    """Class names in ``_no_split_modules`` of every transformers model inside ``model`` (PEFT wrappers too)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The outermost modules whose class is a no-split block: the units FSDP wraps one by one."""
    names = no_split_class_names(model)
    if not names:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules: shardtune cannot tell its decoder "
            "layer class; use a Hugging Face causal LM that declares it"
        )
    layers: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names:
            layers.append(module)
            inside.update(id(m) for m in module.modules())
    if not layers:
        raise ValueError(f"no module of class {sorted(names)} found in {type(model).__name__}")
    return layers


def layer_list(model: nn.Module) -> nn.ModuleList:
    """The ``model.layers`` list of a transformers causal LM (what --compile compiles layer by layer)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"--compile: {type(model).__name__} has no model.layers list of decoder layers: drop "
            "--compile for this model"
        )
    return layers


def check_model_structure(cfg: TrainConfig) -> None:
    if not (cfg.parallel.strategy == "fsdp" or cfg.model.compile):
        return
    from shardtune.model.loading import build_model_on_meta

    model = build_model_on_meta(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code)
    if cfg.parallel.strategy == "fsdp":
        try:
            decoder_layers(model)
        except ValueError as e:
            raise ConfigError(
                f"--enable_fsdp: {e}; or train it with DDP or --enable_deepspeed, which need no layer class"
            ) from None
    if cfg.model.compile:
        try:
            layer_list(model)
        except ValueError as e:
            raise ConfigError(str(e)) from None


CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper, in module and parameter names


def unwrapped_name(name: str) -> str:
    """A parameter's name as state dicts give it: activation checkpointing's wrappers show in named_parameters()
    and named_modules() but not in state dicts (their hook strips them)."""
    return name.replace(CHECKPOINT_WRAPPER_PREFIX, "")
