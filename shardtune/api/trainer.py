"""``SFTTrainer`` / ``DPOTrainer`` in TRL's shape: the script's objects become the command line's inputs, the run is
the command line's worker (``torchrun ... -m shardtune.sft``'s), and the results are read back as TRL's.

Where it runs: under torchrun (one node or several, ``srun torchrun`` in SLURM; accelerate launch starts torchrun
workers too) every process of the script is one worker of the run; under plain ``python`` (or in a notebook's
kernel) the script's process is the run's one worker, as ``shardtune sft`` runs a one-process job in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any, Iterator, Sequence

from shardtune.api.callbacks import ArgsView, CallbackHooks, checked_callbacks, trl_row
from shardtune.api.configs import config_class, fields_of
from shardtune.api.inputs import (
    dataset_settings,
    model_settings,
    model_source,
    peft_settings,
    quantization_settings,
    refuse_image_rows,
    reward_functions,
    tokenizer_settings,
)
from shardtune.api.prediction import Predicting
from shardtune.api.surface import ScriptSurface, model_files
from shardtune.config.dialects.accelerate import clear_accelerate_loading_variables, environment_settings
from shardtune.config.fields import get_value
from shardtune.config.objectives import registration
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.launch.torchrun import in_place_worker_env
from shardtune.runtime.distributed import is_torchrun_worker
from shardtune.runtime.preemption import STOP_SIGNALS
from shardtune.training.engine.checkpoint.layout import checkpoints_dir
from shardtune.training.engine.checks import prepare
from shardtune.training.engine.hooks import install
from shardtune.training.engine.worker import run_worker
from shardtune.training.objectives.grpo.rewards import register_in_process
from shardtune.training.objectives.grpo.tools import register_in_process as register_tools


class TrainOutput(tuple):
    """TRL's ``train()`` result: (global_step, training_loss, metrics)."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any]

    def __new__(cls, global_step: int, training_loss: float, metrics: dict[str, Any]) -> "TrainOutput":
        out = super().__new__(cls, (global_step, training_loss, metrics))
        out.global_step, out.training_loss, out.metrics = global_step, training_loss, metrics
        return out


