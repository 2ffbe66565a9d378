"""Reward modelling: shardtune's whole pairs, batches, scores, Bradley-Terry loss, gradients and metrics equal what
TRL 1.16's RewardTrainer does, on the same model and batch.

trl (the dev extra) is the oracle: the same JSONL file goes through ``shardtune.data.preference.load_pairs(...,
whole=True)`` and through ``trl.RewardTrainer``'s dataset preparation and collator (explicit and implicit prompts,
text and conversational, the margin column, the max_length filter); on the tiny preset model with the score head TRL
draws for the same seed, the loss, every parameter's gradient and the metrics of
``shardtune.training.objectives.reward`` equal ``RewardTrainer.compute_loss``'s. No launch: trainers are only
constructed, steps run in this process (one gloo rank).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import typing
from pathlib import Path

import pytest
import torch
from datasets import load_dataset

from shardtune.config.flags import config_from
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.preference import load_pairs
from shardtune.model.loading import init_model, load_model, load_tokenizer, name_pad_token
from shardtune.training.objectives.reward.loss import METRICS, micro_batch_loss
from shardtune.training.objectives.reward.objective import Reward, collate_reward_pairs, reward_evaluate

EPS = float(torch.finfo(torch.float32).eps)
SYSTEM = {"role": "system", "content": "Count on."}


def chat(user: str, answer: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": user}, {"role": "assistant", "content": answer}]


COUNTS = [(i, f" {i} {i + 1} {i + 2}", f" {i} {i + 5} {i}") for i in range(3, 9)]
ROWS = {
    "text": [{"prompt": f"Count from {i}:", "chosen": c, "rejected": r} for i, c, r in COUNTS],
    "chat": [
        {"prompt": chat(f"Count from {i}", c)[:2], "chosen": chat("", c)[2:], "rejected": chat("", r)[2:]}
        for i, c, r in COUNTS
    ],
    "implicit_text": [{"chosen": f"Count from {i}:{c}", "rejected": f"Count from {i}:{r}"} for i, c, r in COUNTS],
    "implicit_chat": [
        {"chosen": chat(f"Count from {i}", c), "rejected": chat(f"Count from {i}", r)} for i, c, r in COUNTS
    ],
    "margin": [
        {"prompt": f"Count from {i}:", "chosen": c, "rejected": r, "margin": 0.25 * k}
        for k, (i, c, r) in enumerate(COUNTS)
    ],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(str(tiny))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "cache"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reward_cfg(path: Path, max_length: int = 1024, center: float = 0.0) -> TrainConfig:
    cfg = config_from(dataset="trl_dataset", context_length=max_length, run_validation=False)
    cfg.objective = "reward"
    cfg.data.trl_dataset.dataset_name = str(path)
    cfg.reward.center_rewards_coefficient = center
    return cfg


def trl_trainer(cfg: TrainConfig, model_dir: Path, tokenizer, tmp_path: Path, seed: int = 42):
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        max_length=cfg.data.context_length,
        center_rewards_coefficient=cfg.reward.center_rewards_coefficient or None,
        seed=seed,
    )
    dataset = load_dataset("json", data_files=cfg.data.trl_dataset.dataset_name, split="train")
    return RewardTrainer(
        model=str(model_dir), args=args, train_dataset=dataset, processing_class=copy.deepcopy(tokenizer)
    )


def score_model(model_dir: Path, tokenizer, seed: int = 42) -> torch.nn.Module:
    """The model a run of ``shardtune reward --seed`` trains: the causal LM's weights, a score head drawn from the
    seed, the config naming the tokenizer's pad token."""
    model = load_model(str(model_dir), head="score", seed=seed)
    name_pad_token(model, "score", tokenizer)
    return model


CASES = {  # name: (rows, max_length): every format, the margin column, pairs dropped at max_length (not cut)
    "text": ("text", 1024),
    "chat": ("chat", 1024),
    "implicit_text": ("implicit_text", 1024),
    "implicit_chat": ("implicit_chat", 1024),
    "margin": ("margin", 1024),
    "chat_filtered": ("chat", 44),  # the last pair has 45 tokens
}


