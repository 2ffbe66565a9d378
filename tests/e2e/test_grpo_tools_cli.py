"""GRPO with a tool learns to call it: ``shardtune grpo --tools toy.py:add`` on "What is a plus b?" (tests/tool_toy.py:
the tiny model taught a chat format in which about a quarter of its replies call the calculator). The reward is 1 for
the right answer, which only the tool knows, and 0.5 for a call that got its result; in 20 steps of 16 completions the
fraction of completions that call the tool rises from about a quarter to nearly all (measured: 0.25 at step 1, >= 0.9
from step 15 on). One process, as ``shardtune grpo`` runs it on a machine without GPUs."""

from __future__ import annotations

from tests import tool_toy
from tests.helpers import step_rows


def test_grpo_with_a_calculator_learns_to_call_it(run_cli, tmp_path, cache_dir):
    model = cache_dir / "tool-toy-v1"
    if not (model / "config.json").is_file():
        tool_toy.build(model)
    tools = tmp_path / "toy.py"
    tools.write_text(tool_toy.TOOLS_PY)
    prompts = tool_toy.write_data(tmp_path / "prompts", num_train=48)
    out = tmp_path / "out"
    run_cli(
        "grpo",
        "--model_name_or_path",
        model,
        "--dataset_name",
        prompts,
        "--reward_funcs",
        f"{tools}:correct",
        f"{tools}:called",
        "--reward_weights",
        1.0,
        0.5,
        "--tools",
        f"{tools}:add",
        "--num_generations",
        8,
        "--per_device_train_batch_size",
        16,
        "--max_completion_length",
        24,
        "--max_steps",
        20,
        "--learning_rate",
        0.001,
        "--lr_scheduler_type",
        "constant",
        "--logging_steps",
        1,
        "--output_dir",
        out,
        "--save_strategy",
        "no",
    )
    calls = [row["tools/call_frequency"] for row in step_rows(out)]
    assert len(calls) == 20
    early, late = sum(calls[:3]) / 3, sum(calls[-5:]) / 5
    assert early < 0.6 and late > 0.8 and late > early + 0.3, calls
    assert all(row["tools/failure_frequency"] < 0.5 for row in step_rows(out))  # its calls are well formed
