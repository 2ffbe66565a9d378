"""The peak FLOP/s that MFU divides by: the data-sheet dense peak of a known GPU in the compute dtype, else a
matmul rate measured on this machine (labelled as measured).

Published MFU figures (PaLM, Megatron-LM, torchtitan) divide by the vendor's dense (no 2:4 sparsity) tensor
peak of the GPU in the dtype the matmuls run in. :data:`DATA_SHEET_TFLOPS` is that table, the one place these
figures live; :func:`data_sheet_peak` looks a GPU up by the name torch reports (``torch.cuda.get_device_name``).
An fp32 run is measured against the TF32 peak when torch lets fp32 matmuls use TF32, and the fp32 peak otherwise.

A CPU (or a GPU missing from the table) has no data sheet: its peak is measured, a square matmul in the compute
dtype, by :class:`PeakMeter`, before the run, every rank at once (as they share the cores in training), and kept in
a cache file (``~/.cache/shardtune/peak_flops.json``) under a key naming the processor, the dtype, torch's version
and the threads x processes: the first NUM_CACHED_MEASUREMENTS runs of a kind measure (each keeping the best), later
ones read the file, and none measures between steps. A busy machine measures low, and every later step's MFU would
then read high (a demo started beside another job printed ``mfu=160%``), so the peak is never below what a step
demonstrably achieved, and a run that beat the cached figure raises it in the file when it ends.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shardtune.runtime.files import write_text_atomic

TFLOPS = 1e12
# the file under shardtune's cache folder that keeps this machine's measured peaks, one per key (machine_key)
PEAK_CACHE_FILE = "peak_flops.json"
# bursts of a measurement (before the run, all ranks at once; the best is kept)
NUM_START_BURSTS = 3
# runs of a kind that measure before their first step (each keeping the best): one busy moment is not the machine's
# figure for good; later runs read the cache
NUM_CACHED_MEASUREMENTS = 3

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


def cpu_name() -> str:
    """The processor's model as the system names it (``model name`` of /proc/cpuinfo), else platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "this CPU"


def machine_key(device_name: str, key: str, device_type: str) -> str:
    """What a measured peak depends on: the processor, the dtype's column, torch (its matmul library), and on a CPU
    the threads of each process and the processes sharing the machine (LOCAL_WORLD_SIZE)."""
    parts = [device_name, key, f"torch {torch.__version__}"]
    if device_type == "cpu":
        parts.append(f"{torch.get_num_threads()} threads x {os.environ.get('LOCAL_WORLD_SIZE', '1')} processes")
    return " | ".join(parts)


@dataclass(frozen=True)
class CachedPeak:
    flops_per_s: float  # one rank's, the best of the runs that measured it or beat it
    num_measurements: int  # runs that measured it (before their first step)