@pytest.mark.parametrize("case", list(CASES))
def test_whole_pairs_and_batches_equal_trl(case, tiny, tokenizer, tmp_path):
    """prompt + chosen and prompt + rejected are TRL's chosen_ids / rejected_ids (its eos, its chat template); the
    batch is TRL's DataCollatorForPreference's (chosen rows then rejected, right-padded, the margins); a pair with a
    sequence over max_length is dropped and counted, as TRL filters it."""
    name, max_length = CASES[case]
    cfg = reward_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS[name]), max_length)
    pairs, report = load_pairs(cfg, copy.deepcopy(tokenizer), "train", whole=True)
    trainer = trl_trainer(cfg, tiny, tokenizer, tmp_path)
    theirs = list(trainer.train_dataset)
    assert len(pairs) == len(theirs) > 0, report.summary()
    for row, (mine, trl_row) in enumerate(zip(pairs, theirs), start=1):
        assert mine["prompt_ids"] + mine["chosen_ids"] == trl_row["chosen_ids"], f"row {row}: chosen"
        assert mine["prompt_ids"] + mine["rejected_ids"] == trl_row["rejected_ids"], f"row {row}: rejected"
    batch = collate_reward_pairs(pairs, tokenizer.pad_token_id)
    trl_batch = trainer.data_collator(theirs)
    for key in ("input_ids", "attention_mask"):
        assert torch.equal(batch[key], trl_batch[key]), f"different {key}"
    if "margin" in trl_batch:
        assert torch.equal(batch["margin"], trl_batch["margin"]) and batch["margin"].abs().sum() > 0
    else:  # no margin column: the loss is the margin-0 one exactly
        assert not batch["margin"].any()
    if case == "chat_filtered":
        assert report.skipped == {"longer_than_max_length": len(ROWS[name]) - len(pairs)} and report.num_truncated == 0


@pytest.mark.parametrize("center", [0.0, 0.01], ids=["plain", "centred"])
@pytest.mark.parametrize("rows", ["chat", "margin"])
def test_loss_gradients_and_metrics_equal_trl(rows, center, tiny, tokenizer, tmp_path):
    """On one batch: the score head is TRL's (the same seed draws the same weights); the loss, the gradient of every
    parameter and TRL's metrics (accuracy, margin, min / mean / max_reward) equal RewardTrainer.compute_loss's. The
    same forward gives the same scores, so what differs is how the pair terms add up: TRL's fp32 mean of n terms, our
    fp64 sum of the fp32 terms over n (n float32 ulps at most); a gradient is TRL's times n / n (its elements agree
    to an ulp of the largest). Controls: without the margin column or the centring term the loss would differ by far
    more than that."""
    cfg = reward_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS[rows]), center=center)
    pairs, _ = load_pairs(cfg, copy.deepcopy(tokenizer), "train", whole=True)
    trainer = trl_trainer(cfg, tiny, tokenizer, tmp_path)
    model = score_model(tiny, tokenizer)
    assert torch.equal(model.score.weight, trainer.model.score.weight), "the score head is drawn as TRL draws it"
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, trainer.data_collator(list(trainer.train_dataset)))
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    batch = collate_reward_pairs(pairs, tokenizer.pad_token_id)
    # the model's own forward, op for op TRL's (the lean last layer's scores: the next test, to its rounding)
    loss_sum, stats = micro_batch_loss(model, batch, center, torch.device("cpu"), lean=False)
    (loss_sum / len(pairs)).backward()
    n, loss = len(pairs), trl_loss.item()
    assert float(loss_sum) / n == pytest.approx(loss, rel=n * EPS, abs=0)
    from shardtune.training.objectives.reward.loss import means

    ours = means(stats.tolist(), n)
    for name in METRICS:
        assert ours[name] == pytest.approx(trl_metrics[name], rel=n * EPS, abs=n * EPS * abs(trl_metrics["max_reward"]))
    for (name, theirs), (_, mine) in zip(trainer.model.named_parameters(), model.named_parameters()):
        scale = float(theirs.grad.abs().max())
        assert scale > 0, f"{name}: no gradient"
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=n * EPS, atol=EPS * scale, msg=name)
    control = dict(batch, margin=torch.zeros(n))
    without_margin = float(micro_batch_loss(model, control, 0.0, torch.device("cpu"), lean=False)[0]) / n
    if rows == "margin" or center:
        assert abs(without_margin - loss) > 10 * n * EPS * loss, "the margin / centring term changes the loss"


