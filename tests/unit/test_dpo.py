"""DPO: shardtune's preference pairs, batches, log-probabilities and losses equal what TRL 1.16's DPOTrainer does.

trl (the dev extra) is the oracle: the same JSONL file goes through ``shardtune.data.preference.load_pairs`` and
through ``trl.DPOTrainer``'s dataset preparation and collator; every kept pair must give the same token ids,
attention and completion masks. On the tiny preset model and one batch, the loss and the TRL-named metrics of
``shardtune.training.objectives.dpo.objective`` equal ``DPOTrainer.compute_loss``'s. No launch: the trainer is only
constructed.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from datasets import load_dataset

from shardtune.config.flags import config_from, with_settings
from shardtune.config.schema import ConfigError, DpoConfig, TrainConfig
from shardtune.data.preference import collate_pairs, load_pairs
from shardtune.data.trl_utils import extract_prompt
from shardtune.model.loading import init_model, load_model, load_tokenizer
from shardtune.training.engine.step import train_step
from shardtune.training.objectives.dpo.logps import (
    chosen_completion_targets,
    num_completion_targets,
    num_pairs,
    pair_logps,
)
from shardtune.training.objectives.dpo.loss import check_loss_options, loss_types, sft_weight
from shardtune.training.objectives.dpo.objective import DPO, METRICS, TOKEN_METRICS, micro_batch_loss, step_means


def dpo_step(cfg: TrainConfig, env, strategy, model, optimizer, micro: list[dict], tokenizer) -> dict:
    """One optimizer step of the DPO objective, its reference built by the objective as a run builds it (the frozen
    copy of --model_name, or the adapter switched off with PEFT): the step's metrics."""
    objective = DPO(cfg, env, strategy, tokenizer)
    objective.attach(model, [], [])
    return train_step(model, strategy, optimizer, objective, micro, step=1).metrics


SYSTEM = {"role": "system", "content": "Summarize the dialog."}
DIALOGUES = [
    ("Anna: cinema at 7? Tom: sure!", "Anna and Tom go to the cinema.", "Ben can't have lunch."),
    ("Kate: lunch? Ben: can't today.", "Ben can't have lunch with Kate.", "Lucy brings cake."),
    ("Lucy: I'll bring cake. Mark: fruit!", "Lucy brings cake and Mark fruit.", "Tom goes to the cinema."),
]


def chat(user: str, answer: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": user}, {"role": "assistant", "content": answer}]


ROWS = {
    "text": [{"prompt": f"Summarize: {d}\nSummary:", "chosen": f" {c}", "rejected": f" {r}"} for d, c, r in DIALOGUES],
    "chat": [{"prompt": chat(d, c)[:2], "chosen": chat(d, c)[2:], "rejected": chat(d, r)[2:]} for d, c, r in DIALOGUES],
    "implicit_text": [
        {"chosen": f"Summarize: {d}\nSummary: {c}", "rejected": f"Summarize: {d}\nSummary: {r}"}
        for d, c, r in DIALOGUES
    ],
    "implicit_chat": [{"chosen": chat(d, c), "rejected": chat(d, r)} for d, c, r in DIALOGUES],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(str(tiny))


def dpo_cfg(path: Path, max_length: int = 1024, truncation_mode: str = "keep_start") -> TrainConfig:
    cfg = config_from(dataset="trl_dataset", context_length=max_length, run_validation=False)
    cfg.data.trl_dataset.dataset_name = str(path)
    cfg.data.trl_dataset.truncation_mode = truncation_mode
    return cfg


def batch_means(sums: torch.Tensor, batch: dict, dpo: DpoConfig | None = None) -> dict[str, float]:
    """The loss and metrics of one micro-batch's sums (:func:`micro_batch_loss`), divided by its own counts."""
    sft = sft_weight(dpo) if dpo is not None else 0.0
    counts = num_pairs(batch), chosen_completion_targets(batch), num_completion_targets(batch)
    return step_means(sums.tolist(), *counts, sft)


def logp_resolution(metrics: dict[str, float]) -> float:
    """Eight float32 ulps of the largest per-pair log-probability of ``metrics``: two computations of the same
    per-sequence sums (another order of summation or matmul blocking: the lean head's chunks, a padding-free row,
    TRL's full logits) agree to a few ulps and no better, and what is derived from differences of such sums (rewards,
    margins, the loss) inherits that absolute resolution (at |log p| ~ 180: ~1e-5)."""
    largest = max(abs(metrics["logps/chosen"]), abs(metrics["logps/rejected"]))
    return 8 * float(torch.finfo(torch.float32).eps) * largest


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trl_trainer(cfg: TrainConfig, model_dir: Path, tokenizer, tmp_path: Path, dpo: DpoConfig | None = None):
    dpo = dpo or DpoConfig()
    from trl import DPOConfig, DPOTrainer

    types = loss_types(dpo)
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        max_length=cfg.data.context_length,
        truncation_mode=cfg.data.trl_dataset.truncation_mode,
        beta=dpo.beta,
        loss_type=types,
        label_smoothing=dpo.label_smoothing,
        loss_weights=list(dpo.loss_weights) or None,
        f_divergence_type=dpo.f_divergence_type,
        f_alpha_divergence_coef=dpo.f_alpha_divergence_coef,
        discopop_tau=dpo.discopop_tau,
    )
    dataset = load_dataset("json", data_files=cfg.data.trl_dataset.dataset_name, split="train")
    return DPOTrainer(
        model=load_model(str(model_dir)),
        ref_model=load_model(str(model_dir)),
        args=args,
        train_dataset=dataset,
        processing_class=copy.deepcopy(tokenizer),
    )


def trl_and_our_policy(dpo: DpoConfig, tiny: Path, tokenizer, tmp_path: Path):
    """The chat pairs, TRL's trainer on them, and our policy perturbed away from the reference (so the ratios are
    not zero), TRL's model holding the same weights: (cfg, pairs, trainer, policy, reference)."""
    cfg = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS["chat"]))
    pairs, _ = load_pairs(cfg, copy.deepcopy(tokenizer), "train")
    trainer = trl_trainer(cfg, tiny, tokenizer, tmp_path, dpo)
    policy, reference = load_model(str(tiny)), load_model(str(tiny))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    trainer.model.load_state_dict(policy.state_dict())
    return cfg, pairs, trainer, policy, reference


