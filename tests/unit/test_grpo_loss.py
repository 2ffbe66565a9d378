"""GRPO: shardtune's loss, metrics and advantages equal TRL 1.16's GRPOTrainer's on the same completions.

trl (the dev extra) is the oracle. On the tiny preset model and one micro-batch of 6 completions (2 prompts x 3
generations, right-padded completions of different lengths, one completion masked whole as
mask_truncated_completions masks it) with given advantages, old-policy log-probabilities a few tenths away from the
policy's (so that tokens and sequences clip low and high) and, with beta, reference log-probabilities:

- shardtune's per-token log-probabilities and entropies (the lean head, logits / temperature) equal those of
  ``GRPOTrainer._get_per_token_logps_and_entropies`` (TRL's fused head);
- for every loss type x importance-sampling level x beta, the step's loss (``GRPO.loss`` sums / the step's N from
  ``GRPO.counts``), its gradients and ``GRPO.step_metrics``'s kl, entropy and clip ratios equal what
  ``GRPOTrainer._compute_loss`` returns and logs; and :func:`token_terms` / :func:`loss_sum` fed TRL's own
  log-probabilities give TRL's loss to float rounding;
- ``advantages_of`` gives the advantages and reward metrics of ``GRPOTrainer._generate_and_score_completions`` for
  rewards with missing values (None: NaN), an unscorable completion and a group of equal rewards, for every
  scale_rewards x multi_objective_aggregation.

No launch: the trainer is only constructed (use_cpu, fp32); its private methods are called as its training step
calls them (1 process, 1 accumulation step, steps_per_generation 1).
"""

from __future__ import annotations

import math

import pytest
import torch

from shardtune.config.schema import GrpoConfig, TrainConfig
from shardtune.model.loading import load_model, load_tokenizer
from shardtune.runtime.distributed import DistEnv
from shardtune.training.objectives.grpo.advantages import advantages_of, nanstd
from shardtune.training.objectives.grpo.loss import loss_sum, token_logps, token_terms
from shardtune.training.objectives.grpo.objective import GRPO

PROMPTS = ["Summarize: Anna meets Tom at seven.", "Summarize: Kate brings cake for Ben."]
G = 3  # generations per prompt: 6 completions
WIDTH = 8  # the longest completion
MAX_COMPLETION_LENGTH = 10  # > WIDTH: dr_grpo's N is rows x max_completion_length, not rows x width
LENGTHS = [8, 5, 3, 8, 6, 1]  # each completion's tokens (right padding after them)
COUNTED = [True, True, True, False, True, True]  # completion 3: truncated and masked (mask_truncated_completions)
ADVANTAGES = [0.9, -1.1, 0.4, 1.2, -0.6, -0.3]
# old log-probability = policy's - (row shift + token noise in [-0.3, 0.3]): ratios exp(shift + noise); completion 2
# has no noise, its ratio 1.246 (each token's and the sequence's) inside (1 + epsilon, 1 + epsilon_high]: clipped only
# where epsilon_high is not applied
ROW_SHIFTS = [0.45, -0.40, 0.22, 0.5, -0.05, -0.45]
QUIET_ROW = 2
TEMPERATURE = 0.7
EPSILON_HIGH = 0.28
LOGP_TOLERANCE = dict(rtol=0, atol=1e-5)  # two computations of the same log-softmax (tiling, attention kernels)
# The step's loss and metrics from those log-probabilities: O(1) values summed over ~30 tokens, fp32
LOSS_TOLERANCE = dict(rel=1e-5, abs=1e-6)
LOSS_METRICS = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(str(tiny_model))


def no_reward(completions, **kwargs):
    return [0.0] * len(completions)


