"""bf16 and fp16 training, executed on CPU: every low-precision path trains like the fp32 run, within the format's
tolerance; and DoRA trains under FSDP2 exactly as under DDP.

GPUs compute in bf16 (or fp16); a CPU run computes in fp32. The test-only switch SHARDTUNE_TEST_LOW_PRECISION_ON_CPU
(shardtune/runtime/precision.py) makes the CPU take the GPU's precision decisions, so these runs execute the code a GPU
runs after that decision: DDP's autocast (with torch's GradScaler for fp16), FSDP2's MixedPrecisionPolicy (with the
sharded gradient scaler for fp16), pure bf16 FSDP2, and DeepSpeed ZeRO-3's bf16 engine (DeepSpeed's CPU accelerator has
no fp16 here: ZeRO with fp16 is checked by bench/gpu_smoke.sh).

Each run: the real CLI, 2 gloo processes, the tiny preset, 3 optimizer steps, compared with the fp32 DDP run:
- losses at every step within LOSS_RTOL, grad norms within GRAD_NORM_RTOL (a gradient scaler that did not unscale
  would be off by its scale, 2^16);
- the weight update (final - initial weights, all parameters as one vector) within UPDATE_RTOL of the fp32 run's
  update: ||update - update_fp32|| / ||update_fp32||. Measured: bf16 0.037-0.052, fp16 0.015; an fp32 run with a
  learning rate 10% lower gives 0.11, another data order 0.77;
- and not equal to the fp32 run (update difference > 1e-3): the low precision really computed.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardtune.runtime.precision import LOW_PRECISION_ON_CPU_ENV
from tests.helpers import max_relative_difference, step_rows


@dataclass(frozen=True)
class Tolerance:
    loss_rtol: float
    grad_norm_rtol: float
    update_rtol: float


# Measured maxima (3 steps, lr 3e-3): bf16 loss 3.8e-4, grad norm 6.3e-3, update 0.052; fp16 loss 4.5e-5, grad norm
# 1.1e-3, update 0.015.
TOLERANCES = {"bf16": Tolerance(1e-3, 2e-2, 0.08), "fp16": Tolerance(2e-4, 5e-3, 0.03)}
FSDP = ("--enable_fsdp",)
# name -> (format, flags, what the start log's strategy line must say)
VARIANTS = {
    "ddp_autocast_bf16": ("bf16", (), "ddp, world size 2, compute dtype bfloat16"),
    "ddp_autocast_fp16_grad_scaler": ("fp16", ("--use_fp16",), "ddp, world size 2, compute dtype float16"),
    "fsdp_mixed_bf16": ("bf16", FSDP, "weights float32, compute bfloat16, gradient reduction float32"),
    "fsdp_fp16_sharded_grad_scaler": (
        "fp16",
        (*FSDP, "--use_fp16"),
        "weights float32, compute float16, gradient reduction float32, sharded gradient scaler",
    ),
    "fsdp_pure_bf16": (
        "bf16",
        (*FSDP, "--pure_bf16"),
        "weights bfloat16, compute bfloat16, gradient reduction bfloat16",
    ),
    "zero3_bf16": (
        "bf16",
        ("--enable_deepspeed", "--deepspeed_config.zero_stage", "3"),
        "deepspeed ZeRO-3, world size 2, compute dtype bfloat16",
    ),
}
TRAIN_ARGS = (
    "--nproc_per_node",
    2,
    "--batch_size_training",
    4,
    "--batching_strategy",
    "packing",
    "--context_length",
    256,
    "--synthetic_dialogues.num_train",
    64,
    "--synthetic_dialogues.num_validation",
    8,
    "--max_train_step",
    3,
    "--gradient_clipping",
    "true",
    "--num_workers_dataloader",
    0,
    "--run_validation",
    "false",
)
DORA = (
    "--use_peft",
    "--peft_method",
    "lora",
    "--lora_config.use_dora",
    "true",
    "--lora_config.lora_dropout",
    "0",
    "--lr",
    2e-2,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return {"root": tmp_path_factory.mktemp("precision-runs")}


def trained(name: str, flags: tuple, runs: dict, run_cli, model: Path, low_precision: bool = False) -> Path:
    if name not in runs:
        out = runs["root"] / name
        env = {LOW_PRECISION_ON_CPU_ENV: "1"} if low_precision else {}
        proc = run_cli("sft", "--model_name", model, "--output_dir", out, *TRAIN_ARGS, *flags, env=env)
        (out / "stdout.log").write_text(proc.stdout)
        runs[name] = out
    return runs[name]


def fp32_reference(runs: dict, run_cli, model: Path) -> Path:
    return trained("ddp_fp32", ("--mixed_precision", "false", "--lr", 3e-3), runs, run_cli, model)


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].double().flatten() for k in sorted(state)])


def update_difference(initial: Path, reference: Path, other: Path) -> float:
    """||(other - initial) - (reference - initial)|| / ||reference - initial|| over all parameters."""
    start = flat(load_file(str(initial / "model.safetensors")))
    ref_update = flat(load_file(str(reference / "model.safetensors"))) - start
    other_update = flat(load_file(str(other / "model.safetensors"))) - start
    return float((other_update - ref_update).norm() / ref_update.norm())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_low_precision_trains_like_fp32_within_the_formats_tolerance(variant, runs, run_cli, tiny_model):
    fmt, flags, strategy_line = VARIANTS[variant]
    if "--enable_deepspeed" in flags and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("pip install --no-build-isolation 'shardtune[deepspeed]'")
    tol = TOLERANCES[fmt]
    ref = fp32_reference(runs, run_cli, tiny_model)
    out = trained(variant, (*flags, "--lr", 3e-3), runs, run_cli, tiny_model, low_precision=True)
    assert strategy_line in (out / "stdout.log").read_text()
    ref_rows, rows = step_rows(ref), step_rows(out)
    assert len(rows) == len(ref_rows) == 3
    assert ref_rows[-1]["loss"] < ref_rows[0]["loss"] - 0.1, "the fp32 run did not learn: the comparison is vacuous"
    for r, o in zip(ref_rows, rows):
        assert o["num_tokens"] == r["num_tokens"], r["step"]
        assert o["loss"] == pytest.approx(r["loss"], rel=tol.loss_rtol, abs=0), (variant, r["step"])
        assert o["grad_norm"] == pytest.approx(r["grad_norm"], rel=tol.grad_norm_rtol, abs=0), (variant, r["step"])
    difference = update_difference(tiny_model, ref, out)
    print(f"{variant}: update difference to fp32 {difference:.4f} (tolerance {tol.update_rtol})")
    assert 1e-3 < difference <= tol.update_rtol, variant
    saved_dtypes = {t.dtype for t in load_file(str(out / "model.safetensors")).values()}
    assert saved_dtypes == {torch.bfloat16 if variant == "fsdp_pure_bf16" else torch.float32}


def test_dora_trains_under_fsdp_exactly_as_under_ddp(runs, run_cli, tiny_model):
    ddp = trained("dora_ddp", (*DORA, "--mixed_precision", "false"), runs, run_cli, tiny_model)
    fsdp = trained("dora_fsdp", (*DORA, *FSDP, "--mixed_precision", "false"), runs, run_cli, tiny_model)
    assert json.loads((fsdp / "adapter_config.json").read_text())["use_dora"] is True
    ddp_rows, fsdp_rows = step_rows(ddp), step_rows(fsdp)
    assert ddp_rows[-1]["loss"] < ddp_rows[0]["loss"] - 0.1, "DoRA did not learn: the comparison is vacuous"
    for r, o in zip(ddp_rows, fsdp_rows):
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=0), r["step"]
        assert o["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), r["step"]
    ddp_adapter = load_file(str(ddp / "adapter_model.safetensors"))
    fsdp_adapter = load_file(str(fsdp / "adapter_model.safetensors"))
    assert any("lora_magnitude_vector" in k for k in fsdp_adapter), sorted(fsdp_adapter)
    assert max_relative_difference(ddp_adapter, fsdp_adapter) <= 1e-5