CASES = {  # name: (rows, max_length, truncation mode)
    "text": ("text", 1024, "keep_start"),
    "chat": ("chat", 1024, "keep_start"),
    "implicit_text": ("implicit_text", 1024, "keep_start"),
    "implicit_chat": ("implicit_chat", 1024, "keep_start"),
    "chat_cut_keep_start": ("chat", 45, "keep_start"),  # row 1 cut, rows 2-3 dropped (prompt fills it)
    "text_cut_keep_end": ("text", 12, "keep_end"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pairs_and_batches_equal_trl(case, tiny, tokenizer, tmp_path):
    name, max_length, mode = CASES[case]
    cfg = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS[name]), max_length, mode)
    pairs, report = load_pairs(cfg, copy.deepcopy(tokenizer), "train")
    trainer = trl_trainer(cfg, tiny, tokenizer, tmp_path)
    theirs = list(trainer.train_dataset)
    assert len(pairs) == len(theirs), report.summary()
    for row, (mine, trl_row) in enumerate(zip(pairs, theirs), start=1):
        for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
            assert mine[key] == trl_row[key], f"row {row}: different {key}"
    batch = collate_pairs(pairs, tokenizer.pad_token_id, max_length, mode)
    trl_batch = trainer.data_collator(theirs)
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(batch[key], trl_batch[key]), f"different {key}"
    if max_length < 100:
        assert report.num_truncated > 0


def test_implicit_prompt_is_the_shared_prefix_without_the_space():
    parts = extract_prompt({"chosen": "Q: sky? A: blue", "rejected": "Q: sky? A: green"})
    assert parts == {"prompt": "Q: sky? A:", "chosen": " blue", "rejected": " green"}
    c, r = chat("hi", "a"), chat("hi", "b")
    assert extract_prompt({"chosen": c, "rejected": r}) == {"prompt": c[:2], "chosen": c[2:], "rejected": r[2:]}


def test_a_prompt_that_fills_max_length_is_dropped_and_counted(tokenizer, tmp_path):
    cfg = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS["chat"]), 30)
    rows = ROWS["chat"] + [
        {"prompt": chat("x " * 80, "")[:2], "chosen": chat("", "a")[2:], "rejected": chat("", "b")[2:]}
    ]
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    cfg.data.context_length = 60
    pairs, report = load_pairs(cfg, copy.deepcopy(tokenizer), "train")
    assert len(pairs) == 3 and report.skipped == {"prompt_fills_max_length": 1}


LOSSES = [
    DpoConfig(),
    DpoConfig(beta=0.5, loss_type="ipo"),
    DpoConfig(beta=0.3, loss_type="hinge"),
    DpoConfig(beta=0.2, loss_type="robust", label_smoothing=0.1),
]


@pytest.mark.parametrize("dpo", LOSSES, ids=lambda d: str(d.loss_type))
def test_loss_and_log_probabilities_equal_trl(dpo, tiny, tokenizer, tmp_path):
    """The policy perturbed away from the reference (so the ratios are not zero); the same batch for both.

    TRL's reference log-probabilities come from its no-gradient path, whose fused LM head is up to ~5e-3 nats per
    sequence away from a float64 forward on this model (shardtune's are within 1e-4 of it, checked here): the policy's
    log-probabilities are compared to 1e-5 relative, the rewards to beta x 0.01, the loss to 2e-3.
    """
    cfg, pairs, trainer, policy, reference = trl_and_our_policy(dpo, tiny, tokenizer, tmp_path)
    batch = collate_pairs(pairs, tokenizer.pad_token_id, cfg.data.context_length)
    trl_loss = float(trainer.compute_loss(trainer.model, trainer.data_collator(list(trainer.train_dataset))))
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    loss_sum, sums = micro_batch_loss(policy, reference, None, batch, dpo, torch.device("cpu"))
    ours = batch_means(sums, batch)
    assert float(loss_sum) / len(pairs) == pytest.approx(trl_loss, abs=2e-3)
    assert ours["loss"] == pytest.approx(trl_loss, abs=2e-3)
    for name in ("logps/chosen", "logps/rejected"):
        assert ours[name] == pytest.approx(trl_metrics[name], rel=1e-5), name
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert ours[name] == pytest.approx(trl_metrics[name], abs=dpo.beta * 0.01), name
    exact = torch.cat(pair_logps(load_model(str(tiny)).double(), batch, torch.device("cpu"))).double()
    assert torch.allclose(torch.cat(pair_logps(reference, batch, torch.device("cpu"))).double(), exact, atol=1e-3)
    assert abs(ours["rewards/margins"]) > 0.05, "the ratios must not be near zero, or the comparison is empty"
    assert abs(ours["loss"] - math.log(2)) > 0.01


