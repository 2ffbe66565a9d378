"""An evaluation's predictions (shardtune.training.engine.predictions, shardtune.api.prediction) in one process: the
ranks'
rows come back in the split's order, each padded with -100 after its own length, whatever the number of ranks and the
batch size; predict() and compute_metrics equal transformers' Trainer on the same model and rows; what cannot be
honoured is refused in one line. The launched check, python vs torchrun: tests/e2e/test_python_metrics.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardtune import DPOTrainer, SFTConfig, SFTTrainer
from shardtune.config.flags import config_from
from shardtune.config.schema import ConfigError
from shardtune.data.batching import collate_padding, eval_chunk_starts
from shardtune.training.engine.predictions import PredictionKeeper, PredictionRequest, assemble, eval_metrics

VOCAB = 7


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDTUNE_CACHE", str(tmp_path / "cache"))


def made_up_logits(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits that depend on the token and its position only (not on the batch or the padding around it)."""
    ids, positions = batch["input_ids"].double(), batch["position_ids"].double()
    return (ids[..., None] * 10 + positions[..., None] + torch.arange(VOCAB) / 10).float()


EXAMPLES = [
    {"input_ids": list(range(1, n + 1)), "labels": [-100] * (n // 2) + list(range(n // 2 + 1, n + 1))}
    for n in (3, 6, 2, 5, 4, 7, 1, 6, 2)
]


def gathered(tmp_path, name: str, world_size: int, batch_size: int, preprocess=None) -> tuple[np.ndarray, np.ndarray]:
    """The arrays the ranks of a world would give: each rank's keeper takes its chunks' batches (placed by
    eval_chunk_starts, the loader's own rule), then rank 0's assembly."""
    cfg = config_from({"val_batch_size": batch_size})
    folder = tmp_path / name
    keepers = [PredictionKeeper(PredictionRequest(None, preprocess), folder, r, world_size) for r in range(world_size)]
    for rank, keeper in enumerate(keepers):
        for first in eval_chunk_starts(len(EXAMPLES), cfg, rank, world_size):
            batch = collate_padding(EXAMPLES[first : first + batch_size], 0)
            keeper.add(first, batch, made_up_logits(batch))
        keeper.add(None, collate_padding([{"input_ids": [0], "labels": [-100]}], 0), torch.zeros(1, 1, VOCAB))
        keeper.file.close()
    rows = [row for keeper in keepers for row in keeper.rows]
    paths = assemble(rows, [keeper.staging / f"rank-{r}.pkl" for r, keeper in enumerate(keepers)], folder)
    return np.load(paths[0]), np.load(paths[1])


def test_the_ranks_rows_come_back_in_the_splits_order_padded_with_minus_100_on_any_layout(tmp_path):
    predictions, labels = gathered(tmp_path, "one", world_size=1, batch_size=4)
    longest = max(len(e["input_ids"]) for e in EXAMPLES)
    assert predictions.shape == (len(EXAMPLES), longest, VOCAB) and predictions.dtype == np.float32
    assert labels.shape == (len(EXAMPLES), longest) and labels.dtype == np.int64
    for row, example in enumerate(EXAMPLES):
        n = len(example["input_ids"])
        alone = collate_padding([example], 0)
        assert np.array_equal(predictions[row, :n], made_up_logits(alone)[0].numpy())  # not its batch's neighbours'
        assert (predictions[row, n:] == -100).all() and (labels[row, n:] == -100).all()
        assert labels[row, :n].tolist() == example["labels"]  # unshifted, masked positions -100
    for world_size, batch_size in ((2, 2), (3, 1), (2, 3)):  # rank 1 of (2, 3) runs a batch that only joins
        other = gathered(tmp_path, f"{world_size}x{batch_size}", world_size, batch_size)
        assert np.array_equal(other[0], predictions) and np.array_equal(other[1], labels), (world_size, batch_size)

    def argmax(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)

    ids, _ = gathered(tmp_path, "argmax", world_size=2, batch_size=2, preprocess=argmax)
    assert ids.shape == (len(EXAMPLES), longest) and ids.dtype == np.int64
    assert np.array_equal(ids, np.where(predictions[..., 0] == -100, -100, VOCAB - 1))  # what it made, padded


def test_metrics_are_numbers_under_eval_names_and_a_name_of_the_evaluation_is_refused():
    row = {"eval_loss": 1.0}
    returned = {"accuracy": np.float32(0.5), "eval_count": torch.tensor(3), "f1": 1}
    assert eval_metrics(returned, row) == {"eval_accuracy": 0.5, "eval_count": 3, "eval_f1": 1}
    with pytest.raises(ConfigError, match="compute_metrics returned loss, which the evaluation computes itself"):
        eval_metrics({"loss": 2.0}, row)
    with pytest.raises(ConfigError, match="compute_metrics returned per_class=.*return a number"):
        eval_metrics({"per_class": [0.1, 0.2]}, row)
    with pytest.raises(ConfigError, match="compute_metrics returned a list"):
        eval_metrics([0.5], row)


def test_metric_functions_are_refused_where_they_are_not_built(tiny_model):
    rows = [{"prompt": f"say {i}", "completion": f" {i}"} for i in range(8)]
    with pytest.raises(ConfigError, match="compute_metrics: a int is not callable"):
        SFTTrainer(model=str(tiny_model), train_dataset=rows, compute_metrics=3)
    trainer = SFTTrainer(model=str(tiny_model), train_dataset=rows, compute_metrics=len)
    trainer.config.parallel.sequence_parallel_size = 2  # as sp_size 2 makes it: each row split over 2 processes
    with pytest.raises(ConfigError, match="predictions are not gathered from slices: set both to 1"):
        with trainer._predicting(trainer.config):
            pass
    pairs = [{"prompt": "a", "chosen": " b", "rejected": " c"}] * 8
    with pytest.raises(ConfigError, match="compute_metrics: TRL 1.16's DPO predictions .* depend|differ by layout"):
        DPOTrainer(model=str(tiny_model), train_dataset=pairs, compute_metrics=len)
    with pytest.raises(ConfigError, match="predict\\(\\): TRL 1.16's DPO predictions"):
        DPOTrainer(model=str(tiny_model), train_dataset=pairs).predict(pairs)


def test_predict_and_compute_metrics_equal_transformers_trainer_on_the_same_model_and_rows(tiny_model, tmp_path):
    """Trainer's predict() (one process, eval batch 1: no batch padding) is the oracle: the same arrays (logits to
    float rounding of two attention paths, ~1e-6 on logits of size ~1; labels exactly), with and without
    preprocess_logits_for_metrics, and the same compute_metrics numbers. Ours evaluates 3 rows a batch."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    rows = [
        {"input_ids": list(range(5, 5 + n)), "labels": [-100] * (n // 3) + list(range(5 + n // 3, 5 + n))}
        for n in (6, 11, 3, 8, 9, 4, 12)
    ]

    def max_logit(logits, labels):
        return logits.max(-1).values

    def compute_metrics(prediction):
        scored = prediction.label_ids != -100
        return {"labelled": int(scored.sum()), "mean": float(prediction.predictions[scored].mean())}

    def trainer_predicts(preprocess) -> object:
        trainer = Trainer(
            model=AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32),
            args=TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_eval_batch_size=1, report_to=[]),
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess,
        )
        return trainer.predict(Dataset.from_list(rows))

    def we_predict(preprocess, name: str) -> object:
        args = SFTConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=1, per_device_eval_batch_size=3)
        trainer = SFTTrainer(
            model=str(tiny_model),
            args=args,
            train_dataset=rows,
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess,
        )
        return trainer.predict(rows)

    for preprocess, shape in ((None, (7, 12, 1024)), (max_logit, (7, 12))):
        oracle, ours = trainer_predicts(preprocess), we_predict(preprocess, "logits" if preprocess is None else "max")
        assert ours.predictions.shape == oracle.predictions.shape == shape
        assert ours.predictions.dtype == oracle.predictions.dtype == np.float32
        assert np.array_equal(ours.label_ids, oracle.label_ids)  # the labels column, unshifted, padded with -100
        assert np.array_equal(ours.predictions == -100, oracle.predictions == -100)
        np.testing.assert_allclose(ours.predictions, oracle.predictions, rtol=0, atol=1e-5)
        assert ours.metrics["test_labelled"] == oracle.metrics["test_labelled"] == 37
        assert abs(ours.metrics["test_mean"] - oracle.metrics["test_mean"]) <= 1e-5 * abs(oracle.metrics["test_mean"])
