"""The CLI as a user runs it: outputs, contracts, launch paths."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.config.flags import flat_fields
from tests.conftest import REPO, cli_env, main_in_process
from tests.helpers import eval_rows, step_rows, write_remote_code_model
from tests.hub_standin import HubStandIn

SMALL_RUN = (
    "--context_length",
    256,
    "--synthetic_dialogues.num_train",
    48,
    "--synthetic_dialogues.num_validation",
    8,
    "--batch_size_training",
    2,
    "--num_workers_dataloader",
    0,
    "--val_batch_size",
    4,
)


def test_help_lists_every_flag_with_its_default(run_cli):
    out = run_cli("sft", "--help").stdout
    for key in flat_fields():
        assert f"--{key} " in out, key
    assert "counted in optimizer steps" in out  # max_train_step says what it counts


def test_sft_writes_model_config_and_metrics(tiny_model, run_cli, tmp_path):
    out = tmp_path / "run"
    with HubStandIn() as hub:  # --push_to_hub: rank 0 uploads the published model after the run
        proc = run_cli(
            "sft",
            "--nproc_per_node",
            2,
            "--model_name",
            tiny_model,
            "--output_dir",
            out,
            *SMALL_RUN,
            "--gradient_clipping",
            "true",
            "--push_to_hub",
            env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_standin"},
        )
    # the repo is output_dir's name in the token's namespace; it received the model folder, byte for byte
    assert hub.created == [{"name": "run", "organization": None}]
    model_files = {
        p.name: p.read_bytes()
        for p in out.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.name not in ("config.yaml", "metrics.jsonl")
    }
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= model_files.keys()
    assert hub.received("tester/run") == model_files
    assert "pushed to the hub: " in proc.stdout
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert (out / "config.yaml").is_file() and (out / "tokenizer.json").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".staging")]
    rows = step_rows(out)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and rows[-1]["epoch"] == 1.0
    for row in rows:
        assert {"step", "epoch", "loss", "num_tokens", "label_tokens", "lr", "tokens_per_s", "grad_norm"} <= row.keys()
        assert {"mean_token_accuracy", "entropy"} <= row.keys()
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
    # the tiny model as an architecture of its own code (auto_map), which TRL's trust_remote_code lets run
    model = write_remote_code_model(tiny_model, tmp_path / "remote")
    # empty values (a key left blank in a recipe) mean the default, not the string "None"
    recipe.write_text(
        f"model_name: {model}\ntrust_remote_code: true\nbatching_strategy: padding\nlr: 0.5\n"
        "tokenizer_name:\n"
        "warmup_steps:\nsynthetic_dialogues:\n  num_train: 16\n  num_validation: 4\n"
        "samsum_dataset:\n  data_path:\n"
    )
    out = tmp_path / "run"
    proc = run_cli(
        "sft",
        "--config",
        recipe,
        "--lr",
        "0.001",
        "--output_dir",
        out,
        "--max_train_step",
        2,
        "--num_workers_dataloader",
        0,
        "--run_validation",
        "false",
        "--save_model",
        "false",
        "--save_steps",
        2,
    )
    # one process runs in place (no torchrun), and its start log still begins with where the topology came from
    assert proc.stdout.startswith("topology: 1 node (standalone), 1 process per node"), proc.stdout[:300]
    import yaml

    resolved = yaml.safe_load((out / "config.yaml").read_text())  # the canonical config, grouped
    assert resolved["optim"]["lr"] == 0.001 and resolved["data"]["batching"] == "padding"
    assert resolved["data"]["synthetic_dialogues"]["num_train"] == 16
    assert resolved["model"]["tokenizer"] == "" and resolved["optim"]["warmup_steps"] == 0
    assert resolved["data"]["samsum_dataset"]["data_path"] == ""
    assert [r["lr"] for r in step_rows(out)][0] == 0.001
    assert resolved["model"]["trust_remote_code"] is True
    assert f"trust_remote_code: running the model's own code from {model}" in proc.stdout
    assert not (out / "model.safetensors").exists()
    # its checkpoint keeps the model's code, and export runs it as the run did (config.yaml says trust_remote_code)
    exported = main_in_process("export", out, tmp_path / "exported")
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "exported" / "modeling_remote_llama.py").read_text() == (
        model / "modeling_remote_llama.py"
    ).read_text()
    assert (
        type(AutoModelForCausalLM.from_pretrained(tmp_path / "exported", trust_remote_code=True)).__name__
        == "RemoteLlamaForCausalLM"
    )


def test_torchrun_module_path_runs_in_place(tiny_model, cache_dir, tmp_path):
    """`torchrun --nproc_per_node 2 -m shardtune.sft ...` as in the llama-cookbook recipe."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "shardtune.sft",
        "--model_name",
        str(tiny_model),
        "--output_dir",
        str(out),
        "--max_train_step",
        "2",
        *map(str, SMALL_RUN),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(cache_dir), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(step_rows(out)) == 2 and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def test_trls_eval_strategy_steps_evaluates_on_its_interval_only_and_eval_only_repeats_the_last(
    tiny_model, run_cli, tmp_path
):
    """--eval_strategy steps --eval_steps 3 over epochs of 4 steps: evaluations at steps 3 and 6, as Trainer (none
    at the epoch's end, step 4); --eval_only on the published model gives the step-6 evaluation again, alone."""
    data = ("--dataset", "synthetic_dialogues", "--synthetic_dialogues.num_train", 16)
    data += ("--synthetic_dialogues.num_validation", 4, "--max_length", 256)
    out = tmp_path / "run"
    run_cli(
        "sft", "--nproc_per_node", 1, "--model_name_or_path", tiny_model, "--output_dir", out, *data,
        "--per_device_train_batch_size", 4, "--max_steps", 6, "--eval_strategy", "steps", "--eval_steps", 3,
        "--logging_steps", 1, "--save_strategy", "no", "--learning_rate", 1e-3,
    )  # fmt: skip
    evals = {row["step"]: row["eval_loss"] for row in eval_rows(out)}
    assert list(evals) == [3, 6] and [r["epoch"] for r in step_rows(out)][3] == 1.0
    again = tmp_path / "again"
    proc = run_cli(
        "sft", "--nproc_per_node", 2, "--model_name_or_path", out, "--output_dir", again, *data, "--eval_only",
        "--per_device_eval_batch_size", 1,
    )  # fmt: skip
    assert "evaluated: eval loss" in proc.stdout and not step_rows(again)
    (row,) = eval_rows(again)
    assert row["step"] == 0 and row["eval_loss"] == pytest.approx(evals[6], rel=1e-6)
    assert not (again / "model.safetensors").exists()
