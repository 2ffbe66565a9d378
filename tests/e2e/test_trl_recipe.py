"""A TRL user's recipe runs as written: a `trl sft --config` YAML with TRL's keys, its env: and accelerate_config:
(2 processes, LoRA on all-linear, the tiny model, a few steps), checked for what each key did. One launch; the
parsing of every flag without a launch is in tests/unit/test_trl_flags.py."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from shardtune.commands.export import export_checkpoint
from shardtune.training.engine.metrics import read_metrics
from tests.hub_standin import HubStandIn

WARMUP, STEPS, PEAK = 2, 6, 1e-3


def test_a_trl_recipe_with_its_accelerate_file_does_what_each_key_says(tiny_model, run_cli, tmp_path):
    accelerate = tmp_path / "multi_gpu.yaml"  # TRL's keys (examples/accelerate_configs/multi_gpu.yaml), 2 processes
    accelerate.write_text(
        yaml.safe_dump(
            {
                "compute_environment": "LOCAL_MACHINE",
                "debug": False,
                "distributed_type": "MULTI_GPU",
                "downcast_bf16": "no",
                "gpu_ids": "all",
                "machine_rank": 0,
                "main_training_function": "main",
                "mixed_precision": "no",
                "num_machines": 1,
                "num_processes": 2,
                "rdzv_backend": "static",
                "same_network": True,
                "tpu_env": [],
                "tpu_use_cluster": False,
                "tpu_use_sudo": False,
                "use_cpu": False,
            }
        )
    )
    out = tmp_path / "run"
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": str(tiny_model),
                "use_peft": True,
                "lora_r": 4,
                "lora_alpha": 8,
                "lora_target_modules": "all-linear",
                "lora_dropout": 0.0,
                "learning_rate": PEAK,
                "lr_scheduler_type": "cosine",
                "warmup_steps": WARMUP,
                "max_steps": STEPS,
                "num_train_epochs": 1,
                "max_grad_norm": 0.01,
                "gradient_checkpointing": True,
                "attn_implementation": "eager",
                "per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 1,
                "bf16": True,
                "weight_decay": 0.01,
                "packing": True,
                # fractions of the run's 6 steps (Trainer's rule: ceil(0.5 x 6) = 3); the best checkpoint
                # published, judged "higher eval loss is better" so that the earlier one (the loss falls) is
                # chosen over the last (step 0's evaluation, --eval_on_start, has no checkpoint to choose)
                "eval_strategy": "steps",
                "eval_steps": 0.5,
                "eval_on_start": True,
                "save_strategy": "steps",
                "save_steps": 0.5,
                "save_total_limit": 1,
                "load_best_model_at_end": True,
                "metric_for_best_model": "loss",
                "greater_is_better": True,
                "logging_steps": 1,
                "report_to": "none",
                "dataloader_num_workers": 0,
                "output_dir": str(out),
                "env": {"TOKENIZERS_PARALLELISM": "false"},
                "accelerate_config": str(accelerate),
                "max_length": 256,
                "synthetic_dialogues": {"num_train": 48, "num_validation": 4},
                "push_to_hub": True,
                "hub_model_id": "me/tiny-lora",
                "hub_private_repo": True,
                "hub_strategy": "end",
                "hub_token": "hf_recipe_token",
            }
        )
    )
    with HubStandIn(refuse_commits=True) as hub:  # the upload after the run fails: a hub that refuses the commit
        proc = run_cli(
            "sft", "--config", recipe, cwd=tmp_path, check=False, env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url}
        )
    # everything of the run is written before the upload; its failure is one line saying how to upload by hand
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert hub.created == [{"name": "tiny-lora", "organization": "me", "visibility": "private"}]
    assert hub.tokens == {"hf_recipe_token"} and "hf_recipe_token" not in (out / "config.yaml").read_text()
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert "uploading to me/tiny-lora failed (403 Forbidden: You don't have the rights to create a commit)" in error
    assert error.endswith(
        f"the trained model is unharmed in {out}: upload it by hand with hf upload me/tiny-lora {out}"
    )

    assert (
        "ddp, world size 2" in proc.stdout and "activation checkpointing" in proc.stdout
    )  # 2 processes, checkpointing
    (said,) = [line for line in proc.stderr.splitlines() if line.startswith("shardtune: defaults: ")]
    assert said.startswith("shardtune: defaults: TRL's (--dataloader_num_workers, --eval_strategy, ") and said.endswith(
        "lr 0.001, cosine schedule, warmup 2 steps, max_grad_norm 0.01, 6 steps, batch 2, checkpoints every 0.5 of "
        "the steps, packing, LoRA r 4 / alpha 8 / dropout 0"
    )  # the start log: whose defaults (a YAML's keys are TRL's), and what the run has
    assert "attention: eager (--attn_implementation)" in proc.stdout and "by the eager formula" in proc.stdout
    # bf16 (recipe) vs mixed_precision: no (Accelerate file): the recipe wins, and one line says so
    notes = [line for line in proc.stderr.splitlines() if "the Accelerate file says" in line]
    assert len(notes) == 1 and "train.precision" in notes[0] and "(bf16)" in notes[0] and str(recipe) in notes[0]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    lrs = [r["lr"] for r in rows]
    assert len(rows) == STEPS
    assert lrs[: WARMUP + 1] == pytest.approx([PEAK / 3, 2 * PEAK / 3, PEAK])  # warm-up, then the peak
    assert all(a > b for a, b in zip(lrs[WARMUP:], lrs[WARMUP + 1 :]))  # cosine decay
    assert all(r["grad_norm"] > 0.01 for r in rows)  # clipping on: the norm before clipping is reported
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r}
    assert list(evals) == [0, 3, STEPS]  # --eval_on_start, --eval_steps 0.5 inside the epoch, and the run's end
    assert evals[0] > evals[3] > evals[STEPS]
    # save_total_limit 1 keeps the newest, and the best besides; the best's model is the one published
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000003", f"step-{STEPS:06d}"]
    assert "load_best_model_at_end: publishing the model of" in proc.stdout and "step-000003" in proc.stdout
    export_checkpoint(out / "checkpoints" / "step-000003", tmp_path / "best")
    published, best = (load_file(str(d / "adapter_model.safetensors")) for d in (out, tmp_path / "best"))
    assert published.keys() == best.keys() and all(torch.equal(published[k], best[k]) for k in best)
    export_checkpoint(out / "checkpoints" / f"step-{STEPS:06d}", tmp_path / "last")
    last = load_file(str(tmp_path / "last" / "adapter_model.safetensors"))
    assert any(not torch.equal(published[k], last[k]) for k in last)
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8
    assert {m.rsplit(".", 1)[-1] for m in adapter["target_modules"]} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }  # all-linear: every linear layer but the head
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["optim"]["max_grad_norm"] == 0.01 and resolved["eval"]["on_start"]
    assert resolved["optim"]["weight_decay"] == 0.01 and resolved["parallel"]["activation_checkpointing"]
    assert (out / "plots" / "loss.png").is_file() and (out / "plots" / "lr.png").is_file()  # charts at the end
