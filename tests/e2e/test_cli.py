"""The CLI as a user runs it: outputs, contracts, launch paths."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.config.flags import flat_fields
from tests.conftest import REPO, cli_env
from tests.helpers import eval_rows, step_rows

SMALL_RUN = ("--context_length", 256, "--synthetic_dialogues.num_train", 48, "--synthetic_dialogues.num_validation",
             8, "--batch_size_training", 2, "--num_workers_dataloader", 0, "--val_batch_size", 4)


def test_help_lists_every_flag_with_its_default(run_cli):
    out = run_cli("sft", "--help").stdout
    for key in flat_fields():
        assert f"--{key} " in out, key
    assert "OPTIMIZER steps" in out  # max_train_step says what it counts


def test_sft_writes_model_config_and_metrics(tiny_model, run_cli, tmp_path):
    out = tmp_path / "run"
    proc = run_cli("sft", "--nproc_per_node", 2, "--model_name", tiny_model, "--output_dir", out, *SMALL_RUN,
                   "--gradient_clipping", "true")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert (out / "config.yaml").is_file() and (out / "tokenizer.json").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".staging")]
    rows = step_rows(out)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and rows[-1]["epoch"] == 1.0
    for row in rows:
        assert {"step", "epoch", "loss", "num_tokens", "lr", "tokens_per_s", "grad_norm"} <= row.keys()
    (ev,) = eval_rows(out)
    assert ev["eval_ppl"] == pytest.approx(math.exp(ev["eval_loss"]), rel=1e-9)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("Anna: hi", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == model.config.vocab_size
    # rank 0 talks, rank 1 stays quiet
    assert proc.stdout.count("data (train):") == 1
    assert "done:" in proc.stdout and str(out.resolve()) in proc.stdout


def test_yaml_recipe_with_flag_override(tiny_model, run_cli, tmp_path):
    recipe = tmp_path / "r.yaml"
    # empty values (a key left blank in a recipe) mean the default, not the string "None"
    recipe.write_text(f"model_name: {tiny_model}\nbatching_strategy: padding\nlr: 0.5\ntokenizer_name:\n"
                      "warmup_steps:\nsynthetic_dialogues:\n  num_train: 16\n  num_validation: 4\n"
                      "samsum_dataset:\n  data_path:\n")
    out = tmp_path / "run"
    proc = run_cli("sft", "--config", recipe, "--lr", "0.001", "--output_dir", out, "--max_train_step", 2,
                   "--num_workers_dataloader", 0, "--run_validation", "false", "--save_model", "false")
    # one process runs in place (no torchrun), and its start log still begins with where the topology came from
    assert proc.stdout.startswith("topology: 1 node (standalone), 1 process per node"), proc.stdout[:300]
    import yaml

    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["lr"] == 0.001 and resolved["batching_strategy"] == "padding"
    assert resolved["synthetic_dialogues"]["num_train"] == 16
    assert resolved["tokenizer_name"] == "" and resolved["warmup_steps"] == 0
    assert resolved["samsum_dataset"]["data_path"] == ""
    assert [r["lr"] for r in step_rows(out)][0] == 0.001
    assert not (out / "model.safetensors").exists()


def test_torchrun_module_path_runs_in_place(tiny_model, cache_dir, tmp_path):
    """`torchrun --nproc_per_node 2 -m shardtune.sft ...` as in the llama-cookbook recipe."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "shardtune.sft", "--model_name", str(tiny_model), "--output_dir", str(out), "--max_train_step", "2",
           *map(str, SMALL_RUN)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(cache_dir), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(step_rows(out)) == 2 and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
