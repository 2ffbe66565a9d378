"""Small helpers the tests share: reading outputs of real runs."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardtune.training.engine.metrics import read_metrics
from tests.rounding import assert_same_adam_training


def step_rows(out_dir: Path) -> list[dict]:
    return [r for r in read_metrics(out_dir / "metrics.jsonl") if "loss" in r]


def eval_rows(out_dir: Path) -> list[dict]:
    return [r for r in read_metrics(out_dir / "metrics.jsonl") if "eval_loss" in r]


def weights(out_dir: Path) -> dict[str, torch.Tensor]:
    """The saved model's tensors, or the adapter's when the run trained one (PEFT writes no model.safetensors)."""
    model = out_dir / "model.safetensors"
    return load_file(str(model if model.is_file() else out_dir / "adapter_model.safetensors"))


def train_once(runs: dict, name: str, run_cli, *args) -> Path:
    """``shardtune sft ARGS --output_dir ROOT/name``, launched on first use and cached in ``runs`` (a module-scoped
    dict with the "root" folder), so that the tests of a module share their launches; stdout is kept in the output
    dir's stdout.log."""
    if name not in runs:
        out = runs["root"] / name
        proc = run_cli("sft", "--output_dir", out, *args)
        (out / "stdout.log").write_text(proc.stdout)
        runs[name] = out
    return runs[name]


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of ||a - b|| / ||a|| (Frobenius norms).

    Per-element ratios are the wrong yardstick after Adam: an entry whose gradient is ~0 gets an update of
    m / sqrt(v) whose float rounding is amplified; the tensor-level relative difference is what "the same
    weights up to float rounding" means (observed ~1e-6 here, vs ~1e-2 for a genuinely different run).
    """
    assert a.keys() == b.keys(), f"different tensors: {sorted(a.keys() ^ b.keys())}"
    worst = 0.0
    for name in a:
        x, y = a[name].double(), b[name].double()
        worst = max(worst, float((x - y).norm() / x.norm().clamp_min(1e-30)))
    return worst


def assert_same_training(ref: Path, other: Path, label: str, num_steps: int = 4) -> float:
    """Same token counts (TRL's running num_tokens of real input tokens, the step's label_tokens), losses, gradient
    norms and, for SFT, TRL's token accuracy and entropy at every one of the steps, same weights up to Adam's amplified
    rounding (tests/rounding.py): returns the weights' max_relative_difference, for the log."""
    ref_rows, rows = step_rows(ref), step_rows(other)
    assert len(rows) == len(ref_rows) == num_steps, label
    for r, o in zip(ref_rows, rows):
        assert (o["num_tokens"], o["label_tokens"]) == (r["num_tokens"], r["label_tokens"]), (label, r["step"])
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=0), (label, r["step"])
        assert o["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), (label, r["step"])
        for key in ("mean_token_accuracy", "entropy"):
            assert (key in o) == (key in r), (label, key)
            if key in r:
                assert o[key] == pytest.approx(r[key], rel=1e-5, abs=0), (label, key, r["step"])
    # not a relative difference of 1e-5, fitted to one CPU's kernels (1.03e-5 on MKL's other code path): Adam turns
    # the rounding of a nearly cancelling gradient element into up to 2 lr, so count elements beyond lr / 100
    lr = max(r["lr"] for r in ref_rows)
    assert_same_adam_training(weights(ref), weights(other), lr, ref_rows, label)
    return max_relative_difference(weights(ref), weights(other))


def assert_plain_hf_directory(out_dir: Path):
    """The saved model loads with transformers, holds exactly the saved tensors (none of them an empty shard),
    and computes finite logits; returns the loaded model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir)
    saved, state = weights(out_dir), model.state_dict()
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k]) for k in saved)
    assert all(t.numel() > 0 for t in saved.values()), "a partitioned (empty) parameter was saved"
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 5, 9, 14]])).logits).all()
    return model


REMOTE_CONFIG_CODE = """from transformers import LlamaConfig


class RemoteLlamaConfig(LlamaConfig):
    model_type = "remote_llama"
"""
REMOTE_MODELING_CODE = """from transformers import LlamaForCausalLM

from .configuration_remote_llama import RemoteLlamaConfig


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    config_class = RemoteLlamaConfig
"""


def write_remote_code_model(base: Path, out_dir: Path) -> Path:
    """``base`` (a Llama directory) as a model whose architecture is its own code: a model_type transformers does not
    ship, with configuration / modeling files named by auto_map (what --trust_remote_code is for)."""
    import json
    import shutil

    shutil.copytree(base, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    config.update(
        model_type="remote_llama",
        architectures=["RemoteLlamaForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote_llama.RemoteLlamaConfig",
            "AutoModelForCausalLM": "modeling_remote_llama.RemoteLlamaForCausalLM",
        },
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "configuration_remote_llama.py").write_text(REMOTE_CONFIG_CODE)
    (out_dir / "modeling_remote_llama.py").write_text(REMOTE_MODELING_CODE)
    return out_dir


def wait_for(condition, proc: subprocess.Popen, what: str, poll_s: float = 0.002):
    """Poll ``condition`` until it returns a value; the run's stderr if ``proc`` ends first."""
    while (value := condition()) is None:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n{proc.stderr.read()[-8000:]}")
        time.sleep(poll_s)
    return value


def logged_steps(out: Path) -> int:
    """The last optimizer step in ``out``'s metrics.jsonl (0 while there is none or it is being written)."""
    try:
        return max((r["step"] for r in step_rows(out)), default=0)
    except (OSError, json.JSONDecodeError):
        return 0
