"""GRPO's sampling without a launch: the warping equals transformers' samplers, each row's draw follows its softmax and
depends on its own key only, and a completion does not change with the rows sampled beside it (what makes 1 x 4 ==
2 x 2 sample the same completions)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shardtune.training.objectives.grpo.batches import sampling_seed
from shardtune.training.objectives.grpo.generate import (
    Decoder,
    PreallocatedLayer,
    cut_at_eos,
    decoding_head,
    head_logits,
    keyed_choice,
    penalise_repeats,
    sample,
    warp,
)


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, 0, 0.8, 0.0),
        (0.9, 20, 0.6, 0.0),
        (1.0, 0, 1.0, 0.1),
        (0.8, 30, 0.9, 0.05),
    ],
)
def test_warping_equals_transformers_samplers(temperature, top_k, top_p, min_p):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    if min_p:
        expected = MinPLogitsWarper(min_p)(None, expected)
    got = warp(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.allclose(got[~torch.isinf(got)], expected[~torch.isinf(expected)])
    if min_p:  # it removed tokens top-k / top-p kept
        assert torch.isinf(got).sum() > torch.isinf(warp(logits, temperature, top_k, top_p)).sum()


def test_the_repetition_penalty_equals_transformers_processor_on_the_rows_tokens():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 40, generator=generator) * 3  # negative and positive logits
    input_ids = torch.randint(40, (3, 9), generator=generator)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(input_ids, logits.clone())
    seen = torch.zeros(3, 40, dtype=torch.long).scatter_add_(1, input_ids, torch.ones_like(input_ids)) > 0
    assert torch.allclose(penalise_repeats(logits, seen, 1.3), expected)
    assert not torch.allclose(expected, logits)


def test_a_keyed_draw_follows_the_softmax_and_depends_on_its_key_alone():
    logits = torch.tensor([[2.0, 1.0, 0.0, float("-inf")]])
    draws = torch.cat(
        [keyed_choice(logits, [torch.Generator().manual_seed(sampling_seed(0, 0, 0, i, 0))]) for i in range(4000)]
    )
    frequencies = torch.bincount(draws, minlength=4).double() / len(draws)
    assert frequencies[3] == 0  # a token warped away is never drawn
    assert torch.allclose(frequencies, logits.softmax(-1)[0].double(), atol=0.03)
    three = [torch.Generator().manual_seed(s) for s in (5, 6, 7)]
    alone = keyed_choice(logits.expand(1, 4), [torch.Generator().manual_seed(6)])
    assert keyed_choice(logits.expand(3, 4), three)[1] == alone[0]


def test_a_keyed_draw_is_the_argmax_of_the_logits_plus_its_rows_gumbel_noise():
    """The documented draw, to the bit: argmax(l - log(-log u)) in float64, u the row's generator's uniform draws
    (what keeps the completions of a seed the same however the noise is computed; a reused buffer too)."""
    generator = torch.Generator().manual_seed(3)
    buffer = torch.empty(16, 50, dtype=torch.float64)
    for trial in range(50):
        logits = torch.randn(16, 50, generator=generator) * 3
        logits[:, :5] = float("-inf")
        seeds = [trial * 16 + row for row in range(16)]
        expected = []
        for row, seed in enumerate(seeds):
            u = torch.empty(50, dtype=torch.float64).uniform_(generator=torch.Generator().manual_seed(seed))
            expected.append(int((logits[row].double() - u.clamp(min=1e-300).log().neg().log()).argmax()))
        keys = [torch.Generator().manual_seed(seed) for seed in seeds]
        assert keyed_choice(logits, keys, buffer if trial % 2 else None).tolist() == expected


def test_cut_at_eos_keeps_the_eos_and_drops_what_follows():
    assert cut_at_eos([[5, 2, 0, 0], [5, 6, 7], [2]], {2}) == [[5, 2], [5, 6, 7], [2]]


class _Whole:
    """The placement of a model held whole on one device (what DDP's strategy does around generation)."""

    def unwrap(self, model):
        return model

    def generating(self, model, whole=False):
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()


def test_a_completion_does_not_change_with_the_rows_beside_it(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    prompts = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 3, 3, 3], [1, 20, 21]]
    seeds = [sampling_seed(3, 0, 0, i, i % 2) for i in range(4)]
    # a repetition penalty: a padded row's pad tokens are not its own (prompt 3 repeats token 3, prompt 1 has pads)
    options = dict(
        max_new_tokens=12,
        eos_ids={2},
        pad_id=0,
        temperature=0.9,
        top_k=0,
        top_p=0.95,
        repetition_penalty=1.5,
        min_p=0.02,
    )
    together = sample(model, _Whole(), prompts, seeds, device=torch.device("cpu"), **options)
    for i in range(4):
        alone = sample(model, _Whole(), [prompts[i]], [seeds[i]], device=torch.device("cpu"), **options)
        assert alone[0] == together[i], i
    assert len({tuple(c) for c in together}) == 4 and all(0 < len(c) <= 12 for c in together)


