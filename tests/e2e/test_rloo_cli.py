"""``shardtune rloo`` as a user runs it, with a tool: conversational prompts ("What is 3 plus 4?") in a JSONL folder, a
calculator tool and reward functions in a Python file (tests/tool_toy.py: the tiny model taught a chat format in which
it calls the tool now and then), the real launcher, gloo.

1 process x 8 completions, 2 x 4 (DDP), 1 x 2 x accumulation 4, and 2 x 4 under FSDP (stopped inside a generation and
resumed) and under DeepSpeed ZeRO-3 (stopped between two generations, resumed) sample the same completions -- tool
calls, results and resumed replies included -- and train the same steps: rewards, tool-call frequencies, KL, losses,
gradient norms, clip ratios, evaluations, weights. The refusals are one line each, before launch; ``plan --objective
rloo`` counts RLOO's sampling and its reference."""

from __future__ import annotations

import json
import math

import pytest

from tests import tool_toy
from tests.helpers import eval_rows, max_relative_difference, step_rows, weights

# num_iterations 2: each generation trains two steps, the second with the sampling policy's log-probabilities (ratios
# away from 1, clipping); beta 0.05 (RLOO's default): the reference a frozen copy, the KL in the reward
RUN = (
    "--num_generations",
    4,
    "--max_completion_length",
    16,
    "--max_steps",
    4,
    "--num_iterations",
    2,
    "--learning_rate",
    0.003,
    "--lr_scheduler_type",
    "constant",
    "--logging_steps",
    1,
    "--temperature",
    1.2,
    "--seed",
    2,  # its first generation calls the tool (in 3 of 8 completions) and earns rewards that differ
    "--save_plots",
    "false",
    # the test split's 6 prompts x 2 completions in chunks of 3: uneven shares, a rank running one it does not count
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
# two steps: FSDP stops inside one (its checkpoint keeps it), ZeRO-3 between two
LAYOUTS = {
    "one": (1, 8, 1, ("--log_completions", "true"), 0),
    "ddp": (2, 4, 1, (), 0),
    "accumulation": (1, 2, 4, (), 0),
    "fsdp": (2, 4, 1, ("--enable_fsdp",), 3),
    "zero3": (2, 4, 1, ("--enable_deepspeed", "--deepspeed_config.zero_stage", 3), 2),
}
METRICS = ("reward", "reward_std", "rewards/correct/mean", "rewards/called/mean", "frac_reward_zero_std", "kl")
METRICS += ("tools/call_frequency", "tools/failure_frequency", "completions/mean_length", "entropy")
METRICS += ("clip_ratio/low_min", "clip_ratio/high_max", "clip_ratio/region_mean")
EVAL_METRICS = ("eval_loss", "eval_reward", "eval_kl", "eval_entropy", "eval_tools/call_frequency")
# The same completions make the same tokens, rewards and advantages exactly; what differs between layouts is the
# float rounding of the forwards (the policy's and reference's log-probabilities over another batch shape, summed
# over <= 16 tokens: ~1e-6 relative) and of the gradients' reduction over 1 or 2 ranks, carried through two Adam
# steps: 1e-4 relative bounds it with room (observed < 1e-5), while a different completion moves rewards by >= 1/8.
RELATIVE, ABSOLUTE = 1e-4, 1e-6


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory, cache_dir):
    """The toy's model (built once per cache), its prompts and its tool / reward file."""
    model = cache_dir / "tool-toy-v1"
    if not (model / "config.json").is_file():
        tool_toy.build(model)
    root = tmp_path_factory.mktemp("rloo")
    tools = root / "toy.py"
    tools.write_text(tool_toy.TOOLS_PY)
    return model, tool_toy.write_data(root / "prompts", num_train=32, num_test=6), tools


