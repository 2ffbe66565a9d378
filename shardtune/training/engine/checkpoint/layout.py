"""Where training checkpoints live and which of them count: the on-disk layout of output_dir/checkpoints/, the
newest one that verifies, what --resume names. The Checkpointer (shardtune.training.engine.checkpoint.checkpointer)
writes and reads
them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.training.engine.checkpoint.files import MANIFEST_FILE, verify_checkpoint

# ---------------------------------------------------------------------------------------------------------------
# Training checkpoints: output_dir/checkpoints/step-000123/ (torch.distributed.checkpoint + small files)
#
#   .metadata, __R_0.distcp   DCP: "model.*" (trainable parameters; adapter only under PEFT) and "optimizer.*",
#                             every rank writes its own shard (DCP spreads replicated DDP tensors over ranks)
#   rng/rank-00003.pt         rank 3's RNG states (tensors only; read with torch.load(weights_only=True))
#   hf_config/                the model's config.json and tokenizer: enough for `shardtune export` to rebuild
#   hf_model/                 FULL_STATE_DICT only: the gathered model as a Hugging Face directory
#   config.yaml               the resolved training config
#   trainer_state.json        step, epoch, position in the data, scheduler, counters; written last
#
#   manifest.json             every other file's size and SHA-256 (shardtune/training/engine/checkpoint/files.py);
# written last
#
# All ranks write into step-000123.tmp-<attempt>/; when every rank has finished, each fsyncs and hashes a share of
# the files, rank 0 writes the manifest, renames the folder and then rewrites checkpoints/latest (os.replace), each
# step fsynced. A step folder is complete when it has a manifest; resuming takes the newest one whose files match it.

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 2  # 2: manifest.json
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_dir(where: str | Path) -> Path:
    """The folder of step-NNNNNN checkpoints: ``where`` itself when it is one (it holds ``latest`` or step
    folders, as llama-cookbook's checkpoint folder does), else ``where``/checkpoints (an output dir)."""
    where = Path(where)
    if (where / LATEST_FILE).is_file() or any(where.glob("step-*")):
        return where
    return where / CHECKPOINTS_DIR


def checkpoint_root(cfg: TrainConfig) -> Path:
    """Where this run writes its checkpoints: llama-cookbook's <dist_checkpoint_root_folder>/
    <dist_checkpoint_folder>-<model_name> when the root folder is given, else output_dir/checkpoints."""
    if cfg.checkpoint.dist_checkpoint_root_folder:
        return (
            Path(cfg.checkpoint.dist_checkpoint_root_folder)
            / f"{cfg.checkpoint.dist_checkpoint_folder}-{cfg.model.name}"
        )
    return Path(cfg.output.dir) / CHECKPOINTS_DIR


def objective_file(path: Path, rank: int) -> Path:
    """A rank's objective state in a checkpoint (GRPO: the generation its next steps train on), when it has one."""
    return path / "objective" / f"rank-{rank:05d}.pt"


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    """A step folder with its manifest (written last, deleted first): not whether its files are intact."""
    return checkpoint_step(path) is not None and (path / MANIFEST_FILE).is_file()


def step_folders(root: Path) -> list[Path]:
    """Every step-NNNNNN folder of a checkpoints folder, complete or not, oldest first."""
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None] if root.is_dir() else []
    return sorted(found, key=checkpoint_step)


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first; temporary folders of unfinished saves are never listed."""
    return [p for p in step_folders(checkpoints_dir(output_dir)) if is_complete(p)]


def unfinished_saves(output_dir: str | Path) -> list[Path]:
    root = checkpoints_dir(output_dir)
    return sorted(p for p in root.glob("step-*.tmp-*") if p.is_dir()) if root.is_dir() else []


def checkpoint_problem(path: Path, hashes: bool = True) -> str | None:
    """Why the checkpoint ``path`` cannot be resumed from (None: it verifies): its manifest, then its state file."""
    problem = verify_checkpoint(path, hashes)
    if problem is None:
        try:
            read_trainer_state(path)
        except (OSError, ValueError) as e:
            problem = f"{STATE_FILE} cannot be read ({type(e).__name__})"
    return problem


def _named_by_latest(root: Path, notes: list[str]) -> Path | None:
    """The folder ``latest`` names; only a step-NNNNNN folder of ``root`` itself is taken (never ../elsewhere)."""
    try:
        name = (root / LATEST_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    if not _STEP_DIR.match(name):
        notes.append(
            f"checkpoint: {root / LATEST_FILE} names {name[:80]!r}, not a step-NNNNNN folder of {root}: ignored"
        )
        return None
    return root / name


def newest_verified_checkpoint(
    output_dir: str | Path, hashes: bool = True, notes: list[str] | None = None
) -> Path | None:
    """The checkpoint ``latest`` names if it verifies, else the newest one that does; ``notes`` receives one line
    per checkpoint skipped, with the reason."""
    notes = [] if notes is None else notes
    root = checkpoints_dir(output_dir)
    named = _named_by_latest(root, notes)
    candidates = [named] if named is not None and named.is_dir() else []
    candidates += [p for p in reversed(step_folders(root)) if p != named]
    for path in candidates:
        problem = checkpoint_problem(path, hashes)
        if problem is None:
            return path
        notes.append(f"checkpoint: skipped {path}: {problem}")
    return None


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint named by ``latest``; the newest complete one when that file is missing or stale (sizes
    checked against the manifests, not hashes)."""
    return newest_verified_checkpoint(output_dir, hashes=False)


def resolve_checkpoint(
    where: str, output_dir: str | Path, hashes: bool = True, notes: list[str] | None = None, resume: bool = True
) -> Path | None:
    """``latest`` (of output_dir, or of a checkpoints folder), a checkpoint folder, or an output dir or checkpoints
    folder (its latest checkpoint); ``auto``: latest if there is a complete checkpoint, else None (a new run; for
    jobs that requeue or restart themselves). Only a checkpoint that verifies (checkpoint_problem) is returned;
    ``notes`` receives a line for each newer one that was skipped. ``resume``: ``where`` is --resume's value (the
    errors name the flag and offer ``--resume latest``); else a command's argument (``shardtune export``)."""
    if where in ("auto", "latest"):
        path = newest_verified_checkpoint(output_dir, hashes, notes)
        if path is None and where == "latest":
            # an output dir named "checkpoints" is not the checkpoints folder itself: name the folder it is
            looked_in = output_dir if Path(output_dir).name == CHECKPOINTS_DIR else checkpoints_dir(output_dir)
            raise ConfigError(
                f"--resume latest: no complete checkpoint in {looked_in}: drop --resume to start a "
                "new run, or pass a checkpoint folder"
            )
        return path
    path = Path(where)
    if checkpoint_step(path) is not None and path.is_dir():
        problem = checkpoint_problem(path, hashes)
        if problem is not None:
            newest = "--resume latest" if resume else "the run's output dir"
            raise ConfigError(
                f"{'--resume ' if resume else ''}{where}: the checkpoint does not verify ({problem}): "
                f"pass another checkpoint, or {newest} (the newest one that verifies)"
            )
        return path
    if checkpoints_dir(path).is_dir():
        found = newest_verified_checkpoint(path, hashes, notes)
        if found is not None:
            return found
    raise ConfigError(
        f"{where} is not a complete checkpoint (a step-NNNNNN folder with {MANIFEST_FILE}, or an "
        f"output dir holding checkpoints/): pass one{', or --resume latest' if resume else ''}"
    )


def read_trainer_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
