"""DeepSpeed ZeRO trains exactly like DDP behind the same strategy face.

Real torchrun launches of 2 gloo processes (DeepSpeed's CPU accelerator), real tiny Llama, accumulation 2, clipping
and a cosine schedule with warm-up (so the lr changes every step: DeepSpeed must apply the lr the loop's scheduler
sets on the client AdamW). Each ZeRO stage must reproduce the DDP run step by step (token counts, losses, grad
norms) and at the end (weights), up to float32 rounding.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from tests.helpers import (
    assert_plain_hf_directory,
    assert_same_training,
    max_relative_difference,
    step_rows,
)

pytest.importorskip("deepspeed", reason="pip install --no-build-isolation 'shardtune[deepspeed]'")

DS = ("--enable_deepspeed",)
# name -> flags; offload and a HF-Trainer-style config file ride along with ZeRO-1 to keep launches few.
VARIANTS = {
    "ddp": (),
    "zero1+offload_optimizer+config_file": (
        *DS,
        "--deepspeed_config.zero_stage",
        "1",
        "--deepspeed_config.offload_optimizer",
        "true",
    ),
    "zero2": (*DS, "--deepspeed_config.zero_stage", "2"),
    "zero3": (*DS, "--deepspeed_config.zero_stage", "3"),
    "lora_ddp": ("--use_peft", "--peft_method", "lora"),
    "lora_zero3": ("--use_peft", "--peft_method", "lora", *DS, "--deepspeed_config.zero_stage", "3"),
    "qlora_ddp": ("--use_peft", "--peft_method", "lora", "--quantization", "4bit"),
    "qlora_zero3": (
        "--use_peft",
        "--peft_method",
        "lora",
        "--quantization",
        "4bit",
        *DS,
        "--deepspeed_config.zero_stage",
        "3",
    ),
}
# the kind of file TRL / HF Trainer users have: "auto" entries, our accumulation repeated, a bucket size
TRAINER_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 2,
    "bf16": {"enabled": "auto"},
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 500_000, "overlap_comm": "auto"},
}
TRAIN_ARGS = (
    "--nproc_per_node",
    2,
    "--batch_size_training",
    2,
    "--gradient_accumulation_steps",
    2,
    "--batching_strategy",
    "packing",
    "--context_length",
    256,
    "--synthetic_dialogues.num_train",
    96,
    "--synthetic_dialogues.num_validation",
    16,
    "--max_train_step",
    4,
    "--lr",
    3e-3,
    "--lr_scheduler",
    "cosine",
    "--warmup_steps",
    1,
    "--gradient_clipping",
    "true",
    "--num_workers_dataloader",
    0,
    "--val_batch_size",
    4,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Output dirs of the runs so far, shared by the tests of this module (each launch costs ~10 s)."""
    return {"root": tmp_path_factory.mktemp("deepspeed-runs")}


def trained(name: str, runs: dict, run_cli, model) -> object:
    if name not in runs:
        flags = VARIANTS[name]
        out = runs["root"] / name
        if "config_file" in name:
            path = runs["root"] / "ds_config.json"
            path.write_text(json.dumps(TRAINER_CONFIG))
            flags = (*flags, "--deepspeed_config.config_file", path)
        proc = run_cli("sft", "--model_name", model, "--output_dir", out, *TRAIN_ARGS, *flags)
        (out / "stdout.log").write_text(proc.stdout)
        runs[name] = out
    return runs[name]


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.startswith("zero")])
def test_zero_stage_trains_like_ddp(variant, runs, run_cli, tiny_model):
    ddp = trained("ddp", runs, run_cli, tiny_model)
    rows = step_rows(ddp)
    assert rows[-1]["loss"] < rows[0]["loss"], "the model did not learn: the comparison would be vacuous"
    assert len({r["lr"] for r in rows}) == 4, "the schedule must change the lr every step"
    out = trained(variant, runs, run_cli, tiny_model)
    difference = assert_same_training(ddp, out, variant)
    assert [r["lr"] for r in step_rows(out)] == [r["lr"] for r in rows]
    stage = variant[len("zero")]
    assert f"strategy: deepspeed ZeRO-{stage}, world size 2, compute dtype float32" in (out / "stdout.log").read_text()
    print(f"{variant}: max relative weight difference to DDP {difference:.2e}")


def test_zero3_saved_model_is_a_plain_hf_directory(runs, run_cli, tiny_model):
    """ZeRO-3 partitions every parameter; the saved model is gathered whole (tied and untied weights alike)."""
    model = assert_plain_hf_directory(trained("zero3", runs, run_cli, tiny_model))
    reference = AutoModelForCausalLM.from_pretrained(trained("ddp", runs, run_cli, tiny_model))
    assert max_relative_difference(reference.state_dict(), model.state_dict()) <= 1e-5


