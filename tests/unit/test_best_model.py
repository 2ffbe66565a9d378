"""--load_best_model_at_end, fractional --save_steps / --eval_steps and 8-bit AdamW: their rules and refusals without
a launch. The launch that does them (2 processes, TRL's names, the best checkpoint's adapter published) is
tests/e2e/test_trl_recipe.py; the 8-bit optimizer's exact resume is in tests/distributed/test_checkpoint.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardtune.config.flags import parse_args
from shardtune.config.schema import ConfigError
from shardtune.parallel.optim import build_optimizer
from shardtune.training.engine.checkpoint.best import BestModel
from shardtune.training.engine.checks import validate
from shardtune.training.engine.intervals import every


def cfg_of(*argv, world_size: int = 1):
    cfg = parse_args(["--output_dir", "/tmp/shardtune-best-model-unit", *map(str, argv)])
    validate(cfg, world_size)
    return cfg


def test_fractions_of_the_run_are_trainers_ceil_and_trl_floats_map_onto_them():
    cfg = cfg_of("--save_steps", 0.25, "--eval_steps", 0.1, "--eval_strategy", "steps")
    assert (cfg.checkpoint.save_steps, cfg.eval.steps) == (0.25, 0.1)
    assert every(cfg.checkpoint.save_steps, 10) == 3 and every(cfg.eval.steps, 10) == 1
    assert every(0.01, 10) == 1 and every(7, 10) == 7 and every(0, 10) == 0
    assert cfg_of("--save_steps", 4).checkpoint.save_steps == 4
    logging = cfg_of("--logging_steps", 0.1)  # TRL's float: the trackers get every ceil(0.1 x steps)th row
    assert logging.logging.steps == 0.1 and every(0.1, 25) == 3
    assert cfg_of("--logging_steps", 5).logging.steps == 5
    assert cfg_of("--save_fraction", 0.25).checkpoint.save_steps == 0.25  # the older spelling, the same setting


def test_best_checkpoint_is_the_first_best_score_among_evaluated_checkpoints():
    cfg = cfg_of("--save_steps", 2, "--eval_steps", 2, "--load_best_model_at_end")
    best = BestModel(cfg, total_steps=8)
    for step, loss in ((2, 0.9), (4, 0.5), (6, 0.5), (8, 0.7)):
        best.record(step, {"eval_loss": loss, "eval_ppl": 2.0})
    folders = [Path(f"step-{s:06d}") for s in (2, 4, 6, 8, 10)]  # step 10: never evaluated, never chosen
    assert best.choose(folders) == (Path("step-000004"), 0.5)
    assert best.choose(folders[:1]) == (Path("step-000002"), 0.9)
    higher = BestModel(
        cfg_of("--save_steps", 2, "--eval_steps", 2, "--load_best_model_at_end", "--greater_is_better", "true"), 8
    )
    higher.scores = dict(best.scores)
    assert higher.choose(folders)[0] == Path("step-000002")
    # the scores travel with a checkpoint; another metric's are not taken
    again = BestModel(cfg, 8)
    again.restore(best.state())
    assert again.scores == best.scores
    ppl = BestModel(
        cfg_of("--save_steps", 2, "--eval_steps", 2, "--load_best_model_at_end", "--metric_for_best_model", "ppl"), 8
    )
    ppl.restore(best.state())
    assert ppl.scores == {} and ppl.key == "eval_ppl" and not ppl.higher
    with pytest.raises(ConfigError, match="eval_rouge1 is not in this run's evaluation"):
        BestModel(
            cfg_of(
                "--save_steps",
                2,
                "--eval_steps",
                2,
                "--load_best_model_at_end",
                "--metric_for_best_model",
                "rouge1",
                "--log_eval_samples",
                2,
            ),
            8,
        ).record(2, {"eval_loss": 1.0})


@pytest.mark.parametrize(
    "argv,named",
    [
        (("--load_best_model_at_end",), "none are written"),
        (("--load_best_model_at_end", "--save_steps", 4, "--eval_steps", 3), "--eval_steps 4"),
        (("--load_best_model_at_end", "--save_steps", 4, "--run_validation", "false"), "needs evaluations"),
        (("--load_best_model_at_end", "--save_steps", 4, "--eval_steps", 2, "--save_model", "false"), "publishes none"),
        (
            ("--load_best_model_at_end", "--save_steps", 2, "--eval_steps", 2, "--metric_for_best_model", "accuracy"),
            "not an evaluation metric",
        ),
        (
            ("--load_best_model_at_end", "--save_steps", 2, "--eval_steps", 2, "--metric_for_best_model", "rougeL"),
            "--log_eval_samples",
        ),
        (("--metric_for_best_model", "eval_ppl"), "add --load_best_model_at_end"),
        (("--save_fraction", 1.5), "neither a whole number"),
        (("--save_steps", 1.5), "neither a whole number"),
        (("--eval_steps", 2, "--run_validation", "false"), "no effect with --run_validation false"),
        (("--optim", "adamw_8bit", "--enable_fsdp"), "runs under DDP"),
        (("--optim", "paged_adamw_8bit", "--enable_deepspeed"), "runs under DDP"),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_one_line(argv, named):
    with pytest.raises(ConfigError, match=named) as error:
        cfg_of(*argv, world_size=2)
    assert "\n" not in str(error.value)


def test_intervals_that_resolve_to_no_evaluation_at_a_checkpoint_are_refused_at_the_start():
    cfg = cfg_of("--save_steps", 0.5, "--eval_steps", 0.25, "--eval_strategy", "steps", "--load_best_model_at_end")
    BestModel(cfg, total_steps=8)  # checkpoints every 4 steps, evaluations every 2
    with pytest.raises(ConfigError, match="multiple of the evaluation interval"):
        BestModel(cfg, total_steps=10)  # every 5 and every 3: no evaluation at step 5


def test_eight_bit_adamw_keeps_8_bit_moments_with_hugging_face_weight_decay_groups():
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.LayerNorm(64))
    for name, step_as in (
        ("adamw_8bit", "AdamW8bit"),
        ("adamw_bnb_8bit", "AdamW8bit"),
        ("paged_adamw_8bit", "PagedAdamW8bit"),
    ):
        cfg = cfg_of("--optim", name, "--weight_decay", 0.1, "--lr", 1e-2)
        optimizer = build_optimizer(model, cfg)
        assert type(optimizer).__name__ == step_as
        decayed, plain = optimizer.param_groups
        assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0 and len(decayed["params"]) == 1
    before = model[0].weight.detach().clone()
    model(torch.randn(4, 128)).pow(2).mean().backward()
    optimizer.step()
    state = optimizer.state[model[0].weight]
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8  # 8192 values: 8-bit
    assert not torch.equal(before, model[0].weight)
