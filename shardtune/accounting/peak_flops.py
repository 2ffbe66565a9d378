"""The peak FLOP/s that MFU divides by: the data-sheet dense peak of a known GPU in the compute dtype, else a
matmul rate measured on this machine (labelled as measured).

Published MFU figures (PaLM, Megatron-LM, torchtitan) divide by the vendor's dense (no 2:4 sparsity) tensor
peak of the GPU in the dtype the matmuls run in. :data:`DATA_SHEET_TFLOPS` is that table, the one place these
figures live; :func:`data_sheet_peak` looks a GPU up by the name torch reports (``torch.cuda.get_device_name``).
An fp32 run is measured against the TF32 peak when torch lets fp32 matmuls use TF32, and the fp32 peak otherwise.

A CPU (or a GPU missing from the table) has no data sheet: its peak is measured, a square matmul in the compute
dtype, by :class:`PeakMeter`. A single burst at start-up is fragile: a machine busy at that moment measures low,
and the MFU of every later step then reads high (a demo started beside another job printed ``mfu=160%`` for
hundreds of steps). So the meter measures collectively (every rank at once, as they share the cores in training)
after steps 1, 2, 4, 8, ... and again after any step that ran faster than the peak so far, keeps the best, and
never reports a peak below what a step demonstrably achieved.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

TFLOPS = 1e12

# Dense tensor-core (or vector, for fp32) peaks from the vendors' data sheets, in TFLOP/s, per GPU. Keys of each
# row: "bf16", "fp16", "tf32", "fp32". Rows are tried in order and the first pattern found in the name wins, so a
# specific form (H100 NVL, H100 PCIe) comes before the general one (H100 = SXM). Names as torch reports them,
# e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-16GB".
DATA_SHEET_TFLOPS: tuple[tuple[str, str, dict[str, float]], ...] = (
    # pattern (regex, searched case-insensitively), the GPU as the data sheet names it, peaks
    (r"\bB200\b", "NVIDIA B200 (HGX)", {"bf16": 2250, "fp16": 2250, "tf32": 1100}),
    (r"\bH200\b.*\bNVL\b", "NVIDIA H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60}),
    (r"\bH200\b", "NVIDIA H200 SXM", {"bf16": 989, "fp16": 989, "tf32": 494.5, "fp32": 67}),
    (r"\bH100\b.*\bNVL\b", "NVIDIA H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60}),
    (r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe", {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    (r"\bH100\b", "NVIDIA H100 SXM", {"bf16": 989, "fp16": 989, "tf32": 494.5, "fp32": 67}),
    (r"\bH800\b", "NVIDIA H800 SXM", {"bf16": 989, "fp16": 989, "tf32": 494.5, "fp32": 67}),
    (r"\bA100\b", "NVIDIA A100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    (r"\bA800\b", "NVIDIA A800", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    (r"\bL40S\b", "NVIDIA L40S", {"bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6}),
    (r"\bL40\b", "NVIDIA L40", {"bf16": 181, "fp16": 181, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", "NVIDIA L4", {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3}),
    # AWS's A10G: the A10 data sheet's figures, which are the ones usually quoted for it
    (r"\bA10G?\b", "NVIDIA A10", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
    (r"\bRTX A6000\b", "NVIDIA RTX A6000", {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7}),
    # Volta has no bf16 or tf32 tensor cores: a bf16 run on it is measured, not looked up
    (r"\bV100\b.*\bPCIE\b", "NVIDIA V100 PCIe", {"fp16": 112, "fp32": 14}),
    (r"\bV100\b", "NVIDIA V100 SXM2", {"fp16": 125, "fp32": 15.7}),
    (r"\bT4\b", "NVIDIA T4", {"fp16": 65, "fp32": 8.1}),
    (r"\bMI300X\b|\bMI325X\b", "AMD Instinct MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
)

DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class SheetPeak:
    flops_per_s: float
    gpu: str  # the GPU as its data sheet names it
    key: str  # "bf16", "fp16", "tf32" or "fp32"


def matmul_key(dtype: torch.dtype, device_type: str) -> str:
    """The data-sheet column a matmul in ``dtype`` runs at: fp32 on a GPU runs on TF32 tensor cores when torch
    allows it (``torch.backends.cuda.matmul.allow_tf32``, ``torch.set_float32_matmul_precision("high")``)."""
    key = DTYPE_KEYS.get(dtype, "fp32")
    if key == "fp32" and device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return key


def data_sheet_peak(device_name: str, key: str) -> SheetPeak | None:
    """The dense peak of the GPU named ``device_name`` (as torch reports it) in column ``key``; None when the GPU
    is not in :data:`DATA_SHEET_TFLOPS` or its data sheet has no such figure."""
    for pattern, gpu, peaks in DATA_SHEET_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return SheetPeak(peaks[key] * TFLOPS, gpu, key) if key in peaks else None
    return None


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, size: int | None = None, num_bursts: int = 3
) -> float:
    """Best FLOP/s of ``num_bursts`` bursts of two square matmuls in ``dtype`` (after one warm-up). CPU: 1024 x 1024
    with the threads this process has (the rate of 2048 x 2048 on the 2-core test machine, 8x sooner); GPU:
    8192 x 8192."""
    size = size or (8192 if device.type == "cuda" else 1024)
    # a generator of its own: a measurement between training steps leaves the global random state as it was
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up
    sync()
    best = 0.0
    for _ in range(num_bursts):
        start = time.perf_counter()
        for _ in range(2):
            a @ b
        sync()
        best = max(best, 2 * 2 * size**3 / (time.perf_counter() - start))
    return best


def is_remeasure_step(step: int) -> bool:
    """Steps after which a measured peak is measured again: 1, 2, 4, 8, ... (the same on every rank)."""
    return step > 0 and step & (step - 1) == 0


class PeakMeter:
    """The peak (all ranks together) that a run's MFU divides by.

    ``sum_over_ranks`` sums a float64 tensor over the ranks (``shardtune.runtime.distributed.all_reduce_sum``, bound to
    the device); every method that calls it is entered by every rank at the same step.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, sum_over_ranks, device_name: str | None = None):
        # a CPU computes in fp32 (shardtune.runtime.precision); a low-precision CPU run is the tests' stand-in for a
        # GPU, and CPU bf16 / fp16 matmuls take slow paths (0.2 GFLOP/s at 1024 x 1024 on the test machine)
        self.device, self.dtype = device, torch.float32 if device.type == "cpu" else dtype
        dtype = self.dtype
        self.sum_over_ranks = sum_over_ranks
        self.key = matmul_key(dtype, device.type)
        if device_name is None and device.type == "cuda":
            device_name = torch.cuda.get_device_name(device)
        self.device_name = device_name or "this CPU"
        sheet = data_sheet_peak(device_name, self.key) if device_name else None
        self.sheet = sheet
        self.num_measurements = 0
        if sheet is not None:
            self.flops_per_s = float(self._sum(sheet.flops_per_s))
        else:
            self.flops_per_s = 0.0  # measured after the first step (so that it does not delay it)

    @property
    def measured(self) -> bool:
        return self.sheet is None

    def _sum(self, value: float) -> float:
        return float(self.sum_over_ranks(torch.tensor(value, dtype=torch.float64)))

    def measure(self) -> float:
        """Measure every rank's matmul rate at once, and keep the best total so far."""
        # one burst per measurement: the run measures again after steps 1, 2, 4, 8, ... and keeps the best, so the
        # bursts of one measurement would only repeat that (a CPU burst costs the run ~0.1 s per process)
        self.flops_per_s = max(self.flops_per_s, self._sum(measure_matmul_flops(self.device, self.dtype, num_bursts=1)))
        self.num_measurements += 1
        return self.flops_per_s

    def after_step(self, step: int, model_flops_per_s: float) -> float:
        """The peak for step ``step``'s MFU, which achieved ``model_flops_per_s`` (the FLOPs of all ranks over this
        rank's step time). A data-sheet peak is fixed. A measured one is measured again after steps 1, 2, 4, ... and
        after any step that ran faster than it (one all-reduce decides, so every rank measures at once), and is
        never below the rate a step achieved (the ranks' mean): the machine demonstrably reached that."""
        if self.sheet is not None:
            return self.flops_per_s
        faster, rate_sum, num_ranks = self.sum_over_ranks(
            torch.tensor([float(model_flops_per_s > self.flops_per_s), model_flops_per_s, 1.0], dtype=torch.float64)
        ).tolist()
        if faster > 0 or is_remeasure_step(step):
            self.measure()
        self.flops_per_s = max(self.flops_per_s, rate_sum / num_ranks)
        return self.flops_per_s

    def describe(self) -> str:
        """One line for the start log: which peak MFU is against."""
        if self.sheet is not None:
            return (
                f"mfu against the data-sheet dense {self.key} peak of the {self.sheet.gpu} "
                f"({self.sheet.flops_per_s / TFLOPS:g} TFLOP/s per GPU; {self.device_name})"
            )
        what = "GPU not in shardtune.accounting.peak_flops.DATA_SHEET_TFLOPS" if self.device.type == "cuda" else "CPU"
        return (
            f"mfu against the measured {self.key} matmul peak of {self.device_name} ({what}): measured on "
            "every rank at once after steps 1, 2, 4, 8, ... and after any faster step, best kept"
        )


def device_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """One device's peak FLOP/s in ``dtype`` and where it comes from: the data sheet of a known GPU, else a
    measurement (for the benchmarks, which run without a :class:`PeakMeter`)."""
    dtype = torch.float32 if device.type == "cpu" else dtype  # as PeakMeter: CPUs compute in fp32
    key = matmul_key(dtype, device.type)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sheet = data_sheet_peak(name, key)
        if sheet is not None:
            return sheet.flops_per_s, f"data sheet: {sheet.gpu} dense {key}"
    return measure_matmul_flops(device, dtype, num_bursts=8), f"measured: {key} matmul"
