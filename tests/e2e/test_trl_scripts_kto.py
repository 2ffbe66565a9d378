"""TRL 1.16's own trl/scripts/kto.py, read from the installed trl, with only ``trl`` replaced by ``shardtune`` in its
imports, run with TRL's documented flags under ``python`` and ``torchrun --nproc_per_node 2`` (the pattern of
tests/e2e/test_trl_scripts.py). The same effective batch gives the same per-step losses and KL on both (1e-5: the KL
estimate is the step's, whatever its split), and the unmodified script under trl gives the same losses as shardtune's
where the run is deterministic: every step the whole data (16 unpaired rows, TRL's sequential order, its KL pairs the
rows rotated by one), one process, one micro-batch, where TRL's per-device KL estimate is the step's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.e2e.test_trl_scripts import COMMON, close, column, ours, run, theirs, trl_script

# (prompt, completion, label): a desirable count and an undesirable one per number, mixed in the data's order
ROWS = [
    {"prompt": f"Count from {i}:", "completion": f" {i} {i + 1} {i + 2}", "label": True}
    if i % 3
    else {"prompt": f"Count from {i}:", "completion": f" {i} {i + 5} {i}", "label": False}
    for i in range(24)
]


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_model) -> Path:
    """kto.py with its imports changed, the data folder (train / test splits as the script loads them with
    load_dataset(folder)) and the tiny model, in one working directory."""
    import trl.scripts

    work = tmp_path_factory.mktemp("trl-kto")
    text = (Path(trl.scripts.__file__).parent / "kto.py").read_text()
    changed = re.sub(r"\bfrom trl import", "from shardtune import", text)
    assert "trl" not in re.findall(r"^\s*(?:from|import) (\w+)", changed, re.M), "an import of trl is left"
    (work / "kto.py").write_text(changed)
    (work / "ktodata").mkdir()
    for split, part in (("train", ROWS[:16]), ("test", ROWS[16:])):
        (work / "ktodata" / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    (work / "tiny").symlink_to(tiny_model)
    return work


def test_trls_kto_script_runs_under_python_and_torchrun_as_under_trl(work, cache_dir):
    """Losses: TRL scores its KL rows and reference rows with its no-gradient fused head, up to ~5e-3 nats per
    sequence from a float64 forward (tests/unit/test_kto.py): a row's loss moves by at most beta / 4 per unit of its
    log-ratio and of the KL, so by beta / 4 x 1e-2 = 2.5e-4 at TRL's beta 0.1; the KL by 1e-2. 1e-3 and 1e-2 asked."""
    flags = [*COMMON, "--dataset_name", "ktodata", "--eval_strategy", "steps", "--eval_steps", "3"]
    runs = {}
    for layout, per_device in (("python", 16), ("torchrun", 8)):
        shape = ["--per_device_train_batch_size", str(per_device), "--output_dir", f"kto-{layout}"]
        run(work, cache_dir, layout, "kto.py", [*flags, *shape, "--save_strategy", "no"])
        runs[layout] = ours(work, f"kto-{layout}")
    one = runs["python"]
    assert len(column(one, "loss")) == 3 and max(column(one, "kl")) > 1e-3, column(one, "kl")
    for metric in ("loss", "kl", "rewards/margins", "eval_loss", "eval_kl"):
        assert close(column(runs["torchrun"], metric), column(one, metric), 1e-5), (metric, column(one, metric))
    shape = ["--per_device_train_batch_size", "16", "--output_dir", "kto-trl", "--save_steps", "3"]
    run(work, cache_dir, "python", trl_script("kto"), [*flags, *shape])
    trl_rows = theirs(work, "kto-trl", 3)
    assert close(column(one, "loss"), column(trl_rows, "loss"), 1e-3), (column(one, "loss"), column(trl_rows, "loss"))
    assert close(column(one, "kl"), column(trl_rows, "kl"), 1e-2), (column(one, "kl"), column(trl_rows, "kl"))
    assert close(column(one, "logps/chosen"), column(trl_rows, "logps/chosen"), 1e-3)
    assert close(column(one, "eval_loss"), column(trl_rows, "eval_loss"), 1e-3)  # the 8 test rows: one batch, one chunk
    assert (work / "kto-python" / "model.safetensors").is_file()
