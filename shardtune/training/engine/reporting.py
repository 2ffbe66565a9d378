"""The step reporter: each optimizer step's metrics row (the objective's metrics, tokens/s, MFU, memory, timing) into
metrics.jsonl and the trackers, and the progress bar.

A key TRL logs has TRL's meaning (``loss``, ``num_tokens``: real input tokens of all ranks seen so far, a running
total that a resumed run continues; ``grad_norm``: the global norm before clipping, every step); shardtune's own keys
say theirs (``label_tokens``: the step's tokens that carry a loss, on all ranks; ``tokens_per_s``: label tokens per
second). docs/observability.md lists them."""

from __future__ import annotations

import time

from tqdm import tqdm

from shardtune.accounting.peak_flops import PeakMeter
from shardtune.runtime import startup
from shardtune.runtime.distributed import DistEnv, peak_memory_bytes
from shardtune.training.engine.metrics import MetricsWriter
from shardtune.training.engine.profiling import StepProbe
from shardtune.training.engine.step import StepResult


class StepReporter:
    def __init__(
        self, env: DistEnv, writer: MetricsWriter, peak: PeakMeter, probe: StepProbe, total_steps: int, done_steps: int
    ):
        self.env, self.writer, self.peak, self.probe = env, writer, peak, probe
        self.startup_s: float | None = startup.seconds_since_command()  # to this process's first step; first row
        self.bar = tqdm(
            total=total_steps,
            initial=done_steps,
            desc="train",
            unit="step",
            disable=not env.is_main,
            dynamic_ncols=True,
        )
        self.tick = time.perf_counter()

    def say(self, line: str) -> None:
        if self.env.is_main:
            self.bar.write(line)

    def start_epoch(self) -> None:
        self.tick = time.perf_counter()

    def step(self, step: int, epoch: float, lr: float, stats: StepResult, num_tokens: int) -> dict:
        """Rank 0 writes the row of optimizer step ``step`` (every rank builds it);
        ``num_tokens``: the run's real input tokens up to and with this step."""
        now = time.perf_counter()
        step_time_s, self.tick = now - self.tick, now
        flops, palm_flops = stats.counts["flops"], stats.counts["palm_flops"]
        peak_flops = self.peak.after_step(step, flops / step_time_s)
        row = {
            "step": step,
            "epoch": epoch,
            "loss": stats.loss,
            "num_tokens": num_tokens,
            "label_tokens": int(stats.counts["label_tokens"]),
            "lr": lr,
            "tokens_per_s": stats.counts["label_tokens"] / step_time_s,
            "input_tokens_per_s": stats.counts["input_tokens"] / step_time_s,
            "step_time_s": step_time_s,
            "peak_memory_bytes": peak_memory_bytes(self.env.device),
            "model_flops_per_s": flops / step_time_s,
            "mfu": flops / step_time_s / peak_flops if peak_flops else 0.0,  # no peak measured yet: none reached
            "mfu_palm": palm_flops / step_time_s / peak_flops if peak_flops else 0.0,
            "peak_flops_per_s": peak_flops,
            **{name: value for name, value in stats.metrics.items() if name != "loss"},
        }
        if self.startup_s is not None:
            row["startup_s"], self.startup_s = self.startup_s, None
        if stats.grad_norm is not None:
            row["grad_norm"] = stats.grad_norm
        if not stats.stepped:
            row["skipped"] = True
        flop_report = self.probe.report(step, row, stats.counts)
        self.writer.write(row)
        if flop_report:
            self.say(flop_report)
        self.bar.update(1)
        self.bar.set_postfix(
            loss=f"{stats.loss:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", mfu=f"{row['mfu']:.1%}", refresh=False
        )
        return row

    def close(self) -> None:
        self.bar.close()
        self.peak.close()
