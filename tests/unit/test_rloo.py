"""RLOO: shardtune's loss, gradients, metrics and advantages equal TRL 1.16's RLOOTrainer's on the same inputs.

trl (the dev extra) is the oracle; the trainer is only constructed (use_cpu, fp32) and its private methods called as
its training step calls them (1 process, 1 micro-batch, steps_per_generation 1). On the tiny preset model and one
micro-batch of 6 completions (2 prompts x 3 generations, right-padded completions of different lengths, one masked
whole as mask_truncated_completions masks it):

- with old-policy sequence log-probabilities shifted from the policy's (so that sequences clip low and high), the
  step's loss (``RLOO.loss`` sums / the step's N from ``RLOO.counts``: its completions), its gradients and
  ``RLOO.step_metrics``'s entropy and clip ratios equal what ``RLOOTrainer._compute_loss`` returns and logs;
- ``rloo_advantages`` gives the advantages and reward metrics of ``RLOOTrainer._generate_and_score_completions`` for
  rewards with missing values (None: NaN), an unscorable completion and a group of equal rewards, with and without
  beta (the KL in the reward: the reference perturbed so that it is not the policy), normalize_advantages and
  reward_clip_range; ``RLOO.generation_metrics``'s kl is TRL's.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from shardtune.config.rloo_settings import RlooConfig
from shardtune.config.schema import GrpoConfig, TrainConfig
from shardtune.model.loading import load_model, load_tokenizer
from shardtune.runtime.distributed import DistEnv
from shardtune.training.objectives.grpo.objective import TAIL
from shardtune.training.objectives.grpo.rloo import GRPO_ONLY, RLOO, rloo_advantages

PROMPTS = ["Summarize: Anna meets Tom at seven.", "Summarize: Kate brings cake for Ben."]
G = 3
WIDTH = 8
LENGTHS = [8, 5, 3, 8, 6, 1]
COUNTED = [True, True, True, False, True, True]  # completion 3: truncated and masked (mask_truncated_completions)
ADVANTAGES = [0.9, -1.1, 0.4, 1.2, -0.6, -0.3]
# the old policy's sequence log-probability = the policy's - shift: ratios exp(shift); completion 2's 1.246 lies in
# (1 + epsilon, 1 + epsilon_high]: clipped only where epsilon_high is not given; 1 clips low, 0 high
SEQUENCE_SHIFTS = [0.45, -0.40, 0.22, 0.5, -0.05, -0.45]
TEMPERATURE = 0.7
# O(1) per-sequence values averaged over 6 sequences in fp32; log-probabilities summed over up to 8 tokens, each
# equal to TRL's to ~1e-6 (two computations of the same log-softmax): ratios to ~1e-5 relative
LOSS_TOLERANCE = dict(rel=2e-5, abs=2e-6)
METRICS = (
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(str(tiny_model))


def no_reward(completions, **kwargs):
    return [0.0] * len(completions)


def trl_trainer(tiny_model, tokenizer, tmp_path, reward_funcs=(no_reward,), **settings):
    """TRL's RLOOTrainer on the tiny model, only constructed: ``settings`` are RLOOConfig's."""
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    args = RLOOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[], save_strategy="no", **settings
    )
    trainer = RLOOTrainer(
        model=str(tiny_model),
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def completions(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(each completion's prompt ids, its ids): equal-length prompts (no padding: TRL pads on the left), random
    non-special tokens."""
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    width = min(len(p) for p in prompts)
    prompts = [p[-width:] for p in prompts]
    generator = torch.Generator().manual_seed(0)
    special = set(tokenizer.all_special_ids)
    rows = []
    for n in LENGTHS:
        ids = [t for t in torch.randint(len(tokenizer), (3 * n,), generator=generator).tolist() if t not in special]
        rows.append(ids[:n])
    return [prompts[i // G] for i in range(len(LENGTHS))], rows


def objective(tokenizer, **grpo) -> RLOO:
    cfg = TrainConfig(objective="rloo")
    cfg.grpo = GrpoConfig(num_generations=G, temperature=TEMPERATURE, **grpo)
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    made = RLOO(cfg, env, None, tokenizer)
    made.pending = {}
    return made


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_loss_gradients_and_metrics_equal_trl(epsilon_high, tiny_model, tokenizer, tmp_path):
    trainer = trl_trainer(
        tiny_model,
        tokenizer,
        tmp_path,
        per_device_train_batch_size=6,
        num_generations=G,
        temperature=TEMPERATURE,
        epsilon_high=epsilon_high,
    )
    prompt_ids, completion_ids = completions(tokenizer)
    prompt = torch.tensor(prompt_ids)
    ids = torch.full((len(LENGTHS), WIDTH), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(LENGTHS), WIDTH), dtype=torch.long)
    for i, row in enumerate(completion_ids):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = int(COUNTED[i])
    with torch.no_grad():
        trl_logps = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt, ids], 1), torch.cat([torch.ones_like(prompt), mask], 1), WIDTH
        )[0]
    # the old policy's per-token log-probabilities: each scored token shifted alike, the sequence by SEQUENCE_SHIFTS
    lengths = mask.sum(1).clamp(min=1)
    old_per_token = (trl_logps - (torch.tensor(SEQUENCE_SHIFTS) / lengths)[:, None]) * mask
    inputs = {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": ids,
        "completion_mask": mask,
        "old_logps": old_per_token.sum(1),
        "advantages": torch.tensor(ADVANTAGES),
    }
    trainer.model.zero_grad()
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_grads = grads(trainer.model)
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert trl_metrics["clip_ratio/low_mean"] > 0 and trl_metrics["clip_ratio/high_mean"] > 0, trl_metrics

    rloo = objective(tokenizer, epsilon_high=epsilon_high or 0.0)
    batch = rloo.collate(prompt_ids, completion_ids, COUNTED, inputs["advantages"], list(range(len(LENGTHS))))
    batch["normaliser"] = rloo.normaliser(batch)
    p = prompt.size(1)
    batch["old_logps"] = torch.zeros(batch["input_ids"].shape)
    batch["old_logps"][:, p - 1 : p - 1 + WIDTH] = old_per_token
    model = load_model(str(tiny_model))
    counts = rloo.counts([batch], None)
    totals = dict(zip(rloo.count_names, counts))
    assert totals["normaliser"] == totals["completions"] == len(LENGTHS)  # RLOO's N: the step's completions
    total, stats = rloo.loss(model, batch, torch.tensor(counts, dtype=torch.float64))
    (total / totals["normaliser"]).backward()
    metrics = rloo.step_metrics(totals, stats.tolist())
    assert metrics["loss"] == pytest.approx(trl_loss.item(), **LOSS_TOLERANCE)
    ours = grads(model)
    assert ours.keys() == trl_grads.keys()
    for name, grad in trl_grads.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    for name in METRICS:
        assert metrics[name] == pytest.approx(trl_metrics[name], **LOSS_TOLERANCE), name
    assert "kl" not in metrics  # RLOO's kl is the generation's (its reward penalty), not the loss's


