"""KTO: shardtune's unpaired rows, KL rows, batches, losses, gradients and metrics equal what TRL 1.16's KTOTrainer
does, and the KL estimate is the optimizer step's whatever its split into micro-batches.

trl (the dev extra) is the oracle: the same JSONL file goes through ``shardtune.data.unpaired.load_rows`` and through
``trl.KTOTrainer``'s dataset preparation and collator; every kept row must give the same token ids, label, KL
completion, attention and completion masks. On the tiny preset model and one batch (one process, one micro-batch:
where TRL's per-device KL estimate is the step's), the loss, its gradients and the TRL-named metrics of
``shardtune.training.objectives.kto`` equal ``KTOTrainer.compute_loss``'s, per loss type. No launch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import typing
from pathlib import Path

import pytest
import torch
from datasets import load_dataset

from shardtune.config.checks import check_fields
from shardtune.config.flags import build_config, config_from
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.unpaired import collate_rows, load_rows
from shardtune.model.loading import init_model, load_model, load_tokenizer
from shardtune.training.engine.completions import predicted_completion
from shardtune.training.engine.step import train_step
from shardtune.training.objectives.kto.kl import KlRows, chunk_partners, collate_kto_units, rotated, step_partners
from shardtune.training.objectives.kto.loss import step_means
from shardtune.training.objectives.kto.objective import KTO, kl_log_ratios, micro_batch_loss

SYSTEM = {"role": "system", "content": "Summarize the dialog."}
DIALOGUES = [
    ("Anna: cinema at 7? Tom: sure!", "Anna and Tom go to the cinema.", "Ben can't have lunch."),
    ("Kate: lunch? Ben: can't today.", "Ben can't have lunch with Kate.", "Lucy brings cake."),
    ("Lucy: I'll bring cake. Mark: fruit!", "Lucy brings cake and Mark fruit.", "Tom goes to the cinema."),
]


def chat(user: str, answer: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": user}, {"role": "assistant", "content": answer}]


LABELLED = [(0, 1), (1, 2), (2, 1), (0, 2), (2, 2), (1, 1)]  # (dialogue, 1: its summary / 2: another's)
ROWS = {
    "text_pairs": [
        {"prompt": f"Summarize: {d}\nSummary:", "chosen": f" {c}", "rejected": f" {r}"} for d, c, r in DIALOGUES
    ],
    "chat_pairs": [
        {"prompt": chat(d, c)[:2], "chosen": chat(d, c)[2:], "rejected": chat(d, r)[2:]} for d, c, r in DIALOGUES
    ],
    "implicit_text_pairs": [
        {"chosen": f"Summarize: {d}\nSummary: {c}", "rejected": f"Summarize: {d}\nSummary: {r}"}
        for d, c, r in DIALOGUES
    ],
    # desirable and undesirable rows mixed: (dialogue, which summary, label)
    "unpaired_text": [
        {"prompt": f"Summarize: {DIALOGUES[d][0]}\nSummary:", "completion": f" {DIALOGUES[d][k]}", "label": k == 1}
        for d, k in LABELLED
    ],
    "unpaired_chat": [
        {"prompt": chat(DIALOGUES[d][0], "")[:2], "completion": chat("", DIALOGUES[d][k])[2:], "label": k == 1}
        for d, k in LABELLED
    ],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(str(tiny))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def kto_cfg(path: Path, max_length: int = 1024, **kto) -> TrainConfig:
    cfg = config_from(dataset="trl_dataset", context_length=max_length, run_validation=False)
    cfg.objective = "kto"
    cfg.data.trl_dataset.dataset_name = str(path)
    cfg.dpo.beta = kto.pop("beta", 0.1)
    cfg.kto = dataclasses.replace(cfg.kto, **kto)
    return cfg


def trl_trainer(cfg: TrainConfig, model_dir: Path, tokenizer, tmp_path: Path, batch_size: int):
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        per_device_train_batch_size=batch_size,
        max_length=cfg.data.context_length,
        beta=cfg.dpo.beta,
        loss_type=cfg.kto.loss_type,
        desirable_weight=cfg.kto.desirable_weight,
        undesirable_weight=cfg.kto.undesirable_weight,
    )
    dataset = load_dataset("json", data_files=cfg.data.trl_dataset.dataset_name, split="train")
    return KTOTrainer(
        model=load_model(str(model_dir)),
        ref_model=load_model(str(model_dir)),
        args=args,
        train_dataset=dataset,
        processing_class=copy.deepcopy(tokenizer),
    )


def with_kl(rows: list[dict], partners) -> dict:
    return [rows[int(partners[i])]["completion_ids"] for i in range(len(rows))]


CASES = {  # name: (rows, max_length)
    "text_pairs": ("text_pairs", 1024),
    "chat_pairs": ("chat_pairs", 1024),
    "implicit_text_pairs": ("implicit_text_pairs", 1024),
    "unpaired_text": ("unpaired_text", 1024),
    "unpaired_chat": ("unpaired_chat", 1024),
    "chat_cut": ("chat_pairs", 45),  # pair 1's rows cut by the collator; pairs 2-3's dropped (prompt fills it)
}


@pytest.mark.parametrize("case", list(CASES))
def test_rows_kl_rows_and_batches_equal_trl(case, tiny, tokenizer, tmp_path):
    """TRL's rows (pairs unpaired: a block's chosen rows then its rejected rows), KL completions (each batch rotated by
    one in the data's order: chunk_partners with TRL's batch) and collated batches, token for token."""
    name, max_length = CASES[case]
    cfg = kto_cfg(write_jsonl(tmp_path / "rows.jsonl", ROWS[name]), max_length)
    rows, report = load_rows(cfg, copy.deepcopy(tokenizer), "train")
    trainer = trl_trainer(cfg, tiny, tokenizer, tmp_path, batch_size=2)  # KL pairs within batches of 2
    theirs = list(trainer.train_dataset)
    assert len(rows) == len(theirs) > 1, report.summary()
    partners = chunk_partners(len(rows), 2)
    for i, (mine, trl_row) in enumerate(zip(rows, theirs)):
        for key in ("prompt_ids", "completion_ids", "label"):
            assert mine[key] == trl_row[key], f"row {i}: different {key}"
        assert rows[int(partners[i])]["completion_ids"] == trl_row["KL_completion_ids"], f"row {i}: KL completion"
    batch = collate_rows(rows, tokenizer.pad_token_id, max_length, with_kl(rows, partners))
    trl_batch = trainer.data_collator(theirs)
    for key in ("input_ids", "attention_mask", "completion_mask", "KL_input_ids", "KL_attention_mask", "label"):
        assert torch.equal(batch[key], trl_batch[key]), f"different {key}"
    assert torch.equal(batch["KL_completion_mask"], trl_batch["KL_completion_mask"])
    if max_length < 100:
        assert report.num_truncated > 0 and report.skipped == {"prompt_fills_max_length": 4}


def perturbed(tiny: Path) -> torch.nn.Module:
    policy = load_model(str(tiny))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return policy


def batch_metrics(stats: torch.Tensor, batch: dict, kl: float) -> dict[str, float]:
    labels = batch["label"]
    targets = predicted_completion(batch).sum(dim=1)
    tokens = (float(targets.sum()), float(targets[labels].sum()), float(targets[~labels].sum()))
    n, chosen = len(labels), int(labels.sum())
    return step_means(stats.tolist(), n, chosen, n - chosen, tokens, kl)


LOSSES = {
    "kto": {},
    "kto_weighted": {"beta": 0.3, "desirable_weight": 1.33, "undesirable_weight": 0.7},
    "apo_zero_unpaired": {"beta": 0.2, "loss_type": "apo_zero_unpaired"},
}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_loss_gradients_and_metrics_equal_trl(loss, tiny, tokenizer, tmp_path):
    """One batch of 6 rows (one process, one micro-batch), the policy perturbed away from the reference so that the
    log-ratios and the KL are not zero; TRL's KL rows are each row's predecessor's completion (the batch's rotation).

    Tolerances. The policy's row log-probabilities come through its gradient path in both (TRL's fused head, ours the
    lean head): 1e-5 relative. TRL's KL rows (policy and reference) and its reference rows are scored by its
    no-gradient path, whose fused head is up to ~5e-3 nats per sequence away from a float64 forward (tests/unit/
    test_dpo.py; ours: within 1e-4): the KL to 1e-2, the rewards to beta x 1e-2, and the loss, whose derivative in
    a row's reward or the KL is at most beta / 4 (the sigmoid's slope), to beta x 1e-2. A gradient is a sum of the rows'
    log-probability gradients with weights beta w sigma'(z) / n, which a shift dz of their argument changes by at most
    |dz| relative (|sigma''/sigma'| <= 1): beta x 2e-2 relative to each tensor's largest element."""
    cfg = kto_cfg(write_jsonl(tmp_path / "rows.jsonl", ROWS["chat_pairs"]), 1024, **LOSSES[loss])
    beta = cfg.dpo.beta
    rows, _ = load_rows(cfg, copy.deepcopy(tokenizer), "train")
    trainer = trl_trainer(cfg, tiny, tokenizer, tmp_path, batch_size=len(rows))
    policy, reference = perturbed(tiny), load_model(str(tiny))
    trainer.model.load_state_dict(policy.state_dict())
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, trainer.data_collator(list(trainer.train_dataset)))
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    cpu, n = torch.device("cpu"), len(rows)
    uses_kl = cfg.kto.loss_type == "kto"
    batch = collate_rows(rows, tokenizer.pad_token_id, 1024, with_kl(rows, chunk_partners(n, n)))
    ref = {"ref_model": reference}
    kl = max(0.0, float(kl_log_ratios(policy, ref, batch, cpu).mean())) if uses_kl else 0.0
    loss_sum, stats = micro_batch_loss(policy, ref, batch, torch.tensor(kl), cfg, cpu)
    (loss_sum / n).backward()
    ours = batch_metrics(stats, batch, kl)
    assert ours["loss"] == pytest.approx(float(trl_loss), abs=beta * 1e-2)
    assert ours["kl"] == pytest.approx(trl_metrics["kl"], abs=1e-2)
    for name in ("logps/chosen", "logps/rejected"):
        assert ours[name] == pytest.approx(trl_metrics[name], rel=1e-5), name
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert ours[name] == pytest.approx(trl_metrics[name], abs=beta * 1e-2), name
    eps = float(torch.finfo(torch.float32).eps)  # the token metrics: as tests/unit/test_dpo.py derives them
    for name in ("entropy", "logits/chosen", "logits/rejected"):
        assert ours[name] == pytest.approx(trl_metrics[name], rel=64 * eps, abs=64 * eps), name
    theirs = dict(trainer.model.named_parameters())
    for name, p in policy.named_parameters():
        largest = float(theirs[name].grad.abs().max())
        assert float((p.grad - theirs[name].grad).abs().max()) <= beta * 2e-2 * largest, name
    # the controls: rewards and KL far from zero; the KL taken per row instead of over the batch misses TRL's loss
    assert abs(ours["rewards/margins"]) > 0.05 * beta and (kl > 0.1 or not uses_kl)
    if uses_kl:
        per_row = kl_log_ratios(policy, ref, batch, cpu).clamp(min=0).float()
        wrong, _ = micro_batch_loss(policy, ref, batch, per_row, cfg, cpu)
        assert float(wrong) / n != pytest.approx(float(trl_loss), abs=beta * 1e-2)


def test_first_loss_is_half_when_the_policy_is_the_reference(tiny, tokenizer, tmp_path):
    """At the start every log-ratio is 0 and the KL too: each row's loss is 1 - sigmoid(0) = 0.5 (kto), times its
    weight; the graph reaches the weights."""
    cfg = kto_cfg(write_jsonl(tmp_path / "rows.jsonl", ROWS["unpaired_text"]), desirable_weight=2.0)
    rows, _ = load_rows(cfg, copy.deepcopy(tokenizer), "train")
    batch = collate_rows(rows, tokenizer.pad_token_id, 1024, with_kl(rows, chunk_partners(len(rows), len(rows))))
    model, cpu = load_model(str(tiny)), torch.device("cpu")
    ref = {"ref_model": load_model(str(tiny))}
    assert float(kl_log_ratios(model, ref, batch, cpu).abs().max()) < 1e-4
    loss_sum, _ = micro_batch_loss(model, ref, batch, 0.0, cfg, cpu)
    chosen = int(batch["label"].sum())
    assert float(loss_sum) == pytest.approx(0.5 * (2.0 * chosen + (len(rows) - chosen)), abs=1e-4)
    loss_sum.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_kl_pairs_are_the_steps_rows_rotated_whatever_the_layout():
    """A step's KL pairs: its rows in the data's order, each with its predecessor's completion (the first with the
    last's), as TRL pairs a batch; a function of the step's rows alone, so no split of them over processes or
    micro-batches changes them; an epoch's order (shuffled) gives each step's rows their pairs."""
    assert rotated([4, 2, 9]) == {2: 9, 4: 2, 9: 4}
    assert chunk_partners(6, 3).tolist() == [2, 0, 1, 5, 3, 4]  # TRL's rotation of batches of 3
    assert chunk_partners(5, 2).tolist() == [1, 0, 3, 2, 4]  # a last row alone is its own
    order = [7, 1, 4, 0, 6, 2, 5, 3]  # two steps of 4 rows, in the epoch's order
    partners = step_partners(order, 4, 9)
    assert partners[8] == -1  # no step of the epoch trains row 8
    for step in (order[:4], order[4:]):
        assert {row: int(partners[row]) for row in step} == rotated(step)
        assert set(int(partners[row]) for row in step) == set(step)  # the step's completions, each once


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A real one-process gloo group (what DDP needs to wrap a model)."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def kto_step(cfg, env, tiny: Path, rows: list[dict], batch_size: int, tokenizer, policy_state: dict):
    """One optimizer step of the KTO objective over ``rows`` in micro-batches of ``batch_size``, its reference built by
    the objective as a run builds it (a frozen copy of the starting weights): (the step's metrics, the weights)."""
    from shardtune.parallel import make_strategy

    cfg = copy.deepcopy(cfg)
    cfg.train.batch_size, cfg.train.gradient_accumulation_steps = batch_size, len(rows) // batch_size
    cfg.model.name = str(tiny)
    strategy = make_strategy(cfg, env)
    policy = load_model(str(tiny))
    policy.load_state_dict(policy_state)
    model = strategy.wrap(policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    objective = KTO(cfg, env, strategy, tokenizer)
    objective.attach(model, [[row] for row in rows], [])
    kl = KlRows(rows, step_partners(list(range(len(rows))), len(rows), len(rows)))
    units = [[row] for row in rows]
    micro = [
        collate_kto_units(units[i : i + batch_size], cfg, tokenizer.pad_token_id, kl)
        for i in range(0, len(rows), batch_size)
    ]
    result = train_step(model, strategy, optimizer, objective, micro, step=1)
    return result.metrics, strategy.unwrap(model).state_dict()


@pytest.mark.parametrize("loss", ["kto", "apo_zero_unpaired"])
def test_a_step_is_the_same_whatever_its_split_into_micro_batches(loss, process_group, tiny, tokenizer, tmp_path):
    """1 x 4 x 1, 1 x 2 x 2 and 1 x 1 x 4 (processes x rows x accumulation): the same KL (the step's, scored before
    the first backward and all-reduced with the counts), loss, metrics and weights after one step (the launch test
    does 2 ranks). The control: TRL's way at 1 x 2 x 2 (each micro-batch its own rows' KL, its own pairs) gives
    another loss."""
    from shardtune.runtime.distributed import DistEnv

    cfg = kto_cfg(write_jsonl(tmp_path / "rows.jsonl", ROWS["unpaired_text"]), loss_type=loss, beta=0.5)
    rows, _ = load_rows(cfg, copy.deepcopy(tokenizer), "train")
    rows = rows[:4]
    for index, row in enumerate(rows):
        row["index"] = index
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    start = perturbed(tiny).state_dict()
    results = [kto_step(cfg, env, tiny, rows, size, tokenizer, start) for size in (4, 2, 1)]
    (first, weights), others = results[0], results[1:]
    if loss == "kto":
        assert first["kl"] > 0.1
    # Another split pads its rows to other widths: the forward's kernels block otherwise, and a row's log-probability
    # (a float32 below 2^k in magnitude) lands up to one float32 spacing 2^(k - 23) apart. A log-ratio holds two such
    # sums, and so does the KL (a mean of them): both to 2 spacings (rewards: beta x that); a row's loss moves by at
    # most beta / 4 per unit of its log-ratio and of the KL: the loss to beta spacings. The token metrics are sums over
    # tokens of per-token values, each a few ulps of its own size: 64 ulps relative.
    spacing = 2.0 ** (math.floor(math.log2(max(abs(first["logps/chosen"]), abs(first["logps/rejected"])))) - 23)
    beta = cfg.dpo.beta
    near = {"loss": beta * spacing, "kl": 2 * spacing, "logps/chosen": spacing, "logps/rejected": spacing}
    eps = float(torch.finfo(torch.float32).eps)
    for stats, other in others:
        for name in first:
            bound = near.get(name, beta * 4 * spacing if name.startswith("rewards/") else 0.0)  # margins: 4 sums
            assert stats[name] == pytest.approx(first[name], rel=64 * eps, abs=bound), name
        for key, value in weights.items():
            torch.testing.assert_close(other[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert set(first) >= {"loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"}
    if loss != "kto":
        assert first["kl"] == 0.0
        return
    cpu, ref = torch.device("cpu"), {"ref_model": load_model(str(tiny))}
    policy = load_model(str(tiny))
    policy.load_state_dict(start)
    trl_way = 0.0
    for part in (rows[:2], rows[2:]):  # each micro-batch rotated within itself, its own KL
        batch = collate_rows(part, tokenizer.pad_token_id, 1024, with_kl(part, chunk_partners(2, 2)))
        kl = max(0.0, float(kl_log_ratios(policy, ref, batch, cpu).mean()))
        trl_way += float(micro_batch_loss(policy, ref, batch, kl, cfg, cpu)[0]) / len(rows)
    assert trl_way != pytest.approx(first["loss"], abs=1e-4), "a per-micro-batch KL would pass too"


def test_precomputed_reference_log_probabilities_give_the_live_references_loss(
    process_group, tiny, tokenizer, tmp_path
):
    """--precompute_ref_log_probs: one pass scores each row and its KL row (the pairs of the steps of sequential
    sampling); a batch of such rows needs no reference model and gives the live reference's KL and loss."""
    from shardtune.parallel import make_strategy
    from shardtune.runtime.distributed import DistEnv

    cfg = kto_cfg(write_jsonl(tmp_path / "rows.jsonl", ROWS["chat_pairs"]))
    cfg.train.batch_size, cfg.data.sampling, cfg.model.name = 3, "sequential", str(tiny)
    rows, _ = load_rows(cfg, copy.deepcopy(tokenizer), "train")
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    strategy = make_strategy(cfg, env)
    policy, reference = perturbed(tiny), load_model(str(tiny))
    objective = KTO(cfg, env, strategy, tokenizer)
    objective.model = policy
    values = objective.score_reference(rows, {"ref_model": reference})
    assert values.shape == (6, 2) and bool((values[:, 1] != 0).all())
    partners = chunk_partners(len(rows), 3)
    live = collate_rows(rows[:3], tokenizer.pad_token_id, 1024, with_kl(rows, partners)[:3])
    for row, logps in zip(rows, values.tolist()):
        row["ref_logps"] = tuple(logps)
    stored = collate_rows(rows[:3], tokenizer.pad_token_id, 1024, with_kl(rows, partners)[:3])
    assert stored["ref_logps"].shape == (3,) and stored["ref_KL_logps"].shape == (3,)
    cpu = torch.device("cpu")
    kl_live = kl_log_ratios(policy, {"ref_model": reference}, live, cpu)
    kl_stored = kl_log_ratios(policy, {}, stored, cpu)
    torch.testing.assert_close(kl_stored, kl_live, rtol=1e-5, atol=1e-5)
    live_loss, live_stats = micro_batch_loss(policy, {"ref_model": reference}, live, 0.2, cfg, cpu)
    stored_loss, stored_stats = micro_batch_loss(policy, {}, stored, 0.2, cfg, cpu)
    assert float(stored_loss) == pytest.approx(float(live_loss), rel=1e-5)
    torch.testing.assert_close(stored_stats, live_stats, rtol=1e-5, atol=1e-5)
    assert abs(float(kl_live.mean())) > 0.01, "the policy must differ from the reference"


def test_unpaired_rows_come_back_from_the_tokenised_data_cache(tokenizer, tmp_path):
    from shardtune.data.row_cache import load_rows_cached, rows_entry

    cfg = kto_cfg(write_jsonl(tmp_path / "rows.jsonl", ROWS["unpaired_chat"]))
    direct, report = load_rows(cfg, copy.deepcopy(tokenizer), "train")
    cached, cached_report = load_rows_cached(cfg, copy.deepcopy(tokenizer), "train", tmp_path / "cache")
    again, _ = load_rows_cached(cfg, copy.deepcopy(tokenizer), "train", tmp_path / "cache")
    assert cached == direct == again and cached_report == report and len(direct) == 6
    assert [r["label"] for r in again] == [True, False, True, False, False, True]
    again[2]["index"] = 5
    assert again[2] == {**direct[2], "index": 5} and "index" not in again[1]
    with pytest.raises(TypeError, match="read-only"):
        again[0]["label"] = False
    assert (rows_entry(cfg, tokenizer, "train", tmp_path / "cache") / "label.npy").is_file()


def test_trl_names_set_kto_and_the_dpo_settings_it_reads():
    cfg = build_config(
        [("defaults", "trl"), ("loss_type", "apo_zero_unpaired"), ("beta", "0.3"), ("desirable_weight", "1.5")],
        None,
        (),
        [],
        "kto",
    )
    assert (cfg.kto.loss_type, cfg.kto.desirable_weight, cfg.dpo.beta) == ("apo_zero_unpaired", 1.5, 0.3)
    assert (cfg.optim.lr, cfg.data.sampling, cfg.peft.lora.dropout) == (1e-6, "sequential", 0.0)  # KTOConfig's
    random = build_config([("defaults", "trl"), ("train_sampling_strategy", "random")], None, (), [], "kto")
    assert random.data.sampling == "random"
    with pytest.raises(ConfigError, match="choose kto or apo_zero_unpaired"):
        check_fields(build_config([("loss_type", "sigmoid")], None, (), [], "kto"), 1)
    with pytest.raises(ConfigError, match="group_by_length is not built"):
        build_config([("train_sampling_strategy", "group_by_length")], None, (), [], "kto")


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"dpo.label_smoothing": 0.1}, "--dpo.label_smoothing is a DPO loss setting"),
        ({"padding_free": True}, "--padding_free"),
        ({"batch_size_training": 1}, "the effective batch is 1 row"),
        ({"precompute_ref_log_probs": True, "train_sampling_strategy": "random"}, "sequential"),
    ],
)
def test_what_kto_cannot_honour_is_refused_in_one_line(settings, match):
    from shardtune.training.engine.objective import check_objective

    pairs = [("defaults", "trl"), ("per_device_train_batch_size", 2), *settings.items()]
    cfg = build_config(pairs, None, (), [], "kto")
    with pytest.raises(ConfigError, match=match) as error:
        check_objective(cfg, 1)
    assert "\n" not in str(error.value)
    apo = build_config([*pairs, ("loss_type", "apo_zero_unpaired")], None, (), [], "kto")
    if "batch_size_training" in settings or "train_sampling_strategy" in settings:
        check_objective(apo, 1)  # apo_zero_unpaired has no KL term: a batch of 1, a shuffle


def test_kto_config_has_trls_fields_types_and_defaults():
    import trl

    from shardtune.api.kto import KTOConfig

    theirs, ours = trl.KTOConfig, KTOConfig
    their_types, our_types = typing.get_type_hints(theirs), typing.get_type_hints(ours)
    assert sorted(f.name for f in dataclasses.fields(theirs)) == sorted(f.name for f in dataclasses.fields(ours))
    for f in dataclasses.fields(theirs):
        assert their_types[f.name] == our_types[f.name], f.name
        mine = next(g for g in dataclasses.fields(ours) if g.name == f.name)
        assert repr(f.default) == repr(mine.default), f.name
    args = KTOConfig(output_dir="k", loss_type="apo_zero_unpaired", desirable_weight=1.2)
    cfg = args.canonical()
    assert (cfg.objective, cfg.kto.loss_type, cfg.kto.desirable_weight, cfg.data.sampling) == (
        "kto",
        "apo_zero_unpaired",
        1.2,
        "sequential",
    )
    with pytest.raises(ConfigError, match="--sync_ref_model"):
        KTOConfig(output_dir="k", sync_ref_model=True)
    assert math.isclose(args.learning_rate, 1e-6)


def test_plan_counts_the_reference_and_the_kl_rows(cli_in_process):
    """``shardtune plan --objective kto``: the frozen reference beside the policy (full fine-tuning; none with an
    adapter or precomputed log-probabilities), and the KL rows, scored without a graph before the step's backward
    (one layer's activations at a time: far below the step's saved activations); none with apo_zero_unpaired."""
    base = ("plan", "--model_name", "llama3-8b", "--enable_fsdp", "--gpus_per_node", 8, "--gpu", "H100", "--json")
    base = (*base, "--batch_size_training", 8, "--context_length", 2048)

    def given(*flags) -> dict:
        proc = cli_in_process(*base, *flags)
        assert proc.stdout, proc.stderr
        return json.loads(proc.stdout)["given"]["breakdown"]

    sft, kto = given(), given("--objective", "kto")
    assert kto["parameters"] == pytest.approx(2 * sft["parameters"])  # the reference, sharded like the policy
    assert kto["activations"] == pytest.approx(sft["activations"])  # one row per unit (a pair's DPO has two)
    assert 0 < kto["KL rows (no graph)"] < kto["activations"] / 4
    precomputed = given("--objective", "kto", "--precompute_ref_log_probs", "--train_sampling_strategy", "sequential")
    assert precomputed["parameters"] == pytest.approx(sft["parameters"])
    apo = given("--objective", "kto", "--loss_type", "apo_zero_unpaired")
    assert "KL rows (no graph)" not in apo and apo["parameters"] == kto["parameters"]


def test_kl_rows_lora_dropout_masks_are_keyed_by_the_step_and_the_row(tiny, tokenizer, tmp_path):
    """With LoRA dropout on, a KL row's masks are drawn from (seed, step, the row's KL key, the layer), as the rows'
    are: the step's KL sum is the same whether its rows come in one micro-batch or two (the row's place in a padded
    micro-batch changes nothing), and another step draws other masks (the control: the keys reach the dropout)."""
    from peft import LoraConfig, get_peft_model

    from shardtune.model.lora_dropout import use_example_keyed_dropout
    from shardtune.training.objectives.kto.kl import KL_STEP

    cfg = kto_cfg(write_jsonl(tmp_path / "rows.jsonl", ROWS["unpaired_text"]))
    rows, _ = load_rows(cfg, copy.deepcopy(tokenizer), "train")
    rows = rows[:4]
    for index, row in enumerate(rows):
        row["index"] = index
    lora = LoraConfig(r=4, lora_dropout=0.5, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(load_model(str(tiny)), lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.3)
    assert use_example_keyed_dropout(model) > 0
    model.train()

    from shardtune.parallel import make_strategy
    from shardtune.runtime.distributed import DistEnv

    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    objective = KTO(cfg, env, make_strategy(cfg, env), tokenizer)
    objective.model, objective.reference = model, {"peft_model": model}  # what attach sets with an adapter

    def kl_sum(size: int, step: int) -> float:
        kl = KlRows(rows, step_partners([0, 1, 2, 3], 4, 4), {i: step for i in range(4)})
        units = [[row] for row in rows]
        micro = [collate_kto_units(units[i : i + size], cfg, tokenizer.pad_token_id, kl) for i in range(0, 4, size)]
        assert all(int(mb[KL_STEP]) == step for mb in micro)
        return float(objective.kl_sum(micro))

    whole, split = kl_sum(4, 1), kl_sum(2, 1)
    assert split == pytest.approx(whole, abs=1e-4)
    assert kl_sum(4, 2) != pytest.approx(whole, abs=1e-2), "the step's masks are not keyed"


def test_sequential_sampling_keeps_the_datas_order_and_is_refused_where_prompts_are_sampled():
    """--train_sampling_strategy sequential (TRL's KTO default): each epoch's global batches are the units in the
    data's order (each batch sorted by length within, as any padded batch); random: a seeded permutation per epoch.
    GRPO orders its prompts itself: sequential is refused there in one line."""
    from shardtune.config.checks import check_combinations
    from shardtune.data.batching import epoch_order

    units = [[{"input_ids": [1] * (10 - i % 4), "labels": [1] * (10 - i % 4)}] for i in range(8)]
    cfg = config_from(batching_strategy="padding", batch_size_training=4)
    cfg.data.sampling = "sequential"
    orders = [epoch_order(units, cfg, 1, epoch) for epoch in (0, 1)]
    assert orders[0] == orders[1] and [sorted(orders[0][:4]), sorted(orders[0][4:])] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    cfg.data.sampling = "random"
    shuffled = [epoch_order(units, cfg, 1, epoch) for epoch in (0, 1)]
    assert shuffled[0] != shuffled[1] and sorted(shuffled[0]) == list(range(8))
    grpo = build_config([("train_sampling_strategy", "sequential")], None, (), [], "grpo")
    with pytest.raises(ConfigError, match="orders its prompts by its own seeded sampler"):
        check_combinations(grpo, 1)