def softcapped_gemma2(tokenizer, out: Path) -> Path:
    """A tiny Gemma 2 with the shared tokenizer: its logits are soft-capped after the head, so shardtune takes the
    full-logits path (not the lean head) and TRL's fused head applies the cap itself."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        final_logit_softcapping=3.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    Gemma2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def fit_chosen(model: torch.nn.Module, batch: dict, steps: int = 40) -> None:
    """A few Adam steps on the chosen completions, so that the policy predicts some of their tokens (a random model's
    mean_token_accuracy is 0: a comparison of zeros)."""
    n = num_pairs(batch)
    labels = batch["input_ids"][:n].masked_fill(batch["completion_mask"][:n] == 0, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(
            input_ids=batch["input_ids"][:n], attention_mask=batch["attention_mask"][:n], labels=labels
        ).loss.backward()
        optimizer.step()


def fitted_model(model_dir: Path, batch: dict, tokenizer, out: Path) -> Path:
    """``model_dir``'s model after :func:`fit_chosen` on ``batch``, saved in ``out``: its tokens' entropies and
    predictions differ from token to token (a random model's are all alike, so any average of them agrees)."""
    model = load_model(str(model_dir))
    fit_chosen(model, batch)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma2"], ids=["lean_head", "full_logits"])
def test_token_metrics_equal_trl(arch, tiny, tokenizer, tmp_path):
    """TRL 1.16's logits/chosen, logits/rejected, entropy and mean_token_accuracy of one batch on one process (one
    micro-batch: TRL's number is then ours, docs/dpo.md): the lean head's chunks (Llama) and the full logits (Gemma 2,
    soft-capped) against TRL's fused head on the same policy and batch.

    Both compute each token's values in fp32 from the same hidden states; the head's matmul, blocked otherwise, moves
    a logit by a few fp32 ulps of the logits' magnitude, and the entropy (logsumexp - the expected logit) and the mean
    logit (over the vocabulary) cancel terms of that magnitude: each token's value is good to ~8 ulps of the largest
    |logit|, and TRL sums the n tokens in fp32 (n ulps of the sum at most): entropy and logits/* to 8 ulps of the
    largest |logit| plus n ulps of the value; accuracy (a count over a count, TRL's division in fp32) to one ulp.
    Controls: the policy predicts some chosen tokens and not all, chosen and rejected differ by more than both
    tolerances, and the wrong tokens (the entropy of the chosen only, the accuracy of all completions) miss TRL's."""
    from shardtune.model.loss import sequence_log_prob_and_prediction_sums
    from shardtune.training.objectives.dpo.logps import completion_targets

    model_dir = tiny if arch == "llama" else softcapped_gemma2(tokenizer, tmp_path / "gemma2")
    dpo = DpoConfig()
    cfg = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS["chat"]))
    pairs, _ = load_pairs(cfg, copy.deepcopy(tokenizer), "train")
    batch = collate_pairs(pairs, tokenizer.pad_token_id, cfg.data.context_length)
    trainer = trl_trainer(cfg, model_dir, tokenizer, tmp_path, dpo)
    policy, reference = load_model(str(model_dir)), load_model(str(model_dir))
    fit_chosen(policy, batch)
    trainer.model.load_state_dict(policy.state_dict())
    trainer.compute_loss(trainer.model, trainer.data_collator(list(trainer.train_dataset)))
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    cpu = torch.device("cpu")
    with torch.no_grad():
        _, sums = micro_batch_loss(policy, reference, None, batch, dpo, cpu)
        largest = float(policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.abs().max())
    ours = batch_means(sums, batch)
    eps, n = float(torch.finfo(torch.float32).eps), num_completion_targets(batch)
    tolerance = {name: 8 * eps * largest + n * eps * abs(ours[name]) for name in TOKEN_METRICS}
    tolerance["mean_token_accuracy"] = eps
    for name in TOKEN_METRICS:
        assert ours[name] == pytest.approx(trl_metrics[name], rel=0, abs=tolerance[name]), name
    assert 0 < ours["mean_token_accuracy"] < 1, "the policy must predict some chosen tokens and miss others"
    assert abs(ours["logits/chosen"] - ours["logits/rejected"]) > 2 * max(
        tolerance["logits/chosen"], tolerance["logits/rejected"]
    )
    with torch.no_grad():  # the controls: per-sequence sums of (is_top1, entropy, mean logit)
        _, per_sequence = sequence_log_prob_and_prediction_sums(policy, batch, *completion_targets(batch), cpu)
    chosen_tokens = chosen_completion_targets(batch)
    entropy_of_chosen = float(per_sequence[: len(pairs), 1].sum()) / chosen_tokens
    accuracy_of_all = float(per_sequence[: 2 * len(pairs), 0].sum()) / n
    assert abs(entropy_of_chosen - trl_metrics["entropy"]) > 2 * tolerance["entropy"]
    assert abs(accuracy_of_all - trl_metrics["mean_token_accuracy"]) > 2 * tolerance["mean_token_accuracy"]


