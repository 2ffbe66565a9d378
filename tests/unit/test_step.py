"""The engine's units in-process, on one real gloo rank (no torchrun): one optimizer step of each objective, the
step / skip / stop decision of --nan_policy under DDP, FSDP and DeepSpeed ZeRO-2 alike for SFT and DPO, the gradient
norm of every step with clipping or not, TRL's SFT metrics against TRL's own computation, the evaluator, and the
checkpointer's save and restore."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardtune.config.flags import config_from
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.batching import collate_padding
from shardtune.data.preference import collate_pair_units, load_pairs
from shardtune.model.loading import init_model, load_model, load_tokenizer
from shardtune.parallel import make_strategy
from shardtune.runtime.distributed import DistEnv
from shardtune.runtime.errors import TrainingStopped
from shardtune.training.engine.checks import validate
from shardtune.training.engine.objective import objective_class
from shardtune.training.engine.step import NonFiniteLossError, train_step

CPU = torch.device("cpu")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU, backend="gloo")
STRATEGIES = {"ddp": {}, "fsdp": {"enable_fsdp": True}, "zero2": {"enable_deepspeed": True}}


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "pairs.jsonl"
    rows = [
        {
            "prompt": f"Summarize: {a} meets {b}.\nSummary:",
            "chosen": f" {a} and {b} meet.",
            "rejected": f" {b} stays home.",
        }
        for a, b in (("Anna", "Tom"), ("Kate", "Ben"), ("Lucy", "Mark"), ("Tom", "Kate"))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(objective: str, strategy: str, tiny: Path, pairs_file: Path, **settings) -> TrainConfig:
    data = {"dataset_name": str(pairs_file)} if objective == "dpo" else {}
    return config_from(
        {
            "objective": objective,
            "model_name": str(tiny),
            "run_validation": False,
            **STRATEGIES[strategy],
            **data,
            **settings,
        }
    )


def micro_batches(cfg: TrainConfig, tokenizer) -> list[dict]:
    """Two micro-batches of two units: pairs for DPO, labelled rows for SFT."""
    if cfg.objective == "dpo":
        pairs, _ = load_pairs(cfg, copy.deepcopy(tokenizer), "train")
        return [collate_pair_units([[p] for p in pairs[i : i + 2]], cfg, tokenizer.pad_token_id) for i in (0, 2)]
    rows = [{"input_ids": list(range(5 + i, 20 + 2 * i)), "labels": list(range(5 + i, 20 + 2 * i))} for i in range(4)]
    return [collate_padding(rows[i : i + 2], tokenizer.pad_token_id) for i in (0, 2)]


class InfiniteGradient(torch.autograd.Function):
    """Identity forward; backward: an infinite gradient (a finite loss whose gradient norm overflows)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def one_step(cfg: TrainConfig, tiny: Path, fault: str | None):
    """One optimizer step of ``cfg`` on a model with a fault: ``nan`` (a NaN weight: the loss is NaN) or ``inf`` (the
    final norm's output passes an infinite gradient back: a finite loss, a non-finite gradient norm), or None. Returns
    (the step's result or the NonFiniteLossError, the trainable weights before, after)."""
    tokenizer = load_tokenizer(str(tiny))
    strategy = make_strategy(cfg, ENV)
    objective = objective_class(cfg.objective)(cfg, ENV, strategy, tokenizer)
    model = load_model(str(tiny))
    if fault == "nan":
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    elif fault == "inf":
        model.model.norm.register_forward_hook(lambda module, args, out: InfiniteGradient.apply(out))
    model = strategy.wrap(model)
    objective.attach(model, [], [])
    optimizer = strategy.build_optimizer(model)

    def weights() -> dict[str, torch.Tensor]:
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in strategy.unwrap(model).named_parameters()
            if p.requires_grad
        }

    before = weights()
    try:
        result = train_step(model, strategy, optimizer, objective, micro_batches(cfg, tokenizer), step=1)
    except NonFiniteLossError as e:
        result = e
    return result, before, weights()


