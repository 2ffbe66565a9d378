"""TRL's ``create_reference_model``: a frozen copy of a model, the fixed reference a preference or RL objective
compares the trained model with (``DPOTrainer(model, ref_model=create_reference_model(model), ...)``)."""

from __future__ import annotations

import copy

from torch import nn

from shardtune.config.schema import ConfigError


def create_reference_model(
    model: nn.Module, num_shared_layers: int | None = None, pattern: str | None = None
) -> nn.Module:
    """A deep copy of ``model`` with every parameter frozen, in eval mode; ``model`` itself is left as it was.

    TRL can also share the first ``num_shared_layers`` layers' storage between the two (freezing them in ``model``).
    shardtune hands models to its processes as saved weights, where neither the sharing nor the frozen flags
    survive, so that is refused rather than half done."""
    if num_shared_layers is not None or pattern is not None:
        raise ConfigError(
            "create_reference_model: num_shared_layers / pattern share layers between the model and its reference "
            "in this process, which shardtune's processes (loading saved weights) cannot keep: call "
            "create_reference_model(model), and freeze the model's first layers with freeze_layers N"
        )
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval()
