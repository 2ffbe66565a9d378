"""The peak MFU divides by (shardtune/accounting/peak_flops.py): data-sheet peaks looked up by the names torch
reports, in the compute dtype; on CPU a peak measured before the run (or read from the machine's cache file), never
between steps, that a busy machine at measurement time does not leave too low."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from shardtune.accounting.peak_flops import (
    DATA_SHEET_TFLOPS,
    CachedPeak,
    PeakMeter,
    data_sheet_peak,
    machine_key,
    matmul_key,
    measure_matmul_flops,
    read_cached_peak,
    write_cached_peak,
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


def test_a_known_gpu_uses_its_data_sheet_peak_summed_over_ranks_and_says_so(tmp_path):
    # a meter is built with the device's name (torch.cuda.get_device_name on a GPU); two ranks sum their peaks
    meter = PeakMeter(torch.device("cuda"), torch.bfloat16, lambda t: t * 2, device_name="NVIDIA H100 80GB HBM3")
    assert not meter.measured and meter.flops_per_s == 2 * 989e12
    assert meter.after_step(1, 5e15) == 2 * 989e12 and meter.num_measurements == 0  # fixed: never measured
    assert "data-sheet dense bf16 peak of the NVIDIA H100 SXM (989 TFLOP/s per GPU" in meter.describe()
    # an unknown GPU is measured once per machine (here: read from its cache file, so no GPU is needed)
    cache = tmp_path / "peak_flops.json"
    for _ in range(3):  # three runs measured it
        write_cached_peak(cache, machine_key("NVIDIA GeForce GTX 1080", "bf16", "cuda"), 50e12, measured=True)
    unknown = PeakMeter(
        torch.device("cuda"), torch.bfloat16, lambda t: t, device_name="NVIDIA GeForce GTX 1080", cache_file=cache
    )
    assert unknown.cached and unknown.flops_per_s == 50e12
    assert unknown.measured and "measured bf16 matmul peak" in unknown.describe()
    assert "not in shardtune.accounting.peak_flops.DATA_SHEET_TFLOPS" in unknown.describe()


def matmul_step(size: int = 1024, count: int = 4) -> tuple[int, float]:
    """The work that comes closest to the peak: square fp32 matmuls of the size the meter measures with."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    start = time.perf_counter()
    for _ in range(count):
        a @ b
    return 2 * count * size**3, time.perf_counter() - start


def burning_every_core():
    """Processes that keep every core busy with matmuls until the block ends."""
    burn = "import torch\na, b = torch.randn(1024, 1024), torch.randn(1024, 1024)\nwhile True:\n    a @ b\n"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(3 * torch.get_num_threads())]
    time.sleep(1.0)  # the burners are up (importing torch) before the measurement

    class Burning:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            for p in burners:
                p.kill()
            for p in burners:
                p.wait()

    return Burning()


def test_mfu_stays_at_most_100_percent_when_the_machine_is_busy_while_the_peak_is_measured(tmp_path):
    """Processes burn every core while the CPU peak is measured before the run (it reads low), then stop; steps that
    run at the machine's full matmul rate afterwards report an MFU of at most 100%, with nothing measured between
    them; the run leaves the raised peak in the machine's cache file; the next two runs measure again (one busy
    moment is not the machine's figure), keeping the best, and the fourth reads the file instead of measuring."""
    cache = tmp_path / "peak_flops.json"
    with burning_every_core():
        meter = PeakMeter(CPU, torch.float32, lambda t: t, cache_file=cache)
    assert meter.measured and meter.num_measurements == 1 and meter.flops_per_s > 0 and not meter.cached
    assert "measured fp32 matmul peak of this CPU" in meter.describe() and "before the run" in meter.describe()
    for step in range(1, 7):
        flops, seconds = matmul_step()
        peak = meter.after_step(step, flops / seconds)
        assert flops / seconds / peak <= 1.0
    assert meter.num_measurements == 1  # never between steps
    assert not cache.exists()  # written when the run ends, not on the step path
    meter.close()
    best = meter.flops_per_s
    for run in (2, 3):
        again = PeakMeter(CPU, torch.float32, lambda t: t, cache_file=cache)
        assert not again.cached and again.num_measurements == 1 and again.flops_per_s >= best
        best = again.flops_per_s
        again.close()
        assert read_cached_peak(cache, again.cache_key) == CachedPeak(best, run)
    later = PeakMeter(CPU, torch.float32, lambda t: t, cache_file=cache)
    assert later.cached and later.num_measurements == 0 and later.flops_per_s == best
    assert "read from earlier runs' measurements" in later.describe() and str(cache) in later.describe()


def test_the_cache_keeps_one_peak_per_kind_of_run_and_each_rank_reads_its_own_share(tmp_path, monkeypatch):
    """The file holds one rank's peak under a key of processor, dtype, torch and threads x processes: a run with
    another thread count measures its own (and both stay); two ranks sum the per-rank figure, and a run that only
    matches the cache (no faster step) does not rewrite it; a damaged file is measured again."""
    from shardtune.accounting import peak_flops

    monkeypatch.setattr(peak_flops, "NUM_CACHED_MEASUREMENTS", 1)
    cache = tmp_path / "peak_flops.json"
    first = PeakMeter(CPU, torch.float32, lambda t: t, cache_file=cache)
    first.close()
    per_rank = first.flops_per_s
    two_ranks = PeakMeter(CPU, torch.float32, lambda t: t * 2, cache_file=cache)
    assert two_ranks.cached and two_ranks.num_ranks == 2 and two_ranks.flops_per_s == 2 * per_rank
    written = cache.stat().st_mtime_ns
    two_ranks.close()
    assert cache.stat().st_mtime_ns == written
    threads = torch.get_num_threads()
    key = machine_key("cpu model", "fp32", "cpu")
    assert f"{threads} threads x 1 processes" in key and torch.__version__ in key
    try:
        torch.set_num_threads(threads + 1)
        other = PeakMeter(CPU, torch.float32, lambda t: t, cache_file=cache)
        assert not other.cached and other.num_measurements == 1
        other.close()
    finally:
        torch.set_num_threads(threads)
    assert len(json.loads(cache.read_text())) == 2
    cache.write_text("not json")  # a damaged file: measured again, then rewritten
    again = PeakMeter(CPU, torch.float32, lambda t: t, cache_file=cache)
    assert not again.cached and again.num_measurements == 1
    again.close()
    assert len(json.loads(cache.read_text())) == 1


def test_measure_matmul_flops_returns_a_rate():
    assert measure_matmul_flops(CPU, torch.float32, size=128, num_bursts=2) > 0