def test_the_lean_last_layer_gives_the_whole_layers_scores_and_gradients(tiny, tokenizer, tmp_path):
    """Training computes the last decoder layer at each row's read position only (shardtune.model.lean_layer): the
    scores, loss and gradients of the whole layer up to float rounding (another summation order of the same fp32
    attention and matmuls: the lean-loss tests' relative 1e-5, tests/unit/test_loss.py), the last layer's MLP on one
    position a row. The loss's gradient is sum_r c_r grad(s_r) with |c_r| <= 1 (sigmoid weights, no centring), whose
    chosen and rejected terms largely cancel on the shared prompt's embeddings: each term carries its rounding, so the
    bound is 1e-5 of sum_r |grad(s_r)|, not of the (smaller) result."""
    from shardtune.training.objectives.reward.loss import scores

    cfg = reward_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS["chat"]))
    pairs, _ = load_pairs(cfg, copy.deepcopy(tokenizer), "train", whole=True)
    batch = collate_reward_pairs(pairs, tokenizer.pad_token_id)
    model = score_model(tiny, tokenizer)
    rows: list[int] = []
    model.model.layers[-1].mlp.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1].numel()))
    results = []
    for lean in (True, False):
        model.zero_grad()
        loss_sum, _ = micro_batch_loss(model, batch, 0.0, torch.device("cpu"), lean=lean)
        loss_sum.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((scores(model, batch, torch.device("cpu"), lean).detach(), loss_sum.detach(), grads))
    assert rows[0] == rows[1] == batch["input_ids"].shape[0] < rows[2] == rows[3] == batch["input_ids"].numel()
    (lean_scores, lean_loss, lean_grads), (whole_scores, whole_loss, whole_grads) = results
    scale = float(whole_scores.abs().max())
    torch.testing.assert_close(lean_scores, whole_scores, rtol=1e-5, atol=1e-5 * scale)
    assert float(lean_loss) == pytest.approx(float(whole_loss), rel=1e-6)
    magnitude = {n: torch.zeros_like(p) for n, p in model.named_parameters()}  # sum_r |grad(s_r)|, elementwise
    for row in range(batch["input_ids"].shape[0]):
        model.zero_grad()
        scores(model, batch, torch.device("cpu"), lean=False)[row].backward()
        for n, p in model.named_parameters():
            magnitude[n] += p.grad.abs()
    for name, g in whole_grads.items():
        assert float(magnitude[name].max()) > 0, name
        assert float((lean_grads[name] - g).abs().max()) <= 1e-5 * float(magnitude[name].max()), name