def same_weights(before: dict, after: dict) -> bool:
    return all(torch.equal(torch.nan_to_num(after[n]), torch.nan_to_num(v)) for n, v in before.items())


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_nan_policy_is_the_engines_alike_for_every_objective_and_strategy(
    objective, strategy, process_group, tiny, pairs_file, monkeypatch
):
    """A NaN loss stops the run before the update (stop, the default) or skips the update (skip); with clipping, a
    finite loss whose gradient norm is infinite does the same; under every strategy and for SFT and DPO alike (DPO
    stepped on an infinite gradient norm, skipped a NaN silently under stop, and failed with an AssertionError under
    DeepSpeed before the one engine). DeepSpeed steps cannot be skipped: skip is refused before launch."""
    if strategy == "zero2":
        pytest.importorskip("deepspeed")
        for name, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):  # what torchrun sets
            monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError, match="--nan_policy skip is not supported with --enable_deepspeed"):
            validate(config(objective, strategy, tiny, pairs_file, nan_policy="skip"), 1)
        # DeepSpeed measures the gradient norm inside its step, which clips and updates in one call: the run stops
        # after that update, saying so (for every objective alike)
        cfg = config(objective, strategy, tiny, pairs_file, gradient_clipping=True)
        with pytest.raises(TrainingStopped, match="found by DeepSpeed's step, which clips and updates in one call"):
            one_step(cfg, tiny, "inf")
    policies = ("stop",) if strategy == "zero2" else ("stop", "skip")
    for policy in policies:
        for fault in ("nan",) if strategy == "zero2" else ("nan", "inf"):
            cfg = config(objective, strategy, tiny, pairs_file, nan_policy=policy, gradient_clipping=True)
            result, before, after = one_step(cfg, tiny, fault)
            what = (objective, strategy, policy, fault)
            if policy == "stop":
                assert isinstance(result, NonFiniteLossError), what
                loss, _, norm = str(result).removeprefix("loss ").partition(", gradient norm ")
                assert math.isfinite(float(loss)) == (fault == "inf"), (what, str(result))
                assert fault == "nan" or not math.isfinite(float(norm)), (what, str(result))
            else:
                assert not isinstance(result, NonFiniteLossError) and not result.stepped, what
                assert math.isfinite(result.loss) == (fault == "inf"), what
            assert same_weights(before, after), f"{what}: the weights moved"


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_a_finite_step_updates_and_reports_the_objectives_metrics(objective, process_group, tiny, pairs_file):
    """The healthy step of each objective: the weights move, the loss is the objective's (SFT: the token-normalised
    cross-entropy near ln(vocabulary) at init; DPO: ln 2 when the policy is its reference), its counts and metrics
    are global figures, the gradient norm is reported with clipping."""
    cfg = config(objective, "ddp", tiny, pairs_file, gradient_clipping=True)
    tokenizer = load_tokenizer(str(tiny))
    strategy = make_strategy(cfg, ENV)
    objective_ = objective_class(objective)(cfg, ENV, strategy, tokenizer)
    model = strategy.wrap(load_model(str(tiny)))
    objective_.attach(model, [], [])
    optimizer = strategy.build_optimizer(model)
    batches = micro_batches(cfg, tokenizer)
    before = {n: p.detach().clone() for n, p in strategy.unwrap(model).named_parameters()}
    result = train_step(model, strategy, optimizer, objective_, batches, step=1)
    assert result.stepped and result.grad_norm is not None and result.grad_norm > 0
    assert not same_weights(before, {n: p.detach() for n, p in strategy.unwrap(model).named_parameters()})
    if objective == "dpo":
        assert result.loss == pytest.approx(math.log(2), abs=1e-6) and result.metrics["num_pairs"] == 4
        assert set(result.metrics) >= {"rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected"}
    else:
        assert result.loss == pytest.approx(math.log(load_model(str(tiny)).config.vocab_size), rel=0.05)
        assert result.counts["label_tokens"] == sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        assert result.counts["input_tokens"] == 15 + 16 + 17 + 18  # the rows' tokens, not their padding
        assert set(result.metrics) == {"loss", "mean_token_accuracy", "entropy"}


def test_the_gradient_norm_is_measured_every_step_with_clipping_or_not_alike_under_every_strategy(
    process_group, tiny, pairs_file, monkeypatch
):
    """TRL (Trainer) logs grad_norm at every step: the global norm before clipping is measured also without
    clipping, the same under DDP, FSDP2 and DeepSpeed ZeRO-2 (its engine's own norm); it was None without clipping."""
    pytest.importorskip("deepspeed")
    for name, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):  # what torchrun sets
        monkeypatch.setenv(name, value)
    norms = {}
    for strategy in STRATEGIES:
        for clipping in (False, True):
            cfg = config("sft", strategy, tiny, pairs_file, gradient_clipping=clipping)
            assert (cfg.optim.max_grad_norm is None) != clipping
            result, before, after = one_step(cfg, tiny, None)
            assert result.stepped and not same_weights(before, after), (strategy, clipping)
            norms[strategy, clipping] = result.grad_norm
    print("gradient norms:", norms)
    reference = norms["ddp", True]
    assert reference > 1.0  # so that clipping at 1.0 changed the update, and the norm is the one before it
    assert all(norm == pytest.approx(reference, rel=1e-5) for norm in norms.values()), norms


