"""transformers' ``TrainerCallback`` objects on shardtune's loop (shardtune.training.engine.hooks): ``on_train_begin``,
``on_step_end``, ``on_log`` (step and evaluation rows), ``on_evaluate``, ``on_save``, ``on_train_end`` are called with
a ``TrainerState`` and a ``TrainerControl`` as Trainer calls them, and the control's ``should_evaluate``,
``should_save`` and ``should_training_stop`` are honoured (``EarlyStoppingCallback`` stops a run). Callbacks run in
every process of the run; a stop asked for on any rank stops them all.
"""

from __future__ import annotations

from typing import Any

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.training.engine.hooks import Hooks

# our metrics.jsonl names -> TRL's log_history names (the others are the same)
TRL_KEYS = {"lr": "learning_rate"}


def trl_row(row: dict[str, Any]) -> dict[str, Any]:
    return {TRL_KEYS.get(k, k): v for k, v in row.items()}


def checked_callbacks(callbacks: Any) -> list[Any]:
    """The callbacks as objects (a class is instantiated, as Trainer does); anything else is refused."""
    if callbacks is None:
        return []
    from transformers import TrainerCallback

    out = []
    for callback in callbacks:
        if isinstance(callback, type) and issubclass(callback, TrainerCallback):
            callback = callback()
        if not isinstance(callback, TrainerCallback):
            raise ConfigError(
                f"callbacks: a {type(callback).__name__} is not a transformers TrainerCallback: subclass it (its "
                "on_train_begin / on_step_end / on_log / on_evaluate / on_save / on_train_end are called)"
            )
        out.append(callback)
    return out


class ArgsView:
    """What a callback reads of ``args``: the fields the script gave, else the run's canonical settings under
    TrainingArguments' names."""

    def __init__(self, given: dict[str, Any], cfg: TrainConfig) -> None:
        from transformers.trainer_utils import IntervalStrategy

        metric = cfg.eval.metric_for_best_model or "eval_loss"
        greater = cfg.eval.greater_is_better
        strategy = "no" if not cfg.eval.enabled else "steps" if cfg.eval.steps else "epoch"
        self._given = given
        self._canonical = {
            "output_dir": cfg.output.dir,
            "metric_for_best_model": metric,
            "greater_is_better": (not metric.endswith("loss")) if greater is None else greater,
            "load_best_model_at_end": cfg.eval.load_best_model_at_end,
            "eval_strategy": IntervalStrategy(strategy),
            "eval_steps": cfg.eval.steps or None,
            "save_steps": cfg.checkpoint.save_steps,
            "logging_steps": cfg.logging.steps,
            "max_steps": cfg.train.max_steps or -1,
            "num_train_epochs": cfg.train.num_epochs,
            "learning_rate": cfg.optim.lr,
            "per_device_train_batch_size": cfg.train.batch_size,
            "per_device_eval_batch_size": cfg.eval.batch_size,
            "gradient_accumulation_steps": cfg.train.gradient_accumulation_steps,
            "seed": cfg.train.seed,
        }

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._given:
            return self._given[name]
        if name in self._canonical:
            return self._canonical[name]
        raise AttributeError(f"args.{name}: not given, and not one of the settings a callback is shown")


class CallbackHooks(Hooks):
    def __init__(self, callbacks: list[Any], args: ArgsView, rank: int, state: Any = None) -> None:
        from transformers import TrainerControl, TrainerState

        self.callbacks, self.args = callbacks, args
        self.state = state or TrainerState(is_local_process_zero=rank == 0, is_world_process_zero=rank == 0)
        self.control = TrainerControl()

    def _call(self, event: str, **kwargs: Any) -> None:
        for callback in self.callbacks:
            result = getattr(callback, event)(self.args, self.state, self.control, **kwargs)
            if result is not None:
                self.control = result

    def on_train_begin(self, max_steps: int) -> None:
        self.state.max_steps = max_steps
        self._call("on_train_begin")

    def on_step_end(self, row: dict[str, Any]) -> None:
        self.state.global_step, self.state.epoch = row["step"], row.get("epoch", self.state.epoch)
        self._call("on_step_end")
        logs = trl_row(row)
        self.state.log_history.append(logs)
        self._call("on_log", logs=logs)

    def on_evaluate(self, row: dict[str, Any]) -> None:
        metrics = trl_row(row)
        self.state.log_history.append(metrics)
        self.logged_evaluation(metrics)

    def logged_evaluation(self, metrics: dict[str, Any]) -> None:
        """An evaluation's metrics, as Trainer's evaluate() hands them on: on_log (the logged row), then on_evaluate
        and the best metric so far."""
        self._call("on_log", logs=metrics)
        self._call("on_evaluate", metrics=metrics)
        metric = self.args.metric_for_best_model  # then the best so far, as Trainer keeps it (after the callbacks)
        value = metrics.get(metric if metric.startswith("eval_") else f"eval_{metric}")
        if value is not None:
            best = self.state.best_metric
            better = best is None or (value > best if self.args.greater_is_better else value < best)
            if better:
                self.state.best_metric, self.state.best_global_step = value, self.state.global_step

    def on_save(self, step: int) -> None:
        self._call("on_save")

    def on_train_end(self) -> None:
        self._call("on_train_end")

    def take_evaluate(self) -> bool:
        asked, self.control.should_evaluate = self.control.should_evaluate, False
        return asked

    def take_save(self) -> bool:
        asked, self.control.should_save = self.control.should_save, False
        return asked

    def wants_stop(self) -> bool:
        return bool(self.control.should_training_stop)