def test_first_loss_is_ln2_when_policy_is_the_reference(tiny, tokenizer, tmp_path):
    cfg = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS["text"]))
    pairs, _ = load_pairs(cfg, copy.deepcopy(tokenizer), "train")
    model = load_model(str(tiny))
    loss_sum, _ = micro_batch_loss(
        model,
        load_model(str(tiny)),
        None,
        collate_pairs(pairs, tokenizer.pad_token_id, 1024),
        DpoConfig(),
        torch.device("cpu"),
    )
    assert float(loss_sum) / len(pairs) == pytest.approx(math.log(2), abs=1e-6)
    loss_sum.backward()  # the graph reaches the policy's weights
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_label_smoothing_outside_robust_is_refused():
    check_loss_options(DpoConfig(loss_type="robust", label_smoothing=0.1))
    with pytest.raises(ConfigError, match="robust and exo_pair only"):
        check_loss_options(DpoConfig(label_smoothing=0.1))


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A real one-process gloo group (what DDP needs to wrap a model)."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "losses",
    [DpoConfig(), DpoConfig(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])],
    ids=["sigmoid", "sigmoid+sft"],
)
def test_a_step_is_the_mean_over_its_pairs_whatever_the_accumulation(losses, process_group, tiny, tokenizer, tmp_path):
    """1 x 4 x 1, 1 x 2 x 2 and 1 x 1 x 4 (processes x pairs x accumulation): the same loss, metrics and weights
    after one step (the pair count is all-reduced like the SFT loop's token count; the launch test does 2 ranks);
    with an sft term too (a mean over the step's chosen completion tokens, which micro-batches hold unequally). The
    token metrics (logits/*, entropy, mean_token_accuracy) are the whole batch's, not TRL's mean of the micro-batches'
    means, which 1 x 1 x 4 would change (the control)."""
    from shardtune.parallel import make_strategy
    from shardtune.runtime.distributed import DistEnv

    rows = ROWS["text"] + [
        {"prompt": "Summarize: Tom: hi!\nSummary:", "chosen": " Tom says hi.", "rejected": " Kate brings cake."}
    ]
    cfg0 = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", rows))
    pairs, _ = load_pairs(cfg0, copy.deepcopy(tokenizer), "train")
    fitted = fitted_model(tiny, collate_pairs(pairs, tokenizer.pad_token_id, 1024), tokenizer, tmp_path / "fitted")
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    results = []
    for batch_size, accumulation in ((4, 1), (2, 2), (1, 4)):
        cfg = dpo_cfg(tmp_path / "pairs.jsonl")
        cfg.dpo, cfg.objective, cfg.model.name = losses, "dpo", str(fitted)
        cfg.train.batch_size, cfg.train.gradient_accumulation_steps = batch_size, accumulation
        cfg.optim.lr = 1.0
        strategy = make_strategy(cfg, env)
        model = strategy.wrap(load_model(str(fitted)))
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        micro = [
            collate_pairs(pairs[i : i + batch_size], tokenizer.pad_token_id, 1024) for i in range(0, 4, batch_size)
        ]
        stats = dpo_step(cfg, env, strategy, model, optimizer, micro, tokenizer)
        results.append((stats, strategy.unwrap(model).state_dict()))
    (first, weights), others = results[0], results[1:]
    chosen_tokens = chosen_completion_targets(collate_pairs(pairs, tokenizer.pad_token_id, 1024))
    nll = 0.5 * -first["logps/chosen"] * 4 / chosen_tokens  # the sft term: mean NLL per chosen completion token
    assert first["loss"] == pytest.approx(math.log(2) + (nll if sft_weight(losses) else 0), abs=1e-6)
    assert first["num_pairs"] == 4
    cpu, initial = torch.device("cpu"), load_model(str(fitted))
    whole = collate_pairs(pairs, tokenizer.pad_token_id, 1024)
    _, before = micro_batch_loss(initial, load_model(str(fitted)), None, whole, losses, cpu)
    for name in TOKEN_METRICS:  # the step's metrics are those of the policy before its update: the whole batch's
        assert first[name] == pytest.approx(batch_means(before, whole)[name], rel=1e-6, abs=1e-9), name
    for stats, other in others:
        for name in ("loss", "rewards/chosen", "logps/chosen", "logps/rejected", *TOKEN_METRICS):
            assert stats[name] == pytest.approx(first[name], rel=1e-6, abs=1e-9), name
        for key, value in weights.items():
            torch.testing.assert_close(other[key], value, rtol=1e-5, atol=1e-6, msg=key)
    single_means = []  # the control: TRL's way at 1 x 1 x 4, each micro-batch's token means, then their mean
    for pair in pairs:
        single = collate_pairs([dict(pair, ref_logps=(0.0, 0.0))], tokenizer.pad_token_id, 1024)
        single_means.append(batch_means(micro_batch_loss(initial, None, None, single, losses, cpu)[1], single))
    for name in ("entropy", "logits/chosen", "logits/rejected"):
        trl_way = sum(means[name] for means in single_means) / len(single_means)
        assert trl_way != pytest.approx(first[name], rel=1e-4), f"{name}: a mean of means would pass too"
    moved = load_model(str(fitted)).state_dict()
    assert any(not torch.equal(moved[k], v) for k, v in weights.items()), "the step changed no weight"
    # evaluation in chunks of --val_batch_size 3 (3 + 1 pairs) gives the means over all pairs at once, TRL's names
    from shardtune.training.objectives.dpo.objective import dpo_evaluate

    cfg.eval.batch_size = 3
    policy, reference = load_model(str(fitted)), load_model(str(fitted))
    policy.load_state_dict(weights)
    evaluated = dpo_evaluate(
        strategy.wrap(policy), strategy, cfg, env, pairs, tokenizer.pad_token_id, ref_model=reference
    )
    whole = collate_pairs(pairs, tokenizer.pad_token_id, 1024)
    _, direct = micro_batch_loss(policy, reference, None, whole, cfg.dpo, torch.device("cpu"))
    assert evaluated["eval_num_pairs"] == 4 and set(evaluated) == {
        "eval_num_pairs",
        "eval_loss",
        *(f"eval_{m}" for m in METRICS),
    }
    for name, value in batch_means(direct, whole, losses).items():
        assert evaluated[f"eval_{name}"] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert evaluated["eval_loss"] != pytest.approx(math.log(2), abs=1e-4), "the trained policy is not the reference"


def test_precomputed_reference_log_probabilities_give_the_live_references_loss(
    process_group, tiny, tokenizer, tmp_path
):
    """--precompute_ref_log_probs: one pass stores each pair's reference log-probabilities; a batch of such pairs
    needs no reference model and gives the loss and metrics of the live reference (batch composition aside)."""
    from shardtune.parallel import make_strategy
    from shardtune.runtime.distributed import DistEnv
    from shardtune.training.objectives.dpo.reference import precompute_reference

    cfg = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS["chat"]))
    cfg.train.batch_size = 2  # chunks of 2 + 1 pairs
    pairs, _ = load_pairs(cfg, copy.deepcopy(tokenizer), "train")
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    policy, reference = load_model(str(tiny)), load_model(str(tiny))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    precompute_reference(pairs, policy, make_strategy(cfg, env), cfg, env, tokenizer.pad_token_id, ref_model=reference)
    assert all(len(p["ref_logps"]) == 2 for p in pairs)
    batch = collate_pairs(pairs, tokenizer.pad_token_id, cfg.data.context_length)
    assert batch["ref_logps"].shape == (3, 2)
    live_loss, live = micro_batch_loss(
        policy, reference, None, {k: v for k, v in batch.items() if k != "ref_logps"}, cfg.dpo, torch.device("cpu")
    )
    stored_loss, stored = micro_batch_loss(policy, None, None, batch, cfg.dpo, torch.device("cpu"))
    assert float(stored_loss) == pytest.approx(float(live_loss), rel=1e-5)
    torch.testing.assert_close(stored, live, rtol=1e-5, atol=1e-5)
    assert abs(float(live_loss) / 3 - math.log(2)) > 0.01, "the policy must differ from the reference"


