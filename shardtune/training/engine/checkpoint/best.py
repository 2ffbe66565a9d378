"""--load_best_model_at_end (Trainer's flag): the run publishes the model of its best checkpoint, judged by
--metric_for_best_model in the evaluation taken at that checkpoint's step, instead of the last step's.

Trainer's rules, kept: a checkpoint counts only when an evaluation was taken at its step (so checkpoint steps must
be a multiple of the evaluation steps, or both at epoch ends); the first of equal scores wins; --save_total_limit
never removes the best checkpoint (it keeps the best plus the newest K). The scores travel in every checkpoint, so
a resumed run chooses among the checkpoints of its whole history.
"""

from __future__ import annotations

import math
from pathlib import Path

from shardtune.config.flags import spelling_of
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.training.engine.checkpoint.layout import checkpoint_step
from shardtune.training.engine.intervals import every
from shardtune.training.engine.objective import objective_class


def metric_key(cfg: TrainConfig) -> str:
    name = cfg.eval.metric_for_best_model
    return name if name.startswith("eval_") else f"eval_{name}"


def higher_is_better(cfg: TrainConfig) -> bool:
    if cfg.eval.greater_is_better is not None:
        return cfg.eval.greater_is_better
    return not metric_key(cfg).endswith(("loss", "ppl"))


def check_intervals(cfg: TrainConfig, world_size: int) -> None:
    """The settings alone: evaluation intervals that would be ignored, and what --load_best_model_at_end needs."""
    if cfg.eval.steps and not cfg.eval.enabled:
        raise ConfigError(
            f"{spelling_of(cfg, 'eval.steps')} {cfg.eval.steps:g} has no effect with --run_validation false: drop one"
        )
    if not cfg.eval.load_best_model_at_end:
        if cfg.eval.metric_for_best_model != "eval_loss" or cfg.eval.greater_is_better is not None:
            raise ConfigError(
                "--metric_for_best_model / --greater_is_better choose the model --load_best_model_at_end "
                "publishes: add --load_best_model_at_end, or drop them"
            )
        return
    flag = "--load_best_model_at_end"
    if not cfg.eval.enabled:
        raise ConfigError(f"{flag} needs evaluations: drop --run_validation false (TRL: --eval_strategy steps/epoch)")
    if not cfg.output.save_model:
        raise ConfigError(f"{flag} chooses the model to publish, and --save_model false publishes none: drop one")
    save, evaluate = cfg.checkpoint.save_steps, cfg.eval.steps
    if not (save or cfg.checkpoint.checkpoint_type or cfg.checkpoint.dist_checkpoint_root_folder):
        raise ConfigError(
            f"{flag} chooses among checkpoints, and none are written: pass --save_steps N (a multiple of "
            "--eval_steps) or --save_strategy epoch"
        )
    if not save and not cfg.eval.at_epoch_ends:
        raise ConfigError(
            f"{flag}: checkpoints at epoch ends, evaluations only every --eval_steps (--eval_strategy steps): "
            "make the strategies match, as Trainer requires (--save_strategy steps --save_steps N, or "
            "--eval_strategy epoch)"
        )
    if save >= 1 and not (evaluate >= 1 and save % evaluate == 0) and not 0 < evaluate < 1:
        raise ConfigError(
            f"{flag}: a checkpoint every {save:g} steps needs an evaluation at each: pass "
            f"--eval_steps {save:g} (or a divisor of it), as Trainer requires"
        )
    names = objective_class(cfg.objective).eval_metric_names
    if metric_key(cfg) not in names:
        raise ConfigError(
            f"--metric_for_best_model {cfg.eval.metric_for_best_model} is not an evaluation metric of "
            f"shardtune {cfg.objective}: choose one of {', '.join(names)}"
        )
    if metric_key(cfg).startswith("eval_rouge") and not cfg.eval.log_samples:
        raise ConfigError(
            f"--metric_for_best_model {cfg.eval.metric_for_best_model} is measured on generated answers: "
            "add --log_eval_samples N"
        )


class BestModel:
    """The score of each evaluated step; the checkpoint to publish among those on disk."""

    def __init__(self, cfg: TrainConfig, total_steps: int):
        self.key, self.higher = metric_key(cfg), higher_is_better(cfg)
        self.scores: dict[int, float] = {}
        save_every = every(cfg.checkpoint.save_steps, total_steps)
        eval_every = every(cfg.eval.steps, total_steps)
        if save_every and (not eval_every or save_every % eval_every):
            raise ConfigError(
                f"--load_best_model_at_end: checkpoints every {save_every} steps and evaluations every "
                f"{eval_every or 'epoch'} of this run's {total_steps}: make the checkpoint interval a "
                "multiple of the evaluation interval"
            )

    def record(self, step: int, row: dict) -> None:
        if self.key not in row:
            raise ConfigError(
                f"--metric_for_best_model {self.key} is not in this run's evaluation (it has "
                f"{', '.join(k for k in row if k.startswith('eval_'))}): choose one of those"
            )
        self.scores[step] = float(row[self.key])

    def choose(self, checkpoints: list[Path]) -> tuple[Path, float] | None:
        """The best-scoring checkpoint that was evaluated at its step (the first of equal scores), or None."""
        best: tuple[Path, float] | None = None
        for path in sorted(checkpoints, key=lambda p: checkpoint_step(p) or 0):
            score = self.scores.get(checkpoint_step(path) or -1)
            if score is None or not math.isfinite(score):
                continue
            if best is None or (score > best[1] if self.higher else score < best[1]):
                best = (path, score)
        return best

    def state(self) -> dict:
        return {"metric": self.key, "scores": {str(k): v for k, v in self.scores.items()}}

    def restore(self, state: dict | None) -> None:
        if state and state.get("metric") == self.key:  # a checkpoint judged by another metric: its scores do not count
            self.scores.update({int(k): float(v) for k, v in state["scores"].items()})


def load_best(model, strategy, optimizer, checkpointer, best: BestModel, result) -> None:
    """Collective, after the last evaluation: put the best checkpoint's weights into ``model`` (to be published), and
    say which. Rank 0 chooses (it sees the files); every rank loads that one."""
    from shardtune.runtime.distributed import broadcast_from_main, print0
    from shardtune.training.engine.checkpoint.layout import complete_checkpoints, read_trainer_state

    chosen = best.choose(complete_checkpoints(checkpointer.root)) if checkpointer.env.is_main else None
    chosen = broadcast_from_main(chosen)
    if chosen is None:
        raise ConfigError(
            f"--load_best_model_at_end: no checkpoint was evaluated at its step (scores at steps "
            f"{sorted(best.scores)}): the last model is not published; export a checkpoint with "
            "shardtune export"
        )
    path, score = chosen
    step = checkpoint_step(path)
    if step == result.steps:
        print0(f"load_best_model_at_end: the last step's model is the best ({best.key} {score:.4f})")
        return
    strategy.load_training_state(model, optimizer, path, read_trainer_state(path))
    print0(
        f"load_best_model_at_end: publishing the model of {path} ({best.key} {score:.4f}, the best of "
        f"{len(best.scores)} evaluations), not the last step's ({best.key} "
        f"{best.scores.get(result.steps, float('nan')):.4f})"
    )
