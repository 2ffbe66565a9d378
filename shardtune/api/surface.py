"""What a TRL script calls on its trainer around ``train()``, as transformers' Trainer means it: ``accelerator``,
``push_to_hub`` / ``hub_model_id`` / ``create_model_card``, ``log_metrics`` / ``save_metrics`` / ``save_state``,
``end``, the callback list, ``is_world_process_zero``, ``processing_class``. Files are written by the main process,
as Trainer writes them; every process may call every method (those that upload or write return elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardtune.api.accelerator import ScriptAccelerator
from shardtune.api.callbacks import checked_callbacks
from shardtune.config.schema import ConfigError, TrainConfig


class ScriptSurface:
    """Mixed into the trainers (shardtune.api.trainer._Trainer), which provide these attributes."""

    objective: str
    config: TrainConfig
    callbacks: list[Any]
    state: Any
    args: Any
    _trained: bool
    _tokenizer_source: str
    _dataset_name: str | None
    _processing_class: Any  # the script's tokenizer, else the model's own once loaded

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output.dir)

    @property
    def accelerator(self) -> ScriptAccelerator:
        return ScriptAccelerator()

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    # -- the tokenizer -------------------------------------------------------------------------------------------------

    @property
    def processing_class(self) -> Any:
        """The tokenizer the run uses (the one given, else the model's own), loaded on first use."""
        if getattr(self, "_processing_class", None) is None:
            from shardtune.model.loading import load_tokenizer, resolve_model_name

            source = resolve_model_name(self._tokenizer_source)
            self._processing_class = load_tokenizer(source, self.config.model.trust_remote_code)
        return self._processing_class

    @property
    def tokenizer(self) -> Any:  # Trainer's older name
        return self.processing_class

    # -- callbacks ----------------------------------------------------------------------------------------------------

    def add_callback(self, callback: Any) -> None:
        self.callbacks.extend(checked_callbacks([callback]))

    def pop_callback(self, callback: Any) -> Any:
        """Remove ``callback`` (an instance, or the first of a class) and return it (None if absent)."""
        for i, existing in enumerate(self.callbacks):
            if existing is callback or (isinstance(callback, type) and isinstance(existing, callback)):
                return self.callbacks.pop(i)
        return None

    def remove_callback(self, callback: Any) -> None:
        self.pop_callback(callback)

    # -- metrics files and state (Trainer's names and formats) ---------------------------------------------------------

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` on the main process in Trainer's format (transformers' own ``log_metrics``: runtimes as
        h:mm:ss, FLOs in GF)."""
        from transformers.trainer_pt_utils import log_metrics

        log_metrics(self, split, metrics)

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """``output_dir/{split}_results.json`` (merged into ``all_results.json`` with ``combined``), main process."""
        if not self.is_world_process_zero():
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.output_dir / f"{split}_results.json", metrics)
        if combined:
            path = self.output_dir / "all_results.json"
            merged = json.loads(path.read_text()) if path.is_file() else {}
            _write_json(path, {**merged, **metrics})

    def save_state(self) -> None:
        """``output_dir/trainer_state.json`` (transformers' TrainerState: log history, steps, best metric)."""
        if self.is_world_process_zero():
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self.state.save_to_json(str(self.output_dir / "trainer_state.json"))

    # -- the hub -------------------------------------------------------------------------------------------------------

    @property
    def hub_model_id(self) -> str:
        """The repo ``push_to_hub`` uploads to: ``hub_model_id``, else output_dir's folder name (Trainer's rule)."""
        from shardtune.publishing.hub import hub_repo_id

        return hub_repo_id(self.config)

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        **unsupported: Any,
    ) -> None:
        """Write ``output_dir/README.md`` (main process): the base model, the data, how it was trained and its
        figures, with the hub's metadata header."""
        if not self.is_world_process_zero():
            return
        from shardtune.api.model_card import model_card

        text = model_card(
            self.config,
            self.state.log_history,
            model_name or self.output_dir.resolve().name,
            dataset_name or self._dataset_name,
            [tags] if isinstance(tags, str) else list(tags or []),
        )
        (self.output_dir / "README.md").write_text(text)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        **kwargs: Any,
    ) -> str | None:
        """Upload the trained model (or adapter), its tokenizer and a model card to ``hub_model_id`` (main process);
        returns the commit's URL (None on other processes). Offline or without a token: one line saying so."""
        if not self._trained:
            raise ConfigError("push_to_hub(): nothing trained yet: call train() first")
        if revision is not None:
            raise ConfigError("push_to_hub(revision=...): uploads go to the main branch: drop revision")
        if not self.is_world_process_zero():
            return None
        from shardtune.publishing.hub import check_can_upload, push_folder

        token = token or self.config.output.hub_token
        check_can_upload(self.hub_model_id, self.output_dir, token, after="now")
        self.create_model_card(
            model_name=kwargs.pop("model_name", None),
            dataset_name=kwargs.pop("dataset_name", None),
            tags=kwargs.pop("tags", None),
        )
        if kwargs:
            raise ConfigError(f"push_to_hub(): {', '.join(kwargs)} not taken: model_name, dataset_name and tags are")
        return push_folder(
            self.output_dir, self.hub_model_id, model_files(self.output_dir), self.config.output.hub_private_repo, token
        )

    def end(self) -> None:
        """Trainer's ``end()`` (transformers >= 5.18): the run closed its trackers and left its process group when
        ``train()`` returned; nothing is left to close."""


RUN_FILES = ("metrics.jsonl", "config.yaml")  # a run's own files, not the model's


def model_files(folder: Path) -> list[str]:
    """The published model's files in a run's folder (weights or adapter, config, tokenizer, model card): its plain
    files but the run's own and the hidden ones (the run lock)."""
    return sorted(
        path.name
        for path in folder.iterdir()
        if path.is_file() and not path.name.startswith(".") and path.name not in RUN_FILES
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    from shardtune.runtime.files import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=4, sort_keys=True) + "\n")