def read_cached_peak(cache_file: Path, key: str) -> CachedPeak | None:
    """The peak kept under ``key``, or None (no file, no such key, or an unreadable file)."""
    try:
        entry = json.loads(cache_file.read_text())[key]
        peak = CachedPeak(float(entry["flops_per_s"]), int(entry["num_measurements"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return peak if peak.flops_per_s > 0 else None


def write_cached_peak(cache_file: Path, key: str, flops_per_s: float, measured: bool) -> None:
    """Keep ``flops_per_s`` (one rank's) under ``key``, the higher of it and what the file holds, counting this run's
    measurement when ``measured``; other keys stay."""
    try:
        table = json.loads(cache_file.read_text())
        table = table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        table = {}
    kept = read_cached_peak(cache_file, key) or CachedPeak(0.0, 0)
    table[key] = {
        "flops_per_s": max(flops_per_s, kept.flops_per_s),
        "num_measurements": kept.num_measurements + int(measured),
        "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(cache_file, json.dumps(table, indent=1, sort_keys=True) + "\n")


class PeakMeter:
    """The peak (all ranks together) that a run's MFU divides by: a data sheet's, or measured before the run (or read
    from the machine's cache file) and raised by any step that runs faster; nothing is measured between steps.

    ``sum_over_ranks`` sums a float64 tensor over the ranks (``shardtune.runtime.distributed.all_reduce_sum``, bound to
    the device); the constructor calls it, so every rank builds its meter at the same point. ``cache_file``: where the
    machine's measured peaks are kept (None: measured by every meter); ``writes_cache``: whether this rank writes it
    (one per machine)."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        sum_over_ranks,
        device_name: str | None = None,
        cache_file: Path | None = None,
        writes_cache: bool = True,
    ):
        # a CPU computes in fp32 (shardtune.runtime.precision); a low-precision CPU run is the tests' stand-in for a
        # GPU, and CPU bf16 / fp16 matmuls take slow paths (0.2 GFLOP/s at 1024 x 1024 on the test machine)
        self.device, self.dtype = device, torch.float32 if device.type == "cpu" else dtype
        self.sum_over_ranks = sum_over_ranks
        self.key = matmul_key(self.dtype, device.type)
        if device_name is None and device.type == "cuda":
            device_name = torch.cuda.get_device_name(device)
        self.device_name = device_name or "this CPU"
        self.sheet = data_sheet_peak(device_name, self.key) if device_name else None
        self.cache_file, self.writes_cache = cache_file, writes_cache
        self.cache_key = machine_key(device_name or cpu_name(), self.key, device.type)
        self.num_measurements, self.num_ranks, self.cached, self.flops_per_s = 0, 1, False, 0.0
        if self.sheet is not None:
            self.flops_per_s = self._sum(self.sheet.flops_per_s)
        else:
            self.flops_per_s = self._start_peak()
        self.start_flops_per_s = self.flops_per_s

    @property
    def measured(self) -> bool:
        return self.sheet is None

    def _sum(self, value: float) -> float:
        return float(self.sum_over_ranks(torch.tensor(value, dtype=torch.float64)))

    def _start_peak(self) -> float:
        """The cached peak when every rank has one measured by NUM_CACHED_MEASUREMENTS runs (one all-reduce decides),
        else every rank measures at once, and keeps the better of that and its cached figure."""
        cached = read_cached_peak(self.cache_file, self.cache_key) if self.cache_file is not None else None
        settled = cached is not None and cached.num_measurements >= NUM_CACHED_MEASUREMENTS
        found, self.num_ranks = (
            int(v) for v in self.sum_over_ranks(torch.tensor([float(settled), 1.0], dtype=torch.float64))
        )
        if cached is not None and found == self.num_ranks:
            self.cached = True
            return self._sum(cached.flops_per_s)
        self.flops_per_s = self._sum(cached.flops_per_s if cached is not None else 0.0)
        return self.measure()

    def measure(self) -> float:
        """Measure every rank's matmul rate at once, and keep the best total so far."""
        rate = measure_matmul_flops(self.device, self.dtype, num_bursts=NUM_START_BURSTS)
        self.flops_per_s = max(self.flops_per_s, self._sum(rate))
        self.num_measurements += 1
        return self.flops_per_s

    def after_step(self, step: int, model_flops_per_s: float) -> float:
        """The peak for step ``step``'s MFU, which achieved ``model_flops_per_s`` (the FLOPs of all ranks over this
        rank's step time): never below that rate, which the machine demonstrably reached. No measurement and no
        collective: the step path pays nothing (each rank keeps its own figure; rank 0's is the one written)."""
        if self.sheet is None:
            self.flops_per_s = max(self.flops_per_s, model_flops_per_s)
        return self.flops_per_s

    def close(self) -> None:
        """Keep a measured peak for the machine's later runs (the higher of the file's and this run's, per rank)."""
        if self.sheet is not None or self.cache_file is None or not self.writes_cache:
            return
        if self.cached and self.flops_per_s <= self.start_flops_per_s:
            return  # nothing new to keep
        try:
            write_cached_peak(self.cache_file, self.cache_key, self.flops_per_s / self.num_ranks, not self.cached)
        except OSError:  # a read-only home: the next run measures again, as it would without a cache
            pass

    def describe(self) -> str:
        """One line for the start log: which peak MFU is against."""
        if self.sheet is not None:
            return (
                f"mfu against the data-sheet dense {self.key} peak of the {self.sheet.gpu} "
                f"({self.sheet.flops_per_s / TFLOPS:g} TFLOP/s per GPU; {self.device_name})"
            )
        what = (
            "GPU not in shardtune.accounting.peak_flops.DATA_SHEET_TFLOPS" if self.device.type == "cuda" else cpu_name()
        )
        where = f"{self.cache_file} (delete it to measure again)" if self.cache_file is not None else "no file"
        when = "read from earlier runs' measurements" if self.cached else "measured before the run, every rank at once"
        return (
            f"mfu against the measured {self.key} matmul peak of {self.device_name} ({what}; "
            f"{self.flops_per_s / 1e9:,.1f} GFLOP/s): {when}; kept in {where}; raised by any faster step"
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