# Two reward functions over 3 groups of 3 completions (None: not scored by that function): group 1 holds an
# unscorable completion (advantage 0, out of its siblings' baseline), group 2 equal rewards
REWARDS = {
    "correct": [1.0, 0.0, 0.5, 0.25, None, 1.0, 1.0, 1.0, 1.0],
    "brief": [None, 3.0, -1.0, 0.5, None, 0.0, 0.0, 0.0, 0.0],
}
WEIGHTS = [1.0, 0.5]


def correct(completions, **kwargs):
    return REWARDS["correct"][: len(completions)]


def brief(completions, **kwargs):
    return REWARDS["brief"][: len(completions)]


@pytest.mark.parametrize(
    "beta, normalize, clip",
    [(0.0, False, None), (0.0, True, None), (0.0, False, (-0.2, 1.2)), (0.05, False, None), (0.5, True, (0.0, 1.0))],
)
def test_advantages_kl_and_reward_metrics_equal_trl(beta, normalize, clip, tiny_model, tokenizer, tmp_path):
    """TRL's _generate_and_score_completions samples 3 completions of 3 prompts and scores them with the reward
    functions (which ignore the completions) and, with beta, penalises them by their KL to a perturbed reference: its
    advantages and metrics are rloo_advantages' / generation_metrics' for the same rewards and KL sums."""
    rows = len(REWARDS["correct"])
    trainer = trl_trainer(
        tiny_model,
        tokenizer,
        tmp_path,
        reward_funcs=(correct, brief),
        per_device_train_batch_size=rows,
        num_generations=G,
        max_completion_length=3,
        reward_weights=WEIGHTS,
        beta=beta,
        normalize_advantages=normalize,
        reward_clip_range=clip,
    )
    if beta:  # a reference that is not the policy: the KL in the reward is not 0
        with torch.no_grad():
            generator = torch.Generator().manual_seed(3)
            for parameter in trainer.ref_model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    prompts = [*PROMPTS, "Summarize: Lucy and Mark bring fruit."]
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions([{"prompt": prompts[i // G]} for i in range(rows)])
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    table = torch.tensor([[math.nan if v is None else v for v in REWARDS[k]] for k in ("correct", "brief")]).T.double()
    tail = torch.zeros(rows, TAIL, dtype=torch.float64)
    extra = torch.zeros(rows, 0, dtype=torch.float64)
    if beta:
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], 1)
        width = output["completion_ids"].size(1)
        with torch.no_grad():
            ref = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attention, width)[0]
        mask = output["completion_mask"].double()
        kl = output["old_logps"].double() - (ref.double() * mask).sum(1)
        extra = torch.stack([kl, mask.sum(1)], 1)
        assert kl.abs().max() > 1e-3
    rloo = objective(tokenizer, beta=beta, reward_weights=WEIGHTS)
    rloo.cfg.rloo = RlooConfig(normalize_advantages=normalize, reward_clip_range=list(clip or []))
    rloo.rewards, rloo.reward_names = [None, None], ["correct", "brief"]
    rloo.weights = torch.tensor(WEIGHTS, dtype=torch.float64)
    advantages, metrics = rloo.generation_metrics(torch.cat([table, tail, extra], 1), rloo.cfg.grpo)

    torch.testing.assert_close(advantages.float(), output["advantages"], rtol=1e-5, atol=1e-5)
    assert advantages[4] == 0 and advantages.abs().max() > 0.3
    for name in ("reward", "reward_std", "frac_reward_zero_std", *(("kl",) if beta else ())):
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), name
    assert ("kl" in metrics) == bool(beta)
    for name in ("correct", "brief"):
        for s in ("mean", "std"):
            assert metrics[f"rewards/{name}/{s}"] == pytest.approx(trl_metrics[f"rewards/{name}/{s}"], rel=1e-6)


