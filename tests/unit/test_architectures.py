"""Architectures beyond Llama: on padding-free rows and on padded batches, each family's training computes what
its own (eager) attention computes — sliding windows (Mistral, Qwen2, Gemma 2/3, Phi-3) and attention-logit
soft-capping (Gemma 2) included — and the FlashAttention varlen arguments built for CUDA mean the same thing.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from shardtune.data.batching import collate_flat, collate_padding
from shardtune.model.attention import (
    _per_example,
    attention_implementation,
    flash_varlen_arguments,
    use_varlen_attention,
    varlen_kwargs,
)
from shardtune.model.loss import IGNORE_INDEX, model_inputs, token_loss_sum

CPU = torch.device("cpu")
WINDOW = 4  # shorter than most examples below, so that the window changes what a query sees
LENGTHS = (9, 14, 3, 1, 20)
# initializer_range 0.2: attention far from uniform, so a dropped window or soft-cap shows in the numbers
_SHAPE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    initializer_range=0.2,
    pad_token_id=0,
)
CONFIGS = {
    "llama": LlamaConfig(**_SHAPE),
    "qwen2": Qwen2Config(**_SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": Qwen3Config(**_SHAPE),
    "mistral": MistralConfig(**_SHAPE, sliding_window=WINDOW),
    # sliding and full layers alternate; logits soft-capped at 1.0 so that tanh bends the scores measurably
    "gemma2": Gemma2Config(**_SHAPE, sliding_window=WINDOW, attn_logit_softcapping=1.0, query_pre_attn_scalar=8),
    "gemma3": Gemma3TextConfig(
        **_SHAPE, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8
    ),
    "phi3": Phi3Config(**_SHAPE, sliding_window=WINDOW),
}
WINDOWED = ("qwen2", "mistral", "gemma2", "gemma3", "phi3")


def build(family: str, attention: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = copy.deepcopy(CONFIGS[family])
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).float().train()


def examples(lengths=LENGTHS, seed=1) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randint(1, 127) for _ in range(n)]
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (n // 2) + ids[n // 2 :]})
    return out


def logits_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, float, torch.Tensor]:
    """The real tokens' logits in example order, the loss sum, and all gradients of that loss (one vector)."""
    with torch.no_grad():
        logits = model(**model_inputs(batch, CPU), use_cache=False).logits
    real = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones(logits.shape[:2], dtype=bool)
    model.zero_grad(set_to_none=True)
    loss = token_loss_sum(model, batch, CPU)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return logits[real], loss.item(), grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def assert_same(result, reference, label: str) -> None:
    logits, loss, grads = result
    ref_logits, ref_loss, ref_grads = reference
    assert relative(logits, ref_logits) <= 1e-5, label
    assert loss == pytest.approx(ref_loss, rel=1e-5), label
    assert relative(grads, ref_grads) <= 1e-5, label


def drop_window(model: torch.nn.Module) -> None:
    """What the varlen path did before it honoured windows: every layer attends over the whole example."""
    layers = [module for module in model.modules() if hasattr(module, "sliding_window")]
    for module in layers:  # per-layer windows (Qwen2, Gemma)
        module.sliding_window = None
    if not layers:  # the config's window (Mistral, Phi-3)
        model.config.sliding_window = None


@pytest.mark.parametrize("family", list(CONFIGS))
def test_padding_free_equals_padding_equals_the_models_own_attention(family):
    rows = examples()
    padded, flat = collate_padding(rows, pad_id=0), collate_flat(rows)
    eager = build(family, "eager")
    reference = logits_and_grads(eager, padded)
    # the model's eager attention on the flat row itself (transformers masks it from the restarting positions)
    assert_same(logits_and_grads(eager, flat), reference, f"{family}: eager, flat row")
    loaded = build(family, attention_implementation(eager.config))  # what shardtune loads it with
    assert_same(logits_and_grads(loaded, padded), reference, f"{family}: padded batch")
    use_varlen_attention(loaded)
    assert_same(logits_and_grads(loaded, flat), reference, f"{family}: padding-free row")
    assert_same(logits_and_grads(loaded, padded), reference, f"{family}: padded batch, varlen attention set")
    if family in WINDOWED:  # control: ignoring the window (the old padding-free path) gives other numbers
        drop_window(loaded)
        assert relative(logits_and_grads(loaded, flat)[2], reference[2]) > 1e-3, family