def test_a_padded_rows_pad_tokens_are_not_penalised_as_its_own(tiny_model):
    """With a penalty that all but bans a row's own tokens, a short prompt padded beside a long one with the token it
    samples first as the pad samples it still: the pads are not the row's tokens."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    short, long = [1, 7], [1, 3, 5, 9, 11, 13]
    # temperature 0.01: close to greedy, so that the penalty on the token sampled first (the most likely) would move it
    options = dict(max_new_tokens=3, eos_ids={2}, temperature=0.01, top_k=0, top_p=1.0, repetition_penalty=1e4)
    seeds = [sampling_seed(0, 0, 0, 0, 0), sampling_seed(0, 0, 0, 1, 0)]
    first = sample(model, _Whole(), [short], seeds[:1], device=torch.device("cpu"), pad_id=0, **options)[0][0]
    assert first not in short + [2]
    together = sample(model, _Whole(), [short, long], seeds, device=torch.device("cpu"), pad_id=first, **options)
    assert together[0][0] == first


def sharpened(tiny_model):
    """The tiny model with its queries and keys scaled 10x: at the preset's initialisation attention is near uniform,
    so that a position off by one moves no draw; sharpened, it moves the logits by ~0.1 (their spread is ~0.16)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    return model


def one_row_without_cache(model, prompt: list[int], seed: int, max_new_tokens: int, eos_ids: set[int], settings):
    """The reference: one prompt alone, the whole sequence forwarded again for every token (no KV cache, no padding,
    no batch), its logits processed and its token drawn from its own generator as ``sample`` documents."""
    temperature, top_k, top_p, min_p, penalty = settings
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[:, -1].float()
        if penalty != 1.0:
            seen = torch.zeros(logits.shape, dtype=torch.bool)
            seen[0, torch.tensor(ids)] = True
            logits = penalise_repeats(logits, seen, penalty)
        token = int(keyed_choice(warp(logits, temperature, top_k, top_p, min_p), [generator])[0])
        ids.append(token)
        if token in eos_ids:
            break
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p, penalty",
    [(1.0, 0, 1.0, 0.0, 1.0), (0.7, 5, 1.0, 0.0, 1.0), (1.3, 0, 0.8, 0.0, 1.0), (0.9, 20, 0.9, 0.05, 1.3)],
)
@torch.no_grad()
def test_the_batched_sampler_gives_each_rows_tokens_alone(tiny_model, temperature, top_k, top_p, min_p, penalty):
    """All rows decode as one batch, a prompt's num_generations rows share its prefill (its KV cache expanded to
    them), whether all ended is read every few tokens: each row's tokens are still those it samples alone, without a
    cache. Rows repeat their prompt (grouped as GRPO's, and interleaved), end early at different steps (a tenth of
    the vocabulary is eos) or at a smaller budget."""
    model = sharpened(tiny_model)
    eos_ids = set(range(2, model.config.vocab_size, 10))
    a, b, c = [1, 5, 9, 13, 17], [1, 7], [1, 3, 3, 3, 3, 3, 3]
    prompts = [a, a, a, b, b, b, c, c, c, b, a, c]  # three generations of each prompt, then one of each interleaved
    seeds = [sampling_seed(5, 0, 0, i // 3, i % 3) for i in range(len(prompts))]
    budgets = [12] * 9 + [3, 12, 6]
    settings = (temperature, top_k, top_p, min_p, penalty)
    got = sample(
        model,
        _Whole(),
        prompts,
        seeds,
        max_new_tokens=12,
        eos_ids=eos_ids,
        pad_id=0,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=penalty,
        device=torch.device("cpu"),
        budgets=budgets,
    )
    expected = [one_row_without_cache(model, p, s, n, eos_ids, settings) for p, s, n in zip(prompts, seeds, budgets)]
    assert got == expected
    ended_early = [row[-1] in eos_ids for row in got]
    assert any(ended_early) and not all(ended_early)  # rows end at eos and at their budget
    assert len({len(row) for row in got}) > 2
    assert len({tuple(row) for row in got[:3]}) > 1  # a prompt's generations differ: each has its own draws


@torch.no_grad()
def test_the_batched_sampler_stops_when_every_row_has_ended(tiny_model):
    """Every row ends (eos) long before max_new_tokens: the rows are those sampled alone, and no row is padded."""
    model = sharpened(tiny_model)
    eos_ids = set(range(2, model.config.vocab_size, 2))  # half the vocabulary: every row ends within a few tokens
    prompts = [[1, 5, 9], [1, 5, 9], [1, 4], [1, 4]]
    seeds = [11, 12, 13, 14]
    options = dict(eos_ids=eos_ids, pad_id=0, temperature=1.0, top_k=0, top_p=1.0, device=torch.device("cpu"))
    got = sample(model, _Whole(), prompts, seeds, max_new_tokens=64, **options)
    settings = (1.0, 0, 1.0, 0.0, 1.0)
    assert got == [one_row_without_cache(model, p, s, 64, eos_ids, settings) for p, s in zip(prompts, seeds)]
    assert all(row[-1] in eos_ids and len(row) < 16 for row in got)


def _rounding_bound(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """|a - b| for two fp32 orders of the same dot products: each within n x 2^-24 x sum|x_i w_i| of the exact one."""
    return 2 * hidden.size(-1) * 2.0**-24 * (hidden.abs() @ weight.abs().T)


@torch.no_grad()
def test_the_decoding_head_computes_the_models_logits_in_its_own_layout(tiny_model):
    """While decoding, a plain bias-free head over a large vocabulary computes W @ h.T (transposed back as a view:
    the layout is the proof that it ran) and gives F.linear's logits within the rounding of another order of the same
    sums; over the tiny vocabulary, or at a row count where it is slower, or in bf16, F.linear's own."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, 1, model.config.hidden_size, generator=generator)
    with decoding_head(model):
        assert model.lm_head(hidden).is_contiguous()  # 1024 tokens: F.linear is the faster
    model.lm_head = torch.nn.Linear(model.config.hidden_size, 32000, bias=False)
    expected = model.lm_head(hidden)
    with decoding_head(model):
        got = model.lm_head(hidden)
        assert model.lm_head(hidden[:6].repeat(2, 1, 1)).is_contiguous()  # 12 rows: F.linear is the faster
    assert not got.is_contiguous() and got.shape == expected.shape
    assert (got - expected).abs().le(_rounding_bound(hidden, model.lm_head.weight)).all()
    assert model.lm_head(hidden).is_contiguous()  # the head's own forward is back
    assert head_logits(hidden.bfloat16(), model.lm_head.weight.bfloat16()).is_contiguous()  # bf16: F.linear's


@torch.no_grad()
def test_a_lora_head_keeps_its_own_forward_while_decoding(tiny_model):
    """A head with its own forward (LoRA's, a quantized one's) is not replaced: its adapter stays in the logits."""
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    config = peft.LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False)
    lora = peft.get_peft_model(model, config)
    hidden = torch.randn(3, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    head = lora.get_base_model().lm_head
    expected = head(hidden)
    with decoding_head(lora):
        assert torch.equal(head(hidden), expected)
    assert not torch.allclose(expected, head.base_layer(hidden))  # the adapter moves the logits


@torch.no_grad()
def test_the_decode_writes_its_kv_cache_in_place_and_gives_the_uncached_logits(tiny_model):
    """After the shared prefill every layer's cache is one preallocated buffer per keys / values, which the steps
    fill in place (no new storage per token); each row's logits are those of its whole sequence forwarded without a
    cache, within fp32 rounding of the two paths' other orders of sums of 64 terms: 64 x 2^-24 x logits of ~0.5."""
    model = sharpened(tiny_model)
    prompts = [[1, 5, 9, 13, 17], [1, 5, 9, 13, 17], [1, 7], [1, 7]]
    fed = torch.tensor([[4, 8, 12, 16, 20]] * 4) + torch.arange(4)[:, None]
    decoder = Decoder(model, prompts, max_new_tokens=6, pad_id=0, device=torch.device("cpu"))
    decoder.prefill()
    layers = decoder.past.layers
    assert all(isinstance(layer, PreallocatedLayer) for layer in layers)
    storage = [layer.key_buffer.data_ptr() for layer in layers]
    for step in range(fed.size(1)):
        logits = decoder.step(fed[:, step], step)
    assert [layer.keys.data_ptr() for layer in layers] == storage
    assert layers[0].keys.size(-2) == decoder.width + fed.size(1)
    for row, prompt in enumerate(prompts):
        alone = model(input_ids=torch.tensor([prompt + fed[row].tolist()])).logits[0, -1]
        torch.testing.assert_close(logits[row], alone, rtol=0, atol=64 * 2.0**-24 * 0.5)