def test_with_peft_the_reference_is_the_base_with_the_adapter_off(tiny, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model

    from shardtune.training.objectives.dpo.logps import reference_logps

    cfg = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS["text"]))
    pairs, _ = load_pairs(cfg, copy.deepcopy(tokenizer), "train")
    batch = collate_pairs(pairs, tokenizer.pad_token_id, 1024)
    policy = get_peft_model(load_model(str(tiny)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.1)
    cpu = torch.device("cpu")
    base = torch.cat(pair_logps(load_model(str(tiny)), batch, cpu))
    assert torch.allclose(torch.cat(reference_logps(policy, None, policy, batch, cpu)), base, atol=1e-4)
    assert not torch.allclose(torch.cat(pair_logps(policy, batch, cpu)), base, atol=1e-2), "the adapter is on again"


def assert_same_losses_and_gradients(policy, reference, padded: dict, other: dict) -> None:
    """Every loss type's metrics and policy gradients on ``other`` (another layout of ``padded``'s pairs) are the
    padded rows' to float rounding."""
    cpu = torch.device("cpu")
    for dpo in LOSSES:
        grads, means = [], []
        for batch in (padded, other):
            policy.zero_grad()
            loss_sum, sums = micro_batch_loss(policy, reference, None, batch, dpo, cpu)
            loss_sum.backward()
            grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()]))
            means.append(batch_means(sums, batch))
        for name, value in means[0].items():
            assert means[1][name] == pytest.approx(value, rel=1e-5, abs=logp_resolution(means[0])), (
                dpo.loss_type,
                name,
            )
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5 * float(grads[0].abs().max()))
    assert abs(means[0]["rewards/margins"]) > 0.01, "the policy must differ from the reference"


