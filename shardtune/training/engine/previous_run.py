"""A new run in an output_dir that holds an ended run, with ``--output.previous_run move_aside`` (what shardtune's
Python trainers set: TRL's configs have no overwrite_output_dir, so a TRL script run twice must run): rank 0, under the
run lock and before the new run writes anything, renames all that the earlier run left there into
``output_dir/previous/<UTC time>/`` and says so in one line (docs/checkpoints.md).

Renames only (atomic per entry, never a copy and a delete); the run lock, ``previous/`` itself and anything a live
run holds stay. If a rename fails (another file system mounted inside output_dir, a path too long), the entries moved
so far are renamed back and the run stops in one line before anything is written: the earlier run is never left
half-moved. A resumed run (--resume latest / a path, --resume auto that finds a checkpoint, a torchrun restart)
continues its run and moves nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from shardtune.config.checks import previous_run_files
from shardtune.config.schema import PREVIOUS_FOLDER, TrainConfig
from shardtune.runtime.distributed import DistEnv, broadcast_from_main, print0
from shardtune.runtime.elastic import worker_group_attempt
from shardtune.runtime.errors import TrainingStopped
from shardtune.runtime.files import LAST_FILES, fsync_dir
from shardtune.runtime.run_lock import LOCK_FILE, RunLocked, check_not_locked
from shardtune.training.engine.checkpoint.layout import checkpoint_root, newest_verified_checkpoint

STAMP = "%Y%m%d-%H%M%S"  # the folder's name: the UTC time of the move (-2, -3 ... when taken)
NAMES_SHOWN = 6  # entries named in the line; the rest are counted


class NotMovedAside(OSError):
    """A rename failed; what was moved is back in place (or the message says where it is)."""


def moves_aside(cfg: TrainConfig) -> bool:
    """Whether this run moves an earlier run aside: move_aside, not --overwrite_output_dir, a new run (not resumed,
    not a restarted worker group), and output_dir holds an ended run (its files, as check_previous_run finds them)."""
    if cfg.output.previous_run != "move_aside" or cfg.output.overwrite or worker_group_attempt() > 0:
        return False
    resume = cfg.checkpoint.resume
    if resume == "auto" and newest_verified_checkpoint(checkpoint_root(cfg), hashes=False) is not None:
        return False  # the checkpoint the Checkpointer resumes (the check before launch decides alike)
    if resume and resume != "auto":
        return False
    return bool(previous_run_files(Path(cfg.output.dir)))


def set_previous_run_aside(cfg: TrainConfig, env: DistEnv) -> None:
    """Collective, before any rank reads output_dir: rank 0 moves an ended run into previous/ when this run does
    (moves_aside); a failed move stops the run on every rank (TrainingStopped, one line)."""
    line = error = None
    if env.is_main and moves_aside(cfg):
        try:
            line = move_previous_run(Path(cfg.output.dir), checkpoint_root(cfg))
        except NotMovedAside as e:
            error = str(e)
    error = broadcast_from_main(error)  # every rank waits here until rank 0 has moved
    if error:
        raise TrainingStopped(error)
    if line:
        print0(f"shardtune: {line}")


def move_previous_run(output_dir: Path, checkpoints: Path | None = None, now: float | None = None) -> str:
    """Rename every entry of ``output_dir`` (but the lock, previous/ and what a live run holds) into
    ``output_dir/previous/<UTC time of now>/``; ``checkpoints``: the run's checkpoint folder, whose entries go into its
    own previous/<time>/ when it lies outside output_dir (llama-cookbook's dist_checkpoint_root_folder). Returns the
    line that says what moved where; raises NotMovedAside with everything back in place."""
    batches = [(output_dir, *movable(output_dir))]
    if checkpoints is not None and apart(checkpoints, output_dir) and checkpoints.is_dir():
        batches.append((checkpoints, *movable(checkpoints)))
    stamp = time.strftime(STAMP, time.gmtime(now))
    moved: list[tuple[Path, Path]] = []
    targets: list[Path] = []
    step = ""
    try:
        for folder, names, _ in batches:
            step = f"making {folder / PREVIOUS_FOLDER / stamp}"
            targets.append(claim(folder / PREVIOUS_FOLDER, stamp))
            for name in names:
                step = f"renaming {folder / name}"
                os.rename(folder / name, targets[-1] / name)
                moved.append((folder / name, targets[-1] / name))
    except OSError as e:
        raise NotMovedAside(not_moved(output_dir, f"{step}: {e.strerror or e}", moved, targets)) from None
    for folder, target in zip([b[0] for b in batches], targets):
        fsync_dir(target)
        fsync_dir(folder)
    return said(output_dir, batches, targets)


def movable(folder: Path) -> tuple[list[str], list[str]]:
    """(the entries to move, the model's loader files last; those a live run holds, which stay)."""
    names, held = [], []
    for name in os.listdir(folder):
        if name in (LOCK_FILE, PREVIOUS_FOLDER):
            continue
        (held if held_by_a_live_run(folder / name) else names).append(name)
    return sorted(names, key=lambda n: (n in LAST_FILES, n)), sorted(held)


def held_by_a_live_run(path: Path) -> bool:
    """Whether a folder holds, at any depth, the lock of a run still going (another run's output_dir inside ours)."""
    if path.is_symlink() or not path.is_dir():
        return False
    for root, _, files in os.walk(path):
        if LOCK_FILE in files:
            try:
                check_not_locked(Path(root))
            except RunLocked:
                return True
    return False


def apart(one: Path, other: Path) -> bool:
    """Neither folder inside the other."""
    a, b = one.resolve(), other.resolve()
    return not (a.is_relative_to(b) or b.is_relative_to(a))


def claim(previous: Path, stamp: str) -> Path:
    """A new folder previous/<stamp>, or <stamp>-2, -3 ... when taken (two moves in one second)."""
    previous.mkdir(exist_ok=True)
    for suffix in ("", *(f"-{n}" for n in range(2, 10_000))):
        try:
            (previous / f"{stamp}{suffix}").mkdir()
            return previous / f"{stamp}{suffix}"
        except FileExistsError:
            continue
    raise FileExistsError(f"{previous}/{stamp}-*: every name is taken")


def not_moved(output_dir: Path, what: str, moved: list[tuple[Path, Path]], targets: list[Path]) -> str:
    """Put back what was moved (last first) and remove the folders made; the line that says so."""
    left: list[str] = []
    for source, target in reversed(moved):
        try:
            os.rename(target, source)
        except OSError:
            left.append(str(target))
    for target in reversed(targets if not left else []):
        for empty in (target, target.parent):
            try:
                empty.rmdir()
            except OSError:
                break
    kept = (
        "nothing was moved"
        if not left
        else f"{len(left)} entries could not be put back and are in {Path(left[0]).parent}"
    )
    return (
        f"--output.previous_run move_aside: the earlier run in {output_dir} could not be moved into "
        f"{PREVIOUS_FOLDER}/ ({what}); {kept}, and this run wrote nothing: pass another --output_dir, or move the "
        "earlier run's files away yourself"
    )


def said(output_dir: Path, batches: list[tuple[Path, list[str], list[str]]], targets: list[Path]) -> str:
    """One line: what moved where, and what stayed because a live run holds it."""
    parts = []
    for (_, names, held), target in zip(batches, targets):
        shown = [n + "/" if (target / n).is_dir() else n for n in names]
        listed = ", ".join(shown[:NAMES_SHOWN]) + (
            f" and {len(shown) - NAMES_SHOWN} more" if len(shown) > NAMES_SHOWN else ""
        )
        stayed = f" ({', '.join(held)} stayed: a live run holds it)" if held else ""
        parts.append(f"{listed or 'nothing'} into {target}/{stayed}")
    return f"{output_dir} held an earlier run: moved {'; '.join(parts)} (--output.previous_run move_aside)"
