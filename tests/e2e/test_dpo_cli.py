"""``shardtune dpo`` as a user runs it: the embedded dialogues as pairs (own summary vs the next dialogue's), the real
launcher, gloo. 1 process x 4 pairs and 2 processes x 2 pairs (DDP, FSDP, DeepSpeed ZeRO-2 and ZeRO-3) give the same
losses and weights; the first loss is ln 2 (the policy starts as the reference); TRL's reward and token metrics are
in metrics.jsonl."""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file

from tests.helpers import eval_rows, step_rows
from tests.rounding import adam_outliers, allowed_adam_outliers, assert_same_adam_training

LR, BETA = 1e-3, 0.5
RUN = (
    "--context_length",
    256,
    "--synthetic_dialogues.num_train",
    12,
    "--synthetic_dialogues.num_validation",
    6,
    "--val_batch_size",
    2,
    "--num_workers_dataloader",
    0,
    "--max_train_step",
    3,
    "--lr",
    LR,
    "--beta",
    BETA,
    "--seed",
    7,
)
PRECOMPUTED = "reference: log-probabilities of 12 train and 6 test pairs"
REWARDS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
# TRL's token metrics: means over the step's (or the test split's) completion tokens, the same on every layout. Each
# token's value (a mean logit, an entropy) is a few fp32 ulps of its own scale from one layout's forward to another's
# (the tiny model's logits are below 1 and its entropies ~7): 8 ulps relative, 8 ulps of 1 absolute (measured: 5e-8)
TOKENS = ("logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")
TOKEN_REL = TOKEN_ABS = 8 * 1.1920929e-07
# A reward is beta x (policy - reference) of a sequence's log-probability sum: summed in fp64, kept as a float32 below
# 512 in magnitude (<= 32 completion tokens of ~7 nats). Another layout's kernels round each token's log-probability a
# few ulps of 7 (~1e-6) apart, ~6e-6 over 32 tokens (a random walk), so the float32 kept lands at most one spacing
# (2^-15 = 3.1e-5 between 256 and 512) apart. A margin holds four such sums: NEAR = 4 beta 2^-15 = 6.1e-5 bounds the
# rewards, the margins and their means over pairs, and so the loss (|d loss / d margin| < 1). Later steps and the
# evaluation add the weights' rounding, which sits where the gradient is ~0 (tests/rounding.py) and moves them less.
# Measured (default, AVX2 and AVX-512 kernels, both MKL code paths, 1 to 4 threads): <= 5.2e-6, the step loss.
NEAR = 4 * BETA * 2**-15


ZERO = ("--enable_deepspeed", "--deepspeed_config.zero_stage")
STOP_AT_2 = ("--save_steps", 1, "--max_train_step", 2)
# name -> (processes, pairs per process, flags, resumed: stopped after step 2, then resumed from its checkpoint)
LAYOUTS = {
    "one": (1, 4, (), False),
    "ddp": (2, 2, ("--padding_free", "true"), False),
    "fsdp": (2, 2, ("--enable_fsdp", "--low_cpu_fsdp"), True),
    "zero2": (2, 2, (*ZERO, 2), False),
    # each row of 4 pairs split over 2 ranks: Ulysses under DDP, ring attention under FSDP
    "sp": (2, 4, ("--sp_size", 2), False),
    "cp_fsdp": (2, 4, ("--cp_size", 2, "--enable_fsdp"), False),
    "zero3": (2, 2, (*ZERO, 3, "--precompute_ref_log_probs"), True),
}  # last: its log is checked below
SPLIT = ("--sp_size", "--cp_size")


