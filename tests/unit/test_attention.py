"""Padding-free rows: attention stays inside each example, and the loss and gradients are those of padding."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardtune.data.batching import collate_flat, collate_padding
from shardtune.model.attention import VARLEN, use_varlen_attention, varlen_kwargs
from shardtune.model.loss import IGNORE_INDEX, token_loss_sum

CPU = torch.device("cpu")


def tiny_llama(varlen: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).float().eval()
    if varlen:
        use_varlen_attention(model)
    return model


def block(lengths=(9, 14, 5, 1), seed=1) -> list[dict]:
    rng = random.Random(seed)
    examples = []
    for n in lengths:
        ids = [rng.randint(1, 127) for _ in range(n)]
        examples.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (n // 2) + ids[n // 2 :]})
    return examples


def alone(model, example) -> torch.Tensor:
    return model(input_ids=torch.tensor([example["input_ids"]])).logits[0]


@torch.no_grad()
def test_each_example_of_a_flat_row_gets_its_logits_alone():
    model = tiny_llama()
    assert model.config._attn_implementation == VARLEN
    examples = block()
    batch = collate_flat(examples)
    flat = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **varlen_kwargs(batch)).logits[0]
    # the same row read as one sequence: later examples see earlier ones (the test can fail)
    leaky = model(input_ids=batch["input_ids"]).logits[0]
    bounds = batch["cu_seq_lens"].tolist()
    for example, start, end in zip(examples, bounds, bounds[1:]):
        torch.testing.assert_close(flat[start:end], alone(model, example), atol=1e-5, rtol=0)
        if start > 0:
            assert (leaky[start:end] - alone(model, example)).abs().max() > 1e-3


@torch.no_grad()
def test_boundaries_come_from_position_ids_when_no_cu_seq_lens_is_given():
    """Someone else's packed rows (positions restarting, no mask, no cu_seq_lens), one row or several."""
    model = tiny_llama()
    first, second = collate_flat(block((6, 10, 4), seed=2)), collate_flat(block((12, 8), seed=3))
    for batch in (first, second):
        with_cu = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **varlen_kwargs(batch)).logits
        without = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        torch.testing.assert_close(without, with_cu, atol=1e-6, rtol=0)
    two_rows = model(
        input_ids=torch.cat([first["input_ids"], second["input_ids"]]),
        position_ids=torch.cat([first["position_ids"], second["position_ids"]]),
    ).logits
    for row, batch in enumerate((first, second)):
        expected = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], **varlen_kwargs(batch)
        ).logits[0]
        torch.testing.assert_close(two_rows[row], expected, atol=1e-5, rtol=0)


@torch.no_grad()
def test_padded_batches_and_plain_sequences_compute_as_sdpa():
    """Evaluation and generation batches (2-D padding mask, or one unpadded sequence) are unchanged."""
    varlen, sdpa = tiny_llama(), tiny_llama(varlen=False)
    padded = collate_padding(block(), pad_id=0)
    inputs = {k: padded[k] for k in ("input_ids", "attention_mask", "position_ids")}
    mask = padded["attention_mask"].bool()
    torch.testing.assert_close(varlen(**inputs).logits[mask], sdpa(**inputs).logits[mask], atol=1e-6, rtol=0)
    single = torch.tensor([block()[1]["input_ids"]])
    torch.testing.assert_close(varlen(input_ids=single).logits, sdpa(input_ids=single).logits, atol=1e-6, rtol=0)
    prompt = single[:, :6]
    assert torch.equal(
        varlen.generate(prompt, max_new_tokens=5, do_sample=False),
        sdpa.generate(prompt, max_new_tokens=5, do_sample=False),
    )


@pytest.mark.parametrize("lengths", [(9, 14, 5, 1), (30, 3, 17)])
def test_padding_free_loss_and_gradients_equal_padding(lengths):
    model = tiny_llama()
    examples = block(lengths)

    def loss_and_grads(batch):
        model.zero_grad(set_to_none=True)
        loss = token_loss_sum(model, batch, CPU)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    padded_loss, padded_grads = loss_and_grads(collate_padding(examples, pad_id=0))
    flat_loss, flat_grads = loss_and_grads(collate_flat(examples))
    assert flat_loss.item() == pytest.approx(padded_loss.item(), rel=1e-6)
    for name, g in padded_grads.items():
        assert float((flat_grads[name] - g).norm() / g.norm()) <= 1e-5, name


