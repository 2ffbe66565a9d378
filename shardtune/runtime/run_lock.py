"""One run per output_dir: rank 0 holds an exclusive lock on ``output_dir/.shardtune.lock`` for the run's lifetime.

Two runs in one output_dir would delete each other's checkpoints (rotation), interleave metrics.jsonl and publish
over each other's model. The lock is ``flock`` on a file that records the holder (host, pid, SLURM / Kubernetes
job id): the kernel releases it when the holding process dies, however it dies, so a crashed run never blocks
the next one. A file that still names a holder when its lock is free was left by a run that did not end cleanly
(killed, power cut): the next run takes it over and says so.

flock is honoured between the nodes of NFSv4 and Lustre (with ``-o flock``) mounts. Where it is not (NFSv3 without
lockd, Lustre with ``-o localflock``), the record is also a lease: the holder rewrites its ``heartbeat`` time every
HEARTBEAT_S seconds, and a run on another host finding a record whose heartbeat is younger than LEASE_S is refused
although the kernel granted it the lock; an older heartbeat is a dead holder's, taken over with a line. (The
hosts' clocks must agree to well within LEASE_S, as NTP keeps them.)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

LOCK_FILE = ".shardtune.lock"
JOB_ID_VARS = ("SLURM_JOB_ID", "SKYPILOT_TASK_ID", "JOB_ID")
HEARTBEAT_S = 30.0  # the holder rewrites its record this often
LEASE_S = 120.0  # a record from another host with a younger heartbeat is a live run


class RunLocked(RuntimeError):
    """Another live run holds the lock of this output_dir."""


def _holder_record() -> dict:
    job = next((f"{v}={os.environ[v]}" for v in JOB_ID_VARS if os.environ.get(v)), "")
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job, "heartbeat": round(time.time(), 3)}


def _live_elsewhere(record: dict | None, now: float | None = None) -> float | None:
    """The heartbeat's age in seconds when ``record`` is a live run's on another host (its lease not expired),
    else None."""
    if not record or record.get("host") == socket.gethostname():
        return None
    try:
        age = (time.time() if now is None else now) - float(record["heartbeat"])
    except (KeyError, TypeError, ValueError):
        return None
    return age if age < LEASE_S else None


def _leased(path: Path, holder: dict, age: float) -> str:
    return (
        f"--output_dir {path.parent} is in use by another run ({describe_holder(holder)}, whose heartbeat in "
        f"{path.name} is {max(age, 0):.0f} s old; this file system does not share the lock between hosts): wait "
        "for it to end, stop it, or pass another --output_dir"
    )


def describe_holder(record: dict) -> str:
    job = f", {record['job']}" if record.get("job") else ""
    return f"pid {record.get('pid')} on {record.get('host')}{job}"


def _in_use(path: Path, holder: dict) -> str:
    return (
        f"--output_dir {path.parent} is in use by another run ({describe_holder(holder)}, holding {path.name}): "
        "wait for it to end, stop it, or pass another --output_dir"
    )


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

    def __init__(self, directory: Path, heartbeat_s: float = HEARTBEAT_S):
        self.path = Path(directory) / LOCK_FILE
        self.heartbeat_s = heartbeat_s
        self._fh = None
        self._writing = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

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
        age = _live_elsewhere(previous)
        if age is not None:  # the kernel's lock is not shared with the holder's host: its lease is
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()
            raise RunLocked(_leased(self.path, previous, age))
        note = None
        if previous is not None:
            same_host = previous.get("host") == socket.gethostname()
            if same_host:
                state = "no longer running" if not _pid_alive(previous.get("pid")) else "its lock was released"
            elif "heartbeat" in previous:
                state = f"its heartbeat stopped {time.time() - float(previous['heartbeat']):.0f} s ago"
            else:
                state = "its lock was released"
            note = (
                f"{self.path} named {describe_holder(previous)}, which did not end cleanly ({state}): taking "
                "the lock over"
            )
        self._fh = fh
        self._write_record()
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="shardtune-run-lock", daemon=True)
        self._beat.start()
        return note

    def _write_record(self) -> None:
        with self._writing:
            if self._fh is None:
                return
            self._fh.seek(0)
            self._fh.truncate()
            self._fh.write(json.dumps(_holder_record()) + "\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._write_record()
            except OSError:  # a full or vanished file system: the run's own writes will say so
                pass

    def release(self) -> None:
        """A clean end: the record is emptied (so the next run has nothing to take over), then the lock freed."""
        if self._fh is None:
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        with self._writing:
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
        record = _read_record(fh)
        fcntl.flock(fh, fcntl.LOCK_UN)
    age = _live_elsewhere(record)
    if age is not None:
        raise RunLocked(_leased(path, record, age))