def test_the_score_is_read_at_each_rows_last_non_pad_token(tiny, tokenizer):
    """A padded row's score is its score alone (the config names the tokenizer's pad token, as the run sets it); a
    config without the pad token would read a padded row elsewhere (the control)."""
    model = score_model(tiny, tokenizer).eval()
    long, short = [5, 9, 14, 3, 7, 2], [5, 9, 14]
    pad = tokenizer.pad_token_id
    batch = {
        "input_ids": torch.tensor([long, short + [pad] * 3]),
        "attention_mask": torch.tensor([[1] * 6, [1] * 3 + [0] * 3]),
    }
    with torch.no_grad():
        padded = model(**batch).logits[:, 0]
        alone = model(input_ids=torch.tensor([short])).logits[0, 0]
        assert float(padded[1]) == pytest.approx(float(alone), abs=1e-6)
        model.config.pad_token_id = tokenizer.eos_token_id  # another token: the padded row is read at its last pad
        assert float(model(**batch).logits[1, 0]) != pytest.approx(float(alone), abs=1e-4)


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A real one-process gloo group (what DDP needs to wrap a model)."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def reward_step(cfg: TrainConfig, env, tiny: Path, tokenizer, micro: list[dict]) -> tuple[dict, dict]:
    """One optimizer step (SGD, lr 1) of the reward objective as a run takes it: (its metrics, the weights after)."""
    from shardtune.parallel import make_strategy
    from shardtune.training.engine.step import train_step

    strategy = make_strategy(cfg, env)
    model = strategy.wrap(score_model(tiny, tokenizer, seed=cfg.train.seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    objective = Reward(cfg, env, strategy, tokenizer)
    objective.attach(model, [], [])
    metrics = train_step(model, strategy, optimizer, objective, micro, step=1).metrics
    return metrics, {k: v.detach().clone() for k, v in strategy.unwrap(model).state_dict().items()}


def test_a_step_is_the_mean_over_its_pairs_whatever_the_accumulation(process_group, tiny, tokenizer, tmp_path):
    """1 x 4 x 1, 1 x 2 x 2 and 1 x 1 x 4 (processes x pairs x accumulation; the launch test does 2 ranks) give the
    same loss (the centring term a mean over the step's pairs too), metrics and weights after one step; min_reward /
    max_reward are the extremes of the step's scores, not TRL's mean of its micro-batches' extremes, which 1 x 1 x 4
    would change (the control). Evaluation in chunks of --val_batch_size 3 (3 + 1 pairs) gives the whole split's."""
    from shardtune.runtime.distributed import DistEnv

    cfg0 = reward_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS["margin"][:4]), center=0.01)
    pairs, _ = load_pairs(cfg0, copy.deepcopy(tokenizer), "train", whole=True)
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    results = []
    for batch_size, accumulation in ((4, 1), (2, 2), (1, 4)):
        cfg = copy.deepcopy(cfg0)
        cfg.model.name, cfg.train.seed = str(tiny), 3
        cfg.train.batch_size, cfg.train.gradient_accumulation_steps = batch_size, accumulation
        micro = [
            collate_reward_pairs(pairs[i : i + batch_size], tokenizer.pad_token_id) for i in range(0, 4, batch_size)
        ]
        results.append(reward_step(cfg, env, tiny, tokenizer, micro))
    (first, weights), others = results[0], results[1:]
    whole = collate_reward_pairs(pairs, tokenizer.pad_token_id)
    initial = score_model(tiny, tokenizer, seed=3)
    _, direct = micro_batch_loss(initial, whole, 0.01, torch.device("cpu"))
    from shardtune.training.objectives.reward.loss import means

    expected = means(direct.tolist(), 4)
    assert first["num_pairs"] == 4 and set(first) == {"loss", "num_pairs", *METRICS}
    for name, value in expected.items():
        assert first[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    # each layout pads its rows to its own width: the lean last layer's attention over a row's keys (the pads masked
    # to exact zeros) sums in another blocking, so a score moves by fp32 rounding of the largest score's size, and
    # the margin (a difference of near scores) by that much too, not by a part of its own smaller size
    scores_scale = max(abs(first["max_reward"]), abs(first["min_reward"]))
    for metrics, other in others:
        for name in ("loss", *METRICS):
            assert metrics[name] == pytest.approx(first[name], rel=1e-6, abs=1e-6 * scores_scale), name
        for key, value in weights.items():
            torch.testing.assert_close(other[key], value, rtol=1e-5, atol=1e-6, msg=key)
    moved = initial.state_dict()
    assert any(not torch.equal(moved[k], v) for k, v in weights.items()), "the step changed no weight"
    singles = [
        micro_batch_loss(initial, collate_reward_pairs([p], tokenizer.pad_token_id), 0.01, torch.device("cpu"))[1]
        for p in pairs
    ]
    trl_way = sum(float(s[4]) for s in singles) / 4  # TRL's min_reward at 1 x 1 x 4: the mean of each batch's minimum
    assert trl_way != pytest.approx(first["min_reward"], rel=1e-3), "a mean of minima would pass too"
    from shardtune.parallel import make_strategy

    cfg.eval.batch_size = 3
    strategy = make_strategy(cfg, env)
    evaluated = reward_evaluate(strategy.wrap(initial), strategy, cfg, env, pairs, tokenizer.pad_token_id)
    assert set(evaluated) == {"eval_loss", "eval_num_pairs", *(f"eval_{m}" for m in METRICS)}
    assert evaluated["eval_num_pairs"] == 4
    for name, value in expected.items():
        assert evaluated[f"eval_{name}"] == pytest.approx(value, rel=1e-6, abs=1e-9), name


def test_whole_pairs_are_cached_with_their_margins_apart_from_dpos_pairs(tokenizer, tmp_path):
    """The tokenised-data cache keeps whole pairs (and their margins) in entries of their own: DPO's pairs of the same
    file are cut, not filtered, and carry no margin."""
    from shardtune.data.cache import load_pairs_cached, pairs_entry

    cfg = reward_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS["margin"]), max_length=40)
    direct, _ = load_pairs(cfg, copy.deepcopy(tokenizer), "train", whole=True)
    cached, report = load_pairs_cached(cfg, tokenizer, "train", tmp_path / "c", whole=True)
    again, _ = load_pairs_cached(cfg, tokenizer, "train", tmp_path / "c", whole=True)  # read from the entry
    assert [dict(p) for p in cached] == [dict(p) for p in again] == direct
    assert [p["margin"] for p in again] == [0.25 * k for k in range(len(direct))]
    dpo, _ = load_pairs_cached(cfg, tokenizer, "train", tmp_path / "c")
    assert "margin" not in dict(dpo[0]) and len(dpo) == len(direct)
    assert pairs_entry(cfg, tokenizer, "train", tmp_path, whole=True) != pairs_entry(cfg, tokenizer, "train", tmp_path)
    with pytest.raises(ConfigError, match="row 2: its margin is 'wide', not a finite number"):
        bad = [ROWS["margin"][0], dict(ROWS["margin"][1], margin="wide")]
        cfg = reward_cfg(write_jsonl(tmp_path / "bad.jsonl", bad))
        cfg.data.strict = True
        load_pairs(cfg, copy.deepcopy(tokenizer), "train", whole=True)