@pytest.mark.parametrize("rows", ["chat", "implicit_text"])
def test_padding_free_pairs_give_the_padded_losses_and_gradients(rows, tiny, tokenizer, tmp_path):
    """--padding_free: the micro-batch's chosen then rejected sequences in ONE row, no pad token, attention kept in
    each sequence (shardtune_varlen): the same log-probabilities, losses (every loss type, ipo's per-token lengths
    too), metrics and policy gradients as the padded rows; the same pair and completion-token counts."""
    from shardtune.accounting.flops import model_shape, preference_micro_batch_flops
    from shardtune.data.preference import collate_pairs_flat
    from shardtune.model.attention import use_varlen_attention
    from shardtune.training.objectives.dpo.logps import predicted_completion

    cfg = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS[rows]))
    pairs, _ = load_pairs(cfg, copy.deepcopy(tokenizer), "train")
    padded = collate_pairs(pairs, tokenizer.pad_token_id, cfg.data.context_length)
    flat = collate_pairs_flat(pairs, cfg.data.context_length)
    assert flat["input_ids"].shape == (1, int(padded["attention_mask"].sum())) < padded["input_ids"].shape
    assert num_pairs(flat) == num_pairs(padded) == len(pairs)
    assert int(predicted_completion(flat).sum()) == int(predicted_completion(padded).sum())
    policy, reference = load_model(str(tiny)), load_model(str(tiny))
    shape = model_shape(policy)  # the model FLOPs (mfu) count the same tokens and attention
    assert (
        preference_micro_batch_flops(shape, flat, num_completion_targets(flat))[0]
        == preference_micro_batch_flops(shape, padded, num_completion_targets(padded))[0]
    )
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    for model in (policy, reference):
        use_varlen_attention(model)  # as shardtune.model.speed does for --padding_free; padded rows keep SDPA
    cpu = torch.device("cpu")
    for a, b in zip(pair_logps(policy, padded, cpu), pair_logps(policy, flat, cpu)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert_same_losses_and_gradients(policy, reference, padded, flat)


@pytest.mark.parametrize("rows", ["chat", "implicit_text"])
def test_pairs_sharing_their_prompt_give_the_padded_losses_and_gradients(rows, tiny, tokenizer, tmp_path):
    """The training loader's padded pairs carry the shared-prompt layout (shardtune.data.shared_prompt.rows_layout:
    one row [prompt | chosen | rejected] per pair), which the policy and the reference compute on: fewer tokens, the
    same log-probabilities, losses (every loss type), metrics and policy gradients as the padded rows. The control:
    the states read in another order give other log-probabilities, so the comparison can fail."""
    from shardtune.data.preference import collate_pair_units
    from shardtune.data.shared_prompt import SHARED_IDS, SHARED_INDEX
    from shardtune.model.shared_prompt import shared_inputs

    cfg = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS[rows]))
    pairs, _ = load_pairs(cfg, copy.deepcopy(tokenizer), "train")
    shared = collate_pair_units([[pair] for pair in pairs], cfg, tokenizer.pad_token_id)
    padded = {k: v for k, v in shared.items() if not k.startswith("shared_")}
    assert torch.equal(padded["input_ids"], collate_pairs(pairs, tokenizer.pad_token_id, 1024)["input_ids"])
    assert shared[SHARED_IDS].size(0) == len(pairs) and shared[SHARED_IDS].numel() < 0.75 * padded["input_ids"].numel()
    policy, reference = load_model(str(tiny)), load_model(str(tiny))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    cpu = torch.device("cpu")
    assert shared_inputs(policy, shared, cpu) is not None and shared_inputs(reference, shared, cpu) is not None
    for a, b in zip(pair_logps(policy, padded, cpu), pair_logps(policy, shared, cpu)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    shuffled = {**shared, SHARED_INDEX: shared[SHARED_INDEX].flip(0)}
    assert not torch.allclose(torch.cat(pair_logps(policy, shuffled, cpu)), torch.cat(pair_logps(policy, padded, cpu)))
    assert_same_losses_and_gradients(policy, reference, padded, shared)


def test_pairs_and_their_reference_log_probabilities_are_cached_with_the_tokenised_data(tiny, tokenizer, tmp_path):
    """The pairs come back from the tokenised-data cache as load_pairs makes them; the reference's log-probabilities
    are kept beside them under a key that names the weights and how they are computed (not the batch layout); a cut
    or emptied file is a miss (computed again), never read."""
    import os

    import numpy as np

    from shardtune.data.cache import (
        load_pairs_cached,
        pairs_entry,
        read_reference_log_probs,
        write_reference_log_probs,
    )
    from shardtune.training.objectives.dpo.reference import reference_key

    cfg = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS["chat"]), max_length=64)
    cfg.model.name = str(tiny)
    direct, report = load_pairs(cfg, copy.deepcopy(tokenizer), "train")
    cached, cached_report = load_pairs_cached(cfg, copy.deepcopy(tokenizer), "train", tmp_path / "cache")
    again, _ = load_pairs_cached(cfg, copy.deepcopy(tokenizer), "train", tmp_path / "cache")  # read from the entry
    n = len(direct)
    assert cached == direct == again and cached_report == report and n == len(ROWS["chat"])
    # every rank maps the entry's arrays (no token lists held); what the run sets on a pair stays with it
    assert all(isinstance(tokens, np.memmap) for tokens in again.tokens.values())
    assert [p.length for p in again] == [
        len(p["prompt_ids"]) + max(len(p["chosen_ids"]), len(p["rejected_ids"])) for p in direct
    ]
    again[1]["index"] = 7
    assert again[1]["index"] == 7 and again[1] == {**direct[1], "index": 7} and "index" not in again[0]
    with pytest.raises(TypeError, match="read-only"):
        again[0]["chosen_ids"] = [1]
    entry = pairs_entry(cfg, tokenizer, "train", tmp_path / "cache")
    assert (entry / "chosen_ids.npy").is_file()
    cfg.data.trl_dataset.truncation_mode = "keep_end"  # the pairs' options are in the key
    assert pairs_entry(cfg, tokenizer, "train", tmp_path / "cache") != entry
    cfg.data.trl_dataset.truncation_mode = "keep_start"

    cpu, fp32 = torch.device("cpu"), torch.float32
    key = reference_key(cfg, fp32, cpu)
    layout = copy.deepcopy(cfg)
    layout.batch_size_training, layout.gradient_accumulation_steps, layout.enable_fsdp = 1, 4, True
    assert reference_key(layout, fp32, cpu) == key, "the layout changes rounding only"
    assert reference_key(cfg, torch.bfloat16, cpu) != key
    for change in (
        {"padding_free": True},
        {"attn_implementation": "eager"},
        {"quantization": "4bit"},
        {"rope_scaling": "yarn", "rope_factor": 2.0},
    ):
        assert reference_key(with_settings(cfg, change), fp32, cpu) != key, change
    weights = tiny / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # the weights were rewritten
    try:
        assert reference_key(cfg, fp32, cpu) != key
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert reference_key(with_settings(cfg, model_name="someone/not-in-the-cache"), fp32, cpu) is None
    hub = tmp_path / "hub"  # a hub id in the Hugging Face cache: named by its snapshot's commit
    for commit in ("a" * 40, "b" * 40):
        (hub / "models--org--tiny" / "snapshots" / commit).mkdir(parents=True)
        (hub / "models--org--tiny" / "snapshots" / commit / "config.json").write_text("{}")
    (hub / "models--org--tiny" / "refs").mkdir()
    keys = []
    for commit in ("a" * 40, "b" * 40):  # main moved on: another key
        (hub / "models--org--tiny" / "refs" / "main").write_text(commit)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("HF_HUB_CACHE", str(hub))
            keys.append(reference_key(with_settings(cfg, model_name="org/tiny"), fp32, cpu))
    assert None not in keys and len(set(keys)) == 2

    values = np.array([[-1.5, -2.25]] * n)
    path = entry / f"reference-{key}.npy"
    assert read_reference_log_probs(path, n) is None
    write_reference_log_probs(path, values)
    assert np.array_equal(read_reference_log_probs(path, n), values)
    assert read_reference_log_probs(path, n - 1) is None, "another split's pairs"
    path.write_bytes(path.read_bytes()[:-8])  # cut short
    assert read_reference_log_probs(path, n) is None
    path.write_bytes(b"")
    assert read_reference_log_probs(path, n) is None
    assert not [p.name for p in entry.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding_free"])
def test_lora_dropout_masks_follow_the_pair_not_the_layout(padding_free, process_group, tiny, tokenizer, tmp_path):
    """LoRA with dropout (peft's default 0.05; 0.3 here): 4 x 1, 2 x 2 and 1 x 4 pairs x accumulation give the same
    adapter after a step, because each sequence's masks are keyed by its pair and the step, not drawn from the
    rank's generator (at step 1 lora_B's gradient depends on the masks even with B = 0)."""
    from shardtune.data.preference import collate_pair_units
    from shardtune.model.peft import apply_peft
    from shardtune.parallel import make_strategy
    from shardtune.runtime.distributed import DistEnv

    rows = ROWS["text"] + [
        {"prompt": "Summarize: Tom: hi!\nSummary:", "chosen": " Tom says hi.", "rejected": " Kate brings cake."}
    ]
    cfg0 = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", rows))
    pairs, _ = load_pairs(cfg0, copy.deepcopy(tokenizer), "train")
    for index, pair in enumerate(pairs):
        pair["index"] = index
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    adapters = []
    for batch_size, accumulation in ((4, 1), (2, 2), (1, 4)):
        cfg = dpo_cfg(tmp_path / "pairs.jsonl")
        cfg.train.batch_size, cfg.train.gradient_accumulation_steps, cfg.data.padding_free = (
            batch_size,
            accumulation,
            padding_free,
        )
        cfg.peft.method, cfg.peft.lora.dropout, cfg.objective = "lora", 0.3, "dpo"
        torch.manual_seed(0)  # the same adapter init in every layout
        strategy = make_strategy(cfg, env)
        model = strategy.wrap(apply_peft(load_model(str(tiny)), cfg))
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trained, lr=1.0)
        micro = [
            collate_pair_units([[pair] for pair in pairs[i : i + batch_size]], cfg, tokenizer.pad_token_id)
            for i in range(0, 4, batch_size)
        ]
        assert all("example_ids" in mb and "position_ids" in mb for mb in micro)
        stats = dpo_step(cfg, env, strategy, model, optimizer, micro, tokenizer)
        assert stats["loss"] == pytest.approx(math.log(2), abs=1e-6)
        adapters.append(
            {n: p.detach().clone() for n, p in strategy.unwrap(model).named_parameters() if p.requires_grad}
        )
    first = adapters[0]
    assert any(("lora_B" in n and v.abs().max() > 0) for n, v in first.items()), "the step moved lora_B"
    for other in adapters[1:]:
        for name, value in first.items():
            torch.testing.assert_close(other[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("cp,sp", [(1, 2), (2, 1), (2, 2)])
def test_the_slices_of_a_split_row_of_pairs_add_up_to_the_whole_rows_log_probabilities(
    cp, sp, tiny, tokenizer, tmp_path
):
    """--sp_size / --cp_size: each rank of a cp x sp group holds a slice of the row of pairs (shardtune.parallel.
    sequence.split_row: targets shifted before the split, the row padded to a multiple of 2 cp sp, context-parallel
    chunks load-balanced); its per-sequence partial sums over all ranks add up to the whole row's log-probabilities
    and token predictions (the token metrics' sums: a slice's tokens counted on its rank only), and every slice keeps
    the pairs' per-sequence values (completion lengths, precomputed reference)."""
    from shardtune.data.preference import collate_pair_units
    from shardtune.model.loss import sequence_log_prob_and_prediction_sums
    from shardtune.parallel.dims import ParallelDims
    from shardtune.parallel.sequence import RowSlice
    from shardtune.training.objectives.dpo.logps import completion_lengths, completion_targets

    cfg = dpo_cfg(write_jsonl(tmp_path / "pairs.jsonl", ROWS["chat"]))
    cfg.parallel.sequence_parallel_size, cfg.parallel.context_parallel_size = sp, cp
    pairs, _ = load_pairs(cfg, copy.deepcopy(tokenizer), "train")
    for i, pair in enumerate(pairs):
        pair["ref_logps"] = (-1.0 - i, -2.0 - i)
    whole = collate_pair_units([[p] for p in pairs], cfg, tokenizer.pad_token_id)  # split rows are padding-free
    assert "cu_seq_lens" in whole and "attention_mask" not in whole
    logits = torch.randn(1, whole["input_ids"].shape[1], 1024, generator=torch.Generator().manual_seed(0))

    class Logits(torch.nn.Module):  # the logits of the positions a row (or slice) holds, as a model would return them
        def __init__(self, held: torch.Tensor):
            super().__init__()
            self.held = held

        def forward(self, **_):
            return type("Out", (), {"logits": logits[:, self.held]})()

    cpu = torch.device("cpu")
    expected = torch.cat(pair_logps(Logits(torch.arange(logits.shape[1])), whole, cpu))
    _, expected_predictions = sequence_log_prob_and_prediction_sums(
        Logits(torch.arange(logits.shape[1])), whole, *completion_targets(whole), cpu
    )
    dims = ParallelDims.from_config(cfg, cp * sp)
    positions = dict(whole, input_ids=torch.arange(whole["input_ids"].shape[1])[None])  # which tokens a slice holds
    total, targets = torch.zeros_like(expected), 0
    predictions = torch.zeros_like(expected_predictions)
    for rank in range(cp * sp):
        row_slice = RowSlice.of_rank(dims, rank)
        part = row_slice(whole, tokenizer.pad_token_id)
        held = row_slice(positions, tokenizer.pad_token_id)["input_ids"][0].clamp(max=logits.shape[1] - 1)
        assert num_pairs(part) == len(pairs) and torch.equal(part["ref_logps"], whole["ref_logps"])
        assert torch.equal(completion_lengths(part), completion_lengths(whole))
        sums, part_predictions = sequence_log_prob_and_prediction_sums(
            Logits(held), part, *completion_targets(part), cpu
        )
        total += sums[: len(expected)]
        predictions += part_predictions[: len(expected)]
        targets += num_completion_targets(part)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(predictions, expected_predictions, rtol=1e-6, atol=1e-6)
    assert targets == num_completion_targets(whole)


TRL_LOSSES = [
    DpoConfig(loss_type=["exo_pair"], label_smoothing=1e-3),
    DpoConfig(beta=0.3, loss_type=["nca_pair"]),
    DpoConfig(beta=0.3, loss_type=["bco_pair"]),
    DpoConfig(beta=0.5, loss_type=["sppo_hard"]),
    DpoConfig(beta=0.3, loss_type=["apo_zero"]),
    DpoConfig(beta=0.3, loss_type=["apo_down"]),
    DpoConfig(beta=0.3, loss_type=["discopop"], discopop_tau=0.1),
    DpoConfig(beta=0.5, loss_type=["sigmoid_norm"]),
    DpoConfig(loss_type=["sft"]),
    DpoConfig(beta=0.3, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),  # RPO
    DpoConfig(beta=0.3, loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),
    DpoConfig(beta=0.3, f_divergence_type="forward_kl"),
    DpoConfig(beta=0.3, f_divergence_type="js_divergence"),
    DpoConfig(beta=0.3, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
    DpoConfig(beta=0.5, loss_type=["ipo"], f_divergence_type="js_divergence"),
]


@pytest.mark.parametrize("dpo", TRL_LOSSES, ids=lambda d: "+".join(d.loss_type) + "-" + d.f_divergence_type)
def test_every_trl_loss_and_divergence_equals_trl_on_the_same_reference(dpo, tiny, tokenizer, tmp_path):
    """TRL 1.16's other losses, weighted sums of several (--loss_weights; sft: the chosen completions' NLL per token,
    RPO's term) and the f-divergences: the same batch, the same policy and the SAME reference log-probabilities
    given to both (TRL's precomputed-reference path), so the losses agree to float rounding; and each configuration
    passes the flag checks that refuse what a loss would ignore."""
    check_loss_options(dpo)
    cfg, pairs, trainer, policy, reference = trl_and_our_policy(dpo, tiny, tokenizer, tmp_path)
    cpu = torch.device("cpu")
    batch = collate_pairs(pairs, tokenizer.pad_token_id, cfg.data.context_length)
    with torch.no_grad():
        ref_chosen, ref_rejected = pair_logps(reference, batch, cpu)
    trainer.precompute_ref_logps = True
    inputs = trainer.data_collator(list(trainer.train_dataset))
    inputs.update(ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected)
    trl_loss = float(trainer.compute_loss(trainer.model, inputs))
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    for pair, chosen, rejected in zip(pairs, ref_chosen.tolist(), ref_rejected.tolist()):
        pair["ref_logps"] = (chosen, rejected)
    batch = collate_pairs(pairs, tokenizer.pad_token_id, cfg.data.context_length)  # now carrying the reference's values
    loss_sum, sums = micro_batch_loss(policy, None, None, batch, dpo, cpu)
    ours = batch_means(sums, batch, dpo)
    resolution = logp_resolution(ours)
    assert float(loss_sum) / len(pairs) == pytest.approx(trl_loss, rel=1e-5, abs=resolution)
    assert ours["loss"] == pytest.approx(trl_loss, rel=1e-5, abs=resolution)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert ours[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=resolution), name
    assert abs(ours["rewards/margins"]) > 0.05, "the ratios must not be near zero, or the comparison is empty"
    loss_sum.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]), "1 weights for 2 loss types"),
        (dict(loss_type=["exo_pair"]), "exo_pair needs it above 0"),
        (dict(loss_type=["sigmoid"], label_smoothing=0.1), "has no effect with --loss_type sigmoid"),
        (dict(loss_type=["bco_pair"], f_divergence_type="js_divergence"), "no f-DPO form"),
        (dict(f_alpha_divergence_coef=0.3), "--f_alpha_divergence_coef 0.3 has no effect"),
        (dict(discopop_tau=0.1), "--discopop_tau 0.1 has no effect"),
        (dict(loss_type=[]), "--loss_type is empty"),
        (dict(loss_type=["aot"]), "sorts the log-ratios within a device's batch"),
    ],
)
def test_a_loss_flag_that_a_loss_would_ignore_is_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        check_loss_options(DpoConfig(**flags))