def trl_trainer(tiny_model, tokenizer, tmp_path, reward_funcs=(no_reward,), **settings):
    """TRL's GRPOTrainer on the tiny model, only constructed: ``settings`` are GRPOConfig's."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        **settings,
    )
    trainer = GRPOTrainer(
        model=str(tiny_model),
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    trainer.model.train()  # TRL logs under "train" (and scales for accumulation) when the model is training
    trainer.current_gradient_accumulation_steps = 1  # what the training loop sets before its first step
    return trainer


def sampled_completions(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids of each completion, the completion ids): equal-length prompts (TRL pads prompts on the left,
    shardtune does not: without padding both see the same positions), completions of LENGTHS tokens."""
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    width = min(len(p) for p in prompts)
    prompts = [p[-width:] for p in prompts]
    generator = torch.Generator().manual_seed(0)
    vocabulary = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    rows = []
    for n in LENGTHS:
        ids = [t for t in torch.randint(vocabulary, (3 * n,), generator=generator).tolist() if t not in special][:n]
        assert len(ids) == n
        rows.append(ids)
    return [prompts[i // G] for i in range(len(LENGTHS))], rows


def trl_inputs(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int) -> dict:
    """What TRL's _generate_and_score_completions hands _compute_loss (without the log-probabilities)."""
    rows = len(completion_ids)
    prompt = torch.tensor(prompt_ids)
    completion = torch.full((rows, WIDTH), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, WIDTH), dtype=torch.long)
    for i, ids in enumerate(completion_ids):
        completion[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = int(COUNTED[i])
    return {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion,
        "completion_mask": mask,
        "advantages": torch.tensor(ADVANTAGES),
        "num_items_in_batch": mask.sum(),  # the generation batch's completion tokens (1 process)
    }


def to_shardtune_layout(x: torch.Tensor, prompt_length: int, width: int) -> torch.Tensor:
    """TRL's (rows, completion) per-token values (column j: completion token j) in shardtune's (rows, T) layout
    (column t: the token at t + 1)."""
    out = torch.zeros(x.size(0), width, dtype=torch.float32)
    out[:, prompt_length - 1 : prompt_length - 1 + x.size(1)] = x
    return out


def expected_normaliser(loss_type: str, mask: torch.Tensor) -> float:
    """TRL's N at 1 process, 1 accumulation step, steps_per_generation 1."""
    rows = mask.size(0)
    return {
        "dapo": float(mask.sum()),  # num_items_in_batch
        "bnpo": float(mask.sum()),  # the batch's completion tokens
        "grpo": float(rows),  # the mean of the rows' token means
        "dr_grpo": float(rows * MAX_COMPLETION_LENGTH),
    }[loss_type]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_loss_gradients_and_metrics_equal_trl(loss_type, level, beta, tiny_model, tokenizer, tmp_path):
    """The same completions, advantages, old and reference log-probabilities through GRPOTrainer._compute_loss and
    through GRPO's collate, counts, loss and step_metrics: the same log-probabilities, loss, N, gradients, metrics."""
    check_against_trl(loss_type, level, beta, tiny_model, tokenizer, tmp_path)


# delta caps the unclipped term's ratio where the loss takes it (negative advantages, ratio above 1 + epsilon_high):
# completion 4 (advantage < 0) gets ratios exp(0.4 +- 0.3), some tokens above 1.35; completion 1 still clips low
DELTA_ROW_SHIFTS = [0.45, -0.40, 0.22, 0.5, 0.40, -0.45]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_two_sided_clipping_delta_equals_trl(level, tiny_model, tokenizer, tmp_path):
    check_against_trl("dapo", level, 0.04, tiny_model, tokenizer, tmp_path, DELTA_ROW_SHIFTS, delta=1.35)


def check_against_trl(loss_type, level, beta, tiny_model, tokenizer, tmp_path, row_shifts=ROW_SHIFTS, **extra):
    settings = dict(
        per_device_train_batch_size=len(LENGTHS),
        num_generations=G,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        beta=beta,
        epsilon_high=EPSILON_HIGH,
        loss_type=loss_type,
        importance_sampling_level=level,
        **extra,
    )
    trainer = trl_trainer(tiny_model, tokenizer, tmp_path, **settings)
    prompt_ids, completion_ids = sampled_completions(tokenizer)
    inputs = trl_inputs(prompt_ids, completion_ids, tokenizer.pad_token_id)
    mask = inputs["completion_mask"].float()
    p = inputs["prompt_ids"].size(1)

    # TRL's log-probabilities of the completions; the old policy's and the reference's a few tenths away from them
    with torch.no_grad():
        trl_logps, trl_entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            WIDTH,
            compute_entropy=True,
        )
    generator = torch.Generator().manual_seed(1)
    noise = torch.rand(trl_logps.shape, generator=generator) * 0.6 - 0.3
    noise[QUIET_ROW] = 0.0
    inputs["old_per_token_logps"] = trl_logps - torch.tensor(row_shifts)[:, None] - noise
    if beta:
        inputs["ref_per_token_logps"] = trl_logps + torch.rand(trl_logps.shape, generator=generator) - 0.5

    trainer.model.zero_grad()
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_grads = grads(trainer.model)
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert trl_metrics["clip_ratio/low_mean"] > 0 and trl_metrics["clip_ratio/high_mean"] > 0, trl_metrics
    assert trl_metrics["clip_ratio/region_mean"] < 1, "everything clipped"
    assert ADVANTAGES[QUIET_ROW] > 0 and 1 + 0.2 < math.exp(row_shifts[QUIET_ROW]) <= 1 + EPSILON_HIGH  # epsilon 0.2

    # shardtune: the micro-batch as GRPO collates it, the old / reference log-probabilities where it places them
    cfg = TrainConfig()
    cfg.grpo = GrpoConfig(
        num_generations=G,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        beta=beta,
        epsilon_high=EPSILON_HIGH,
        loss_type=loss_type,
        importance_sampling_level=level,
        **extra,
    )
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    objective = GRPO(cfg, env, None, tokenizer)
    objective.pending = {}  # the round's reward metrics (attach / batches set them): none here
    batch = objective.collate(prompt_ids, completion_ids, COUNTED, inputs["advantages"], list(range(len(LENGTHS))))
    batch["normaliser"] = objective.normaliser(batch, int(mask.sum()))  # 1 micro-batch: the round's tokens for dapo
    width = batch["input_ids"].size(1)
    batch["old_logps"] = to_shardtune_layout(inputs["old_per_token_logps"] * mask, p, width)
    if beta:
        batch["ref_logps"] = to_shardtune_layout(inputs["ref_per_token_logps"] * mask, p, width)
    model = load_model(str(tiny_model))

    # (a) the same log-probabilities and entropies (under logits / temperature) where tokens are scored
    with torch.no_grad():
        ours, entropies = token_logps(model, batch, env.device, TEMPERATURE, True)
    scored = mask.bool()
    torch.testing.assert_close(ours[:, p - 1 : p - 1 + WIDTH][scored], trl_logps[scored], **LOGP_TOLERANCE)
    torch.testing.assert_close(entropies[:, p - 1 : p - 1 + WIDTH][scored], trl_entropies[scored], **LOGP_TOLERANCE)
    assert not ours[:, p - 1 : p - 1 + WIDTH][~scored].any()

    # (b) the step's loss: the micro-batch's sum / N, N the loss type's
    counts = objective.counts([batch], None)
    totals = dict(zip(objective.count_names, counts))
    assert totals["normaliser"] == expected_normaliser(loss_type, mask)
    assert totals["label_tokens"] == mask.sum() and totals["completions"] == len(LENGTHS)
    total, stats = objective.loss(model, batch, torch.tensor(counts, dtype=torch.float64))
    (total / totals["normaliser"]).backward()
    metrics = objective.step_metrics(totals, stats.tolist())
    assert metrics["loss"] == pytest.approx(trl_loss.item(), **LOSS_TOLERANCE)
    assert (total / totals["normaliser"]).item() == pytest.approx(trl_loss.item(), **LOSS_TOLERANCE)

    # the loss's formula alone: TRL's own log-probabilities through token_terms / loss_sum
    terms = token_terms(
        trl_logps,
        inputs["old_per_token_logps"],
        inputs.get("ref_per_token_logps"),
        inputs["advantages"],
        mask,
        cfg.grpo,
    )
    formula = loss_sum(terms["per_token_loss"], mask, loss_type) / expected_normaliser(loss_type, mask)
    assert formula.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-7)
    if extra.get("delta"):  # it changed the loss
        cfg.grpo.delta, kept = 0.0, cfg.grpo.delta
        args = (trl_logps, inputs["old_per_token_logps"], inputs.get("ref_per_token_logps"), inputs["advantages"])
        uncapped = loss_sum(token_terms(*args, mask, cfg.grpo)["per_token_loss"], mask, loss_type)
        assert abs(uncapped.item() / expected_normaliser(loss_type, mask) - trl_loss.item()) > 1e-4
        cfg.grpo.delta = kept

    # the same gradients
    ours_grads = grads(model)
    assert ours_grads.keys() == trl_grads.keys()
    for name, grad in trl_grads.items():
        torch.testing.assert_close(ours_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)

    # (c) TRL's metrics (with beta 0, TRL logs no kl and neither does shardtune)
    names = [m for m in LOSS_METRICS if m != "kl" or beta]
    assert ("kl" in metrics) == bool(beta) == ("kl" in trl_metrics)
    for name in names:
        assert metrics[name] == pytest.approx(trl_metrics[name], **LOSS_TOLERANCE), name


