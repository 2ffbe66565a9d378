"""Architectures beyond Llama through the real launcher: a Gemma 2 model (sliding-window layers shorter than the
examples, soft-capped attention logits, eager attention) trains identically on padded and padding-free batches
under 2 processes; a tokenizer larger than the model's embedding is refused before launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config

from shardtune.model.loading import PRESETS, train_tokenizer
from tests.e2e.test_bad_input import assert_one_line_error
from tests.helpers import assert_same_training, step_rows

WINDOW = 8  # synthetic dialogues are tens of tokens long: most examples are longer than the window


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory) -> Path:
    """A random Gemma 2 of the tiny preset's size, with the preset's tokenizer, as save_pretrained writes it."""
    tokenizer = train_tokenizer()
    shape = {
        k: PRESETS["tiny"][k]
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    }
    config = Gemma2Config(
        **shape,
        head_dim=16,
        vocab_size=len(tokenizer),
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        initializer_range=0.1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "gemma2"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


RUN = (
    "--nproc_per_node",
    2,
    "--batching_strategy",
    "padding",
    "--max_train_step",
    4,
    "--batch_size_training",
    4,
    "--synthetic_dialogues.num_train",
    64,
    "--synthetic_dialogues.num_validation",
    8,
    "--run_validation",
    "false",
    "--num_workers_dataloader",
    0,
    "--lr",
    1e-3,
    "--gradient_clipping",
    "true",
)


def test_gemma2_trains_the_same_on_padded_and_padding_free_batches(tiny_gemma2, run_cli, tmp_path):
    padded, flat = tmp_path / "padded", tmp_path / "flat"
    proc = run_cli("sft", "--model_name", tiny_gemma2, "--output_dir", padded, *RUN, "--padding_free", "false")
    assert "padding-free batches" not in proc.stdout
    proc = run_cli("sft", "--model_name", tiny_gemma2, "--output_dir", flat, *RUN)  # padding: padding-free on CPU
    assert "padding-free batches" in proc.stdout
    assert_same_training(padded, flat, "gemma2: padding vs padding-free")
    assert step_rows(flat)[-1]["loss"] < step_rows(flat)[0]["loss"]


def test_a_tokenizer_larger_than_the_embedding_is_refused_before_launch(tiny_model, cli_in_process, tmp_path):
    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})  # a new pad token, one id past the embedding
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    proc = cli_in_process(
        "sft",
        "--model_name",
        tiny_model,
        "--tokenizer_name",
        tmp_path / "tokenizer",
        "--output_dir",
        tmp_path / "never",
        "--batching_strategy",
        "padding",
        "--max_train_step",
        1,
        "--synthetic_dialogues.num_train",
        16,
        "--run_validation",
        "false",
        "--num_workers_dataloader",
        0,
    )
    assert_one_line_error(
        proc, f"--tokenizer_name {tmp_path / 'tokenizer'}", "1025 tokens", "1024 rows", "resize_token_embeddings"
    )