def test_gemma2_loads_with_eager_attention_and_soft_capping_is_honoured_per_example():
    assert attention_implementation(CONFIGS["gemma2"]) == "eager"
    assert attention_implementation(CONFIGS["mistral"]) == "sdpa"
    model = build("gemma2", "eager")
    use_varlen_attention(model)
    flat = collate_flat(examples())
    reference = logits_and_grads(model, flat)
    for layer in model.model.layers:  # control: without the cap, the same row computes differently
        layer.self_attn.attn_logit_softcapping = None
    assert relative(logits_and_grads(model, flat)[2], reference[2]) > 1e-3


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
@torch.no_grad()
def test_windowed_plain_sequences_and_generation_compute_as_the_models_own_attention(family):
    """A sequence longer than the window, without a mask or cu_seq_lens, and cached decoding past the window."""
    varlen, eager = build(family, attention_implementation(CONFIGS[family])).eval(), build(family, "eager").eval()
    use_varlen_attention(varlen)
    sequence = torch.tensor([examples()[-1]["input_ids"]])
    expected = eager(input_ids=sequence).logits
    torch.testing.assert_close(varlen(input_ids=sequence).logits, expected, atol=1e-5, rtol=0)
    cache = varlen(input_ids=sequence[:, :-3], use_cache=True).past_key_values  # then 3 tokens, no mask given
    last = varlen(input_ids=sequence[:, -3:], cache=cache).logits
    torch.testing.assert_close(last, expected[:, -3:], atol=1e-5, rtol=0)
    prompt = sequence[:, :6]
    assert torch.equal(
        varlen.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0),
        eager.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0),
    )


# -- the FlashAttention varlen call that CUDA makes, its arguments checked here --------------------------------------


def reference_varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    is_causal=False,
):
    """torch.nn.attention.varlen.varlen_attn's documented semantics, one SDPA per sequence: (T, H, D) tensors;
    query i of a sequence sees its keys j with i - left <= j <= i + right (-1: unbounded); ``is_causal`` (older
    torch) means window (-1, 0); grouped-query attention only when ``enable_gqa``."""
    assert query.dim() == key.dim() == value.dim() == 3 and cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k == int(cu_seq_q.diff().max())
    assert enable_gqa or key.shape[1] == query.shape[1]
    left, right = (-1, 0) if is_causal else window_size
    outputs = []
    for start, end in zip(cu_seq_q.tolist(), cu_seq_q.tolist()[1:]):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        i, j = torch.arange(end - start)[:, None], torch.arange(end - start)[None, :]
        seen = ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale, enable_gqa=enable_gqa)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


@pytest.mark.parametrize("window", [None, 3, 64])
@pytest.mark.parametrize(
    "accepted",
    [
        frozenset({"scale", "window_size", "enable_gqa"}),  # torch 2.13
        frozenset({"scale", "is_causal"}),
    ],
)  # an older varlen_attn
def test_flash_varlen_arguments_mean_causal_windowed_gqa_attention_per_example(window, accepted):
    torch.manual_seed(0)
    batch = collate_flat(examples())
    cu, max_length = batch["cu_seq_lens"], varlen_kwargs(batch)["max_length_q"]
    total = int(cu[-1])
    query, key, value = torch.randn(1, 4, total, 8), torch.randn(1, 2, total, 8), torch.randn(1, 2, total, 8)
    arguments = flash_varlen_arguments(query, key, value, cu, max_length, 0.3, window, accepted)
    if window == 3 and "window_size" not in accepted:  # this kernel cannot express the window: no flash call
        assert arguments is None
        return
    args, options = arguments
    flash_like = reference_varlen_attn(*args, **options).unsqueeze(0)
    expected = _per_example(query, key, value, cu, 0.0, 0.3, window, None)  # the CPU path, tested above
    torch.testing.assert_close(flash_like, expected, atol=1e-6, rtol=0)
    if window == 3:  # control: the window is in the arguments (a causal call differs)
        causal = reference_varlen_attn(*args, **{**options, "window_size": (-1, 0)}).unsqueeze(0)
        assert (causal - expected).abs().max() > 1e-2
