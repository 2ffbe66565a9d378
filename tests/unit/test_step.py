"""The engine's units in-process, on one real gloo rank (no torchrun): one optimizer step of each objective, the
step / skip / stop decision of --nan_policy under DDP, FSDP and DeepSpeed ZeRO-2 alike for SFT and DPO, the
evaluator, and the checkpointer's save and restore."""

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
from shardtune.training.checks import validate
from shardtune.training.objective import objective_class
from shardtune.training.step import NonFiniteLossError, train_step

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


def one_step(cfg: TrainConfig, tiny: Path, fault: str):
    """One optimizer step of ``cfg`` on a model with a fault: ``nan`` (a NaN weight: the loss is NaN) or ``inf`` (the
    final norm's output passes an infinite gradient back: a finite loss, a non-finite gradient norm). Returns
    (the step's result or the NonFiniteLossError, the trainable weights before, after)."""
    tokenizer = load_tokenizer(str(tiny))
    strategy = make_strategy(cfg, ENV)
    objective = objective_class(cfg.objective)(cfg, ENV, strategy, tokenizer)
    model = load_model(str(tiny))
    if fault == "nan":
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    else:
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
        assert result.counts["num_tokens"] == sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)


def test_the_evaluator_writes_the_objectives_row_and_records_the_best_score(process_group, tiny, pairs_file, tmp_path):
    """The evaluator runs the objective's evaluation (SFT: token-weighted loss and perplexity over the rank's eval
    batches), writes one metrics row with the step and epoch, records the score --load_best_model_at_end compares
    and says one line."""
    from shardtune.training.best_model import BestModel
    from shardtune.training.evaluation import Evaluator
    from shardtune.training.metrics import MetricsWriter, read_metrics

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
    assert row["eval_loss"] == pytest.approx(direct, rel=1e-6) and row["eval_num_tokens"] == tokens
    assert row["eval_ppl"] == pytest.approx(math.exp(direct), rel=1e-6)
    written = read_metrics(tmp_path / "metrics.jsonl")
    assert written == [{"step": 2, "epoch": 0.5, **row}]
    assert best.scores == {2: row["eval_loss"]}
    assert said == [f"step 2: eval loss {direct:.4f}, perplexity {row['eval_ppl']:.2f}"]


def test_the_checkpointer_resumes_in_process_to_the_uninterrupted_run_keeping_the_last_evaluation(
    process_group, tiny, tmp_path
):
    """Whole runs in this process (shardtune.training.worker.fine_tune on one gloo rank, no torchrun), 4 steps an
    epoch: 3 steps (the run ends inside the first epoch), checkpointed every 2, then resumed to 6 steps, equal the
    uninterrupted 6-step run, its losses, token counts, evaluations, learning rates (the per-epoch schedule) and
    weights. The run's last step is checkpointed after its evaluation, so the resume keeps that evaluation's row
    (written after the checkpoint, it was dropped)."""
    from safetensors.torch import load_file

    from shardtune.training.worker import fine_tune
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
        keys = ("step", "epoch", "loss", "num_tokens", "lr", "grad_norm", "eval_loss")
        return [tuple(r.get(k) for k in keys) for r in rows]

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
    from shardtune.training.worker import fine_tune
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