def test_non_finite_loss_stops_a_deepspeed_run_before_its_step(run_cli, tiny_model, tmp_path):
    """lr 1e30: step 1 is finite and makes the weights huge, step 2's loss overflows; the loop stops before
    DeepSpeed's step, with one error line, and every rank exits (nobody is left waiting in a collective)."""
    out = tmp_path / "run"
    proc = run_cli(
        "sft",
        "--model_name",
        tiny_model,
        "--output_dir",
        out,
        *TRAIN_ARGS,
        *VARIANTS["zero2"],
        "--lr",
        1e30,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1
    errors = [
        line[line.index("shardtune: error:") :] for line in proc.stderr.splitlines() if "shardtune: error:" in line
    ]
    assert len(errors) == 1 and "non-finite loss" in errors[0] and "at step 2" in errors[0], proc.stderr[-3000:]
    assert [r["step"] for r in step_rows(out)] == [1]


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_under_zero3_trains_like_lora_under_ddp(method, runs, run_cli, tiny_model):
    """The adapter is gathered from ZeRO-3's partitions (trainable parameters only) and equals DDP's; with QLoRA
    the 4-bit base is stored in the compute dtype so that ZeRO-3 partitions it like any other weight."""
    from safetensors.torch import load_file

    ddp, zero3 = (trained(f"{method}_{s}", runs, run_cli, tiny_model) for s in ("ddp", "zero3"))
    for r, o in zip(step_rows(ddp), step_rows(zero3), strict=True):
        assert o["num_tokens"] == r["num_tokens"]
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=0)
        assert o["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
    assert not (zero3 / "model.safetensors").exists()
    adapters = [load_file(str(out / "adapter_model.safetensors")) for out in (ddp, zero3)]
    assert adapters[0] and all("lora_" in k for k in adapters[0])
    difference = max_relative_difference(*adapters)
    assert difference <= 1e-5
    print(f"{method} zero3: max relative adapter difference to DDP {difference:.2e}")


# 2 epochs of 3 steps, StepLR (the lr changes at the epoch boundary: the scheduler's state must come back)
RESUME_ARGS = (
    "--save_steps",
    2,
    "--save_total_limit",
    2,
    "--max_train_step",
    0,
    "--num_epochs",
    2,
    "--synthetic_dialogues.num_train",
    48,
    "--lr_scheduler",
    "step",
    "--gamma",
    0.5,
)


@pytest.mark.parametrize("variant", ["zero2", "lora_zero3"])
def test_a_resumed_deepspeed_run_equals_the_uninterrupted_one_and_exports(
    variant, run_cli, cli_in_process, tiny_model, tmp_path
):
    """DeepSpeed writes its own partitions into our checkpoint folder; resume continues the same data order,
    schedule and optimizer state; export consolidates the partitions into the same model (or adapter)."""
    from safetensors.torch import load_file

    from shardtune.training.engine.checkpoint.layout import latest_checkpoint, read_trainer_state

    flags = (*TRAIN_ARGS, *VARIANTS[variant], *RESUME_ARGS)
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_cli("sft", "--model_name", tiny_model, "--output_dir", ref, *flags)
    run_cli("sft", "--model_name", tiny_model, "--output_dir", out, *flags, "--max_train_step", 4)
    state = read_trainer_state(latest_checkpoint(out))
    assert (state["step"], state["strategy"], state["zero_stage"]) == (4, "deepspeed", int(variant[-1]))
    wrong = cli_in_process(
        "sft",
        "--model_name",
        tiny_model,
        "--output_dir",
        out,
        *flags,
        "--resume",
        "latest",
        "--nproc_per_node",
        1,
        "--gradient_accumulation_steps",
        4,
    )  # refused before launch
    assert (
        wrong.returncode != 0 and "partitions of 2 processes" in wrong.stderr and "--nproc_per_node 2" in wrong.stderr
    ), wrong.stderr[-2000:]
    resumed = run_cli("sft", "--model_name", tiny_model, "--output_dir", out, *flags, "--resume", "latest")
    assert "data order kept" in resumed.stdout
    ref_rows, rows = step_rows(ref), step_rows(out)
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] and len(rows) > 4
    assert len({r["lr"] for r in ref_rows}) == 2
    for r, o in zip(ref_rows, rows):
        assert (o["num_tokens"], o["lr"]) == (r["num_tokens"], r["lr"]), r["step"]
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-6, abs=0), r["step"]
    name = "adapter_model.safetensors" if "lora" in variant else "model.safetensors"
    final = load_file(str(out / name))
    assert max_relative_difference(load_file(str(ref / name)), final) <= 1e-6
    run_cli("export", out, tmp_path / "exported")
    assert max_relative_difference(final, load_file(str(tmp_path / "exported" / name))) <= 1e-6


def test_8bit_lora_checkpoints_and_resumes_under_ddp_and_trains_like_zero2(run_cli, tiny_model, tmp_path):
    """bitsandbytes 8-bit layers put non-attribute entries (SCB) in their state dict: the adapter, checkpoints and
    resume take the trainable parameters directly. DDP (stopped at step 2, resumed) and ZeRO-2 train alike."""
    from safetensors.torch import load_file

    flags = (*TRAIN_ARGS, "--use_peft", "--peft_method", "lora", "--quantization", "8bit", "--lr_scheduler", "step")
    ddp, zero2 = tmp_path / "ddp", tmp_path / "zero2"
    run_cli("sft", "--model_name", tiny_model, "--output_dir", ddp, *flags, "--max_train_step", 2, "--save_steps", 2)
    resumed = run_cli("sft", "--model_name", tiny_model, "--output_dir", ddp, *flags, "--resume", "latest")
    assert "resumed from" in resumed.stdout
    run_cli("sft", "--model_name", tiny_model, "--output_dir", zero2, *flags, *DS, "--deepspeed_config.zero_stage", 2)
    for r, o in zip(step_rows(ddp), step_rows(zero2), strict=True):
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=0), r["step"]
    adapters = [load_file(str(out / "adapter_model.safetensors")) for out in (ddp, zero2)]
    assert max_relative_difference(*adapters) <= 1e-5