def test_leave_one_out_baseline_by_hand():
    """Without normalisation the advantage of a reward is it minus the mean of its group's other scorable rewards."""
    rewards = torch.tensor([[1.0], [2.0], [6.0], [0.0], [math.nan], [3.0]], dtype=torch.float64)
    advantages, metrics = rloo_advantages(rewards, torch.ones(1, dtype=torch.float64), None, 3, 0.0, False, [])
    expected = [1 - 4, 2 - 3.5, 6 - 1.5, 0 - 3, 0, 3 - 0]
    assert advantages.tolist() == pytest.approx(expected)
    assert metrics["frac_reward_zero_std"] == 0


def test_grpo_only_settings_are_what_rloo_config_lacks():
    """The GRPO settings shardtune rloo refuses are exactly GrpoConfig's that TRL's RLOOConfig has not (less the
    reward functions, named by the script in TRL, and the tools, shardtune's for both)."""
    from trl import RLOOConfig

    theirs = {f.name for f in dataclasses.fields(RLOOConfig)}
    lacking = {f.name for f in dataclasses.fields(GrpoConfig)} - theirs
    assert lacking - {"reward_funcs", "tools", "max_tool_calling_iterations"} == set(GRPO_ONLY)


def test_rloo_config_has_trls_fields_types_and_defaults_and_rloo_trainer_its_signature():
    """RLOOConfig: TRL 1.16's fields, types and defaults, and GRPOConfig's max_tool_calling_iterations (shardtune's
    RLOO samples with tools as its GRPO does); RLOOTrainer: TRL's constructor and GRPOTrainer's ``tools``; the
    defaults of ``shardtune rloo`` under TRL's names are RLOOConfig's."""
    import inspect
    import typing

    import trl

    import shardtune
    from shardtune.config.defaults import TRL_DEFAULTS

    theirs, ours = trl.RLOOConfig, shardtune.RLOOConfig
    their_fields = {f.name: f for f in dataclasses.fields(theirs)}
    our_fields = {f.name: f for f in dataclasses.fields(ours)}
    assert set(our_fields) - set(their_fields) == {"max_tool_calling_iterations"}
    assert set(their_fields) <= set(our_fields)
    their_types, our_types = typing.get_type_hints(theirs), typing.get_type_hints(ours)
    for name, f in their_fields.items():
        assert their_types[name] == our_types[name], name
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        mine = our_fields[name]
        assert repr(default) == repr(mine.default_factory() if mine.default is dataclasses.MISSING else mine.default)
    trl_rloo = TRL_DEFAULTS["rloo"]
    defaults = theirs(output_dir="x", use_cpu=True)
    assert trl_rloo["optim.lr"] == defaults.learning_rate and trl_rloo["grpo.beta"] == defaults.beta
    assert trl_rloo["grpo.num_generations"] == defaults.num_generations
    their_parameters = list(inspect.signature(trl.RLOOTrainer.__init__).parameters)
    assert list(inspect.signature(shardtune.RLOOTrainer.__init__).parameters) == [*their_parameters, "tools"]
    made = ours(output_dir="x", beta=0.1, normalize_advantages=True, reward_clip_range=(-1.0, 1.0)).canonical()
    assert (made.objective, made.grpo.beta, made.grpo.num_generations) == ("rloo", 0.1, 2)
    assert made.rloo == RlooConfig(normalize_advantages=True, reward_clip_range=[-1.0, 1.0])