def test_llama_adapter_on_padding_free_rows_equals_padding():
    """peft's adapted attention wraps the model's own (now varlen) attention and adds the adapter per token."""
    import peft

    model = peft.get_peft_model(
        tiny_llama(), peft.AdaptionPromptConfig(adapter_len=4, adapter_layers=2, task_type="CAUSAL_LM")
    )
    for name, p in model.named_parameters():
        if "adaption_gate" in name:  # gates start at 0: open them so the adapter changes the numbers
            torch.nn.init.constant_(p, 0.5)
    examples = block()

    def loss_and_grads(batch):
        model.zero_grad(set_to_none=True)
        loss = token_loss_sum(model, batch, CPU)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    padded_loss, padded_grads = loss_and_grads(collate_padding(examples, pad_id=0))
    flat_loss, flat_grads = loss_and_grads(collate_flat(examples))
    assert flat_loss == pytest.approx(padded_loss, rel=1e-6)
    assert float((flat_grads - padded_grads).norm() / padded_grads.norm()) <= 1e-5


@torch.no_grad()
def test_attn_implementation_eager_computes_every_path_by_the_eager_formula(monkeypatch):
    """--attn_implementation eager (TRL's flag): packed rows, padded batches and plain sequences go through the eager
    formula (softmax(q k^T) v, never SDPA), and give what transformers' own eager attention gives each example."""
    from shardtune.config.flags import parse_args
    from shardtune.model import attention
    from shardtune.model.speed import apply_speed_features

    hf_eager = tiny_llama(varlen=False)
    hf_eager.set_attn_implementation("eager")
    model = tiny_llama(varlen=False)
    cfg = parse_args(["--attn_implementation", "eager", "--batching_strategy", "packing"])
    assert cfg.model.attn_implementation == "eager"
    apply_speed_features(model, cfg, CPU)
    assert model.config._attn_implementation == attention.VARLEN_EAGER
    calls = []
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1))  # never SDPA
    examples = block()
    batch = collate_flat(examples)
    flat = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **varlen_kwargs(batch)).logits[0]
    bounds = batch["cu_seq_lens"].tolist()
    for example, start, end in zip(examples, bounds, bounds[1:]):
        torch.testing.assert_close(flat[start:end], alone(hf_eager, example), atol=1e-5, rtol=0)
    padded = collate_padding(examples, pad_id=0)
    inputs = {k: padded[k] for k in ("input_ids", "attention_mask", "position_ids")}
    mask = padded["attention_mask"].bool()
    torch.testing.assert_close(model(**inputs).logits[mask], hf_eager(**inputs).logits[mask], atol=1e-5, rtol=0)
    assert calls == []
    # padding without padding-free rows: the model's own eager attention
    plain = tiny_llama(varlen=False)
    apply_speed_features(plain, parse_args(["--attn_implementation", "eager", "--batching_strategy", "padding"]), CPU)
    assert plain.config._attn_implementation == "eager"


def test_an_attention_kernel_this_machine_or_model_cannot_run_is_refused_before_launch(tmp_path):
    from transformers import Gemma2Config

    from shardtune.config.flags import parse_args
    from shardtune.config.schema import ConfigError
    from shardtune.model.speed import check_attention_fits
    from shardtune.training.engine.checks import validate

    with pytest.raises(ConfigError, match="flash_attention_2 needs") as error:  # no flash-attn, no CUDA here
        validate(parse_args(["--attn_implementation", "flash_attention_2", "--output_dir", str(tmp_path)]), 1)
    assert "\n" not in str(error.value)
    gemma2 = Gemma2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    with pytest.raises(ConfigError, match="soft-capped attention logits: pass --attn_implementation eager"):
        check_attention_fits(parse_args(["--attn_implementation", "sdpa"]), gemma2)
    check_attention_fits(parse_args(["--attn_implementation", "eager"]), gemma2)


def test_cuda_processes_turn_off_the_cudnn_attention_backend_that_replans_every_padded_shape():
    """The GPU smoke run found padded batches 4-40x slower with SDPA's cuDNN backend (a plan per new shape): a
    training process on CUDA turns it off and says so; on CPU nothing changes."""
    from shardtune.model.attention import avoid_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert avoid_cudnn_attention(CPU) is None
        assert torch.backends.cuda.cudnn_sdp_enabled()
        note = avoid_cudnn_attention(torch.device("cuda", 0))
        assert note is not None and "cuDNN" in note
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert avoid_cudnn_attention(torch.device("cuda", 0)) is None  # said once
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
