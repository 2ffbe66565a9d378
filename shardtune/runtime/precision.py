"""Which low-precision compute a device gets: the one decision the strategies' precision settings start from.

bf16 mixed precision (``--mixed_precision``, the default) computes in bf16 on CUDA GPUs that support it and in fp32
elsewhere; ``--use_fp16`` (fp16 compute with a gradient scaler) is for CUDA GPUs, typically those without bf16.
On CPU, bf16 / fp16 matmuls are slow at a small model's sizes (measured on the 2-core test machine, 64-256 square:
bf16 2-5 GFLOP/s, fp16 3-4, fp32 70-180), so a CPU run computes in fp32.

Test-only switch: with ``SHARDTUNE_TEST_LOW_PRECISION_ON_CPU=1`` in the environment, a CPU device is treated as a
GPU with bf16 and fp16 for these decisions only. Everything after the decision (autocast, FSDP2's
MixedPrecisionPolicy, the gradient scalers, DeepSpeed's bf16 section) is the code a GPU runs, so the tests execute
the GPU's precision paths on CPU at tiny sizes (tests/distributed/test_precision.py). It is read here and nowhere
else; it is not a user setting.
"""

from __future__ import annotations

import os

import torch

LOW_PRECISION_ON_CPU_ENV = "SHARDTUNE_TEST_LOW_PRECISION_ON_CPU"


def low_precision_forced_on_cpu() -> bool:
    """The test-only switch (see the module docstring)."""
    return os.environ.get(LOW_PRECISION_ON_CPU_ENV) == "1"


def bf16_compute_available(device: torch.device) -> bool:
    """Whether mixed precision computes in bf16 on ``device``: CUDA GPUs with bf16 (and CPUs under the test switch)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return low_precision_forced_on_cpu()


def fp16_compute_available() -> bool:
    """Whether --use_fp16 can run on this machine's training devices: CUDA GPUs (and CPUs under the test switch)."""
    return torch.cuda.is_available() or low_precision_forced_on_cpu()


def weights_dtype(strategy: str, precision: str) -> torch.dtype:
    """The dtype a run holds its trained weights in: bf16 under FSDP's pure_bf16 (parameters, gradients and optimizer
    state all bf16), else fp32 master weights, whatever the compute dtype. One rule, read by the model a run builds,
    the dry run's meta model and DPO's reference cache key, so that they cannot disagree."""
    return torch.bfloat16 if strategy == "fsdp" and precision == "pure_bf16" else torch.float32
