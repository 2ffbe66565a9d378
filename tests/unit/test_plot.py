"""`shardtune plot` reads llama-cookbook's metrics_data_*.json beside shardtune's metrics.jsonl and overlays them."""

from __future__ import annotations

import json

from shardtune.commands.plot import main, read_run, run_names

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_cookbook_metrics_file_and_a_shardtune_run_overlay_in_one_set_of_pictures(tmp_path):
    cookbook = tmp_path / "a" / "run"
    cookbook.mkdir(parents=True)
    (cookbook / "metrics_data_0-2026-12-01_10-00-00.json").write_text(
        json.dumps(
            {
                "train_step_loss": [3.0, 2.5, 2.2, 2.0, 1.9, 1.8],
                "train_epoch_loss": [2.5, 1.9],
                "train_step_perplexity": [20.1, 12.2, 9.0, 7.4, 6.7, 6.0],
                "train_epoch_perplexity": [12.2, 6.7],
                "val_step_loss": [2.4, 2.3, 1.95, 1.9],
                "val_epoch_loss": [2.35, 1.92],
                "val_step_perplexity": [11.0, 10.0, 7.0, 6.7],
                "val_epoch_perplexity": [10.5, 6.8],
            }
        )
    )
    ours = tmp_path / "b" / "run"
    ours.mkdir(parents=True)
    rows = [
        {
            "step": s,
            "epoch": s / 3,
            "loss": 3.1 - 0.2 * s,
            "lr": 1e-4,
            "tokens_per_s": 100.0 + s,
            "mfu": 0.3,
            "peak_memory_bytes": 1 << 30,
            "num_tokens": 10,
        }
        for s in range(1, 7)
    ]
    rows.append({"step": 6, "epoch": 2, "eval_loss": 1.95, "eval_ppl": 7.0})
    (ours / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    run = read_run(cookbook, "cookbook")
    assert [r["loss"] for r in run.steps] == [3.0, 2.5, 2.2, 2.0, 1.9, 1.8]
    assert [(r["step"], r["eval_loss"]) for r in run.evals] == [(3, 2.35), (6, 1.92)]  # at each epoch's end
    assert run_names([cookbook, ours]) == ["a/run", "b/run"]  # same directory name: the parent tells them apart

    out = tmp_path / "plots"
    assert main([str(cookbook), str(ours), "--out_dir", str(out)]) == 0
    for name in ("loss.png", "lr.png", "tokens_per_s.png", "mfu.png", "memory.png", "overview.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    assert not (out / "grad_norm.png").exists()  # neither run logged a gradient norm
    assert main([str(tmp_path / "missing")]) == 2
