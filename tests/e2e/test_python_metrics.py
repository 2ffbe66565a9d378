"""compute_metrics, preprocess_logits_for_metrics and predict() from a script (examples/sft_metrics.py) under
``python`` (1 process x batch 4) and ``torchrun --nproc_per_node 2`` (2 x batch 1 x accumulation 2): the same
evaluation rows with the metrics compute_metrics made, the same predictions in the test rows' order, the same logits."""

from __future__ import annotations

import math
import sys

import numpy as np

from tests.e2e.test_python_scripts import EXAMPLES, result_of, run


def test_compute_metrics_and_predict_give_the_same_arrays_and_metrics_under_python_and_torchrun(
    tiny_model, cache_dir, tmp_path
):
    script = EXAMPLES / "sft_metrics.py"
    one = result_of(run([sys.executable, str(script), str(tiny_model), "one", "4", "1"], cache_dir, tmp_path).stdout)
    two = result_of(
        run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), str(tiny_model)]
            + ["two", "1", "2"],
            cache_dir,
            tmp_path,
        ).stdout
    )
    # the evaluations at steps 2 and 4 carry compute_metrics' metrics, equal on both layouts to the training's
    # rounding (the weights of 1 x 4 and 2 x 1 x 2 agree to ~1e-7 relative; a log-probability moves as much)
    assert [row["step"] for row in one["evaluations"]] == [2, 4]
    for a, b in zip(one["evaluations"], two["evaluations"], strict=True):
        assert a["eval_rows"] == b["eval_rows"] == 8
        for key in ("eval_loss", "eval_mean_logp", "eval_perplexity"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5), (key, a, b)
        # the predictions are the labels' own: their perplexity is the evaluation's (a float32 mean of 62 log-probs)
        assert math.isclose(a["eval_mean_logp"], -a["eval_loss"], rel_tol=1e-6)
        assert math.isclose(a["eval_perplexity"], a["eval_ppl"], rel_tol=1e-5)
    assert one["metrics"]["test_rows"] == 8 and "epoch" not in one["metrics"]  # predict()'s, under its prefix
    assert math.isclose(one["metrics"]["test_loss"], one["evaluations"][-1]["eval_loss"], rel_tol=1e-9)
    for key in ("predictions", "label_ids"):
        a, b = (np.array(result["predicted"][key]) for result in (one, two))
        assert a.shape == b.shape == (8, 18), a.shape
        assert np.allclose(a, b, rtol=0, atol=1e-5), (key, np.abs(a - b).max())
    labels, predictions = (np.array(one["predicted"][key]) for key in ("label_ids", "predictions"))
    pads = predictions == -100  # each row padded after its own length, whatever batch it was evaluated in
    assert all(np.array_equal(row, np.sort(row)) for row in pads) and pads[:, -1].any() and not pads[:, -1].all()
    assert (labels[pads] == -100).all() and (predictions[~pads] <= 0).all()  # log-probabilities inside each row
    # the starting model's logits (8 rows x 18 positions x 1024) and labels: the same weights, the same batches
    assert one["logits"]["shape"] == two["logits"]["shape"] == [8, 18, 1024]
    assert np.allclose(one["logits"]["values"], two["logits"]["values"], rtol=0, atol=1e-5)
    assert one["logit_labels"] == two["logit_labels"] == one["predicted"]["label_ids"]
    assert one["logit_metrics"] == two["logit_metrics"]
