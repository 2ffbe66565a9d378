"""GPU smoke suite: every GPU-only path of shardtune against the reference the CPU tests prove, each check a loss
comparison (not an exit code). One command, one GPU, under 5 minutes, a table at the end; the exit status is the
number of failed checks.

    bash bench/gpu_smoke.sh                          # on a machine with a CUDA GPU
    bash bench/gpu_smoke.sh --cpu-smoke --only NAME  # the same comparisons on CPU (tests/e2e/test_gpu_bench_smoke.py)

Each training run is `shardtune sft` as a user runs it (one process, 4 optimizer steps, padding-free packed rows),
and a check compares the losses of two runs step by step. The pairs and what the CPU tests prove about them:

- bf16 / fp16 against fp32 (DDP autocast, FSDP2 mixed precision and sharded scaler, DeepSpeed): on CPU within the
  same tolerances, tests/distributed/test_precision.py (CUDA adds the real bf16 / fp16 kernels, DeepSpeed's fp16);
- QLoRA under FSDP as recipes/llama3-70b-qlora-fsdp-4gpu.yaml runs it (scaled down) against QLoRA under DDP: on CPU
  tests/distributed/test_peft.py (CUDA adds bitsandbytes' GPU kernels and bf16 compute);
- --use_fast_kernels (flash-attention 2 / liger-kernel, whichever is installed) against the default run: a no-op on
  CPU, so this is its only check;
- FSDP2 CPU offload against the GPU-resident run (and its peak GPU memory is lower): on CPU only the policy is
  checkable (tests/distributed/test_fsdp.py);
- the FlashAttention varlen kernel against padded SDPA (bench/varlen_check.py);
- shardtune dpo under FSDP2 in bf16 (the frozen reference sharded and cast like the policy, so step 1 is ln 2 in
  bf16 too) against fp32: on CPU the same placement in fp32, tests/e2e/test_dpo_cli.py.

--cpu-smoke runs on CPU with the tiny preset and the test-only switch SHARDTUNE_TEST_LOW_PRECISION_ON_CPU
(shardtune/runtime/precision.py), so that the comparison logic itself is tested where no GPU is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
QLORA_RECIPE = "recipes/llama3-70b-qlora-fsdp-4gpu.yaml"
# per-step relative loss tolerance, by the compute format of the run under test (4 steps; measured on CPU over 3
# steps: bf16 <= 3.8e-4, fp16 <= 4.5e-5, tests/distributed/test_precision.py)
LOSS_RTOL = {"bf16": 5e-3, "fp16": 1e-3, "same": 1e-4}
RUN_TIMEOUT_S = 240


@dataclass(frozen=True)
class Check:
    name: str
    run: str
    reference: str
    tolerance: str  # a key of LOSS_RTOL
    needs: tuple[str, ...] = ()  # modules that must import; "cuda" for GPU-only checks


# run name -> its flags (after the common ones)
QLORA_SCALED_DOWN = (
    "--config",
    QLORA_RECIPE,
    "--dataset",
    "synthetic_dialogues",
    "--context_length",
    "256",
    "--gradient_accumulation_steps",
    "2",
    "--warmup_steps",
    "0",
    "--lr",
    "1e-3",
    "--lora_config.lora_dropout",
    "0",
)
RUNS: dict[str, tuple[str, ...]] = {
    "fp32": ("--mixed_precision", "false"),
    "ddp_bf16": (),
    "ddp_fp16": ("--use_fp16",),
    "fsdp_bf16": ("--enable_fsdp",),
    "fsdp_fp16": ("--enable_fsdp", "--use_fp16"),
    "fsdp_bf16_cpu_offload": ("--enable_fsdp", "--fsdp_config.fsdp_cpu_offload", "true"),
    "zero3_bf16": ("--enable_deepspeed", "--deepspeed_config.zero_stage", "3"),
    "zero2_fp16": ("--enable_deepspeed", "--deepspeed_config.zero_stage", "2", "--use_fp16"),
    "fast_kernels": ("--use_fast_kernels",),
    "qlora_fsdp_recipe": QLORA_SCALED_DOWN,
    "qlora_ddp": (*QLORA_SCALED_DOWN, "--enable_fsdp", "false", "--fsdp_config.fsdp_activation_checkpointing", "false"),
    # shardtune dpo (runs named dpo_*): the policy and its frozen reference in bf16 under FSDP2 against fp32
    "dpo_fp32": ("--mixed_precision", "false"),
    "dpo_fsdp_bf16": ("--enable_fsdp",),
}
CHECKS = [
    Check("fsdp2_bf16_vs_fp32", "fsdp_bf16", "fp32", "bf16"),
    Check("fsdp2_fp16_sharded_scaler_vs_fp32", "fsdp_fp16", "fp32", "fp16"),
    Check("ddp_autocast_bf16_vs_fp32", "ddp_bf16", "fp32", "bf16"),
    Check("ddp_autocast_fp16_grad_scaler_vs_fp32", "ddp_fp16", "fp32", "fp16"),
    Check("zero3_bf16_vs_fp32", "zero3_bf16", "fp32", "bf16", ("deepspeed",)),
    Check("zero2_fp16_vs_fp32", "zero2_fp16", "fp32", "fp16", ("deepspeed", "cuda")),
    Check("qlora_fsdp_recipe_vs_qlora_ddp", "qlora_fsdp_recipe", "qlora_ddp", "bf16", ("bitsandbytes",)),
    Check("fast_kernels_vs_default", "fast_kernels", "ddp_bf16", "bf16"),
    Check("fsdp_cpu_offload_vs_resident", "fsdp_bf16_cpu_offload", "fsdp_bf16", "same"),
    Check("dpo_fsdp2_bf16_vs_fp32", "dpo_fsdp_bf16", "dpo_fp32", "bf16"),
]
VARLEN_CHECKS = {
    "varlen_flash_bf16_vs_padded_sdpa": ("--dtype", "bfloat16"),
    "varlen_flash_autocast_vs_padded_sdpa": ("--dtype", "float32", "--autocast", "bfloat16"),
    "varlen_flash_window_vs_padded_sdpa": ("--dtype", "bfloat16", "--sliding_window", "32"),
}


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    max_loss_rel_diff: float | None = None
    tolerance: float | None = None
    note: str = ""


def loss_differences(run_rows: list[dict], reference_rows: list[dict]) -> list[float]:
    """Relative loss difference at every step; an error when the runs did not take the same steps."""
    if not reference_rows or len(run_rows) != len(reference_rows):
        raise ValueError(f"{len(run_rows)} step rows against the reference's {len(reference_rows)}")
    return [abs(r["loss"] - ref["loss"]) / abs(ref["loss"]) for r, ref in zip(run_rows, reference_rows)]


def compare(check: Check, run_rows: list[dict], reference_rows: list[dict]) -> Result:
    tolerance = LOSS_RTOL[check.tolerance]
    try:
        worst = max(loss_differences(run_rows, reference_rows))
    except ValueError as e:
        return Result(check.name, "FAIL", note=str(e))
    return Result(check.name, "PASS" if worst <= tolerance else "FAIL", worst, tolerance)


class Runner:
    """Launches each run once, on first use, and keeps its step rows and log."""

    def __init__(self, out_dir: Path, cpu_smoke: bool):
        self.out_dir, self.cpu_smoke = out_dir, cpu_smoke
        self.rows: dict[str, list[dict]] = {}
        self.logs: dict[str, str] = {}
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        if cpu_smoke:
            self.env["SHARDTUNE_TEST_LOW_PRECISION_ON_CPU"] = "1"

    def common_flags(self, out: Path) -> list[str]:
        size = (
            ["--model_name", "preset:tiny", "--synthetic_dialogues.num_train", "64", "--context_length", "256"]
            if self.cpu_smoke
            else ["--model_name", "preset:demo", "--synthetic_dialogues.num_train", "400", "--context_length", "512"]
        )
        return [
            *size,
            "--nproc_per_node",
            "1",
            "--max_train_step",
            "4",
            "--batch_size_training",
            "4",
            "--synthetic_dialogues.num_validation",
            "8",
            "--run_validation",
            "false",
            "--lr",
            "1e-3",
            "--gradient_clipping",
            "true",
            "--num_workers_dataloader",
            "0",
            "--save_model",
            "false",
            "--overwrite_output_dir",
            "true",
        ]

    def step_rows(self, name: str) -> list[dict]:
        if name not in self.rows:
            out = self.out_dir / name
            # the common flags override the run's (the QLoRA recipe's model, sizes and output_dir)
            command = "dpo" if name.startswith("dpo_") else "sft"
            argv = [
                sys.executable,
                "-m",
                "shardtune",
                command,
                *RUNS[name],
                *self.common_flags(out),
                "--output_dir",
                str(out),
            ]
            try:
                proc = subprocess.run(
                    argv, capture_output=True, text=True, cwd=REPO, env=self.env, timeout=RUN_TIMEOUT_S
                )
            except subprocess.TimeoutExpired as e:
                partial = [
                    x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)
                ]
                (self.out_dir / f"{name}.log").write_text("".join(partial))
                raise RuntimeError(f"run {name} took over {RUN_TIMEOUT_S} s: see {self.out_dir / name}.log") from None
            self.logs[name] = proc.stdout + proc.stderr
            (self.out_dir / f"{name}.log").write_text(self.logs[name])
            if proc.returncode != 0:
                raise RuntimeError(f"run {name} exited {proc.returncode}: see {self.out_dir / name}.log")
            lines = (out / "metrics.jsonl").read_text().splitlines()
            self.rows[name] = [row for row in map(json.loads, lines) if "loss" in row]
        return self.rows[name]


def missing_needs(check: Check, cpu_smoke: bool) -> str:
    for need in check.needs:
        if need == "cuda" and (cpu_smoke or not torch.cuda.is_available()):
            return "needs CUDA"
        if need != "cuda" and importlib.util.find_spec(need) is None:
            return f"{need} is not installed"
    return ""


def run_check(check: Check, runner: Runner) -> Result:
    missing = missing_needs(check, runner.cpu_smoke)
    if missing:
        return Result(check.name, "SKIP", note=missing)
    try:
        result = compare(check, runner.step_rows(check.run), runner.step_rows(check.reference))
    except RuntimeError as e:
        return Result(check.name, "FAIL", note=str(e).splitlines()[0])
    log = runner.logs[check.run]
    if check.run == "fast_kernels":
        result.note = "; ".join(
            line.removeprefix("speed: ")
            for line in log.splitlines()
            if line.startswith("speed: ") and ("kernels" in line or "attention" in line)
        )
    if check.run == "fsdp_bf16_cpu_offload" and not runner.cpu_smoke:
        offloaded, resident = (runner.step_rows(n)[-1]["peak_memory_bytes"] for n in (check.run, check.reference))
        result.note = f"peak GPU memory {offloaded / 2**20:.0f} MiB offloaded vs {resident / 2**20:.0f} MiB"
        if offloaded >= resident:
            result.status = "FAIL"
    return result


def run_varlen_check(name: str, flags: tuple[str, ...], runner: Runner) -> Result:
    device = (
        ["--device", "cpu", "--dtype", "float32", "--preset", "tiny"]
        if runner.cpu_smoke
        else ["--device", "cuda", *flags]
    )
    proc = subprocess.run(
        [sys.executable, "-m", "bench.varlen_check", *device],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=runner.env,
        timeout=120,
    )
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return Result(name, "FAIL", note=(proc.stderr.strip().splitlines() or ["no output"])[-1])
    return Result(
        name,
        "PASS" if report["ok"] else "FAIL",
        report["loss_rel_diff"],
        None,
        f"{report['kernel']}, grad rel diff {report['grad_rel_diff']:.1e}",
    )


def table(results: list[Result]) -> str:
    lines = ["| check | result | max loss rel diff | tolerance | note |", "|---|---|---|---|---|"]
    for r in results:
        diff = f"{r.max_loss_rel_diff:.1e}" if r.max_loss_rel_diff is not None else ""
        tol = f"{r.tolerance:.0e}" if r.tolerance is not None else ""
        lines.append(f"| {r.name} | {r.status} | {diff} | {tol} | {r.note} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny preset on CPU: tests the comparisons themselves")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--out", default="", help="folder for the runs (default: a new temporary folder)")
    args = ap.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device: run on a GPU machine, or pass --cpu-smoke", file=sys.stderr)
        return 2
    selected = set(filter(None, args.only.split(",")))
    known = {c.name for c in CHECKS} | set(VARLEN_CHECKS)
    if selected - known:
        print(f"gpu_smoke: unknown checks {sorted(selected - known)}: choose from {sorted(known)}", file=sys.stderr)
        return 2
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="shardtune-gpu-smoke."))
    out_dir.mkdir(parents=True, exist_ok=True)
    runner, results, start = Runner(out_dir, args.cpu_smoke), [], time.perf_counter()
    for name, flags in VARLEN_CHECKS.items():
        if not selected or name in selected:
            results.append(run_varlen_check(name, flags, runner))
            print(f"{results[-1].status} {name}", flush=True)
    for check in CHECKS:
        if not selected or check.name in selected:
            results.append(run_check(check, runner))
            print(f"{results[-1].status} {check.name}", flush=True)
    failures = sum(r.status == "FAIL" for r in results)
    print(f"\n{table(results)}\n\n{failures} failure(s) in {time.perf_counter() - start:.0f} s; runs in {out_dir}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
