"""``shardtune kto`` as a user runs it: the embedded dialogues as preference pairs, unpaired as TRL does (each pair a
desirable and an undesirable row; each step all 4 rows of 2 pairs, in their order: TRL's KTO default), the real
launcher, gloo. 1 process x 4 rows, 1 x 2 x accumulation 2 and
2 processes x 2 rows (DDP, FSDP, DeepSpeed ZeRO-3) give the same per-step KL, losses, metrics and weights, also when
stopped at a checkpoint and resumed (on another layout too): the KL estimate and its pairs are the optimizer step's,
whatever its split; the first loss is each row's 0.5 weighted (the policy starts as the reference)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.helpers import eval_rows, step_rows
from tests.rounding import adam_outliers, allowed_adam_outliers, assert_same_adam_training

LR, BETA = 1e-2, 0.5
RUN = (
    "--context_length",
    256,
    "--synthetic_dialogues.num_train",  # 2 pairs: 4 rows, 2 desirable then 2 undesirable: a step each epoch
    2,
    "--num_epochs",
    3,
    "--synthetic_dialogues.num_validation",
    4,
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
    "--train_sampling_strategy",  # TRL's KTO default: steps of consecutive rows (what the precompute needs)
    "sequential",
    "--desirable_weight",  # the desirable completions pushed up harder: other prompts' completions too (KL > 0)
    3,
    "--undesirable_weight",
    0.5,
    "--save_plots",
    "false",
)
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
TOKENS = ("logits/chosen", "logits/rejected", "entropy")
TOKEN_REL = TOKEN_ABS = 8 * 1.1920929e-07  # as tests/e2e/test_dpo_cli.py derives them
# A row's log-probability is a float32 below 512 in magnitude (<= 64 completion tokens of ~7 nats): another layout's
# kernels round it up to one spacing 2^-15 apart (tests/e2e/test_dpo_cli.py). The KL (a mean of log-ratios, two such
# sums each) to 2 spacings; a reward beta x 2, a margin beta x 4; a row's loss moves by at most beta / 4 per unit of its
# log-ratio and of the KL: beta spacings. NEAR = 4 beta 2^-15 bounds the rewards, margins and loss, KL_NEAR the KL.
SPACING = 2**-15
NEAR, KL_NEAR = 4 * BETA * SPACING, 2 * SPACING

ZERO = ("--enable_deepspeed", "--deepspeed_config.zero_stage")
STOP_AT_2 = ("--save_steps", 1, "--max_train_step", 2)
# name -> (processes, rows per process, flags, resumed as: None (uninterrupted), or (processes, rows, flags))
LAYOUTS = {
    "one": (1, 4, (), None),
    "accumulation": (1, 2, ("--gradient_accumulation_steps", 2), (2, 2, ())),  # resumed under DDP 2 x 2
    "fsdp": (2, 2, ("--enable_fsdp", "--low_cpu_fsdp"), (2, 2, ("--enable_fsdp", "--low_cpu_fsdp"))),
    "zero3": (2, 2, (*ZERO, 3, "--precompute_ref_log_probs"), (2, 2, (*ZERO, 3, "--precompute_ref_log_probs"))),
}
PRECOMPUTED = "reference: log-probabilities of 4 train and 8 test rows and their KL rows"


def test_kto_one_by_four_equals_two_by_two_and_accumulation_under_ddp_fsdp_and_zero3(tiny_model, run_cli, tmp_path):
    """1 x 4 == 1 x 2 x accumulation 2 (stopped after step 2, resumed as 2 x 2 under DDP) == 2 x 2 under FSDP (the
    reference sharded like the policy; stopped and resumed) and ZeRO-3 (the reference's log-probabilities of each row
    and its KL row precomputed, every rank joining each forward; the resumed run reads them from the tokenised-data
    cache and loads no reference): per step the same KL, loss, TRL's metrics; the same weights and evaluation."""
    rows, weights = {}, {}
    initial = load_file(tiny_model / "model.safetensors")
    for name, (nproc, batch, extra, resumed) in LAYOUTS.items():
        out = tmp_path / name
        base = ("kto", "--model_name", tiny_model, "--output_dir", out, *RUN)
        shape = ("--nproc_per_node", nproc, "--batch_size_training", batch)
        proc = run_cli(*base, *shape, *extra, *(STOP_AT_2 if resumed else ()))
        assert "unpaired as TRL does" in proc.stdout and "done:" in proc.stdout
        if "--precompute_ref_log_probs" in extra:
            assert f"{PRECOMPUTED} computed before training, kept in the tokenised-data cache" in proc.stdout, name
        if resumed:
            nproc, batch, extra = resumed
            shape = ("--nproc_per_node", nproc, "--batch_size_training", batch)
            proc = run_cli(*base, *shape, *extra, "--resume", "latest")
            assert "data order kept" in proc.stdout
            if "--precompute_ref_log_probs" in extra:  # the resumed run reads what the first computed
                assert f"{PRECOMPUTED} read from the tokenised-data cache" in proc.stdout, name
        rows[name] = step_rows(out)
        weights[name] = load_file(out / "model.safetensors")
    assert "strategy: deepspeed ZeRO-3, world size 2" in proc.stdout
    one = rows["one"]
    assert [r["step"] for r in one] == [1, 2, 3] and one[0]["num_rows"] == 4
    # the policy starts as the reference: every row's loss 0.5 x its weight (2 desirable x 3, 2 undesirable x 0.5)
    assert one[0]["loss"] == pytest.approx(0.875, abs=1e-5) and one[0]["kl"] == pytest.approx(0, abs=1e-5)
    assert any(r["kl"] > 1e-3 for r in one), "a KL term that stays 0 would compare nothing"
    assert all(abs(r["rewards/margins"]) > 1e-3 for r in one[1:]), "after a step the policy is not the reference"
    assert all(r["mfu"] > 0 for r in one)
    for name in LAYOUTS:
        assert [r["step"] for r in rows[name]] == [1, 2, 3], name
        for a, b in zip(one, rows[name]):
            assert b["kl"] == pytest.approx(a["kl"], abs=KL_NEAR), name
            assert b["loss"] == pytest.approx(a["loss"], abs=NEAR), name
            for metric in REWARDS:
                assert b[metric] == pytest.approx(a[metric], rel=1e-4, abs=NEAR), (name, metric)
            for metric in TOKENS:
                assert b[metric] == pytest.approx(a[metric], rel=TOKEN_REL, abs=TOKEN_ABS), (name, metric)
        assert_same_adam_training(weights["one"], weights[name], LR, one, name)
    moved, allowed = adam_outliers(initial, weights["one"], LR), allowed_adam_outliers(initial, one)
    assert all(moved[key] > allowed[key] for key in initial), "training moves every tensor beyond the bound"
    evals = {name: {e["step"]: e for e in eval_rows(tmp_path / name)} for name in LAYOUTS}  # the test split's 8 rows
    assert set(evals["one"]) == {1, 2, 3} and evals["one"][3]["eval_num_rows"] == 8
    assert any(e["eval_kl"] > 1e-3 for e in evals["one"].values())
    for name, by_step in evals.items():
        assert set(by_step) == {1, 2, 3}, name
        for step, e in by_step.items():
            first = evals["one"][step]
            assert e["eval_kl"] == pytest.approx(first["eval_kl"], abs=KL_NEAR), (name, step)
            for metric in ("eval_loss", *(f"eval_{m}" for m in REWARDS)):
                assert e[metric] == pytest.approx(first[metric], rel=1e-4, abs=NEAR), (name, step, metric)
