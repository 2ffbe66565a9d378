"""TRL 1.16's own ``trl/scripts/rloo.py``, read from the installed trl, with only ``trl`` replaced by ``shardtune`` in
its imports, run with TRL's flags under ``python`` and ``torchrun --nproc_per_node 2`` (as tests/e2e/test_trl_scripts.py
runs sft.py, dpo.py and grpo.py): the same effective batch gives the same per-step losses and rewards on both (1e-5:
the same completions, shardtune's keyed sampling). The unmodified script under trl samples other completions (its own
generator), so its losses are compared where they do not depend on them: RLOO's loss at ratio 1 (one optimizer step
per generation) is minus the mean leave-one-out advantage, zero for any rewards up to rounding, on both sides."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.e2e.test_trl_scripts import close, column, ours, run, theirs, trl_script

COMMON = ["--model_name_or_path", "tiny", "--learning_rate", "1e-3", "--num_train_epochs", "1", "--max_steps", "3"]
COMMON += ["--logging_steps", "1", "--report_to", "none", "--bf16", "false", "--seed", "0"]
COMMON += ["--dataset_name", "rloodata", "--num_generations", "4", "--max_completion_length", "6"]
COMMON += ["--reward_funcs", "my_rewards.length_reward"]  # a dotted path: the script imports it from its cwd


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_model) -> Path:
    """rloo.py with its imports changed, a data folder (train / test splits), the user's reward module, the model."""
    import trl.scripts

    work = tmp_path_factory.mktemp("trl-rloo")
    text = (Path(trl.scripts.__file__).parent / "rloo.py").read_text()
    changed = re.sub(r"\bfrom trl(\.rewards)? import", lambda m: f"from shardtune{m.group(1) or ''} import", text)
    assert "trl" not in re.findall(r"^\s*(?:from|import) (\w+)", changed, re.M), "an import of trl is left"
    (work / "rloo.py").write_text(changed)
    rows = [{"prompt": f"Say a number bigger than {i}:", "solution": str(i + 1)} for i in range(24)]
    (work / "rloodata").mkdir()
    for split, part in (("train", rows[:16]), ("test", rows[16:])):
        (work / "rloodata" / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    (work / "my_rewards.py").write_text(
        "def length_reward(completions, **kwargs):\n"
        "    return [len(c if isinstance(c, str) else c[-1]['content']) / 10 for c in completions]\n"
    )
    (work / "tiny").symlink_to(tiny_model)
    return work


def test_trls_rloo_script_runs_under_python_and_torchrun_with_the_same_completions(work, cache_dir):
    runs = {}
    for layout, processes in (("python", 1), ("torchrun", 2)):
        shape = ["--per_device_train_batch_size", str(8 // processes), "--output_dir", f"rloo-{layout}"]
        run(work, cache_dir, layout, "rloo.py", [*COMMON, *shape, "--save_strategy", "no"])
        runs[layout] = ours(work, f"rloo-{layout}")
    one = runs["python"]
    assert len(set(column(one, "reward"))) > 1  # rewards that vary: the comparison below can fail
    assert column(one, "kl")[0] == pytest.approx(0.0, abs=1e-6) and column(one, "kl")[-1] != 0  # RLOO's beta 0.05
    for name in ("loss", "reward", "kl", "grad_norm"):
        assert close(column(runs["torchrun"], name), column(one, name), 1e-5), (name, column(runs["torchrun"], name))
    assert (work / "rloo-python" / "model.safetensors").is_file()
    shape = ["--per_device_train_batch_size", "8", "--output_dir", "rloo-trl", "--save_steps", "3"]
    run(work, cache_dir, "python", trl_script("rloo"), [*COMMON, *shape])
    trl_rows = [row for row in theirs(work, "rloo-trl", 3) if "loss" in row]
    assert close(column(one, "loss"), column(trl_rows, "loss"), 1e-3), (column(one, "loss"), column(trl_rows, "loss"))
    assert set(column(trl_rows, "reward")) and all(abs(x) < 1e-3 for x in column(trl_rows, "loss"))
