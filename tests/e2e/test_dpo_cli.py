"""``shardtune dpo`` as a user runs it: the embedded dialogues as pairs (own summary vs the next dialogue's), the real
launcher, DDP on gloo. 1 process x 4 pairs and 2 processes x 2 pairs give the same losses and weights; the first
loss is ln 2 (the policy starts as the reference); TRL's reward metrics are in metrics.jsonl."""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file

from tests.helpers import eval_rows, step_rows

RUN = ("--context_length", 256, "--synthetic_dialogues.num_train", 12, "--synthetic_dialogues.num_validation", 6,
       "--val_batch_size", 2, "--num_workers_dataloader", 0,
       "--max_train_step", 3, "--lr", 1e-3, "--beta", 0.5, "--seed", 7)
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def test_dpo_one_by_four_equals_two_by_two_under_ddp_and_fsdp(tiny_model, run_cli, tmp_path):
    """1 x 4 (DDP) == 2 x 2 (DDP) == 2 x 2 (FSDP, the reference sharded like the policy, stopped after step 2 and
    resumed from its checkpoint); LoRA under FSDP, its reference's log-probabilities precomputed, starts at
    ln 2 too (its reference: the base with the adapter off) and trains the adapter."""
    rows, weights = [], []
    for name, nproc, batch, extra in (("one", 1, 4, ()), ("ddp", 2, 2, ()),
                                      ("fsdp", 2, 2, ("--enable_fsdp", "--save_steps", 1, "--max_train_step", 2))):
        out = tmp_path / name
        proc = run_cli("dpo", "--nproc_per_node", nproc, "--batch_size_training", batch, "--model_name", tiny_model,
                       "--output_dir", out, *RUN, *extra)
        assert "preference pairs" in proc.stdout and "done:" in proc.stdout
        if name == "fsdp":
            proc = run_cli("dpo", "--nproc_per_node", nproc, "--batch_size_training", batch, "--model_name",
                           tiny_model, "--output_dir", out, *RUN, "--enable_fsdp", "--save_steps", 1, "--resume",
                           "latest")
            assert "data order kept" in proc.stdout
        rows.append(step_rows(out))
        weights.append(load_file(out / "model.safetensors"))
    evals = [eval_rows(tmp_path / name)[-1] for name in ("one", "ddp", "fsdp")]  # the test split's 6 pairs
    assert [e["step"] for e in evals] == [3] * 3 and evals[0]["eval_num_pairs"] == 6
    for e in evals[1:]:
        for name in ("eval_loss", *(f"eval_{m}" for m in REWARDS)):
            assert e[name] == pytest.approx(evals[0][name], rel=1e-4, abs=1e-6), name
    assert [r["step"] for r in rows[2]] == [1, 2, 3]
    for a, b in zip(rows[1], rows[2]):  # DDP and FSDP on the same 2 x 2
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert b["rewards/margins"] == pytest.approx(a["rewards/margins"], rel=1e-4, abs=1e-6)
    for key, value in weights[1].items():
        assert (weights[2][key] - value).abs().max() < 1e-5, key
    out = tmp_path / "fsdp-lora"  # and the reference's log-probabilities precomputed (every rank joins each forward)
    proc = run_cli("dpo", "--nproc_per_node", 2, "--batch_size_training", 2, "--model_name", tiny_model,
                   "--output_dir", out, *RUN, "--enable_fsdp", "--use_peft", "--lr", 1e-2, "--precompute_ref_log_probs")
    assert "reference: log-probabilities of 12 train and 6 test pairs computed before training" in proc.stdout
    lora = step_rows(out)
    assert lora[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and abs(lora[-1]["rewards/margins"]) > 1e-4
    assert (out / "adapter_model.safetensors").is_file()
    one, two = rows[:2]
    assert [r["step"] for r in one] == [1, 2, 3] == [r["step"] for r in two]
    assert one[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert one[0]["rewards/margins"] == pytest.approx(0, abs=1e-6) and one[0]["num_pairs"] == 4
    assert all(r["mfu"] > 0 and r["model_flops_per_s"] > 0 for r in one + two), "DPO's model FLOPs are counted"
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        for name in REWARDS:
            assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), name
    assert all(abs(r["rewards/margins"]) > 1e-3 for r in one[1:]), "after a step the policy is not the reference"
    for key, value in weights[0].items():
        assert (weights[1][key] - value).abs().max() < 1e-5, key
