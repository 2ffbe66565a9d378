"""A new objective is a plug-in of the engine: this file defines one — a per-token weighted SFT, its Objective and its
Registration — and trains it through the command line (``shardtune sft --objective <this module>:WEIGHTED``) and the
Python face (a trainer class of its own), with no file of the package edited. The engine gives it what it gives the
built-in objectives: the step's loss is sum(w x token loss) over the step's tokens of all ranks / the global sum of
w, so 1 process x 4 rows == 2 processes x 2 rows; the first step's loss equals the weighted loss computed here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from shardtune.config.objectives import Registration
from shardtune.model.loss import IGNORE_INDEX, model_inputs, next_token_targets
from shardtune.training.objectives.sft.objective import SFT
from tests.conftest import cli_env, shardtune_argv


def token_weights(targets: torch.Tensor) -> torch.Tensor:
    """The toy's weights: a target token with an odd id weighs 2, an even one 1, a masked one 0."""
    return torch.where(targets == IGNORE_INDEX, 0.0, 1.0 + (targets % 2).float())


class WeightedSFT(SFT):
    """SFT whose label tokens weigh by their id (token_weights): normalised by the step's global sum of weights."""

    name = "weighted_sft"
    stat_names = ("loss_sum",)

    def counts(self, micro_batches: list[dict], shape) -> list[float]:
        weights = sum(float(token_weights(next_token_targets(mb)).sum()) for mb in micro_batches)
        return [weights, *super().counts(micro_batches, shape)[1:]]  # the normaliser, then SFT's counts

    def loss(self, model, batch: dict, totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        targets = next_token_targets(batch).to(self.env.device)
        logits = model(**model_inputs(batch, self.env.device), use_cache=False).logits.float()
        token_loss = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        )
        loss_sum = (token_loss * token_weights(targets.flatten())).sum()
        return loss_sum, loss_sum.detach().double().reshape(1)

    def step_metrics(self, totals: dict[str, float], stats: list[float]) -> dict[str, float]:
        return {"loss": stats[0] / max(totals["normaliser"], 1.0)}


MODULE = "tests.e2e.test_plugin_objective"  # importable in every process of a run (the repo is on PYTHONPATH)
WEIGHTED = Registration("per-token weighted SFT (a plug-in of the tests)", f"{MODULE}:WeightedSFT")
SPEC = f"{MODULE}:WEIGHTED"


def write_rows(folder: Path, vocab: int) -> list[list[int]]:
    """Pre-tokenised rows (TRL's input_ids format: every token labelled) of lengths 5..12."""
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, vocab, (5 + i,), generator=generator).tolist() for i in range(8)]
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in rows))
    return rows


def weighted_loss(model_dir: Path, rows: list[list[int]]) -> float:
    """The oracle: the starting model's weighted loss over all the rows (one step holds all of them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total, weight = 0.0, 0.0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row])
            logits = model(input_ids=ids).logits[0, :-1].double()
            targets = ids[0, 1:]
            token_loss = F.cross_entropy(logits, targets, reduction="none")
            total += float((token_loss * token_weights(targets).double()).sum())
            weight += float(token_weights(targets).sum())
    return total / weight


def run(argv: list[str], cache_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=cli_env(cache_dir), cwd=cwd)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def losses(folder: Path) -> list[float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def test_a_plug_in_objective_trains_through_the_command_line_and_the_python_face(tiny_model, cache_dir, tmp_path):
    from transformers import AutoConfig

    rows = write_rows(tmp_path / "data", AutoConfig.from_pretrained(str(tiny_model)).vocab_size)
    common = ["--model_name", str(tiny_model), "--dataset_name", str(tmp_path / "data"), "--max_steps", "3"]
    common += ["--lr", "1e-3", "--batching_strategy", "padding", "--run_validation", "false", "--save_model", "false"]
    for name, shape in (
        ("one", ["--nproc_per_node", "1", "--batch_size_training", "8"]),
        ("two", ["--nproc_per_node", "2", "--batch_size_training", "4"]),
    ):
        argv = shardtune_argv("sft", "--objective", SPEC, *common, *shape, "--output_dir", str(tmp_path / name))
        run(argv, cache_dir, tmp_path)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == 3 and all(abs(a - b) <= 1e-5 for a, b in zip(one, two, strict=True)), (one, two)
    assert abs(one[0] - weighted_loss(tiny_model, rows)) <= 1e-5  # the plug-in's own loss, not SFT's
    sft = shardtune_argv("sft", *common, "--nproc_per_node", "1", "--batch_size_training", "8", "--max_steps", "1")
    run([*sft, "--output_dir", str(tmp_path / "sft")], cache_dir, tmp_path)
    assert abs(losses(tmp_path / "sft")[0] - one[0]) > 1e-3  # control: the weights change the loss
    # the Python face: a trainer class of the plug-in's own, in TRL's shape
    script = f"""
import json
from shardtune import SFTConfig, SFTTrainer

class WeightedSFTTrainer(SFTTrainer):
    objective = {SPEC!r}

rows = [json.loads(line) for line in open({str(tmp_path / "data" / "train.jsonl")!r})]
args = SFTConfig(output_dir="face", per_device_train_batch_size=8, max_steps=3, learning_rate=1e-3, bf16=False,
                 lr_scheduler_type="constant", max_grad_norm=0.0, gradient_checkpointing=False, logging_steps=1)
trainer = WeightedSFTTrainer(model={str(tiny_model)!r}, args=args, train_dataset=rows)
trainer.train()
print("RESULT", json.dumps([r["loss"] for r in trainer.state.log_history if "loss" in r]))
"""
    out = run([sys.executable, "-c", script], cache_dir, tmp_path).stdout
    face = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    assert abs(face[0] - weighted_loss(tiny_model, rows)) <= 1e-5 and len(face) == 3
