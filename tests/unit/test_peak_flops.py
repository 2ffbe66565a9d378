"""The peak MFU divides by (shardtune/accounting/peak_flops.py): data-sheet peaks looked up by the names torch
reports, in the compute dtype; on CPU a measured peak that a busy machine at measurement time does not leave too low."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from shardtune.accounting.peak_flops import (
    DATA_SHEET_TFLOPS,
    PeakMeter,
    data_sheet_peak,
    is_remeasure_step,
    matmul_key,
    measure_matmul_flops,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "name, key, tflops, gpu",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989, "NVIDIA H100 SXM"),
        ("NVIDIA H100 PCIe", "bf16", 756, "NVIDIA H100 PCIe"),
        ("NVIDIA H100 NVL", "bf16", 835.5, "NVIDIA H100 NVL"),
        ("NVIDIA H200", "bf16", 989, "NVIDIA H200 SXM"),
        ("NVIDIA H200", "tf32", 494.5, "NVIDIA H200 SXM"),
        ("NVIDIA H200", "fp32", 67, "NVIDIA H200 SXM"),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312, "NVIDIA A100"),
        ("NVIDIA A100-PCIE-40GB", "tf32", 156, "NVIDIA A100"),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5, "NVIDIA A100"),
        ("NVIDIA L40S", "bf16", 362, "NVIDIA L40S"),
        ("NVIDIA L40", "bf16", 181, "NVIDIA L40"),
        ("NVIDIA L4", "bf16", 121, "NVIDIA L4"),
        ("NVIDIA A10G", "bf16", 125, "NVIDIA A10"),
        ("NVIDIA A10", "fp32", 31.2, "NVIDIA A10"),
        ("Tesla V100-SXM2-16GB", "fp16", 125, "NVIDIA V100 SXM2"),
        ("Tesla V100-PCIE-32GB", "fp16", 112, "NVIDIA V100 PCIe"),
        ("Tesla T4", "fp32", 8.1, "NVIDIA T4"),
    ],
)
def test_a_gpu_is_looked_up_by_the_name_torch_reports(name, key, tflops, gpu):
    peak = data_sheet_peak(name, key)
    assert peak is not None and peak.flops_per_s == tflops * 1e12 and peak.gpu == gpu and peak.key == key


def test_an_unknown_gpu_or_a_dtype_its_data_sheet_lacks_has_no_data_sheet_peak():
    assert data_sheet_peak("NVIDIA GeForce GTX 1080", "bf16") is None
    assert data_sheet_peak("Tesla V100-SXM2-16GB", "bf16") is None  # Volta: no bf16 tensor cores


def test_every_row_has_dense_peaks_ordered_as_the_hardware_runs_them():
    for _, gpu, peaks in DATA_SHEET_TFLOPS:
        assert set(peaks) <= {"bf16", "fp16", "tf32", "fp32"}, gpu
        tensor = peaks.get("bf16", peaks["fp16"])  # the half-precision tensor peak, which every row has
        assert tensor >= peaks.get("tf32", 0) and tensor >= peaks.get("fp32", 0), gpu
        assert "tf32" not in peaks or peaks["tf32"] >= peaks.get("fp32", 0), gpu


def test_fp32_runs_are_measured_against_the_tf32_peak_only_when_torch_uses_tf32():
    assert matmul_key(torch.bfloat16, "cuda") == "bf16" and matmul_key(torch.float16, "cuda") == "fp16"
    assert matmul_key(torch.float32, "cpu") == "fp32"
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert matmul_key(torch.float32, "cuda") == "fp32"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert matmul_key(torch.float32, "cuda") == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def test_a_known_gpu_uses_its_data_sheet_peak_summed_over_ranks_and_says_so():
    # a meter is built with the device's name (torch.cuda.get_device_name on a GPU); two ranks sum their peaks
    meter = PeakMeter(torch.device("cuda"), torch.bfloat16, lambda t: t * 2, device_name="NVIDIA H100 80GB HBM3")
    assert not meter.measured and meter.flops_per_s == 2 * 989e12
    assert meter.after_step(1, 5e15) == 2 * 989e12 and meter.num_measurements == 0  # fixed: never measured
    assert "data-sheet dense bf16 peak of the NVIDIA H100 SXM (989 TFLOP/s per GPU" in meter.describe()
    unknown = PeakMeter(torch.device("cuda"), torch.bfloat16, lambda t: t, device_name="NVIDIA GeForce GTX 1080")
    assert unknown.measured and "measured bf16 matmul peak" in unknown.describe()
    assert "not in shardtune.accounting.peak_flops.DATA_SHEET_TFLOPS" in unknown.describe()


def test_the_measured_peak_is_remeasured_after_steps_1_2_4_8():
    assert [s for s in range(1, 20) if is_remeasure_step(s)] == [1, 2, 4, 8, 16]


def matmul_step(size: int = 1024, count: int = 4) -> tuple[int, float]:
    """The work that comes closest to the peak: square fp32 matmuls of the size the meter measures with."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    start = time.perf_counter()
    for _ in range(count):
        a @ b
    return 2 * count * size**3, time.perf_counter() - start


def test_mfu_stays_at_most_100_percent_when_the_machine_is_busy_while_the_peak_is_measured():
    """Processes burn every core while the CPU peak is first measured (it reads low), then stop; steps that run at
    the machine's full matmul rate afterwards still report an MFU of at most 100%."""
    meter = PeakMeter(CPU, torch.float32, lambda t: t)
    assert meter.measured and "measured fp32 matmul peak of this CPU" in meter.describe()
    burn = "import torch\na, b = torch.randn(1024, 1024), torch.randn(1024, 1024)\nwhile True:\n    a @ b\n"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(3 * torch.get_num_threads())]
    try:
        time.sleep(1.0)  # the burners are up (importing torch) before the measurement
        busy_peak = meter.measure()
    finally:
        for p in burners:
            p.kill()
        for p in burners:
            p.wait()
    assert busy_peak > 0
    for step in range(2, 8):
        flops, seconds = matmul_step()
        peak = meter.after_step(step, flops / seconds)
        assert flops / seconds / peak <= 1.0
    assert meter.num_measurements >= 3  # after steps 2 and 4 at least


def test_measure_matmul_flops_returns_a_rate():
    assert measure_matmul_flops(CPU, torch.float32, size=128, num_bursts=2) > 0