def labels_half_predicted(model, tokenizer) -> list[dict]:
    """Four rows of uneven lengths whose every other label is the model's own argmax prediction (so that the token
    accuracy is far from 0 and from 1), the others the next input token."""
    rows = []
    for i in range(4):
        ids = torch.arange(5 + 3 * i, 30 + 5 * i) % 1000 + 3
        with torch.no_grad():
            predicted = model(input_ids=ids[None]).logits[0].argmax(-1)
        labels = ids.clone()
        labels[1::2] = predicted[:-1][0::2]  # label t is the target of position t - 1
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def trl_token_metrics(model, batch: dict) -> tuple[float, float, int]:
    """(mean_token_accuracy, entropy, label tokens) as TRL 1.16's SFTTrainer.compute_loss computes them: its fused
    output head (trl.trainer.utils.add_fused_lm_head) gives per-token is_top1 and entropy, summed over label_mask."""
    from trl.trainer.utils import add_fused_lm_head

    model = copy.deepcopy(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    keys = ("input_ids", "attention_mask", "position_ids", "labels")
    with torch.no_grad():
        out = model(**{k: batch[k] for k in keys}, fused_lm_head=True)
    valid = out.label_mask.sum()
    return float(out.is_top1.sum() / valid), float(out.entropy.sum() / valid), int(valid)


def direct_token_metrics(model, batch: dict) -> tuple[float, float]:
    """The same from the model's full logits, written out: argmax == label, -sum p log p, over labels != -100."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].double()
    targets, keep = batch["labels"][:, 1:], batch["labels"][:, 1:] != -100
    log_p = logits.log_softmax(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return float((logits.argmax(-1) == targets)[keep].double().mean()), float(entropy[keep].mean())


@pytest.mark.parametrize("loss_path", ["lean", "full_logits"])
def test_sft_token_accuracy_and_entropy_are_trls_whatever_the_micro_batches(
    loss_path, process_group, tiny, pairs_file, monkeypatch
):
    """TRL's SFTTrainer metrics of a step, from the logits the loss computes (the lean loss's chunks of rows, here 16
    rows a chunk and 5 a block, or the full logits): mean_token_accuracy and entropy over the step's label tokens equal
    TRL's fused head and a direct computation on the same weights and rows, and the same when the step's 4 rows are
    one micro-batch or two (sums divided by the step's label tokens, not means of micro-batch means)."""
    from shardtune.model import loss

    if loss_path == "full_logits":
        monkeypatch.setattr(loss, "lean_head", lambda model: None)
    else:
        monkeypatch.setitem(loss.CHUNK_ELEMENTS, "cpu", 16 * 1024)  # 16 rows of the tiny model's 1,024 logits
        monkeypatch.setattr(loss, "PREDICTION_BLOCK_ELEMENTS", 5 * 1024)
    cfg = config("sft", "ddp", tiny, pairs_file)
    tokenizer = load_tokenizer(str(tiny))
    rows = labels_half_predicted(load_model(str(tiny)), tokenizer)
    whole = collate_padding(rows, tokenizer.pad_token_id)
    trl_accuracy, trl_entropy, label_tokens = trl_token_metrics(load_model(str(tiny)), whole)
    direct_accuracy, direct_entropy = direct_token_metrics(load_model(str(tiny)), whole)
    layouts = {
        "one micro-batch": [whole],
        "two": [collate_padding(rows[i : i + 2], tokenizer.pad_token_id) for i in (0, 2)],
    }
    for layout, batches in layouts.items():
        strategy = make_strategy(cfg, ENV)
        sft = objective_class("sft")(cfg, ENV, strategy, tokenizer)
        model = strategy.wrap(load_model(str(tiny)))
        sft.attach(model, [], [])
        result = train_step(model, strategy, strategy.build_optimizer(model), sft, batches, step=1)
        accuracy, entropy = result.metrics["mean_token_accuracy"], result.metrics["entropy"]
        print(
            f"{loss_path}, {layout}: accuracy {accuracy:.6f} (TRL {trl_accuracy:.6f}), entropy {entropy:.6f} "
            f"(TRL {trl_entropy:.6f}, direct {direct_entropy:.6f}) over {label_tokens} label tokens"
        )
        assert result.counts["label_tokens"] == label_tokens
        assert 0.3 < accuracy < 0.8 and 0.1 < entropy < math.log(1024)
        assert accuracy == pytest.approx(trl_accuracy, abs=1e-12) == direct_accuracy
        assert entropy == pytest.approx(trl_entropy, rel=1e-5) == pytest.approx(direct_entropy, rel=1e-5)


def test_the_evaluator_writes_the_objectives_row_and_records_the_best_score(process_group, tiny, pairs_file, tmp_path):
    """The evaluator runs the objective's evaluation (SFT: token-weighted loss and perplexity over the rank's eval
    batches), writes one metrics row with the step and epoch, records the score --load_best_model_at_end compares
    and says one line."""
    from shardtune.training.engine.checkpoint.best import BestModel
    from shardtune.training.engine.evaluation import Evaluator
    from shardtune.training.engine.metrics import MetricsWriter, read_metrics

    cfg = config("sft", "ddp", tiny, pairs_file, run_validation=True, val_batch_size=2)
    tokenizer = load_tokenizer(str(tiny))
    strategy = make_strategy(cfg, ENV)
    sft = objective_class("sft")(cfg, ENV, strategy, tokenizer)
    model = strategy.wrap(load_model(str(tiny)))
    rows = [{"input_ids": list(range(5, 9 + 3 * i)), "labels": list(range(5, 9 + 3 * i))} for i in range(3)]
    sft.attach(model, [], rows)
    said, best = [], BestModel(cfg, total_steps=4)
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    row = Evaluator(sft, model, writer, best, said.append)(step=2, epoch=0.5, when="step 2")
    writer.close()
    # the same loss computed directly over all examples at once
    from shardtune.model.loss import token_loss_sum

    whole = collate_padding(rows, tokenizer.pad_token_id)
    tokens = int((whole["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        direct = float(token_loss_sum(strategy.unwrap(model), whole, CPU)) / tokens
    assert row["eval_loss"] == pytest.approx(direct, rel=1e-6) and row["eval_label_tokens"] == tokens
    accuracy, entropy = direct_token_metrics(strategy.unwrap(model), whole)
    assert row["eval_mean_token_accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert row["eval_entropy"] == pytest.approx(entropy, rel=1e-5) and row["eval_entropy"] > 0
    assert row["eval_ppl"] == pytest.approx(math.exp(direct), rel=1e-6)
    written = read_metrics(tmp_path / "metrics.jsonl")
    assert written == [{"step": 2, "epoch": 0.5, **row}]
    assert best.scores == {2: row["eval_loss"]}
    assert said == [f"step 2: eval loss {direct:.4f}, perplexity {row['eval_ppl']:.2f}"]


def test_the_checkpointer_resumes_in_process_to_the_uninterrupted_run_keeping_the_last_evaluation(
    process_group, tiny, tmp_path
):
    """Whole runs in this process (shardtune.training.engine.worker.fine_tune on one gloo rank, no torchrun), 4 steps an
    epoch: 3 steps (the run ends inside the first epoch), checkpointed every 2, then resumed to 6 steps, equal the
    uninterrupted 6-step run, its losses, token counts, evaluations, learning rates (the per-epoch schedule) and
    weights. The run's last step is checkpointed after its evaluation, so the resume keeps that evaluation's row
    (written after the checkpoint, it was dropped). num_tokens is TRL's: the running total of the input tokens
    trained on, counted here from the data's units in each epoch's order, which the resumed run continues."""
    import itertools

    from safetensors.torch import load_file

    from shardtune import data
    from shardtune.data.batching import epoch_order
    from shardtune.data.cache import load_examples_cached
    from shardtune.model.loading import cache_dir
    from shardtune.training.engine.worker import fine_tune
    from tests.helpers import eval_rows, step_rows

    base = {
        "model_name": str(tiny),
        "context_length": 128,
        "synthetic_dialogues.num_train": 16,
        "synthetic_dialogues.num_validation": 4,
        "batch_size_training": 2,
        "lr": 3e-3,
        "gradient_clipping": True,
        "num_epochs": 3,
        "num_workers_dataloader": 0,
        "save_steps": 2,
        "eval_steps": 2,
        "save_plots": False,
    }
    whole, run = tmp_path / "whole", tmp_path / "run"
    fine_tune(config_from({**base, "output_dir": str(whole), "max_train_step": 6}), ENV)
    fine_tune(config_from({**base, "output_dir": str(run), "max_train_step": 3}), ENV)
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000002", "step-000003"]
    assert [r["step"] for r in eval_rows(run)] == [2, 3]
    fine_tune(config_from({**base, "output_dir": str(run), "max_train_step": 6, "resume": "latest"}), ENV)

    def numbers(rows: list[dict]) -> list[tuple]:
        keys = ("step", "epoch", "loss", "num_tokens", "label_tokens", "lr", "grad_norm", "eval_loss")
        keys += ("mean_token_accuracy", "entropy", "eval_mean_token_accuracy", "eval_entropy")
        return [tuple(r.get(k) for k in keys) for r in rows]

    cfg = config_from({**base, "output_dir": str(whole)})
    tokenizer = data.apply_tokenizer_options(cfg, load_tokenizer(str(tiny)))
    units = data.build_units(load_examples_cached(cfg, tokenizer, "train", cache_dir())[0], cfg)
    batch = cfg.train.batch_size
    step_tokens = []
    for epoch in (0, 1):
        order = epoch_order(units, cfg, 1, epoch)
        for start in range(0, len(order), batch):
            step_tokens.append(sum(len(e["input_ids"]) for i in order[start : start + batch] for e in units[i]))
    expected = list(itertools.accumulate(step_tokens))[:6]
    assert [r["num_tokens"] for r in step_rows(run)] == [r["num_tokens"] for r in step_rows(whole)] == expected
    print("num_tokens of steps 1-6:", expected)

    assert [r["step"] for r in eval_rows(whole)] == [2, 4, 6]
    assert [r["step"] for r in eval_rows(run)] == [2, 3, 4, 6], (run / "metrics.jsonl").read_text()
    assert numbers(step_rows(run)) == numbers(step_rows(whole))
    assert numbers(r for r in eval_rows(run) if r["step"] != 3) == numbers(eval_rows(whole))
    resumed, uninterrupted = (load_file(str(d / "model.safetensors")) for d in (run, whole))
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


def test_max_steps_overrides_the_epochs_as_in_trl(process_group, tiny, tmp_path):
    """TRL's --max_steps is the run's length whatever the epochs: 5 steps on data of 2 steps an epoch train over 2.5
    epochs (each epoch its own order), the linear schedule reaching 0 at step 5 (it stopped at the data's end, step
    2, its schedule squeezed into 2 steps)."""
    from shardtune.training.engine.worker import fine_tune
    from tests.helpers import eval_rows, step_rows

    cfg = config_from(
        {
            "model_name": str(tiny),
            "context_length": 512,
            "synthetic_dialogues.num_train": 8,
            "synthetic_dialogues.num_validation": 1,
            "batching_strategy": "padding",
            "batch_size_training": 4,
            "num_epochs": 1,
            "max_steps": 5,
            "lr_scheduler_type": "linear",
            "lr": 1e-3,
            "num_workers_dataloader": 0,
            "save_plots": False,
            "output_dir": str(tmp_path / "run"),
        }
    )
    fine_tune(cfg, ENV)
    rows = step_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["epoch"] for r in rows] == [0.5, 1.0, 1.5, 2.0, 2.5]
    assert [r["lr"] for r in rows] == pytest.approx([1e-3 * (5 - i) / 5 for i in range(5)])
    assert [r["step"] for r in eval_rows(tmp_path / "run")] == [2, 4, 5]  # each epoch's end, the last in part


def test_step_statistics_combine_by_their_reductions():
    """Sum, min and max stats over micro-batches (one process: the ranks' reduction is the identity); a min stat
    starts at +inf and a max at -inf, so a step whose micro-batches have none stays infinite (shown as NaN)."""
    from shardtune.training.engine.step import StatReductions

    reductions = StatReductions(("sum", "min", "max"), torch.device("cpu"))
    stats = reductions.start()
    assert stats.tolist() == [0.0, float("inf"), float("-inf")]
    for values in ([1.0, 0.5, 0.2], [2.0, 0.25, 0.7], [0.5, 0.75, 0.1]):
        stats = reductions.combine(stats, torch.tensor(values, dtype=torch.float64))
    assert reductions.across_ranks(stats).tolist() == [3.5, 0.25, 0.7]
    summed = StatReductions(("sum", "sum"), torch.device("cpu"))
    assert summed.across_ranks(summed.combine(summed.start(), torch.tensor([1.0, 2.0]))).tolist() == [1.0, 2.0]
