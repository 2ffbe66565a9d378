"""The run lock's lease (shardtune/runtime/run_lock.py), for file systems that do not share flock between hosts:
a record from another host with a fresh heartbeat is a live run, an old one a dead run's. No launch: another
host's run is its record, as that host would have written it."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from shardtune.runtime.run_lock import LEASE_S, LOCK_FILE, RunLock, RunLocked, check_not_locked


def other_host_record(path, heartbeat_age_s: float) -> None:
    path.write_text(
        json.dumps(
            {
                "host": f"not-{socket.gethostname()}",
                "pid": 4242,
                "job": "SLURM_JOB_ID=7",
                "heartbeat": time.time() - heartbeat_age_s,
            }
        )
        + "\n"
    )


def test_a_live_lease_from_another_host_is_refused_before_launch_and_at_the_lock(tmp_path):
    other_host_record(tmp_path / LOCK_FILE, heartbeat_age_s=5)
    for attempt in (lambda: check_not_locked(tmp_path), lambda: RunLock(tmp_path).acquire()):
        with pytest.raises(RunLocked) as caught:
            attempt()
        assert "in use by another run (pid 4242 on not-" in str(caught.value)
        assert "whose heartbeat in .shardtune.lock is 5 s old" in str(caught.value)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == 4242  # the holder's record is left alone


def test_an_expired_lease_is_taken_over_with_a_line_and_the_holder_keeps_beating(tmp_path):
    other_host_record(tmp_path / LOCK_FILE, heartbeat_age_s=LEASE_S + 60)
    check_not_locked(tmp_path)
    lock = RunLock(tmp_path, heartbeat_s=0.05)
    note = lock.acquire()
    try:
        assert note is not None and "which did not end cleanly (its heartbeat stopped" in note
        first = json.loads((tmp_path / LOCK_FILE).read_text())
        assert first["host"] == socket.gethostname() and first["pid"] == os.getpid()
        # the holder keeps renewing it (a stuck heartbeat ends at the suite's per-test limit)
        while json.loads((tmp_path / LOCK_FILE).read_text() or "{}").get("heartbeat", 0) <= first["heartbeat"]:
            time.sleep(0.02)
    finally:
        lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean end leaves nothing to take over
