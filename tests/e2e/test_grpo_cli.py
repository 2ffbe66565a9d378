"""``shardtune grpo`` as a user runs it: prompts in a JSONL file, reward functions in a Python file, the real launcher,
gloo. 1 process x 8 completions, 2 x 4 (DDP), 1 x 2 x accumulation 4, and 2 x 4 under FSDP (stopped inside a
generation and resumed) and under DeepSpeed ZeRO-3 (stopped between two), sample the same completions and train the
same steps (rewards, losses, gradient norms, weights); the refusals are one line each, before launch."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import eval_rows, max_relative_difference, step_rows, weights

REWARDS = '''
def digits(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def low_ids(completion_ids, target, **kwargs):
    """An extra column (target) reaches the function as TRL passes it; None: not scored by this function."""
    pairs = zip(completion_ids, target)
    return [None if t == 2 else sum(i < 100 * (t + 1) for i in ids) / len(ids) for ids, t in pairs]
'''

# num_iterations 2: each generation trains two steps, the second with the old policy's log-probabilities (ratios
# away from 1, clipping); beta: the reference (a frozen copy placed like the policy)
RUN = (
    "--num_generations",
    4,
    "--max_completion_length",
    6,
    "--max_steps",
    4,
    "--num_iterations",
    2,
    "--beta",
    0.05,
    "--epsilon_high",
    0.28,
    "--learning_rate",
    0.02,
    "--lr_scheduler_type",
    "constant",
    "--logging_steps",
    1,
    "--temperature",
    0.9,
    "--top_k",
    50,
    "--seed",
    3,
    # the test split's 5 prompts x 2 completions in chunks of 3: uneven shares, a rank running one it does not count
    "--eval_strategy",
    "steps",
    "--eval_steps",
    2,
    "--per_device_eval_batch_size",
    3,
    "--num_generations_eval",
    2,
)
# name -> (processes, batch, accumulation, flags, stopped after that step and resumed, or 0); each generation trains
# two steps (num_iterations 2): FSDP stops inside one (its checkpoint keeps it), ZeRO-3 between two
LAYOUTS = {
    "one": (1, 8, 1, ("--log_completions", "true"), 0),
    "ddp": (2, 4, 1, (), 0),
    "accumulation": (1, 2, 4, (), 0),
    "fsdp": (2, 4, 1, ("--enable_fsdp",), 3),
    "zero3": (2, 4, 1, ("--enable_deepspeed", "--deepspeed_config.zero_stage", 3), 2),
}
EVAL_METRICS = ("eval_loss", "eval_reward", "eval_reward_std", "eval_rewards/digits/mean", "eval_kl", "eval_entropy")
METRICS = ("reward", "reward_std", "rewards/digits/mean", "rewards/low_ids/mean", "completions/mean_length", "kl")
# the step's extremes over all micro-batches and ranks (min / max reductions of the step's one sync), and a sum
METRICS += ("clip_ratio/low_min", "clip_ratio/high_max", "clip_ratio/region_mean", "entropy")


@pytest.fixture
def grpo_data(tmp_path):
    prompts = tmp_path / "prompts"  # a folder of split files: train.jsonl, test.jsonl
    prompts.mkdir()
    for split, count in (("train", 24), ("test", 5)):
        with open(prompts / f"{split}.jsonl", "w") as f:
            for i in range(count):
                row = {"prompt": f"Count to {i} and then stop: {i} {i + 1}", "target": i % 3}
                f.write(json.dumps(row) + "\n")
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    return prompts, rewards


def test_grpo_layouts_sample_the_same_completions_and_train_the_same_steps(tiny_model, run_cli, tmp_path, grpo_data):
    prompts, rewards = grpo_data
    base = (
        "grpo",
        "--defaults",
        "trl",
        "--model_name_or_path",
        tiny_model,
        "--dataset_name",
        prompts,
        "--reward_funcs",
        f"{rewards}:digits",
        f"{rewards}:low_ids",
        "--reward_weights",
        1.0,
        0.5,
        *RUN,
    )
    rows, evaluations = {}, {}
    for name, (nproc, batch, accumulation, extra, resumed) in LAYOUTS.items():
        out = tmp_path / name
        args = (
            *base,
            "--nproc_per_node",
            nproc,
            "--per_device_train_batch_size",
            batch,
            "--gradient_accumulation_steps",
            accumulation,
            "--output_dir",
            out,
            *extra,
        )
        if resumed:
            first = run_cli(*args, "--max_steps", resumed, "--save_steps", 1)
            kept = sorted(p.name for p in (out / "checkpoints" / f"step-{resumed:06d}" / "objective").glob("*.pt"))
            assert kept == (["rank-00000.pt", "rank-00001.pt"] if resumed % 2 else []), (name, kept)
            # ZeRO-3 samples the first half with the whole model gathered (TRL's default), the second layer by layer
            proc = run_cli(
                *args,
                "--save_steps",
                1,
                "--resume_from_checkpoint",
                "true",
                *(("--ds3_gather_for_generation", "false") if name == "zero3" else ()),
            )
            assert "resumed from" in proc.stdout + proc.stderr and "sampled again" not in proc.stderr
            if name == "zero3":
                assert "strategy: deepspeed ZeRO-3, world size 2" in first.stdout + proc.stdout
        else:
            run_cli(*args, "--save_strategy", "no")
        rows[name] = step_rows(out)
        evaluations[name] = eval_rows(out)
        assert [r["step"] for r in evaluations[name]] == [2, 4], name
        assert [r["step"] for r in rows[name]] == [1, 2, 3, 4], name
    one = rows["one"]
    logged = [json.loads(line) for line in (tmp_path / "one" / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1] * 8 + [3] * 8  # each generation's 8 completions, at its first step
    assert {"prompt", "prediction", "reference"} <= set(logged[0])
    first = one[0]
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as its reference
    assert 0 <= first["completions/mean_length"] <= 6 and "clip_ratio/region_mean" in first
    assert one[1]["kl"] > 0 and any(r["clip_ratio/region_mean"] > 0 for r in one)  # the second pass moves, clips
    for name, other in rows.items():
        for mine, theirs in zip(one, other):
            for key in ("loss", "grad_norm", *METRICS):
                assert math.isclose(mine[key], theirs[key], rel_tol=1e-4, abs_tol=1e-6), (name, mine["step"], key)
        assert max_relative_difference(weights(tmp_path / "one"), weights(tmp_path / name)) < 1e-4, name
        for mine, theirs in zip(evaluations["one"], evaluations[name]):
            for key in EVAL_METRICS:
                assert math.isclose(mine[key], theirs[key], rel_tol=1e-4, abs_tol=1e-6), (name, mine["step"], key)
    assert evaluations["one"][0]["eval_entropy"] != evaluations["one"][1]["eval_entropy"]  # the weights moved
    assert evaluations["one"][0]["eval_kl"] > 0 and 0 < evaluations["one"][0]["eval_completions/mean_length"] <= 6


@pytest.mark.parametrize(
    "flags, says",
    [
        ((), "needs reward functions"),
        (
            ("--reward_funcs", "REWARDS:digits", "--per_device_train_batch_size", 6),
            "not a multiple of --num_generations",
        ),
        (("--reward_funcs", "REWARDS:digits", "--use_vllm", "true"), "vLLM is not built"),
        (
            ("--reward_funcs", "REWARDS:digits", "--loss_type", "cispo"),
            "--loss_type cispo (MiniMax-M1's clipped importance weights) is not built in shardtune grpo",
        ),
        (("--reward_funcs", "REWARDS:nothing"), "defines no function 'nothing'"),
        (("--reward_funcs", "REWARDS:digits", "--reward_weights", 1, 2), "2 weights for 1 reward functions"),
        (("--reward_funcs", "REWARDS:digits", "--log_eval_samples", 2), "--log_completions"),
    ],
)
def test_grpo_refusals_are_one_line_before_launch(cli_in_process, tiny_model, tmp_path, grpo_data, flags, says):
    prompts, rewards = grpo_data
    flags = tuple(str(f).replace("REWARDS", str(rewards)) for f in flags)
    proc = cli_in_process(
        "grpo",
        "--model_name_or_path",
        tiny_model,
        "--dataset_name",
        prompts,
        "--num_generations",
        4,
        "--per_device_train_batch_size",
        4,
        "--output_dir",
        tmp_path / "out",
        *flags,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and says in errors[0], proc.stderr
