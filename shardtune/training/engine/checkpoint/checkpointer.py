"""Training checkpoints that resume exactly: torch.distributed.checkpoint folders written by every rank, published
whole by rank 0, rotated, found again on resume."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from shardtune.config.checks import check_previous_run
from shardtune.config.fields import settings_by
from shardtune.config.flags import flat_settings, from_dict, spelling_of, to_yaml
from shardtune.config.schema import ConfigError, TrainConfig, effective_batch_size
from shardtune.model.loading import model_head, name_pad_token, training_model_config
from shardtune.parallel.deepspeed import deepspeed_resume_problem
from shardtune.parallel.optim import apply_settings_on_resume
from shardtune.publishing.saving import save_hf_model
from shardtune.runtime.distributed import (
    DistEnv,
    all_reduce_sum,
    barrier,
    broadcast_from_main,
    print0,
    warn0,
)
from shardtune.runtime.elastic import worker_group_attempt
from shardtune.runtime.errors import CheckpointError
from shardtune.runtime.files import fsync_dir, write_text_atomic
from shardtune.runtime.preemption import Preempted, stop_signal_anywhere
from shardtune.training.engine.checkpoint.best import BestModel
from shardtune.training.engine.checkpoint.files import (
    remove_checkpoint,
    verify_checkpoint,
    write_manifest,
)
from shardtune.training.engine.checkpoint.layout import (
    FORMAT_VERSION,
    LATEST_FILE,
    STATE_FILE,
    checkpoint_name,
    checkpoint_root,
    checkpoint_step,
    complete_checkpoints,
    newest_verified_checkpoint,
    objective_file,
    read_trainer_state,
    resolve_checkpoint,
    unfinished_saves,
)
from shardtune.training.engine.intervals import epochs_reached, every

# Settings that may change between a run and its resumption without changing what is trained (run control), and
# the optimizer hyperparameters a resume applies to the restored optimizer (parallel/optim.apply_settings_on_resume):
# what each field of the config declares (shardtune.config.schema).
OPTIMIZER_SETTINGS = settings_by(lambda info: info.affects == "optimizer")
RUN_CONTROL_SETTINGS = settings_by(lambda info: info.affects == "run")


def check_checkpointing(cfg: TrainConfig, world_size: int) -> None:
    # sizes only: the worker's rank 0 checks the hashes (and says which checkpoints it skipped) before loading
    path = (
        resolve_checkpoint(cfg.checkpoint.resume, checkpoint_root(cfg), hashes=False) if cfg.checkpoint.resume else None
    )
    if (
        cfg.checkpoint.resume == "auto" and path is None
    ):  # nothing to resume: a new run, refused over a previous one like any
        check_previous_run(cfg, resuming=False)
    if path is not None:
        saved = read_trainer_state(path)
        if not saved.get("optimizer_saved", True):
            raise ConfigError(
                f"--resume {cfg.checkpoint.resume}: {path} was saved with --save_optimizer false and holds no "
                "optimizer state: start a new run from its export (shardtune export), or resume from "
                "a checkpoint saved with the optimizer"
            )
        by_deepspeed = saved.get("strategy") == "deepspeed"
        if by_deepspeed != (cfg.parallel.strategy == "deepspeed"):
            how, fix = (
                ("by DeepSpeed ZeRO, whose files only DeepSpeed reads", "add")
                if by_deepspeed
                else ("without DeepSpeed", "drop")
            )
            raise ConfigError(
                f"--resume {cfg.checkpoint.resume}: {path} was saved {how}: {fix} --enable_deepspeed, or start a "
                "new run from its export (shardtune export)"
            )
        problem = by_deepspeed and deepspeed_resume_problem(path, saved, world_size, cfg.parallel.zero_stage)
        if problem:
            raise ConfigError(f"--resume {cfg.checkpoint.resume}: {problem}")


def checkpointing_enabled(cfg: TrainConfig) -> bool:
    """Checkpoints are written when --save_steps N > 0, a --checkpoint_type or a --dist_checkpoint_root_folder is
    given."""
    return (
        cfg.checkpoint.save_steps > 0
        or bool(cfg.checkpoint.checkpoint_type)
        or bool(cfg.checkpoint.dist_checkpoint_root_folder)
    )


def checkpoint_bytes_estimate(model: nn.Module, full_model: bool) -> int:
    """Trainable parameters x 3 (weights + AdamW's two moments), plus the whole model for FULL_STATE_DICT."""
    params = list(model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    whole = sum(p.numel() * p.element_size() for p in params) if full_model else 0
    return 3 * trainable + whole


def settings_changed(saved: dict, current: TrainConfig) -> list[str]:
    """Settings (canonical dotted names) that differ between a checkpoint's config.yaml (this release's grouped form
    or an earlier one's flat names) and this run's, run control aside."""
    now, before = flat_settings(current), flat_settings(from_dict(saved))
    return sorted(k for k in now if k not in RUN_CONTROL_SETTINGS and now[k] != before[k])


def config_hash(cfg: TrainConfig) -> str:
    trained = {k: v for k, v in flat_settings(cfg).items() if k not in RUN_CONTROL_SETTINGS}
    return hashlib.sha256(json.dumps(trained, sort_keys=True, default=str).encode()).hexdigest()[:16]


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random generators as tensors (so that reading them needs no unpickling)."""
    version, internal, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *internal], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, *internal = state["python"].tolist()
    gauss = float(state["python_gauss"][0])
    random.setstate((version, tuple(internal), None if math.isnan(gauss) else gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def rng_file(path: Path, rank: int) -> Path:
    return path / "rng" / f"rank-{rank:05d}.pt"


def failure_reason(error: BaseException) -> str:
    """The root cause in a few words: 'No space left on device' rather than DCP's multi-rank traceback."""
    if isinstance(error, CheckpointException):
        causes = [exc for exc, _trace in error.failures.values()]
        oserrors = [e for e in causes if isinstance(e, OSError)]
        error = oserrors[0] if oserrors else (causes[0] if causes else error)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _all_ok(ok: bool, device: torch.device) -> bool:
    """True when every rank reports ok (a collective: every rank must call it)."""
    return int(all_reduce_sum(torch.tensor([0.0 if ok else 1.0]), device)[0]) == 0


@dataclass
class Position:
    """Where training stands: optimizer steps done in all, the epoch, and the steps done within it."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    data: dict | None = None  # a streamed run's data position (shardtune.data.streaming); None: the epoch's order


class Checkpointer:
    """Writes checkpoints at the configured times and restores the newest one when resuming.

    When: every --save_steps optimizer steps, at the end of each completed epoch (after its LR step and
    evaluation), and after the last step, whenever checkpointing is enabled (see checkpointing_enabled).
    """

    def __init__(self, cfg: TrainConfig, env: DistEnv, strategy, tokenizer):
        self.cfg, self.env, self.strategy, self.tokenizer = cfg, env, strategy, tokenizer
        self.enabled = checkpointing_enabled(cfg)
        self.full_model = cfg.checkpoint.checkpoint_type == "FULL_STATE_DICT"
        self.root = checkpoint_root(cfg)
        self.attempt = worker_group_attempt()  # the same on every node (shardtune/runtime/elastic.py)
        self.resume_from = self._resume_source()
        self.resume_state = read_trainer_state(self.resume_from) if self.resume_from else None
        self.training: tuple | None = None
        self.bytes_needed = 0
        self.last_saved: Path | None = self.resume_from
        self.data_position: Callable[[], dict | None] | None = None  # a streamed run's, saved with each checkpoint
        self.objective_state: Callable[[], dict | None] | None = None  # this rank's, saved beside its RNG state
        self.best: BestModel | None = (
            None  # --load_best_model_at_end: the scores (set by the loop with the run's steps)
        )
        self.save_every = cfg.checkpoint.save_steps
        if env.is_main:
            for stale in unfinished_saves(self.root):
                print0(f"checkpoint: removing {stale.name}, left by a save that did not finish")
                shutil.rmtree(stale, ignore_errors=True)

    def _resume_source(self) -> Path | None:
        """The checkpoint to resume from, decided by rank 0 and taken by every rank: all ranks must load the same
        one, and a shared file system may show a node an older ``latest`` for a moment."""
        found, error = None, None
        if self.env.is_main:
            try:
                found = self._find_resume_source()
            except ConfigError as e:
                error = str(e)
        found, error = broadcast_from_main((found, error))
        if error is not None:
            raise ConfigError(error)
        return found

    def _find_resume_source(self) -> Path | None:
        notes: list[str] = []
        try:
            return self._choose_resume_source(notes)
        finally:
            for note in notes:
                warn0(note)

    def _choose_resume_source(self, notes: list[str]) -> Path | None:
        if self.cfg.checkpoint.resume:
            return resolve_checkpoint(self.cfg.checkpoint.resume, self.root, notes=notes)
        if self.attempt > 0:  # the worker group was restarted (--max_restarts): after a failure on any node
            latest = newest_verified_checkpoint(self.root, notes=notes)
            if latest is not None:
                print0(f"restart {self.attempt} of the worker group: resuming automatically from {latest}")
            else:
                print0(
                    f"restart {self.attempt} of the worker group: no complete checkpoint in {self.root}, "
                    "training starts over"
                )
            return latest
        return None

    # -- metrics.jsonl continues where the checkpoint was taken ------------------------------------------------
    def keep_metrics_rows(self, metrics_path: Path, total_steps: int) -> bool:
        """Rank 0: drop rows logged after the checkpoint (a crashed run's last steps, an evaluation that training
        on will redo); True: append to the file. A run resumed at its end (``total_steps`` reached) trains and
        evaluates nothing again, so its rows all stay."""
        if self.resume_state is None or not metrics_path.is_file():
            return False
        keep = self.resume_state.get("metrics_rows")
        same_run = self.resume_from.parent.resolve() == self.root.resolve()  # type: ignore[union-attr]
        if same_run and keep is not None and self.resume_state["step"] < total_steps:
            lines = metrics_path.read_text(encoding="utf-8").splitlines(keepends=True)
            write_text_atomic(metrics_path, "".join(lines[:keep]))
        return True

    # -- start: space check and restore -------------------------------------------------------------------------
    def start(self, model: nn.Module, optimizer, scheduler, result, steps_per_epoch: int, total_steps: int) -> Position:
        self.training = (model, optimizer, scheduler, result)
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.save_every = every(self.cfg.checkpoint.save_steps, total_steps)
        if self.enabled:
            self._check_space(model)
        if self.resume_state is None:
            return Position()
        return self._restore()

    def _check_space(self, model: nn.Module) -> None:
        need = self.bytes_needed = checkpoint_bytes_estimate(model, self.full_model)
        planned = 1 + self.total_steps // self.save_every if self.save_every else 1
        planned += epochs_reached(self.total_steps, self.steps_per_epoch)
        keep = (
            min(planned, self.cfg.checkpoint.save_total_limit + 1) if self.cfg.checkpoint.save_total_limit else planned
        )
        ok = True
        if self.env.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.root).free
            if free < need:
                ok = False
            elif free < need * keep:
                warn0(
                    f"{self.root} has {free / 1e6:,.1f} MB free; {keep} checkpoints of about {need / 1e6:,.1f} MB "
                    f"each may be on disk at once: free space, or lower --save_total_limit"
                )
        if not _all_ok(ok, self.env.device):
            raise CheckpointError(
                f"{self.root} has {shutil.disk_usage(self.root).free / 1e6:,.1f} MB free, less "
                f"than one checkpoint (about {need / 1e6:,.1f} MB): free space or pass another "
                "--output_dir"
            )

    def _restore(self) -> Position:
        model, optimizer, scheduler, result = self.training  # type: ignore[misc]
        state, path = self.resume_state, self.resume_from
        assert state is not None and path is not None
        saved_cfg = yaml.safe_load((path / "config.yaml").read_text())
        changed = settings_changed(saved_cfg, self.cfg)
        if changed:
            applied = [k for k in changed if k in OPTIMIZER_SETTINGS]
            then, now = flat_settings(from_dict(saved_cfg)), flat_settings(self.cfg)
            names = {k: spelling_of(self.cfg, k).removeprefix("--") for k in changed}
            how = (
                (
                    f"; applied from step {state['step'] + 1} on: "
                    + ", ".join(f"{names[k]} {then[k]} -> {now[k]}" for k in applied)
                    + " (the optimizer's moments and the schedule's position are kept)"
                )
                if applied
                else ""
            )
            warn0(
                f"resuming with settings that differ from the checkpoint's ({', '.join(names.values())}): the run "
                f"will not equal an uninterrupted one{how}"
            )
        planned = state.get("total_steps")
        if self.cfg.optim.lr_scheduler == "cosine" and planned is not None and planned != self.total_steps:
            warn0(
                f"the cosine schedule now spans {self.total_steps} steps instead of the checkpoint's {planned} "
                f"(--max_steps / --num_epochs / batch changed): the learning rate from step {state['step']} "
                "on differs from the uninterrupted run's"
            )
        try:  # torch's CheckpointException is a BaseException: caught here by name, so that it is one line
            self.strategy.load_training_state(model, optimizer, path, state)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"{path} could not be loaded ({failure_reason(e)}): resume from another checkpoint "
                "(--resume CHECKPOINT_FOLDER), or start a new run"
            ) from e
        scheduler.load_state_dict(state["scheduler"])
        apply_settings_on_resume(optimizer, scheduler, self.cfg)  # this run's lr & co., not the checkpoint's
        own_rng = rng_file(path, self.env.rank)
        if own_rng.is_file():
            set_rng_state(torch.load(own_rng, weights_only=True), self.env.device)
        result.steps = state["step"]
        if "label_tokens" in state:
            result.num_tokens, result.label_tokens = state["num_tokens"], state["label_tokens"]
        else:  # an older checkpoint: its num_tokens counted label tokens, and the input tokens were not kept
            result.num_tokens, result.label_tokens = 0, state["num_tokens"]
            warn0(f"{path} predates the num_tokens count (TRL's: input tokens seen): it restarts from 0")
        result.train_time_s = state["train_time_s"]
        if self.best is not None:
            self.best.restore(state.get("best_model"))
        position = Position(state["step"], state["epoch"], state["step_in_epoch"], state.get("data_position"))
        global_batch = effective_batch_size(self.cfg, self.strategy.dims.dp_size)
        where = f"epoch {position.epoch + 1}, step {position.step_in_epoch} of {self.steps_per_epoch}"
        if position.data is not None:  # a stream: its rows are where the next step's begin, whatever the batch
            order = f"the stream continues at the row where step {position.step + 1}'s data begins"
        elif global_batch == state["global_batch_size"]:
            order = f"data order kept (global batch {global_batch} unchanged): continuing at {where}"
        else:
            order = (
                f"data order recomputed: global batch {state['global_batch_size']} -> {global_batch}, so "
                f"epoch {position.epoch + 1} restarts at its first step"
            )
            position.step_in_epoch = 0
        rng_note = "" if own_rng.is_file() else f"; ranks >= {state['world_size']} start their RNG from the seed"
        print0(
            f"resumed from {path} (step {position.step}, saved by {state['world_size']} processes, now "
            f"{self.env.world_size}): {order}{rng_note}"
        )
        return position

    # -- when to save --------------------------------------------------------------------------------------------
    def after_step(self, epoch: int, done_in_epoch: int) -> None:
        """After an optimizer step, its metrics row and its evaluation; the last step of an epoch, and the run's last
        step, are saved by after_epoch, after their evaluation (so a resume keeps that evaluation's row)."""
        step = self.training[3].steps  # type: ignore[index]
        if not self.enabled or done_in_epoch == self.steps_per_epoch or step >= self.total_steps:
            return
        if self.save_every and step % self.save_every == 0:
            self.save(Position(step, epoch, done_in_epoch))

    def after_epoch(self, epoch: int, done_in_epoch: int) -> None:
        """After an epoch's LR step and evaluation: a completed epoch (every one without --save_steps; with it, one
        on its cadence), or the run's end."""
        step = self.training[3].steps  # type: ignore[index]
        if not self.enabled:
            return
        on_cadence = not self.save_every or step % self.save_every == 0  # --save_steps N: every N (Trainer's)
        if done_in_epoch == self.steps_per_epoch and (on_cadence or step >= self.total_steps):
            self.save(Position(step, epoch + 1, 0))
        elif step >= self.total_steps and (self.last_saved is None or checkpoint_step(self.last_saved) != step):
            self.save(Position(step, epoch, done_in_epoch))

    def save_now(self, epoch: int, done_in_epoch: int) -> Path:
        """This step's checkpoint (a script's callback set should_save), unless it is written already; also with
        checkpointing off, as a stop signal's. An epoch's last step is saved after the epoch's end (its LR step and
        evaluation), as after_epoch saves it: ``done_in_epoch`` 0 of the next epoch."""
        step = self.training[3].steps  # type: ignore[index]
        if self.last_saved is not None and checkpoint_step(self.last_saved) == step:
            return self.last_saved
        return self.save(Position(step, epoch, done_in_epoch))

    def stop_if_requested(self, epoch: int, done_in_epoch: int) -> None:
        """Collective, after each optimizer step but the last: when a stop signal reached any rank, save this step
        (also with checkpointing off) and raise Preempted on every rank (see shardtune/runtime/preemption.py)."""
        signal_name = stop_signal_anywhere(self.env.device)
        if signal_name is None:
            return
        step = self.training[3].steps  # type: ignore[index]
        saved = (
            self.last_saved
            if self.last_saved is not None and checkpoint_step(self.last_saved) == step
            else (self.save(Position(step, epoch, done_in_epoch)))
        )
        raise Preempted(signal_name, step, saved)

    # -- writing -------------------------------------------------------------------------------------------------
    def save(self, position: Position) -> Path:
        model, optimizer, scheduler, result = self.training  # type: ignore[misc]
        name = checkpoint_name(position.step)
        final, tmp = self.root / name, self.root / f"{name}.tmp-{self.attempt}"
        started = time.perf_counter()
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            self.root.mkdir(parents=True, exist_ok=True)
        barrier()
        error: BaseException | None = None
        try:
            self.strategy.save_training_state(model, optimizer, tmp)
            full_state = self.strategy.full_state_dict(model) if self.full_model else None
        except (OSError, RuntimeError, CheckpointException) as e:  # DCP raises on every rank when one fails
            error = e
        if error is None:
            try:
                rng_file(tmp, self.env.rank).parent.mkdir(parents=True, exist_ok=True)
                torch.save(rng_state(self.env.device), rng_file(tmp, self.env.rank))
                if (objective := self.objective_state() if self.objective_state else None) is not None:
                    objective_file(tmp, self.env.rank).parent.mkdir(parents=True, exist_ok=True)
                    torch.save(objective, objective_file(tmp, self.env.rank))
                if self.env.is_main:
                    self._write_rank0_files(tmp, position, scheduler, result, full_state)
            except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
                error = e
        if not _all_ok(error is None, self.env.device):
            self._fail(name, tmp, error)
        try:  # collective: every rank fsyncs and hashes a share of the files, rank 0 writes the manifest
            write_manifest(tmp, self.env.rank, self.env.world_size)
        except OSError as e:
            error = e
        if not _all_ok(error is None, self.env.device):
            self._fail(name, tmp, error)
        if self.env.is_main:
            try:
                self._publish(tmp, final)
            except OSError as e:
                error = e
        if not _all_ok(error is None, self.env.device):
            self._fail(name, tmp, error)
        self.last_saved = final
        if self.env.is_main:
            print0(f"checkpoint: {final} ({dir_bytes(final) / 1e6:,.2f} MB, {time.perf_counter() - started:.2f} s)")
        return final

    def _write_rank0_files(self, tmp: Path, position: Position, scheduler, result, full_state) -> None:
        model = self.strategy.unwrap(self.training[0])  # type: ignore[index]
        if full_state is not None:
            save_hf_model(model, full_state, self.tokenizer, tmp / "hf_model")
        # the source's dtype (not the fp32 master's), with what training changes (--rope_scaling): export rebuilds it
        hf_config = training_model_config(self.cfg)
        name_pad_token(hf_config, model_head(self.cfg), self.tokenizer)
        hf_config.save_pretrained(tmp / "hf_config")
        if (
            self.cfg.model.trust_remote_code
        ):  # the model's own modeling code (the config's is saved with it): export runs it
            from transformers.dynamic_module_utils import custom_object_save

            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            if getattr(base, "_auto_class", None) is not None:
                custom_object_save(base, tmp / "hf_config")
        self.tokenizer.save_pretrained(tmp / "hf_config")
        (tmp / "config.yaml").write_text(to_yaml(self.cfg), encoding="utf-8")
        metrics = Path(self.cfg.output.dir) / "metrics.jsonl"
        state = {
            "format_version": FORMAT_VERSION,
            "step": position.step,
            "epoch": position.epoch,
            "step_in_epoch": position.step_in_epoch,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.total_steps,
            "global_batch_size": effective_batch_size(self.cfg, self.strategy.dims.dp_size),
            "world_size": self.env.world_size,
            "seed": self.cfg.train.seed,
            "strategy": self.strategy.name,
            "model_name": self.cfg.model.name,
            "adapter_only": bool(bool(self.cfg.peft.method)),
            "checkpoint_type": self.cfg.checkpoint.checkpoint_type or "SHARDED_STATE_DICT",
            "optimizer_saved": self.cfg.checkpoint.save_optimizer,
            "scheduler": scheduler.state_dict(),
            "num_tokens": result.num_tokens,  # TRL's: real input tokens so far
            "label_tokens": result.label_tokens,
            "train_time_s": result.train_time_s,
            "metrics_rows": (
                sum(1 for _ in metrics.open(encoding="utf-8"))
                if self.cfg.logging.save_metrics and metrics.is_file()
                else None
            ),
            "config_hash": config_hash(self.cfg),
            **({"best_model": self.best.state()} if self.best is not None else {}),
            **({"data_position": self.data_position()} if self.data_position is not None else {}),
            **self.strategy.checkpoint_state(),
        }
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")

    def _publish(self, tmp: Path, final: Path) -> None:
        if final.exists():  # left by an earlier timeline (resumed from an older checkpoint): superseded
            remove_checkpoint(final)
        os.replace(tmp, final)
        fsync_dir(self.root)
        problem = verify_checkpoint(final, hashes=False)  # the hashes were taken from the disk just before
        if problem is not None:
            raise OSError(f"{final} does not verify after the rename: {problem}")
        write_text_atomic(self.root / LATEST_FILE, final.name + "\n")
        if self.cfg.checkpoint.save_total_limit:  # only now, with the new checkpoint verified, do older ones go
            step = checkpoint_step(final)
            older = [p for p in complete_checkpoints(self.root) if checkpoint_step(p) <= step]  # type: ignore
            best = self.best.choose(older) if self.best is not None else None
            for stale in older[: -self.cfg.checkpoint.save_total_limit]:
                if best is None or stale != best[0]:  # --load_best_model_at_end: the best one stays
                    remove_checkpoint(stale)

    def _fail(self, name: str, tmp: Path, error: BaseException | None) -> None:
        free = shutil.disk_usage(self.root).free
        reason = failure_reason(error) if error is not None else "another rank failed to write its part"
        if free < self.bytes_needed:  # whatever layer reported it (DCP, torch.save), the disk is full
            reason = (
                f"No space left on device: {free / 1e6:,.1f} MB free, a checkpoint needs about "
                f"{self.bytes_needed / 1e6:,.1f} MB"
            )
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        kept = f"the previous checkpoint {self.last_saved} is kept" if self.last_saved else "no earlier checkpoint"
        raise CheckpointError(
            f"checkpoint {name} could not be written ({reason}): {kept}; free space in "
            f"{self.root} (or pass another --output_dir) and resume with --resume latest"
        )

    def describe_last(self) -> str:
        return (
            f"the last good checkpoint is {self.last_saved} (resume with --resume latest)"
            if self.last_saved
            else "no checkpoint was written"
        )


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_resume_fits(cfg: TrainConfig) -> None:
    """Before launch (``cfg.model.name`` resolved): a checkpoint that cannot load into this run's model is one line
    naming the mismatch, found before config.yaml or metrics.jsonl are touched."""
    path = resolve_checkpoint(cfg.checkpoint.resume, checkpoint_root(cfg)) if cfg.checkpoint.resume else None
    if path is None:
        return
    saved, flag = read_trainer_state(path), f"--resume {cfg.checkpoint.resume}"
    if saved.get("adapter_only") and not bool(cfg.peft.method):
        raise ConfigError(
            f"{flag}: {path} holds a PEFT adapter's training state: add --use_peft (and the run's "
            "--peft_method / --lora_config), or start a new run"
        )
    if not saved.get("adapter_only", bool(cfg.peft.method)) and bool(cfg.peft.method):
        raise ConfigError(f"{flag}: {path} holds a full model's training state: drop --use_peft, or start a new run")
    from transformers import AutoConfig

    from shardtune.model.peft import SHAPE_FIELDS

    trust = {"trust_remote_code": cfg.model.trust_remote_code}
    theirs, ours = (
        AutoConfig.from_pretrained(path / "hf_config", **trust).to_dict(),
        AutoConfig.from_pretrained(cfg.model.name, **trust).to_dict(),
    )
    diffs = [f"{k} {theirs.get(k)} vs {ours.get(k)}" for k in SHAPE_FIELDS if theirs.get(k) != ours.get(k)]
    if diffs:
        raise ConfigError(
            f"{flag}: {path} was trained from {saved.get('model_name')}, whose shapes differ from "
            f"--model_name {cfg.model.name} ({'; '.join(diffs)}): pass --model_name "
            f"{saved.get('model_name')}"
        )
    if bool(cfg.peft.method):
        before = flat_settings(from_dict(yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))))
        now = flat_settings(cfg)
        shaped = ("peft.lora.r", "peft.lora.target_modules", "peft.lora.use_dora", "peft.lora.bias")
        keys = ["peft.method", *(shaped if cfg.peft.method == "lora" else ())]
        changed = [f"{spelling_of(cfg, k)} {before[k]} -> {now[k]}" for k in keys if before[k] != now[k]]
        if changed:
            raise ConfigError(
                f"{flag}: {path} holds another adapter ({', '.join(changed)}): pass the checkpoint's "
                "values, or start a new run"
            )
