"""One run per output_dir: rank 0 holds an exclusive lock on ``output_dir/.shardtune.lock`` for the run's lifetime.

Two runs in one output_dir would delete each other's checkpoints (rotation), interleave metrics.jsonl and publish
over each other's model. The lock is ``flock`` on a file that records the holder (host, pid, SLURM / Kubernetes
job id): the kernel releases it when the holding process dies, however it dies, so a crashed run never blocks
the next one. A file that still names a holder when its lock is free was left by a run that did not end cleanly
(killed, power cut): the next run takes it over and says so.

flock is honoured between the nodes of NFSv4 and Lustre (with ``-o flock``) mounts; on a file system without it,
two runs on different nodes are not kept apart (docs/security.md).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

LOCK_FILE = ".shardtune.lock"
JOB_ID_VARS = ("SLURM_JOB_ID", "SKYPILOT_TASK_ID", "JOB_ID")


class RunLocked(RuntimeError):
    """Another live run holds the lock of this output_dir."""


def _holder_record() -> dict:
    job = next((f"{v}={os.environ[v]}" for v in JOB_ID_VARS if os.environ.get(v)), "")
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job}


def describe_holder(record: dict) -> str:
    job = f", {record['job']}" if record.get("job") else ""
    return f"pid {record.get('pid')} on {record.get('host')}{job}"


def _in_use(path: Path, holder: dict) -> str:
    return (f"--output_dir {path.parent} is in use by another run ({describe_holder(holder)}, holding {path.name}): "
            "wait for it to end, stop it, or pass another --output_dir")


def _read_record(fh) -> dict | None:
    fh.seek(0)
    text = fh.read()
    try:
        record = json.loads(text) if text.strip() else None
    except ValueError:
        return {"host": "?", "pid": "?", "job": "unreadable lock file"}
    return record if isinstance(record, dict) else None


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


class RunLock:
    """Held from acquire() to release() (or the process's end)."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self._fh = None

    def acquire(self) -> str | None:
        """Take the lock or raise RunLocked naming the holder; returns a line when a stale record was taken over."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fh) or {}
            fh.close()
            raise RunLocked(_in_use(self.path, holder)) from None
        previous = _read_record(fh)
        note = None
        if previous is not None:
            same_host = previous.get("host") == socket.gethostname()
            state = ("no longer running" if same_host and not _pid_alive(previous.get("pid"))
                     else "its lock was released")
            note = (f"{self.path} named {describe_holder(previous)}, which did not end cleanly ({state}): taking "
                    "the lock over")
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(_holder_record()) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
        self._fh = fh
        return note

    def release(self) -> None:
        """A clean end: the record is emptied (so the next run has nothing to take over), then the lock freed."""
        if self._fh is None:
            return
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.flush()
        fcntl.flock(self._fh, fcntl.LOCK_UN)
        self._fh.close()
        self._fh = None


def check_not_locked(directory: Path) -> None:
    """Before launch: refuse (RunLocked) when a live run holds ``directory``'s lock; takes nothing."""
    path = Path(directory) / LOCK_FILE
    if not path.is_file():
        return
    with open(path, "a+", encoding="utf-8") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLocked(_in_use(path, _read_record(fh) or {})) from None
        fcntl.flock(fh, fcntl.LOCK_UN)