@contextlib.contextmanager
def _worker_environment() -> Iterator[None]:
    """Under torchrun: as it is. Else this process is rank 0 of 1, as ``shardtune sft`` runs one process in place."""
    if is_torchrun_worker():
        yield
        return
    added = in_place_worker_env()
    saved = {k: os.environ.get(k) for k in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """The run records SIGTERM / SIGUSR1 / SIGINT to stop after a step with a checkpoint; after train() the script's
    own handlers are back (Ctrl-C stops the script's later code as before)."""
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _refuse(name: str, value: Any, why: str) -> None:
    if value is not None and value != (None, None):
        raise ConfigError(f"{name}: {why}")


class _Trainer(ScriptSurface, Predicting):
    objective = "sft"
    refusals: dict[str, str] = {}  # argument -> why it is refused (the class's: REFUSED below)

    def __init__(
        self,
        model: Any,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        quantization_config: Any = None,
        **unsupported: Any,
    ) -> None:
        self.callbacks = checked_callbacks(unsupported.pop("callbacks", None))
        formatting_func = unsupported.pop("formatting_func", None)
        self._take_metric_functions(unsupported)  # compute_metrics, preprocess_logits_for_metrics
        objective_pairs = self._objective_settings(unsupported)
        for name, value in unsupported.items():
            _refuse(name, value, self.refusals[name])
        model_pairs = model_settings(model)
        self.args = args if args is not None else self._default_args(model)
        given = fields_of(self.args)  # validated as the command line's settings just below, with the rest
        if self.callbacks and not given.get("load_best_model_at_end"):  # what a callback compares (EarlyStopping)
            self._for_callbacks: dict[str, Any] = {
                k: given.pop(k) for k in ("metric_for_best_model", "greater_is_better") if k in given
            }
        else:
            self._for_callbacks = {}
        # TRL loads the tokenizer from the model's own name or path when the script gives none
        self._tokenizer_source = model_source(processing_class if processing_class is not None else model, model)
        self._pairs = [
            ("defaults", "trl"),
            # a script run again where it ran before runs, as with TRL: the ended run moves into output_dir/previous/
            ("output.previous_run", "move_aside"),
            *environment_settings(
                dict(os.environ)
            ),  # under accelerate launch: its file's strategy, as the CLI reads it
            *given.items(),
            *model_pairs,
            *objective_pairs,
            *tokenizer_settings(processing_class if processing_class is not None else _object_source(model, self)),
            *peft_settings(peft_config),
            *quantization_settings(quantization_config),
            *dataset_settings(train_dataset, eval_dataset, formatting_func),
        ]
        clear_accelerate_loading_variables()  # read above; shardtune loads the weights itself
        self.config = self._config()  # every refusal here, when the trainer is made
        refuse_image_rows(
            self.objective, self.config.model.name, train_dataset=train_dataset, eval_dataset=eval_dataset
        )
        self._datasets = (train_dataset, eval_dataset, formatting_func)
        self._dataset_name = _dataset_name(train_dataset)
        self._starting_model = dict(model_pairs)["model_name_or_path"]
        self._processing_class = processing_class if hasattr(processing_class, "save_pretrained") else None
        self._evaluations = 0
        self.state = _new_state()
        self._model: Any = None
        self._trained = False

    def _default_args(self, model: Any) -> Any:
        """TRL's default when a script passes no args: ``<model's name>-<SFT|DPO|GRPO>`` as output_dir."""
        name = str(model) if isinstance(model, (str, os.PathLike)) else getattr(model.config, "_name_or_path", "")
        name = Path(name.rstrip("/")).name.removeprefix("preset:") or "model"
        return config_class(self.objective)(output_dir=f"{name}-{self.objective.upper()}")

    def _objective_settings(self, arguments: dict[str, Any]) -> list[tuple[str, Any]]:
        """The objective's own constructor arguments, taken out of ``arguments``, as settings."""
        return []

    def _config(self, more: Sequence[tuple[str, Any]] = ()) -> TrainConfig:
        return self._config_of(self._pairs, more)

    def _config_of(self, pairs: list[tuple[str, Any]], more: Sequence[tuple[str, Any]] = ()) -> TrainConfig:
        from shardtune.config.flags import build_config

        return build_config([*pairs, *more], None, (), [], self.objective)

    def train(self, resume_from_checkpoint: str | bool | None = None, **unsupported: Any) -> TrainOutput:
        """Train; ``resume_from_checkpoint``: True, the newest checkpoint of output_dir; a path, that checkpoint."""
        for name, value in unsupported.items():
            _refuse(name, value, "not built (hyperparameter search, ignore_keys_for_eval): drop it")
        more = []
        if resume_from_checkpoint:
            more.append(
                ("checkpoint.resume", "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint))
            )
        cfg = self._config(more)
        self._run(cfg, "run", callbacks=True)
        self.config = cfg
        self._trained = True
        self._model = None
        history = self._log_history()
        self.state = _state_after(history, cfg, {**fields_of(self.args), **self._for_callbacks})
        steps = [row for row in history if "loss" in row]
        mean = sum(r["loss"] for r in steps) / len(steps) if steps else float("nan")
        metrics = {"train_loss": mean, "epoch": self.state.epoch}
        return TrainOutput(self.state.global_step, mean, metrics)

    def _log_history(self) -> list[dict[str, Any]]:
        return _rows(self.output_dir)

    def _run(self, cfg: TrainConfig, what: str, callbacks: bool = False) -> None:
        """``cfg`` run by this process as one worker of the job (the script's callbacks with ``callbacks``); a
        refusal or a failure is this call's exception, on every rank alike; an exception of the script's own code
        (a reward function, a callback) is raised again here, with its traceback."""
        with _worker_environment():
            prepare(cfg, int(os.environ["WORLD_SIZE"]))
            hooks = (
                CallbackHooks(
                    self.callbacks,
                    ArgsView({**fields_of(self.args), **self._for_callbacks}, cfg),
                    int(os.environ["RANK"]),
                )
                if callbacks and self.callbacks
                else None
            )
            with install(hooks), self._predicting(cfg), _signal_handlers_kept():
                status = run_worker(cfg, prepared=True, exit_when_stopped=True, reraise=True)
        if status != 0:
            raise RuntimeError(f"shardtune: the {what} stopped with status {status} (its error is above)")

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
    ) -> dict[str, Any]:
        """TRL's ``evaluate()``: the model as it is now (the trained one after train(), else the starting one) on
        ``eval_dataset`` (default: the trainer's), by the run's own evaluation (every process, exact across
        layouts): the metrics under TRL's names with ``metric_key_prefix``. It writes only its metrics row, in
        output_dir/evaluations/; the row joins ``state.log_history`` and the callbacks see it, as Trainer's."""
        metrics, cfg = self._evaluation(eval_dataset, ignore_keys, metric_key_prefix)
        self._logged_evaluation(metrics, cfg)
        return metrics

    def _evaluation(
        self, eval_dataset: Any, ignore_keys: Any, metric_key_prefix: str
    ) -> tuple[dict[str, Any], TrainConfig]:
        """An evaluation's metrics (and its config), not logged: evaluate()'s, and predict()'s (which Trainer does
        not log)."""
        _refuse("ignore_keys", ignore_keys, "not taken: every metric the objective computes is returned; drop it")
        pairs = list(self._pairs)
        if eval_dataset is not None:
            train, _, formatting_func = self._datasets
            pairs += dataset_settings(train, eval_dataset, formatting_func)
        if self._trained:
            pairs += self._trained_model_settings()
        self._evaluations += 1
        folder = self.output_dir / "evaluations" / f"{self._evaluations:03d}"
        more = [("eval_only", True), ("output_dir", str(folder)), ("overwrite_output_dir", True)]
        cfg = self._config_of(pairs, [*more, ("report_to", "none"), ("save_model", False)])
        self._run(cfg, "evaluation")
        metrics = {k: v for k, v in _rows(folder)[-1].items() if k not in ("step", "epoch")}
        metrics = {metric_key_prefix + k.removeprefix("eval"): v for k, v in metrics.items()}
        return {**metrics, "epoch": self.state.epoch}, cfg

    def _logged_evaluation(self, metrics: dict[str, Any], cfg: TrainConfig) -> None:
        """As Trainer's evaluate() logs its metrics: a log_history row, then the callbacks' on_log and on_evaluate."""
        self.state.log_history.append({**metrics, "step": self.state.global_step})
        if self.callbacks:
            args = ArgsView({**fields_of(self.args), **self._for_callbacks}, cfg)
            hooks = CallbackHooks(self.callbacks, args, int(os.environ.get("RANK", "0")), state=self.state)
            hooks.logged_evaluation(metrics)

    def _trained_model_settings(self) -> list[tuple[str, Any]]:
        """The trained run's published output as the model to evaluate (an adapter: on its base)."""
        out = self.output_dir
        if not self.config.output.save_model or not any((out / f).is_file() for f in PUBLISHED):
            raise ConfigError(
                f"evaluate(): the trained model was not written to {out} (save_model off): evaluate during "
                "training instead (eval_strategy steps or epoch), or keep save_model on"
            )
        if (out / "adapter_config.json").is_file():
            return [("from_peft_checkpoint", str(out))]
        settings = [("model_name_or_path", str(out))]
        reference = registration(self.objective).reference_setting
        if reference and not get_value(self.config, reference):  # the reference stays the starting weights
            settings.append((reference, self._starting_model))
        return settings

    @property
    def model(self) -> Any:
        """After train(): the trained model (a PeftModel with the adapter for adapter runs), loaded on the CPU
        from the run's published output on every process; before: the starting model, loaded on the CPU (the run
        loads and places its own copy: changing this object changes nothing the run trains)."""
        if self._model is None:
            self._model = load_published(self.output_dir) if self._trained else _load_starting(self.config)
        return self._model

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Copy the trained model's files (weights or adapter, config, tokenizer, model card) to ``output_dir``
        (the main process writes; the run's own files and its lock stay)."""
        if not self._trained:
            raise ConfigError("save_model(): nothing trained yet: call train() first")
        target = Path(output_dir) if output_dir else self.output_dir
        if target.resolve() == self.output_dir.resolve() or not self.is_world_process_zero():
            return
        target.mkdir(parents=True, exist_ok=True)
        for name in model_files(self.output_dir):
            shutil.copy2(self.output_dir / name, target / name)


def _rows(folder: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl rows under TRL's names ([] before any)."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    return [trl_row(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


PUBLISHED = ("adapter_config.json", "config.json")  # what a run's published model (or adapter) always has


def load_published(folder: Path) -> Any:
    """The model a run published: a full model directory, or an adapter on its base (a vision-language model as
    its own class, AutoModelForImageTextToText)."""
    if (folder / "adapter_config.json").is_file():
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
        if base and _auto_model_class(base).__name__ != "AutoModelForCausalLM":
            from peft import PeftModel

            return PeftModel.from_pretrained(_auto_model_class(base).from_pretrained(base), str(folder))
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(str(folder))
    return _auto_model_class(str(folder)).from_pretrained(str(folder))


def _auto_model_class(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language model (as the run built it)."""
    import transformers

    from shardtune.model.loading import is_vision_model

    vision = is_vision_model(name_or_path, trust_remote_code)
    return transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM


def _load_starting(cfg: TrainConfig) -> Any:
    from shardtune.model.loading import resolve_model_name

    name = resolve_model_name(cfg.model.name)
    auto = _auto_model_class(name, cfg.model.trust_remote_code)
    return auto.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)


def _object_source(model: Any, trainer: "_Trainer") -> str | None:
    """A model object's tokenizer source (None for a model given by name: the run loads its own)."""
    return None if isinstance(model, (str, os.PathLike)) else trainer._tokenizer_source


def _new_state(**fields: Any) -> Any:
    from transformers import TrainerState

    return TrainerState(**fields)


def _state_after(history: list[dict[str, Any]], cfg: TrainConfig, given: dict[str, Any]) -> Any:
    """transformers' TrainerState of a finished run: its log, steps and epoch, and the best evaluation (by
    metric_for_best_model, when the script names one or loads the best model) with its checkpoint, as Trainer keeps
    it; ``given``: the script's fields (a callback's metric_for_best_model is not the run's setting)."""
    steps = [row for row in history if "loss" in row]
    last = steps[-1] if steps else {}
    state = _new_state(
        global_step=last.get("step", 0),
        epoch=last.get("epoch", 0.0),
        max_steps=last.get("step", 0),
        log_history=history,
        train_batch_size=cfg.train.batch_size,
        is_local_process_zero=int(os.environ.get("LOCAL_RANK", "0")) == 0,
        is_world_process_zero=int(os.environ.get("RANK", "0")) == 0,
    )
    metric = given.get("metric_for_best_model") or cfg.eval.metric_for_best_model
    if metric or cfg.eval.load_best_model_at_end:
        name = metric or "loss"  # Trainer's default with load_best_model_at_end
        key = name if name.startswith("eval_") else f"eval_{name}"
        greater = given.get("greater_is_better", cfg.eval.greater_is_better)
        greater = (not key.endswith("loss")) if greater is None else greater
        rows = [row for row in history if key in row]
        if rows:
            best = (max if greater else min)(rows, key=lambda row: row[key])
            state.best_metric, state.best_global_step = best[key], best.get("step")
            folder = checkpoints_dir(cfg.output.dir) / f"step-{best.get('step', 0):06d}"
            state.best_model_checkpoint = str(folder) if folder.is_dir() else None
    return state


def _dataset_name(dataset: Any) -> str | None:
    """A datasets.Dataset's own name (its builder's: a hub id or the loader), for the model card."""
    info = getattr(dataset, "info", None)
    name = getattr(info, "dataset_name", None) if info is not None else None
    return name if name and name not in ("json", "parquet", "csv", "generator", "text", "arrow") else None


def ref_model_settings(arguments: dict[str, Any]) -> list[tuple[str, Any]]:
    """DPO's and KTO's ``ref_model``, taken out of the constructor's ``arguments``, as settings (None: the starting
    weights)."""
    ref_model = arguments.pop("ref_model", None)
    return model_settings(ref_model, "ref_model", "ref_model") if ref_model is not None else []


def given(arguments: dict[str, Any]) -> dict[str, Any]:
    """A trainer's constructor arguments (its ``locals()``), as TRL's signature names them, for _Trainer."""
    return {k: v for k, v in arguments.items() if k not in ("self", "__class__")}


REFUSED = {
    "data_collator": "not taken: shardtune builds the batches (padding, packing, padding-free) from the data flags: "
    "drop it",
    "compute_loss_func": "not taken: the loss is shardtune's (normalised by the global label tokens): drop it",
    "optimizers": "not taken: the optimizer and schedule come from the config (optim, lr_scheduler_type): drop it",
    "optimizer_cls_and_kwargs": "not taken: the optimizer comes from the config (optim): drop it",
}


class SFTTrainer(_Trainer):
    """TRL's ``SFTTrainer`` on shardtune (same constructor names)."""

    objective = "sft"
    refusals = REFUSED

    def __init__(
        self,
        model: Any,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_loss_func: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Any = None,
        quantization_config: Any = None,
        peft_config: Any = None,
        formatting_func: Any = None,
    ) -> None:
        super().__init__(**given(locals()))


class DPOTrainer(_Trainer):
    """TRL's ``DPOTrainer`` on shardtune (same constructor names)."""

    objective = "dpo"
    refusals = REFUSED

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ) -> None:
        super().__init__(**given(locals()))

    def _objective_settings(self, arguments: dict[str, Any]) -> list[tuple[str, Any]]:
        return ref_model_settings(arguments)


GRPO_REFUSED = {
    **REFUSED,
    "reward_processing_classes": "not taken: a reward model's tokenizer is loaded from its directory: drop it",
    "rollout_func": "not taken: completions are sampled by shardtune's decode loop with the trained model: drop it",
    "environment_factory": "environments (multi-turn rollouts) are not built: drop it",
}


def _refuse_streamed(train_dataset: Any) -> None:
    import datasets

    if isinstance(train_dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise ConfigError(
            "train_dataset: an IterableDataset is not streamed for GRPO (its prompts are read whole): pass a "
            "datasets.Dataset or a list of dicts"
        )


class GRPOTrainer(_Trainer):
    """TRL's ``GRPOTrainer`` on shardtune (same constructor names). ``reward_funcs``: a callable (kept in the process
    that runs the script: every process of a run does), a string as ``--reward_funcs`` takes it (path.py:function,
    package.module.function, a reward model's directory or hub id), or a list of them."""

    objective = "grpo"
    refusals = GRPO_REFUSED

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Any = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ) -> None:
        _refuse_streamed(train_dataset)
        super().__init__(**given(locals()))

    def _objective_settings(self, arguments: dict[str, Any]) -> list[tuple[str, Any]]:
        entries, self._reward_funcs = reward_functions(arguments.pop("reward_funcs"))  # kept in this process
        self._tools = list(arguments.pop("tools", None) or [])  # callables, kept in this process as well
        return [("reward_funcs", entries), *([("tools", register_tools(self._tools))] if self._tools else [])]

    def _run(self, cfg: TrainConfig, what: str, callbacks: bool = False) -> None:
        register_in_process(self._reward_funcs)  # again: another GRPOTrainer of the script may have registered its own
        register_tools(self._tools)
        super()._run(cfg, what, callbacks)


__all__ = ["DPOTrainer", "GRPOTrainer", "SFTTrainer", "TrainOutput"]
