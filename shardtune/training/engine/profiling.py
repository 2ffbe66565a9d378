"""Watching chosen training steps without changing them: torch.profiler traces (--use_profiler) and torch's
FLOP counter (--flop_counter), both with llama-cookbook's flags and schedule."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from shardtune.accounting.flops import flop_counter
from shardtune.config.schema import PROFILER_SCHEDULE, TrainConfig
from shardtune.runtime.distributed import DistEnv, all_reduce_sum, warn0


def profiler_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.logging.profiler_dir or Path(cfg.output.dir) / "profiler")


def start_profiler(cfg: TrainConfig, env: DistEnv) -> torch.profiler.profile:
    """One trace per rank (rank{N}.*.pt.trace.json: TensorBoard's profiler plugin or ui.perfetto.dev)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if env.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(**PROFILER_SCHEDULE, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(profiler_dir(cfg)), worker_name=f"rank{env.rank}"),
        record_shapes=True,
        profile_memory=True,
        with_stack=False,
    )
    profiler.start()
    return profiler


class StepProbe:
    """Wraps each optimizer step: advances the profiler's schedule, and counts one step's FLOPs on every rank."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, total_steps: int):
        self.env = env
        self.flop_step = cfg.logging.flop_counter_start + 1 if cfg.logging.flop_counter else None
        if self.flop_step is not None and self.flop_step > total_steps:
            warn0(
                f"--flop_counter: the run has {total_steps} steps, so step {self.flop_step} (after "
                f"--flop_counter_start {cfg.logging.flop_counter_start}) is never measured: lower --flop_counter_start"
            )
        self.profiler = start_profiler(cfg, env) if cfg.logging.profiler else None
        self.measured_flops: int | None = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around optimizer step ``step`` (1-based); every rank enters it for the same steps."""
        if step == self.flop_step:
            with flop_counter() as counter:
                yield
            total = torch.tensor(counter.get_total_flops(), dtype=torch.float64)
            self.measured_flops = int(all_reduce_sum(total, self.env.device))
        else:
            yield
        if self.profiler is not None:
            self.profiler.step()

    def report(self, step: int, row: dict, stats: dict) -> str | None:
        """After the measured step: its measured FLOPs go into the metrics row; returns the line to print."""
        if step != self.flop_step or self.measured_flops is None:
            return None
        row["measured_flops"] = self.measured_flops
        return (
            f"flop counter, step {step}: {self.measured_flops / 1e9:,.3f} GFLOP measured (torch FlopCounterMode, "
            f"all ranks; attention counted as the full square, backward with recomputation), analytic "
            f"{stats['flops'] / 1e9:,.3f} GFLOP as computed (mfu), {stats['palm_flops'] / 1e9:,.3f} GFLOP PaLM "
            "convention (mfu_palm)"
        )

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
