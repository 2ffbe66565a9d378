"""Bad PEFT / quantisation input: each is one clear line on stderr, exit status 2, before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO


def assert_refused(proc, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert len(errors) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "train:" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def sft(run, model, tmp_path, *flags, **kwargs):
    """``run``: the ``cli_in_process`` fixture (refusals come before any process starts) or ``run_cli``."""
    args = ("sft", "--nproc_per_node", 2, "--model_name", model, "--output_dir", tmp_path / "out", "--use_peft", *flags)
    return run(*args, check=False, **kwargs) if kwargs else run(*args)


@pytest.mark.parametrize(
    "flags,fragments",
    [
        (["--peft_method", "lorra"], ["--peft_method 'lorra'", "did you mean lora?"]),
        (["--lora_config.target_modules", "q_proj,qv_proj"], ["'qv_proj' matches no module", "did you mean"]),
        (["--enable_fsdp", "--quantization", "8bit"], ["--quantization 8bit", "--enable_fsdp"]),
    ],
)
def test_bad_peft_settings_are_refused_before_training(flags, fragments, cli_in_process, tiny_model, tmp_path):
    assert_refused(sft(cli_in_process, tiny_model, tmp_path, *flags), *fragments)


def test_quantization_without_bitsandbytes_says_how_to_install(run_cli, tiny_model, tmp_path):
    # a module that fails to import, first on the path: what Python sees when bitsandbytes is not installed
    shadow = tmp_path / "no-bitsandbytes"
    shadow.mkdir()
    (shadow / "bitsandbytes.py").write_text("raise ImportError(\"No module named 'bitsandbytes'\")\n")
    proc = sft(run_cli, tiny_model, tmp_path, "--quantization", "4bit", env={"PYTHONPATH": f"{shadow}:{REPO}"})
    assert_refused(proc, "bitsandbytes", "pip install 'shardtune[qlora]'")


def test_llama_adapter_on_an_unsupported_architecture(cli_in_process, tiny_model, tmp_path):
    from transformers import Qwen2Config

    other = tmp_path / "qwen2-tiny"
    Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1024,
    ).save_pretrained(other)
    proc = sft(cli_in_process, other, tmp_path, "--peft_method", "llama_adapter", "--tokenizer_name", tiny_model)
    assert_refused(proc, "llama_adapter does not support model type 'qwen2'", "--peft_method lora")


@pytest.fixture
def tiny_adapter(tiny_model, tmp_path) -> Path:
    """A LoRA adapter of the tiny model, as peft writes it."""
    import peft

    from shardtune.model.loading import load_model

    model = peft.get_peft_model(load_model(str(tiny_model)), peft.LoraConfig(target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def test_adapter_of_another_base_is_refused(cli_in_process, tiny_model, tiny_adapter, tmp_path):
    from transformers import AutoConfig

    deeper = tmp_path / "deeper"
    config = AutoConfig.from_pretrained(tiny_model)
    config.num_hidden_layers = 3
    config.save_pretrained(deeper)
    proc = sft(cli_in_process, deeper, tmp_path, "--from_peft_checkpoint", tiny_adapter, "--tokenizer_name", tiny_model)
    assert_refused(proc, f"was trained on {tiny_model}", "num_hidden_layers 2 vs 3")
    proc = sft(
        cli_in_process,
        tiny_model,
        tmp_path,
        "--from_peft_checkpoint",
        tiny_adapter,
        "--peft_method",
        "prefix",
        "--batching_strategy",
        "padding",
    )
    assert_refused(proc, "holds a lora adapter", "--peft_method lora")