def test_dpo_one_by_four_equals_two_by_two_under_ddp_fsdp_and_zero(tiny_model, run_cli, tmp_path):
    """1 x 4 (DDP, padded pairs) == 2 x 2 under DDP (padding-free rows: the policy and its frozen reference both attend
    within each sequence of the row), FSDP (the reference sharded like the policy, both loaded on rank 0 only with
    --low_cpu_fsdp), ZeRO-2 (the reference whole on each rank) and ZeRO-3 (the reference partitioned by an engine of
    its own, its log-probabilities precomputed: every rank joins each forward); FSDP and ZeRO-3 stopped after step 2
    and resumed from their checkpoints (ZeRO-3's resumed run reads the log-probabilities its first run kept in the
    tokenised-data cache, and loads no reference). 1 x 4 with each row of pairs split over 2 ranks (--sp_size under
    DDP, --cp_size under FSDP: the policy and its reference compute slices, per-sequence sums all-reduced) equals it
    too. QLoRA under FSDP with rows split (--sp_size 2), its reference's log-probabilities precomputed on the split
    rows, starts at ln 2 too (its reference: the 4-bit base with the adapter off) and trains the adapter."""
    rows, weights = {}, {}
    initial = load_file(tiny_model / "model.safetensors")
    for name, (nproc, batch, extra, resumed) in LAYOUTS.items():
        out = tmp_path / name
        args = (
            "dpo",
            "--nproc_per_node",
            nproc,
            "--batch_size_training",
            batch,
            "--model_name",
            tiny_model,
            "--output_dir",
            out,
            *RUN,
            *extra,
        )
        proc = run_cli(*args, *(STOP_AT_2 if resumed else ()))
        assert "preference pairs" in proc.stdout and "done:" in proc.stdout
        if set(SPLIT) & set(extra):  # each is what its name says
            assert "long rows split over ranks: " + ("Ulysses" if "--sp_size" in extra else "ring") in proc.stdout
        if "--precompute_ref_log_probs" in extra:
            assert f"{PRECOMPUTED} computed before training, kept in the tokenised-data cache" in proc.stdout, name
        if resumed:
            proc = run_cli(*args, "--save_steps", 1, "--resume", "latest")
            assert "data order kept" in proc.stdout
            if "--precompute_ref_log_probs" in extra:  # the resumed run reads what the first computed
                assert f"{PRECOMPUTED} read from the tokenised-data cache" in proc.stdout, name
        rows[name] = step_rows(out)
        weights[name] = load_file(out / "model.safetensors")
    assert "strategy: deepspeed ZeRO-3, world size 2" in proc.stdout
    evals = {name: eval_rows(tmp_path / name)[-1] for name in LAYOUTS}  # the test split's 6 pairs
    assert {e["step"] for e in evals.values()} == {3} and evals["one"]["eval_num_pairs"] == 6
    for name, e in evals.items():
        for metric in ("eval_loss", *(f"eval_{m}" for m in REWARDS)):
            assert e[metric] == pytest.approx(evals["one"][metric], rel=1e-4, abs=NEAR), (name, metric)
        for metric in (f"eval_{m}" for m in TOKENS):
            assert e[metric] == pytest.approx(evals["one"][metric], rel=TOKEN_REL, abs=TOKEN_ABS), (name, metric)
    one = rows["one"]
    assert [r["step"] for r in one] == [1, 2, 3]
    assert one[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert one[0]["rewards/margins"] == pytest.approx(0, abs=1e-6) and one[0]["num_pairs"] == 4
    assert all(abs(r["rewards/margins"]) > 1e-3 for r in one[1:]), "after a step the policy is not the reference"
    assert all(r["mfu"] > 0 and r["model_flops_per_s"] > 0 for r in one + rows["ddp"]), "DPO's model FLOPs are counted"
    assert all(0 <= r["mean_token_accuracy"] <= 1 and r["entropy"] > 0 for r in one)
    assert one[0]["logits/chosen"] != one[0]["logits/rejected"]
    for name in LAYOUTS:
        assert [r["step"] for r in rows[name]] == [1, 2, 3], name
        for a, b in zip(one, rows[name]):
            assert b["loss"] == pytest.approx(a["loss"], abs=NEAR), name
            for metric in TOKENS:
                assert b[metric] == pytest.approx(a[metric], rel=TOKEN_REL, abs=TOKEN_ABS), (name, metric)
            for metric in REWARDS:
                if metric == "rewards/accuracies" and abs(a["rewards/margins"]) < NEAR:
                    continue  # step 1: a live reference gives margins of exactly 0 (accuracy 0), a precomputed one
                    # margins of +-1e-7 (accuracy ~0.5)
                assert b[metric] == pytest.approx(a[metric], rel=1e-4, abs=NEAR), (name, metric)
        # the lean head sums the head's gradient chunk by chunk, in chunks that depend on the layout, and Adam's
        # normalised updates turn such rounding of a nearly cancelling gradient element into up to 2 lr: weights are
        # compared by how many elements differ by more than lr / 100 (tests/rounding.py: <= 2 + 1 in 2,000 of a
        # tensor; measured: at most 3 of the model's 223,552, 1 in a tensor, on the kernels and threads above)
        assert_same_adam_training(weights["one"], weights[name], LR, one, name)
    moved, allowed = adam_outliers(initial, weights["one"], LR), allowed_adam_outliers(initial, one)
    assert all(moved[key] > allowed[key] for key in initial), "training moves every tensor beyond the bound"
    out = tmp_path / "fsdp-qlora"  # 4-bit base, padding-free: another reference key, so computed here (each rank
    # joins each forward)
    proc = run_cli(
        "dpo",
        "--nproc_per_node",
        2,
        "--batch_size_training",
        2,
        "--model_name",
        tiny_model,
        "--output_dir",
        out,
        *RUN,
        "--enable_fsdp",
        "--use_peft",
        "--quantization",
        "4bit",
        "--lr",
        1e-2,
        "--precompute_ref_log_probs",
        "--padding_free",
        "true",
        "--sp_size",
        2,
    )
    assert "trainable; frozen base weights in 4-bit nf4 (double quantised))" in proc.stdout
    assert "long rows split over ranks: Ulysses sequence parallel 2" in proc.stdout
    assert f"{PRECOMPUTED} computed before training, kept in the tokenised-data cache" in proc.stdout
    lora = step_rows(out)
    assert lora[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and abs(lora[-1]["rewards/margins"]) > 1e-4
    assert (out / "adapter_model.safetensors").is_file()


def test_dpo_with_a_reference_model_of_its_own(tiny_model, run_cli, tmp_path):
    """--ref_model (TRL's DPOTrainer ref_model): the policy's weights at another path give exactly the default run;
    other weights are the reference from step 1 (the margins are not 0), live or precomputed alike; with an adapter
    it is refused in one line, as TRL refuses it."""
    import shutil

    import torch
    from safetensors.torch import save_file

    same = tmp_path / "models" / "same"
    shutil.copytree(tiny_model, same)
    other = tmp_path / "models" / "other"
    shutil.copytree(tiny_model, other)
    weights = load_file(other / "model.safetensors")
    torch.manual_seed(3)
    save_file({k: v + 0.02 * torch.randn_like(v) for k, v in weights.items()}, other / "model.safetensors")
    base = ("dpo", "--nproc_per_node", 1, "--batch_size_training", 4, "--model_name", tiny_model, *RUN)
    base = (*base, "--max_train_step", 2, "--run_validation", "false")
    rows = {}
    for name, extra in {
        "default": (),
        "same": ("--ref_model", same),
        "other": ("--ref_model", other),
        "other_precomputed": ("--ref_model", other, "--precompute_ref_log_probs"),
    }.items():
        run_cli(*base, "--output_dir", tmp_path / name, *extra)
        rows[name] = step_rows(tmp_path / name)
    assert [r["loss"] for r in rows["same"]] == pytest.approx([r["loss"] for r in rows["default"]], rel=1e-6)
    first = rows["other"][0]
    assert abs(first["rewards/margins"]) > 1e-3 and abs(first["loss"] - math.log(2)) > 1e-4
    assert first["logps/chosen"] == pytest.approx(rows["default"][0]["logps/chosen"], rel=1e-6)  # the same policy
    for a, b in zip(rows["other"], rows["other_precomputed"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=2e-5)
    refused = run_cli(*base, "--output_dir", tmp_path / "lora", "--ref_model", other, "--use_peft", check=False)
    assert refused.returncode != 0 and "drop --ref_model" in refused.stderr
    assert not (tmp_path / "lora" / "metrics.jsonl").exists()