def _field_defaults(cls: type) -> dict[str, typing.Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_reward_config_is_trls_and_its_settings_mean_trls():
    """RewardConfig has TRL's fields, types and defaults (in TRL's order); center_rewards_coefficient None is no
    centring term (0); TRL's learning rate default (1e-4) and dropout off."""
    import trl

    import shardtune

    ours, theirs = shardtune.RewardConfig, trl.RewardConfig
    assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]
    their_types, our_types = typing.get_type_hints(theirs), typing.get_type_hints(ours)
    assert all(their_types[name] == our_types[name] for name in their_types)
    assert repr(_field_defaults(theirs)) == repr(_field_defaults(ours))
    cfg = ours(output_dir="rm").canonical()
    assert (cfg.objective, cfg.optim.lr, cfg.peft.lora.dropout, cfg.reward.center_rewards_coefficient) == (
        "reward",
        1e-4,
        0.0,
        0.0,
    )
    assert ours(output_dir="rm", center_rewards_coefficient=0.01).canonical().reward.center_rewards_coefficient == 0.01
    assert ours(output_dir="rm").max_length == 1024 and ours(output_dir="rm").pad_to_multiple_of is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (("reward", "--loss_type", "sigmoid"), "--loss_type: shardtune reward trains one loss"),
        (("sft", "--lora_task_type", "SEQ_CLS"), "--lora_task_type SEQ_CLS trains a sequence-classification head"),
        (("reward", "--padding_free", "true"), "--padding_free: a reward model reads each sequence's score"),
        (("dpo", "--center_rewards_coefficient", "0.01"), "center_rewards_coefficient is a flag of shardtune reward"),
        (("reward", "--center_rewards_coefficient", "-1"), "center_rewards_coefficient -1"),
    ],
)
def test_what_reward_cannot_honour_is_refused_in_one_line(argv, message, cli_in_process, tiny, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", ROWS["text"])
    proc = cli_in_process(*argv, "--model_name", tiny, "--dataset_name", data, "--output_dir", tmp_path / "out")
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_model_object_needs_one_label_as_trl_says(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    import shardtune

    with pytest.raises(ConfigError, match="num_labels=2: a reward model has num_labels=1"):
        shardtune.RewardTrainer(
            model=AutoModelForCausalLM.from_pretrained(str(tiny)),
            args=shardtune.RewardConfig(output_dir=str(tmp_path / "rm")),
            train_dataset=ROWS["text"],
        )


def test_plan_counts_two_rows_a_pair_the_score_head_and_no_reference(tiny):
    """``shardtune plan --objective reward``: the model is the causal LM without its output layer over the vocabulary,
    plus a one-output score head (the meta-built model's own count); two rows a pair (DPO's activations); no
    reference; no vocabulary logits (loss buffers: the scores alone)."""
    from shardtune.config.objectives import OBJECTIVES
    from shardtune.model.loading import build_model_on_meta, count_parameters
    from shardtune.planner.estimate import Setup, estimate
    from shardtune.planner.shapes import read_arch
    from tests.conftest import main_in_process

    arch = read_arch(str(tiny))
    scored = dataclasses.replace(arch, score_outputs=1)
    assert scored.num_params == count_parameters(build_model_on_meta(str(tiny), head="score"))[0]
    plan = {}
    for objective in ("sft", "dpo", "reward"):
        proc = main_in_process(
            "plan", "--model_name", "llama3-8b", "--gpus_per_node", 8, "--json", "--objective", objective
        )
        assert proc.returncode in (0, 1), proc.stderr
        plan[objective] = json.loads(proc.stdout)
    head_bytes = 128256 * 4096 * 4  # llama3-8b's untied output layer, fp32 master weights under DDP
    sft, dpo, reward = (plan[o]["given"]["breakdown"] for o in ("sft", "dpo", "reward"))
    assert plan["sft"]["parameters"] - plan["reward"]["parameters"] == 128256 * 4096 - 4096
    assert sft["parameters"] - reward["parameters"] == pytest.approx(head_bytes - 4096 * 4, rel=1e-9)
    assert reward["activations"] == pytest.approx(dpo["activations"]) and reward["loss buffers"] < 1e6
    assert not OBJECTIVES["reward"].frozen_reference(config_from(objective="reward"))
    setup = Setup(arch=scored, rows_per_unit=2, batch_size=2, seq_len=1024)
    assert estimate(setup).loss_buffers == 4 * 2 * 2 * 1024
    assert plan["reward"]["command"] == "shardtune reward"
