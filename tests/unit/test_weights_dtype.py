"""The one rule of the dtype a run holds its trained weights in (shardtune.runtime.precision.weights_dtype), which
the model a run builds, the dry run's meta model and DPO's reference cache key all read."""

from __future__ import annotations

import pytest
import torch

from shardtune.config.schema import PRECISIONS, STRATEGIES
from shardtune.runtime.precision import weights_dtype


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_weights_are_bf16_only_under_fsdp_pure_bf16(strategy, precision):
    """pure_bf16 is FSDP's (parameters, gradients and optimizer state in bf16); every other run keeps fp32 master
    weights, whatever it computes in (auto / fp16 compute in low precision from fp32 weights)."""
    expected = torch.bfloat16 if (strategy, precision) == ("fsdp", "pure_bf16") else torch.float32
    assert weights_dtype(strategy, precision) is expected