def test_trl_loss_flags_parse_as_trl_writes_them(tmp_path):
    """``--loss_type sigmoid sft`` (TRL's parser: the values one after another), the comma-separated form and a
    recipe's YAML list are the same setting; --loss_weights likewise."""
    from shardtune.config.flags import parse_args

    dpo = ["--objective", "dpo"]  # under sft, --loss_type is SFT's (nll)
    spaced = parse_args([*dpo, "--loss_type", "sigmoid", "sft", "--loss_weights", "1", "0.5", "--beta", "0.2"])
    commas = parse_args([*dpo, "--loss_type", "sigmoid,sft", "--loss_weights", "1,0.5", "--beta", "0.2"])
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text("loss_type: [sigmoid, sft]\nloss_weights: [1, 0.5]\nbeta: 0.2\n")
    from_file = parse_args([*dpo, "--config", str(recipe)])
    assert spaced.dpo == commas.dpo == from_file.dpo
    assert spaced.dpo.loss_type == ["sigmoid", "sft"] and spaced.dpo.loss_weights == [1.0, 0.5]
    assert parse_args([*dpo, "--loss_type", "ipo"]).dpo.loss_type == ["ipo"]
    with pytest.raises(ConfigError, match="unexpected argument"):  # only list settings take several values
        parse_args(["--beta", "0.2", "0.3"])


def test_a_range_is_checked_once_by_its_setting_with_what_zero_means():
    """--precompute_ref_batch_size's range is its setting's (at_least 0): one check, whose message says what 0 means
    for it (its help's own words), not "positive"; a setting whose help gives 0 no meaning gets none."""
    from shardtune.config.flags import parse_args
    from shardtune.training.engine.checks import validate

    dpo = ["--objective", "dpo", "--precompute_ref_log_probs"]
    with pytest.raises(ConfigError) as refused:
        validate(parse_args([*dpo, "--precompute_ref_batch_size", "-1"]), 1)
    assert str(refused.value) == "--precompute_ref_batch_size -1 must be >= 0 (0: train.batch_size)"
    with pytest.raises(ConfigError) as refused:
        validate(parse_args([*dpo, "--weight_decay", "-0.1"]), 1)
    assert str(refused.value) == "--weight_decay -0.1 must be >= 0"
    validate(parse_args([*dpo, "--precompute_ref_batch_size", "0"]), 1)
