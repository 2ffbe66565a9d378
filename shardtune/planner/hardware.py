"""The devices a plan fits onto: data-sheet memory and speed of the GPUs the planner knows, the host, and the
``--gpu`` / ``--gpu_memory`` flags that name them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from shardtune.accounting.memory import GIB
from shardtune.accounting.peak_flops import data_sheet_peak
from shardtune.config.schema import ConfigError

# -- hardware --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """Peak rates the estimate assumes (data-sheet dense bf16 matmul; usable link bandwidths)."""

    name: str
    memory_bytes: float
    matmul_flops: float  # per second, dense, in the compute dtype
    intra_node_bytes_s: float  # per GPU, achievable collective bus bandwidth inside a node
    inter_node_bytes_s: float  # per GPU, across nodes
    compute_bytes: int = 2  # bf16
    host_memory_bytes: float = 2 * 2**40  # CPU memory of one node (all its GPUs' processes share it)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.memory_bytes / GIB:.0f} GiB, {self.matmul_flops / 1e12:.0f} TFLOP/s dense "
            f"{'bf16' if self.compute_bytes == 2 else 'fp32'}, {self.intra_node_bytes_s / 1e9:.0f} GB/s in a "
            f"node, {self.inter_node_bytes_s / 1e9:.0f} GB/s across nodes; host memory "
            f"{self.host_memory_bytes / GIB:,.0f} GiB per node"
        )


GB = 1e9


def bf16_peak(name: str) -> float:
    """The data-sheet dense bf16 peak (shardtune.accounting.peak_flops: the one table MFU divides by too)."""
    return data_sheet_peak(name, "bf16").flops_per_s


DEVICES: dict[str, Device] = {
    # NVLink 4 (900 GB/s bidirectional) reaches ~360 GB/s of NCCL bus bandwidth; 400 Gb/s InfiniBand per GPU = 50 GB/s
    # host memory per node: what an 8-GPU server of the kind ships with (DGX H100 / H200 / A100 80GB: 2 TB; an
    # L40S server: 1 TB); --host_memory sets the real figure
    "H100": Device("H100 80GB SXM", 80 * GIB, bf16_peak("H100 SXM"), 360 * GB, 50 * GB, host_memory_bytes=2048 * GIB),
    "H200": Device("H200 141GB SXM", 141 * GIB, bf16_peak("H200"), 360 * GB, 50 * GB, host_memory_bytes=2048 * GIB),
    "A100": Device("A100 80GB SXM", 80 * GIB, bf16_peak("A100"), 230 * GB, 25 * GB, host_memory_bytes=2048 * GIB),
    "L40S": Device("L40S 48GB (PCIe)", 48 * GIB, bf16_peak("L40S"), 20 * GB, 12.5 * GB, host_memory_bytes=1024 * GIB),
}
ASSUMED_MFU = 0.40  # fraction of the matmul peak a well-tuned fine-tuning step reaches (what MFU reports show)
HOST_LINK_BYTES_S = 25 * GB  # PCIe gen4/5 x16, achievable: what offloaded state crosses each step
HOST_ADAM_BYTES_S = 10 * GB  # a CPU AdamW step streams its state at about this rate per rank


def cpu_device(memory_bytes: float) -> Device:
    """This machine, measured: fp32 matmul rate, memory bandwidth-bound collectives between processes."""
    from shardtune.accounting.flops import measured_peak_flops

    return Device(
        "this CPU (measured)",
        memory_bytes,
        measured_peak_flops("cpu"),
        5 * GB,
        1 * GB,
        compute_bytes=4,
        host_memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
    )


def parse_memory(text: str, flag: str = "--gpu_memory") -> float:
    units = {"TB": 1e12, "GB": 1e9, "TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "MB": 1e6}
    upper = text.strip().upper()
    unit = next((u for u in units if upper.endswith(u)), None)
    number, size = (upper[: -len(unit)], units[unit]) if unit else (upper, 2**30)
    try:
        return float(number) * size
    except ValueError:
        raise ConfigError(f"{flag} {text!r} is not a size: pass e.g. 80GB or 141GiB") from None


def resolve_device(values: dict[str, str]) -> Device:
    name = values["gpu"]
    if name.lower() == "cpu":
        device = cpu_device(parse_memory(values["gpu_memory"] or "24GiB"))
        if values.get("host_memory"):
            device = replace(device, host_memory_bytes=parse_memory(values["host_memory"], "--host_memory"))
        return device
    if name not in DEVICES:
        raise ConfigError(f"--gpu {name!r} is unknown: choose one of {', '.join(DEVICES)}, cpu")
    device = DEVICES[name]
    if values.get("gpu_memory"):
        device = replace(device, memory_bytes=parse_memory(values["gpu_memory"]))
    if values.get("host_memory"):
        device = replace(device, host_memory_bytes=parse_memory(values["host_memory"], "--host_memory"))
    return device
