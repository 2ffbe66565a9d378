"""GRPO's completions that share a prompt, computed over one copy of it (shardtune.model.shared_prompt),
give the log-probabilities, entropies and gradients of the padded rows [prompt | completion | pad].

On the tiny preset model (fp32, SDPA and eager attention): a micro-batch of 7 completions of 3 prompts of different
lengths, in mixed order (one prompt with a single completion), completions of different lengths, one masked whole
(mask_truncated_completions), one with a tool result's tokens unscored. The control: completions allowed to see each
other in the shared row change the log-probabilities, so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardtune.config.schema import GrpoConfig, TrainConfig
from shardtune.data.shared_prompt import SHARED_IDS, SHARED_SEGMENTS
from shardtune.model.loading import load_tokenizer
from shardtune.model.shared_prompt import shared_inputs
from shardtune.runtime.distributed import DistEnv
from shardtune.training.objectives.grpo.loss import token_logps
from shardtune.training.objectives.grpo.objective import GRPO

PROMPTS = ["Summarize: Anna meets Tom at seven.", "Hi", "Summarize: Kate brings a cake for Ben and his sister."]
ROWS = [0, 1, 0, 2, 1, 0, 1]  # which prompt each completion answers
LENGTHS = [6, 4, 1, 5, 7, 3, 6]
COUNTED = [True, True, True, True, False, True, True]  # completion 4 masked whole
TOOL_ROW, TOOL_TOKENS = 6, slice(2, 4)  # completion 6's tokens 2 and 3: a tool's result, no loss
TEMPERATURE = 0.7
# Two computations of the same log-softmax in fp32 (other matmul shapes, masked keys adding exact zeros): |logp| < 20
LOGP_TOLERANCE = dict(rtol=0, atol=1e-5)
# Gradients summed over ~35 tokens, a shared prompt's from its completions in another order: fp32 rounding
GRAD_TOLERANCE = dict(rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(str(tiny_model))


def micro_batch(tokenizer) -> tuple[GRPO, dict]:
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3
    generator = torch.Generator().manual_seed(0)
    completions = [torch.randint(4, len(tokenizer), (n,), generator=generator).tolist() for n in LENGTHS]
    masks = [[1] * n for n in LENGTHS]
    masks[TOOL_ROW][TOOL_TOKENS] = [0, 0]
    cfg = TrainConfig()
    cfg.grpo = GrpoConfig(num_generations=3, temperature=TEMPERATURE)
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    objective = GRPO(cfg, env, None, tokenizer)
    rows = [prompts[r] for r in ROWS]
    batch = objective.collate(rows, completions, COUNTED, torch.zeros(len(ROWS)), list(range(len(ROWS))), masks)
    return objective, batch


def padded(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if not k.startswith("shared_")}


def logps_and_grads(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logps, entropies = token_logps(model, batch, torch.device("cpu"), TEMPERATURE, True)
    weights = torch.linspace(-1.0, 1.0, logps.numel()).view_as(logps)  # a different gradient per token
    (logps * weights).sum().backward()
    return logps.detach(), entropies, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompts_give_the_padded_rows_logps_entropies_and_gradients(attention, tiny_model, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32, attn_implementation=attention)
    model.train()
    _, batch = micro_batch(tokenizer)
    assert shared_inputs(model, batch, torch.device("cpu")) is not None  # the shared layout is what is computed
    assert batch[SHARED_IDS].size(0) == 3 and batch[SHARED_IDS].numel() < batch["input_ids"].numel()
    logps, entropies, grads = logps_and_grads(model, batch)
    plain_logps, plain_entropies, plain_grads = logps_and_grads(model, padded(batch))
    scored = plain_logps != 0
    assert int(scored.sum()) == sum(n for n, c in zip(LENGTHS, COUNTED) if c) - 2  # less the tool's tokens
    assert torch.equal(logps != 0, scored)
    torch.testing.assert_close(logps, plain_logps, **LOGP_TOLERANCE)
    torch.testing.assert_close(entropies, plain_entropies, **LOGP_TOLERANCE)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, **GRAD_TOLERANCE, msg=name)


def test_completions_that_see_each_other_would_change_the_logps(tiny_model, tokenizer):
    """The control: the same shared row with every completion in one segment (each sees those before it)."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    _, batch = micro_batch(tokenizer)
    leaky = dict(batch, **{SHARED_SEGMENTS: batch[SHARED_SEGMENTS].clamp(max=1)})
    with torch.no_grad():
        plain = token_logps(model, padded(batch), torch.device("cpu"), TEMPERATURE, False)[0]
        wrong = token_logps(model, leaky, torch.device("cpu"), TEMPERATURE, False)[0]
    assert (wrong - plain).abs().max() > 1e-2


def test_no_shared_layout_where_every_prompt_differs_or_dropout_is_on(tiny_model, tokenizer):
    objective, batch = micro_batch(tokenizer)
    one_each = objective.collate([[5, 6], [7, 8]], [[9], [10]], [True, True], torch.zeros(2), [0, 1])
    assert SHARED_IDS not in one_each
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32, attention_dropout=0.1)
    assert shared_inputs(model.train(), batch, torch.device("cpu")) is None  # dropout: masks would differ
    assert shared_inputs(model.eval(), batch, torch.device("cpu")) is not None