# -- advantages ------------------------------------------------------------------------------------------------------

# Two reward functions over 3 groups of 3 completions (None: the function does not score it, NaN): group 1 holds an
# unscorable completion (no function scores it: advantage 0, left out of the group's mean and std), group 2 equal
# rewards (std 0: frac_reward_zero_std). Values exact in fp32, as TRL holds rewards.
REWARDS = {
    "correct": [1.0, 0.0, 0.5, 0.25, None, 1.0, 1.0, 1.0, 1.0],
    "brief": [None, 3.0, -1.0, 0.5, None, 0.0, 0.0, 0.0, 0.0],
}  # weighted sums: 1, 1.5, 0 | 0.5, NaN, 1 | 1, 1, 1
WEIGHTS = [1.0, 0.5]


def correct(completions, **kwargs):
    return REWARDS["correct"][: len(completions)]


def brief(completions, **kwargs):
    return REWARDS["brief"][: len(completions)]


@pytest.mark.parametrize(
    "aggregation, scale",
    [
        ("sum_then_normalize", "group"),
        ("sum_then_normalize", "batch"),
        ("sum_then_normalize", "none"),
        ("normalize_then_sum", "group"),  # GDPO: scale_rewards has no effect
        ("normalize_then_sum", "none"),
    ],
)
def test_advantages_and_reward_metrics_equal_trl(aggregation, scale, tiny_model, tokenizer, tmp_path):
    """TRL's _generate_and_score_completions samples 3 completions of 3 prompts with the tiny model and scores them
    with the reward functions (which ignore the completions): its advantages and reward metrics are advantages_of's
    for the same rewards."""
    rows = len(REWARDS["correct"])
    trainer = trl_trainer(
        tiny_model,
        tokenizer,
        tmp_path,
        reward_funcs=(correct, brief),
        per_device_train_batch_size=rows,
        num_generations=G,
        max_completion_length=2,
        reward_weights=WEIGHTS,
        scale_rewards=scale,
        multi_objective_aggregation=aggregation,
    )
    prompts = [*PROMPTS, "Summarize: Lucy and Mark bring fruit."]
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions([{"prompt": prompts[i // G]} for i in range(rows)])
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    table = torch.tensor([[math.nan if v is None else v for v in REWARDS[k]] for k in ("correct", "brief")]).T
    grpo = GrpoConfig(num_generations=G, scale_rewards=scale, multi_objective_aggregation=aggregation)
    advantages, metrics = advantages_of(table.double(), torch.tensor(WEIGHTS, dtype=torch.float64), grpo)

    torch.testing.assert_close(advantages.float(), output["advantages"], rtol=1e-5, atol=1e-5)
    assert advantages[4] == 0  # the unscorable completion
    assert advantages.abs().max() > 0.4
    if aggregation == "sum_then_normalize":  # group 2's equal rewards: no advantage; its std 0 unless the batch's
        assert (advantages[6:] == 0).all()
        assert trl_metrics["frac_reward_zero_std"] == pytest.approx(0 if scale == "batch" else 1 / 3)
    for name in ("reward", "reward_std", "frac_reward_zero_std"):
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-6, abs=1e-6), name
    for i, name in enumerate(("correct", "brief")):
        for s in ("mean", "std"):
            assert metrics[f"rewards/{i}/{s}"] == pytest.approx(trl_metrics[f"rewards/{name}/{s}"], rel=1e-6)


@pytest.mark.parametrize("dim", [None, 1])
def test_nanstd_is_trls(dim):
    from trl.trainer.utils import nanstd as trl_nanstd

    x = torch.tensor(
        [[1.0, math.nan, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0], [math.nan, -1.0, 4.0, 0.25]], dtype=torch.float64
    )
    expected = trl_nanstd(x) if dim is None else trl_nanstd(x, dim=dim)
    torch.testing.assert_close(nanstd(x, dim), expected)