def test_rloo_layouts_with_a_tool_sample_the_same_completions_and_train_the_same_steps(run_cli, tmp_path, tool_run):
    model, prompts, tools = tool_run
    base = (
        "rloo",
        "--defaults",
        "trl",
        "--model_name_or_path",
        model,
        "--dataset_name",
        prompts,
        "--reward_funcs",
        f"{tools}:correct",
        f"{tools}:called",
        "--tools",
        f"{tools}:add",
        *RUN,
    )
    rows, evaluations = {}, {}
    for name, (nproc, batch, accumulation, extra, resumed) in LAYOUTS.items():
        out = tmp_path / name
        shape = ("--per_device_train_batch_size", batch, "--gradient_accumulation_steps", accumulation)
        args = (*base, "--nproc_per_node", nproc, *shape, "--output_dir", out, *extra)
        if resumed:
            run_cli(*args, "--max_steps", resumed, "--save_steps", 1)
            kept = sorted(p.name for p in (out / "checkpoints" / f"step-{resumed:06d}" / "objective").glob("*.pt"))
            assert kept == (["rank-00000.pt", "rank-00001.pt"] if resumed % 2 else []), (name, kept)
            proc = run_cli(*args, "--save_steps", 1, "--resume_from_checkpoint", "true")
            assert "resumed from" in proc.stdout + proc.stderr and "sampled again" not in proc.stderr
        else:
            run_cli(*args, "--save_strategy", "no")
        rows[name], evaluations[name] = step_rows(out), eval_rows(out)
        assert [r["step"] for r in rows[name]] == [1, 2, 3, 4], name
        assert [r["step"] for r in evaluations[name]] == [2, 4], name
    one = rows["one"]
    assert any(r["tools/call_frequency"] > 0 for r in one)  # tools were called: the comparison covers their turns
    assert one[0]["kl"] == pytest.approx(0.0, abs=1e-6) and one[2]["kl"] != 0  # the policy moved from its reference
    assert any(r["clip_ratio/region_mean"] > 0 for r in one)  # the second pass of a generation clips
    logged = [json.loads(line) for line in (tmp_path / "one" / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1] * 8 + [3] * 8
    for name, other in rows.items():
        for mine, theirs in zip(one, other):
            for key in ("loss", "grad_norm", *METRICS):
                close = math.isclose(mine[key], theirs[key], rel_tol=RELATIVE, abs_tol=ABSOLUTE)
                assert close, (name, mine["step"], key, mine[key], theirs[key])
        assert max_relative_difference(weights(tmp_path / "one"), weights(tmp_path / name)) < RELATIVE, name
        for mine, theirs in zip(evaluations["one"], evaluations[name]):
            for key in EVAL_METRICS:
                assert math.isclose(mine[key], theirs[key], rel_tol=RELATIVE, abs_tol=ABSOLUTE), (name, key)


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--loss_type", "dapo"), "--loss_type: shardtune rloo"),
        (("--scale_rewards", "batch"), "--scale_rewards is a flag of shardtune grpo (TRL's RLOOConfig has no"),
        (("--importance_sampling_level", "sequence"), "TRL's RLOOConfig has no importance_sampling_level"),
        (("--reward_clip_range", "2,1"), "--reward_clip_range"),
        (("--num_generations", 1), "--num_generations"),
        (("--tools", "TOOLS:nothing"), "defines no function 'nothing'"),
        (("--use_vllm", "true"), "vLLM is not built"),
    ],
)
def test_rloo_refusals_are_one_line_before_launch(cli_in_process, tmp_path, tool_run, flags, says):
    model, prompts, tools = tool_run
    flags = tuple(str(f).replace("TOOLS", str(tools)) for f in flags)
    proc = cli_in_process(
        "rloo",
        "--model_name_or_path",
        model,
        "--dataset_name",
        prompts,
        "--reward_funcs",
        f"{tools}:correct",
        "--per_device_train_batch_size",
        4,
        "--output_dir",
        tmp_path / "out",
        *flags,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and says in errors[0], proc.stderr


def test_an_rloo_flag_under_grpo_is_refused_and_plan_counts_rloos_sampling(cli_in_process, tmp_path, tool_run):
    model, prompts, tools = tool_run
    proc = cli_in_process(
        "grpo",
        "--model_name_or_path",
        model,
        "--dataset_name",
        prompts,
        "--reward_funcs",
        f"{tools}:correct",
        "--normalize_advantages",
        "true",
        "--output_dir",
        tmp_path / "out",
    )
    assert proc.returncode != 0 and "--normalize_advantages is a flag of shardtune rloo" in proc.stderr
    common = ("--model_name_or_path", "preset:llama-8b-shape", "--gpus_per_node", 8, "--json")
    plans = {}
    for name, objective, extra in (("rloo", "rloo", ()), ("beta 0", "rloo", ("--beta", 0.0)), ("grpo", "grpo", ())):
        proc = cli_in_process("plan", "--objective", objective, *common, *extra)
        assert proc.returncode == 0, proc.stderr
        plans[name] = json.loads(proc.stdout)["given"]["breakdown"]
    # RLOO samples as GRPO does (the KV cache of a generation's share), and its default beta 0.05 keeps a frozen
    # reference beside the policy (TRL's RLOOConfig; GRPO's default 0 keeps none)
    assert plans["rloo"]["sampling (KV cache)"] == plans["grpo"]["sampling (KV cache)"] > 0
    assert plans["rloo"]["parameters"] == 2 * plans["beta 0"]["parameters"]
    assert plans["beta 0"] == plans["grpo"]
