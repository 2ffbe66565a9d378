"""TRL 1.16's own trl/scripts/reward.py, read from the installed trl, with only ``trl`` replaced by ``shardtune`` in its
imports, run with TRL's documented flags under ``python`` and ``torchrun --nproc_per_node 2``: the same effective
batch gives the same per-step losses and metrics on both layouts (1e-5), and the unmodified script under trl gives
the same losses, accuracies, margins and evaluation as shardtune's (every step a full pass over the 16 pairs, so the
data order does not matter, and the score head is drawn from --seed as TRL draws it: 1e-5 asked, ~1e-8 seen)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.e2e.test_trl_scripts import COMMON, close, column, ours, run, theirs, trl_script


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_model) -> Path:
    """reward.py with its imports changed, the pairs as a train / test folder, and the tiny model, in one folder."""
    work = tmp_path_factory.mktemp("trl-reward-script")
    text = Path(trl_script("reward")).read_text()
    changed = re.sub(r"\bfrom trl import", "from shardtune import", text)
    assert "trl" not in re.findall(r"^\s*(?:from|import) (\w+)", changed, re.M), "an import of trl is left"
    (work / "reward.py").write_text(changed)
    rows = [
        {"prompt": f"Count from {i}:", "chosen": f" {i} {i + 1} {i + 2}", "rejected": f" {i} {i + 5} {i}"}
        for i in range(24)
    ]
    (work / "rmdata").mkdir()
    for split, part in (("train", rows[:16]), ("test", rows[16:])):
        (work / "rmdata" / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    (work / "tiny").symlink_to(tiny_model)
    return work


def test_trls_reward_script_runs_under_python_and_torchrun_as_under_trl(work, cache_dir):
    flags = [*COMMON, "--dataset_name", "rmdata", "--eval_strategy", "steps", "--eval_steps", "3"]
    runs = {}
    for layout, processes in (("python", 1), ("torchrun", 2)):
        shape = ["--per_device_train_batch_size", str(16 // processes), "--save_strategy", "no"]
        run(work, cache_dir, layout, "reward.py", [*flags, *shape, "--output_dir", f"reward-{layout}"])
        runs[layout] = ours(work, f"reward-{layout}")
    one = runs["python"]
    for key in ("loss", "accuracy", "margin", "mean_reward", "eval_loss", "eval_accuracy"):
        assert close(column(runs["torchrun"], key), column(one, key), 1e-5), (key, column(runs["torchrun"], key))
    assert len(set(column(one, "loss"))) == 3 and column(one, "loss")[-1] < column(one, "loss")[0]
    assert (work / "reward-python" / "model.safetensors").is_file()
    shape = ["--per_device_train_batch_size", "16", "--output_dir", "reward-trl", "--save_steps", "3"]
    run(work, cache_dir, "python", trl_script("reward"), [*flags, *shape])
    trl_rows = theirs(work, "reward-trl", 3)
    for key in ("loss", "accuracy", "margin", "mean_reward", "min_reward", "max_reward", "eval_loss", "eval_margin"):
        assert close(column(one, key), column(trl_rows, key), 1e-5), (key, column(one, key), column(trl_rows, key))
